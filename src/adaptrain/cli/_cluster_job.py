"""One job of ``adaptrain demo --cluster``: ``python -m adaptrain.cli._cluster_job digits|charlm
--until T``, run by the service as each of its replicas.

A small real model trained with :mod:`adaptrain.torch` exactly as a user's script would be:
the server sets its ``ADAPTRAIN_*`` environment, rank 0 posts its goodput model as hints, the
batch size is autoscaled, and a rescale is a checkpoint-restart on the new allocation (the
epoch loop resumes where the checkpoint left it). It trains until the wall-clock time ``T``
(Unix seconds), so that the demo's jobs end one after another within its ``--minutes``:
the replicas agree on stopping at an epoch's start (a max all-reduce of "past T"), so none
waits for a step the others will not take.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import adaptrain.torch as adl


def _past(deadline: float) -> bool:
    """Whether any replica is past ``deadline`` (every replica gets the same answer)."""
    flag = torch.tensor([1 if time.time() >= deadline else 0])
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return bool(flag.item())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m adaptrain.cli._cluster_job")
    parser.add_argument("workload", choices=["digits", "charlm"])
    parser.add_argument("--until", type=float, required=True, help="stop at this Unix time")
    parser.add_argument(
        "--step-sleep", type=float, default=0.05, help="seconds added to each step (a bigger model)"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    adl.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    replicas = torch.distributed.get_world_size()
    if args.workload == "digits":
        from adaptrain.workloads import DigitsNet, digits_datasets

        train_set, _ = digits_datasets()
        model = DigitsNet()
        optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
        loader = adl.AdaptiveDataLoader(train_set, batch_size=64, shuffle=True, drop_last=True)
        loader.autoscale_batch_size(1024, local_bsz_bounds=(32, 256))

        def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(model(x), y)
    else:
        from adaptrain.workloads import CharLM, charlm_datasets

        train_set, _ = charlm_datasets(seq_len=32, max_chars=48_000)
        model = CharLM(hidden=32, seed=0)
        optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
        loader = adl.AdaptiveDataLoader(train_set, batch_size=32, shuffle=True, drop_last=True)
        loader.autoscale_batch_size(1024, local_bsz_bounds=(16, 256))

        def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            logits = model(x)
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    model = adl.AdaptiveDataParallel(model, optimizer)
    if rank == 0:
        print(f"{args.workload}: {replicas} replica(s), until {time.ctime(args.until)}", flush=True)
    for epoch in adl.remaining_epochs_until(1_000_000):
        if _past(args.until):
            break
        model.train()
        total, count = 0.0, 0
        for x, y in loader:
            optimizer.zero_grad()
            loss = loss_of(x, y)
            loss.backward()
            optimizer.step()
            total, count = total + loss.item(), count + 1
            if args.step_sleep:
                time.sleep(args.step_sleep)
        if rank == 0:
            print(
                f"epoch {epoch}: loss {total / max(count, 1):.3f}, batch size "
                f"{loader.current_batch_size} on {replicas} replica(s)",
                flush=True,
            )
    if rank == 0:
        print(f"{args.workload}: done", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
