"""Character-level language model on the Python standard library's source, adaptive batch size.

The workload where large batches pay off late in training: early on the gradient noise is small
relative to the gradient and small batches make the fastest progress; as the loss flattens the
noise scale grows and adaptrain raises the batch size (and the learning rate with it, through
the AdamScale rule AdaptiveDataParallel picks for Adam). Real data, no download: the text is the
``.py`` files of the interpreter running this script.

    python examples/charlm.py --epochs 3
    torchrun --nproc-per-node=2 examples/charlm.py --epochs 3
    mkdir -p ckpt; ADAPTRAIN_CHECKPOINT_PATH=ckpt python examples/charlm.py   # Ctrl-C, rerun

Every epoch is one pass over the training windows (each processed exactly once over all
replicas); the validation loss is summed exactly over replicas with an Accumulator.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

import adaptrain.checkpoint
import adaptrain.torch as adl
from adaptrain.workloads import CharLM, charlm_datasets, charlm_loss


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument(
        "--max-steps",
        type=int,
        default=0,
        help="stop each epoch's training loop after this many optimizer steps, counted across "
        "restarts (0: full pass)",
    )
    p.add_argument("--max-chars", type=int, default=1_000_000, help="corpus size in characters")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=32, help="initial global batch size")
    p.add_argument("--max-batch-size", type=int, default=1024)
    p.add_argument("--local-bsz-bounds", type=int, nargs=2, default=(8, 256))
    p.add_argument("--gradient-accumulation", action="store_true")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--log-interval", type=int, default=50)
    p.add_argument("--cache-dir", default=None, help="cache the encoded corpus here")
    p.add_argument("--tensorboard", default=None, help="TensorBoard log directory")
    return p.parse_args()


class StepCount(adaptrain.checkpoint.State):
    """Optimizer steps in all and per epoch, checkpointed: a restart mid-epoch goes on counting
    (``enumerate(train_loader)`` would start again at 0 in the resumed pass)."""

    def __init__(self) -> None:
        super().__init__("charlm-example-steps")
        self.total = 0
        self.per_epoch: dict[str, int] = {}

    def count(self, epoch: int) -> int:
        self.total += 1
        key = str(epoch)
        self.per_epoch[key] = self.per_epoch.get(key, 0) + 1
        return self.per_epoch[key]

    def save(self, fileobj) -> None:
        fileobj.write(json.dumps({"total": self.total, "per_epoch": self.per_epoch}).encode())

    def load(self, fileobj) -> None:
        data = json.loads(fileobj.read().decode())
        self.total, self.per_epoch = int(data["total"]), dict(data["per_epoch"])


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    adl.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank0 = torch.distributed.get_rank() == 0
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    train_set, valid_set = charlm_datasets(
        seq_len=args.seq_len, max_chars=args.max_chars, cache_dir=args.cache_dir
    )
    model = CharLM(hidden=args.hidden).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    model = adl.AdaptiveDataParallel(model, optimizer)

    train_loader = adl.AdaptiveDataLoader(train_set, batch_size=args.batch_size, shuffle=True)
    train_loader.autoscale_batch_size(
        args.max_batch_size,
        local_bsz_bounds=tuple(args.local_bsz_bounds),
        gradient_accumulation=args.gradient_accumulation,
    )
    valid_loader = adl.AdaptiveDataLoader(valid_set, batch_size=256)
    writer = None
    if args.tensorboard and rank0:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(args.tensorboard)

    steps = StepCount()
    adaptrain.checkpoint.load_state(steps)
    for epoch in adl.remaining_epochs_until(args.epochs):
        model.train()
        start = time.perf_counter()
        for i, (inputs, targets) in enumerate(train_loader):
            optim_step = adl.current_dataloader().is_optim_step()  # not an accumulation micro-batch
            loss = charlm_loss(model, (inputs.to(device), targets.to(device)))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            in_epoch = steps.count(epoch) if optim_step else steps.per_epoch.get(str(epoch), 0)
            step = steps.total
            if rank0 and i % args.log_interval == 0:
                gain = getattr(model, "gain", float("nan"))
                print(
                    f"epoch {epoch} step {i}: loss {loss.item():.3f} nats/char, batch size "
                    f"{train_loader.current_batch_size} "
                    f"(local {train_loader.current_local_bsz} × "
                    f"{train_loader.accumulation_steps}), gain {gain:.2f}",
                    flush=True,
                )
            if writer is not None:
                writer.add_scalar("train/loss", loss.item(), step)
                train_loader.to_tensorboard(writer, step, "train")
            if args.max_steps and in_epoch >= args.max_steps:
                break
        elapsed = time.perf_counter() - start

        model.eval()
        stats = adl.Accumulator()
        with torch.no_grad():
            for inputs, targets in valid_loader:
                loss = charlm_loss(model, (inputs.to(device), targets.to(device)))
                stats["loss_sum"] += loss.item() * targets.numel()
                stats["chars"] += targets.numel()
        with stats.synchronized():
            bpc = stats["loss_sum"] / stats["chars"] / math.log(2)
            if rank0:
                print(
                    f"epoch {epoch}: valid {bpc:.3f} bits/char on {stats['chars']} chars, "
                    f"train pass {elapsed:.1f}s",
                    flush=True,
                )
            if writer is not None:
                writer.add_scalar("valid/bits_per_char", bpc, epoch)
    if writer is not None:
        writer.close()


if __name__ == "__main__":
    main()
