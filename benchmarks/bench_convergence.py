"""Final loss of each compressed optimizer vs uncompressed all-reduce SGD on sklearn digits.

Run: ``python benchmarks/bench_convergence.py [--epochs 24] [--budgets 8,16,24] [--seeds 3]
[--world-size 2] [--tol 0.10] [--kinds "EF-signSGD,sgd (baseline)"]``

``--world-size`` gloo processes each take an equal shard of every mini-batch (global batch 64)
of the digits training split (``adaptrain.workloads.digits``, MLP 64-64-10) and train with:
CentralizedSGD (baseline: momentum 0.9), PowerSGD rank 1 and 2 (same momentum, error
feedback), CentralizedSparsifiedSGD (random-k, random block and cyclic block, k = ``--k``
coordinates per parameter, memory), SignSGD with majority vote (signum, momentum 0.9) and with
error feedback (momentum 0.9, and without momentum as in Algorithm 1 of Karimireddy et al.), and
DecentralizedSGD on a ring.

Protocol: every optimizer gets the same 5-point learning-rate grid (0.03 … 3.0; signum, whose
step is ``lr`` per coordinate rather than ``lr · gradient``, gets the same grid scaled by 1e-2),
and every (optimizer, lr) runs with ``--seeds`` seeds (seed s: model init s, data order 1+s).
Learning rates are constant, so the loss after ``b`` epochs of the ``--epochs`` run *is* the
result of a ``b``-epoch run: each budget in ``--budgets`` picks its own best lr (lowest median
final loss over the seeds). The figure is the full-training-set cross-entropy of rank 0's model;
Δ is the median over seeds of the paired difference to the baseline (same seed, each at its
best lr). Criterion: median Δ ≤ ``--tol`` nats.
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import time
from statistics import median

import torch

from adaptrain.dist.spawn import spawn

GLOBAL_BATCH = 64


def _make(kind, model, ws, rank, lr, k=64):
    from adaptrain.optim._centralized import CentralizedSGD
    from adaptrain.optim._decentralized import DecentralizedSGD, ring_neighbors
    from adaptrain.optim._powersgd import PowerSGD
    from adaptrain.optim._sign import SignSGD
    from adaptrain.optim._sparsified import CentralizedSparsifiedSGD

    if kind == "sgd (baseline)":
        return CentralizedSGD(ws, model, lr=lr, momentum=0.9)
    if kind == "powersgd r1":
        return PowerSGD(model, lr=lr, momentum=0.9, rank=1, world_size=ws, reuse_query=True)
    if kind == "powersgd r2":
        return PowerSGD(model, lr=lr, momentum=0.9, rank=2, world_size=ws, reuse_query=True)
    if kind == "sparsified random-k":
        return CentralizedSparsifiedSGD(
            model.parameters(), lr=lr, sparse_grad_size=k, random_sparse=True, world_size=ws
        )
    if kind == "sparsified block":
        return CentralizedSparsifiedSGD(
            model.parameters(), lr=lr, sparse_grad_size=k, world_size=ws
        )
    if kind == "sparsified cyclic block":
        return CentralizedSparsifiedSGD(
            model.parameters(), lr=lr, sparse_grad_size=k, world_size=ws, cyclic_blocks=True
        )
    if kind == "signum majority vote":
        return SignSGD(model.parameters(), lr=lr, momentum=0.9, majority_vote=True)
    if kind == "EF-signSGD":
        return SignSGD(model.parameters(), lr=lr, momentum=0.9, error_feedback=True)
    if kind == "EF-signSGD no momentum":
        return SignSGD(model.parameters(), lr=lr, error_feedback=True)
    if kind == "decentralized ring":
        return DecentralizedSGD(rank, ring_neighbors(rank, ws), model, lr=lr, momentum=0.9)
    raise ValueError(kind)


GRID = [0.03, 0.1, 0.3, 1.0, 3.0]
KINDS = [
    "sgd (baseline)",
    "powersgd r1",
    "powersgd r2",
    "sparsified random-k",
    "sparsified block",
    "sparsified cyclic block",
    "signum majority vote",
    "EF-signSGD",
    "EF-signSGD no momentum",
    "decentralized ring",
]
GRIDS = {k: [lr * 1e-2 for lr in GRID] if k == "signum majority vote" else GRID for k in KINDS}


def _worker(rank, ws, runs, epochs, seed, k):
    from adaptrain.workloads.digits import DigitsNet, digits_datasets

    torch.set_num_threads(1)
    train, test = digits_datasets(seed=0)
    x, y = train.tensors
    xt, yt = test.tensors
    per = GLOBAL_BATCH // ws
    out = {}
    for kind, lr in runs:
        model = DigitsNet(hidden=64, conv=False, seed=seed)
        opt = _make(kind, model, ws, rank, lr, k)
        g = torch.Generator().manual_seed(1 + seed)  # same shuffles on all workers
        losses, accs = [], []
        for _ in range(epochs):
            perm = torch.randperm(len(y), generator=g)
            for b in range(len(y) // GLOBAL_BATCH):
                idx = perm[b * GLOBAL_BATCH + rank * per : b * GLOBAL_BATCH + (rank + 1) * per]
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
                opt.step()
            with torch.no_grad():
                loss = float(torch.nn.functional.cross_entropy(model(x), y))
                losses.append(loss if math.isfinite(loss) else math.inf)
                accs.append(float((model(xt).argmax(1) == yt).float().mean()))
        out[(kind, lr)] = (losses, accs)
    return out


def _fmt_lr(lr: float) -> str:
    return f"{lr:g}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--epochs", type=int, default=24)
    ap.add_argument("--budgets", default="8,16,24", help="epoch budgets to report (≤ --epochs)")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--tol", type=float, default=0.10, help="allowed absolute loss excess (nats)")
    ap.add_argument("--k", type=int, default=64, help="sparsifiers: coordinates per parameter")
    ap.add_argument("--kinds", default="", help="comma-separated subset of the optimizers")
    args = ap.parse_args(argv)
    budgets = sorted({int(b) for b in args.budgets.split(",") if b})
    if not budgets or budgets[0] < 1 or budgets[-1] > args.epochs:
        raise ValueError(f"--budgets {args.budgets!r} must lie in [1, --epochs={args.epochs}]")
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()] or list(KINDS)
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise ValueError(f"unknown --kinds {unknown}; choose from {KINDS}")
    if "sgd (baseline)" not in kinds:
        kinds.insert(0, "sgd (baseline)")
    steps_per_epoch = 1437 // GLOBAL_BATCH
    print(
        f"# machine: {platform.platform()}, torch {torch.__version__}, python {sys.version.split()[0]}"
    )
    print(
        f"# digits MLP 64-64-10, {args.world_size} gloo workers, global batch {GLOBAL_BATCH} "
        f"({steps_per_epoch} steps/epoch), {args.epochs} epochs, {args.seeds} seeds, "
        f"sparsifiers k={args.k}/parameter; "
        f"criterion: median paired Δ <= {args.tol} nats\n"
    )
    runs = [(k, lr) for k in kinds for lr in GRIDS[k]]
    t0 = time.perf_counter()
    per_seed = []
    for seed in range(args.seeds):
        per_seed.append(
            spawn(_worker, args.world_size, args=(runs, args.epochs, seed, args.k), timeout=590)[0]
        )
    print(f"# wall time {time.perf_counter() - t0:.0f} s\n")

    def final(kind, lr, b):  # per-seed losses after b epochs
        return [r[(kind, lr)][0][b - 1] for r in per_seed]

    for b in budgets:
        best = {k: min(GRIDS[k], key=lambda lr, k=k: median(final(k, lr, b))) for k in kinds}
        base = final("sgd (baseline)", best["sgd (baseline)"], b)
        print(f"## {b} epochs ({b * steps_per_epoch} steps)\n")
        print(
            "| optimizer | best lr | median loss [min, max] | median Δ vs SGD [min, max] "
            "| median test acc | within tol |"
        )
        print("|---|---|---|---|---|---|")
        for kind in kinds:
            lr = best[kind]
            losses = final(kind, lr, b)
            deltas = [a - c for a, c in zip(losses, base)]
            accs = [r[(kind, lr)][1][b - 1] for r in per_seed]
            edge = " (grid edge)" if lr in (GRIDS[kind][0], GRIDS[kind][-1]) else ""
            ok = (
                "—" if kind == "sgd (baseline)" else ("yes" if median(deltas) <= args.tol else "NO")
            )
            print(
                f"| {kind} | {_fmt_lr(lr)}{edge} | {median(losses):.4f} "
                f"[{min(losses):.4f}, {max(losses):.4f}] | {median(deltas):+.4f} "
                f"[{min(deltas):+.4f}, {max(deltas):+.4f}] | {median(accs):.3f} | {ok} |"
            )
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
