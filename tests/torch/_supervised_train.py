"""A real training script for the supervisor tests (run as a process, not collected).

Trains the digits MLP with adaptrain.torch (adaptive batch size with accumulation) for about
``--seconds`` seconds (by rank 0's clock), logging one JSON line per micro-batch (flushed at once, so a ``kill -9``
keeps every line before it): wall time, step seconds, batch size, and the global position of
the micro-batch's first sample (``epoch × len(train set) + samples done in the epoch``). At the
end it logs what the process holds: whether ``httpx`` was imported, the names of its threads and
the hints reporter's counters. Launch it with ADAPTRAIN_* variables (one process per replica).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time

import torch
import torch.nn.functional as F

import adaptrain.torch as at
from adaptrain.torch import _hints
from adaptrain.workloads.digits import DigitsNet, digits_datasets


def replica_env(port: int, replicas: int, rank: int, **extra: str) -> dict[str, str]:
    """This process's environment without any launcher's or job's variables, with those of
    ``rank`` of ``replicas`` gloo replicas meeting on 127.0.0.1:``port``, and ``extra``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("ADAPTRAIN_", "MASTER_", "TORCHELASTIC_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    }
    env.update(
        ADAPTRAIN_MASTER_ADDR="127.0.0.1",
        ADAPTRAIN_MASTER_PORT=str(port),
        ADAPTRAIN_NUM_REPLICAS=str(replicas),
        ADAPTRAIN_REPLICA_RANK=str(rank),
        **extra,
    )
    return env


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True, help="folder of the per-rank logs")
    p.add_argument("--tag", default="run")
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-batch-size", type=int, default=512)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("adaptrain.torch._hints").setLevel(logging.INFO)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    at.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    train_set, _ = digits_datasets()
    model = DigitsNet(conv=False, seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model = at.AdaptiveDataParallel(model, optimizer)
    loader = at.AdaptiveDataLoader(train_set, batch_size=args.batch_size, shuffle=True)
    loader.autoscale_batch_size(
        args.max_batch_size, local_bsz_bounds=(8, 128), gradient_accumulation=True
    )
    log = open(os.path.join(args.out, f"{args.tag}-rank{rank}.jsonl"), "a")
    deadline = time.monotonic() + args.seconds
    n = len(train_set)
    done = False
    count = 0
    last = time.perf_counter()
    for epoch in at.remaining_epochs_until(10_000):
        for xb, yb in loader:
            position = epoch * n + at.current_dataloader().current_index
            loss = F.cross_entropy(model(xb), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            now = time.perf_counter()
            record = {
                "t": time.time(),
                "dt": now - last,
                "bsz": loader.current_batch_size,
                "pos": position,
                "n": len(yb),
            }
            last = now
            log.write(json.dumps(record) + "\n")
            log.flush()
            count += 1
            if count % 50 == 0:  # every replica stops at the same step: rank 0's clock
                flag = torch.tensor([int(rank == 0 and time.monotonic() > deadline)])
                torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
                done = bool(flag.item())
            if done:
                break
        if done:
            break
    threads = sorted(t.name for t in threading.enumerate())
    r = _hints.reporter()
    if r is not None:
        r.close(timeout=6.0)  # let a post in flight end, so its counters are final
    end = {
        "end": True,
        "httpx": "httpx" in sys.modules,
        "threads": threads,
        "reporter": None if r is None else r.state_dict(),
    }
    log.write(json.dumps(end) + "\n")
    log.close()


if __name__ == "__main__":
    main()
