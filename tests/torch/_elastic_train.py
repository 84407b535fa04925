"""A real elastic training script for the exactly-once tests (run as a process, not collected).

Trains a linear classifier on sklearn's digits with adaptrain.torch, records the sample ids of
every processed micro-batch per rank (one JSON line each, flushed after the step), and can
interrupt itself with a real signal: on rank ``--stop-rank``, after ``--stop-after`` micro-batches
of this run (training and evaluation counted together), it sends ``--signal`` to its own process.
Launch it with ADAPTRAIN_* variables or under torchrun; set ADAPTRAIN_CHECKPOINT_PATH.
"""

from __future__ import annotations

import argparse
import json
import os
import signal

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import TensorDataset

import adaptrain.torch as at


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--tag", required=True)
    p.add_argument("--n-train", type=int, default=157)
    p.add_argument("--n-eval", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=12)
    p.add_argument("--eval-batch-size", type=int, default=16)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--stop-after", type=int, default=-1)
    p.add_argument("--stop-rank", type=int, default=0)
    p.add_argument("--signal", default="SIGTERM")
    p.add_argument("--autoscale", type=int, default=0, help="max global batch size (0: off)")
    p.add_argument("--local-max", type=int, default=32, help="max local batch (autoscale)")
    p.add_argument("--grad-accum", action="store_true", help="allow gradient accumulation")
    p.add_argument(
        "--poll-period",
        type=float,
        default=None,
        help="seconds between stop polls (0: every step, so a stop lands where it is planned)",
    )
    args = p.parse_args()
    if args.poll_period is not None:
        from adaptrain.dist import signals

        signals.POLL_PERIOD = args.poll_period
    torch.set_num_threads(1)
    torch.manual_seed(0)

    at.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32) / 16.0
    y = torch.tensor(y)
    ids = torch.arange(len(y))
    tr = slice(0, args.n_train)
    ev = slice(args.n_train, args.n_train + args.n_eval)
    train_set = TensorDataset(x[tr], y[tr], ids[tr])
    eval_set = TensorDataset(x[ev], y[ev], ids[ev])

    model = torch.nn.Linear(64, 10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model = at.AdaptiveDataParallel(model, optimizer)
    train_loader = at.AdaptiveDataLoader(train_set, batch_size=args.batch_size, shuffle=True)
    if args.autoscale:
        train_loader.autoscale_batch_size(
            args.autoscale,
            local_bsz_bounds=(1, args.local_max),
            gradient_accumulation=args.grad_accum,
        )
    eval_loader = at.AdaptiveDataLoader(eval_set, batch_size=args.eval_batch_size)
    stats = at.Accumulator()

    log = open(os.path.join(args.out, f"{args.tag}-rank{rank}.jsonl"), "a")
    processed = 0

    def record(**kw: object) -> None:
        nonlocal processed
        log.write(json.dumps(kw) + "\n")
        log.flush()
        processed += 1
        if processed == args.stop_after and rank == args.stop_rank:
            os.kill(os.getpid(), getattr(signal, args.signal))

    for epoch in at.remaining_epochs_until(args.epochs):
        model.train()
        for xb, yb, ib in train_loader:
            loss = F.cross_entropy(model(xb), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            record(
                phase="train",
                epoch=epoch,
                ids=ib.tolist(),
                bsz=train_loader.current_batch_size,
                optim=at.current_dataloader().is_optim_step(),
            )
        model.eval()
        with torch.no_grad():
            for xb, yb, ib in eval_loader:
                stats["correct"] += (model(xb).argmax(1) == yb).sum().item()
                stats["n"] += len(yb)
                record(phase="eval", epoch=epoch, ids=ib.tolist())
        with stats.synchronized():
            if rank == 0:
                log.write(
                    json.dumps(
                        {
                            "phase": "acc",
                            "epoch": epoch,
                            "n": stats["n"],
                            "correct": stats["correct"],
                        }
                    )
                    + "\n"
                )
                log.flush()
            stats.clear()
    log.write(json.dumps({"phase": "done"}) + "\n")
    log.close()


if __name__ == "__main__":
    main()
