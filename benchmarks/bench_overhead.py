"""Step-time overhead of AdaptiveDataParallel (statistics on) over plain DistributedDataParallel.

Both wrap the same model on the same 2-process gloo group and train on the same batches
(digits, fixed batch size). Each of ``--reps`` repetitions runs a block of ``--steps`` DDP steps
a block of DDP steps with torch's Python ``allreduce_hook`` and a block of ADP steps
(rotating order), timing every step; the ratio of the
blocks' median step times is one paired sample and the median over repetitions is reported
(robust to load that drifts, and to preemption spikes on a shared machine).

    python benchmarks/bench_overhead.py [--reps 15] [--steps 20] [--out benchmarks/results/overhead.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from adaptrain.dist.spawn import spawn

CONFIGS = [  # (label, hidden width, per-replica batch)
    ("MLP 64-256-256-10 (85k params), batch 16/replica", 256, 16),
    ("MLP 64-256-256-10 (85k params), batch 128/replica", 256, 128),
    ("MLP 64-1024-1024-10 (1.1M params), batch 32/replica", 1024, 32),
]


def _model(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, 10),
    )


def _worker(rank: int, ws: int, width: int, bsz: int, reps: int, steps: int) -> list[float]:
    import torch.distributed as dist
    from sklearn.datasets import load_digits

    from adaptrain.torch.parallel import AdaptiveDataParallel

    X, y = load_digits(return_X_y=True)
    X = torch.tensor(X / 16.0, dtype=torch.float32)
    y = torch.tensor(y)
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    models = {}
    m = _model(width)
    models["ddp"] = (
        DistributedDataParallel(m),
        torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9),
    )
    m = _model(width)
    hooked = DistributedDataParallel(m)  # torch's own Python all-reduce hook, for reference
    hooked.register_comm_hook(dist.group.WORLD, default_hooks.allreduce_hook)
    models["pyhook"] = (hooked, torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9))
    m = _model(width)
    opt_adp = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
    adp = AdaptiveDataParallel(m, opt_adp)
    models["adp"] = (adp, opt_adp)
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, len(y), (bsz,), generator=g) for _ in range(16)]

    def step(model, opt, idx) -> tuple[float, float]:
        t0, c0 = time.perf_counter(), time.process_time()
        opt.zero_grad()
        F.cross_entropy(model(X[idx]), y[idx]).backward()
        opt.step()
        return time.perf_counter() - t0, time.process_time() - c0

    for i in range(10):  # warm-up (DDP bucket rebuild, allocator)
        for model, opt in models.values():
            step(model, opt, batches[i % 16])
    names = list(models)
    wall = {k: [] for k in names}
    cpu = {k: [] for k in names}
    for r in range(reps):
        dist.barrier()
        for name in names[r % 3 :] + names[: r % 3]:  # rotate the order
            model, opt = models[name]
            for i in range(steps):
                w, c = step(model, opt, batches[i % 16])
                wall[name].append(w)
                cpu[name].append(c)
    assert adp.gns.num_updates > 0  # the statistics really were collected
    return wall, cpu


def _paired(wall: dict, name: str, reps: int, n: int) -> list[float]:
    """Block r of ``name`` against block r of DDP (adjacent in time): ratio of median steps."""
    med = statistics.median
    return [
        med(wall[name][k * n : (k + 1) * n]) / med(wall["ddp"][k * n : (k + 1) * n])
        for k in range(reps)
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--out", default=None, help="write a markdown report here")
    args = ap.parse_args(argv)
    rows = []
    med = statistics.median
    n = args.steps
    for label, width, bsz in CONFIGS:
        wall, cpu = spawn(_worker, 2, args=(width, bsz, args.reps, n), timeout=600)[0]

        adp, hook = _paired(wall, "adp", args.reps, n), _paired(wall, "pyhook", args.reps, n)
        q = statistics.quantiles(adp, n=4)
        row = (
            label,
            med(adp),
            q[0],
            q[2],
            med(cpu["adp"]) / med(cpu["ddp"]),
            med(hook),
            med(wall["ddp"]) * 1e3,
        )
        rows.append(row)
        print(
            f"{label}: ADP/DDP paired median {row[1]:.3f} (IQR {q[0]:.3f}-{q[2]:.3f}), "
            f"CPU {row[4]:.3f}; torch Python hook/DDP {row[5]:.3f}; DDP step {row[6]:.2f} ms",
            flush=True,
        )
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            f.write("# AdaptiveDataParallel overhead over DistributedDataParallel\n\n")
            f.write(
                f"Command: `python benchmarks/bench_overhead.py --reps {args.reps} "
                f"--steps {args.steps} --out {args.out}`\n\n"
            )
            f.write(
                f"Machine: {platform.platform()}, {os.cpu_count()} CPU cores, "
                f"Python {sys.version.split()[0]}, torch {torch.__version__}, "
                "2 gloo processes on 127.0.0.1, 1 thread each.\n\n"
            )
            f.write(
                "Caveat: measured while ~6 other jobs shared the 2 cores; only the ratios "
                "of paired, interleaved runs are meaningful, not absolute times.\n\n"
            )
            f.write(
                "| model, batch | ADP/DDP step time (median of paired blocks) | IQR | "
                "ADP/DDP process CPU time | torch's Python allreduce_hook/DDP | "
                "DDP step (ms, loaded) |\n|---|---|---|---|---|---|\n"
            )
            for label, m_, lo, hi, cpu_, hook_, ms in rows:
                f.write(
                    f"| {label} | **{m_:.3f}×** | {lo:.3f}–{hi:.3f} | {cpu_:.3f}× | "
                    f"{hook_:.3f}× | {ms:.2f} |\n"
                )
            f.write(
                f"\n{args.reps} repetitions; each runs a block of {args.steps} steps of "
                "plain DDP, of DDP with torch's Python `allreduce_hook` and of ADP (rotating "
                "order), SGD with momentum, statistics on, scale 1; per-step wall and process "
                "CPU time on rank 0; one paired sample = ratio of two adjacent blocks' median "
                "step times. The Python-hook column separates the cost any Python "
                "communication hook pays from ADP's own statistics.\n"
            )
            f.write(
                "\nWhere ADP's time goes (per optimizer step, R = 2): a Python DDP communication "
                "hook instead of DDP's C++ all-reduce (the column above); per bucket one BLAS dot "
                "(local norm²) in the hook and one (norm² of the averaged bucket) in the "
                "optimizer's step pre-hook; the replicas' local norms ride on the smallest "
                "bucket's all-reduce of the next step (no extra collective): that bucket is "
                "divided straight into one of two reused send buffers, its local dot runs while "
                "its all-reduce is in flight, and the norm² of its averaged output is taken "
                "during the next step's all-reduce; the previous step's sample is folded into "
                "the EMAs in Python floats (no numpy, no tensor allocation) and the lr scaled "
                "by the scaling rule's step hooks. The dots are memory-bound O(parameters); the "
                "rest is a fixed Python cost of some tens of µs per step, which matters only at "
                "millisecond step times.\n"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
