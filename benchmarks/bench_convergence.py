"""Final loss of each compressed optimizer vs uncompressed all-reduce SGD on sklearn digits.

Run: ``python benchmarks/bench_convergence.py [--epochs 8] [--world-size 2] [--tol 0.10]``

``--world-size`` gloo processes each take an equal shard of every mini-batch (global batch 64)
of the digits training split (``adaptrain.workloads.digits``, MLP 64-64-10, seed 0) and train
with: CentralizedSGD (baseline: momentum 0.9), PowerSGD rank 1 and 2 (same momentum, error
feedback), CentralizedSparsifiedSGD (random-k and block, k = 64 coordinates per parameter,
memory), SignSGD with majority vote (signum, momentum 0.9) and with error feedback, and
DecentralizedSGD on a ring. The figure is the final full-training-set loss of rank 0's model
(test accuracy alongside); the criterion is ``loss ≤ baseline + tol`` (absolute, nats).
Every optimizer, the baseline included, gets the best learning rate of a 3-point grid.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time

import torch

from adaptrain.dist.spawn import spawn

GLOBAL_BATCH = 64


def _make(kind, model, ws, rank, lr):
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
            model.parameters(), lr=lr, sparse_grad_size=64, random_sparse=True, world_size=ws
        )
    if kind == "sparsified block":
        return CentralizedSparsifiedSGD(
            model.parameters(), lr=lr, sparse_grad_size=64, world_size=ws
        )
    if kind == "signum majority vote":
        return SignSGD(model.parameters(), lr=lr, momentum=0.9, majority_vote=True)
    if kind == "EF-signSGD":
        return SignSGD(model.parameters(), lr=lr, momentum=0.9, error_feedback=True)
    if kind == "decentralized ring":
        return DecentralizedSGD(rank, ring_neighbors(rank, ws), model, lr=lr, momentum=0.9)
    raise ValueError(kind)


GRIDS = {
    "sgd (baseline)": [0.03, 0.1, 0.3],
    "powersgd r1": [0.03, 0.1, 0.3],
    "powersgd r2": [0.03, 0.1, 0.3],
    "sparsified random-k": [0.1, 0.3, 1.0],
    "sparsified block": [0.1, 0.3, 1.0],
    "signum majority vote": [3e-4, 1e-3, 3e-3],
    "EF-signSGD": [0.03, 0.1, 0.3],
    "decentralized ring": [0.03, 0.1, 0.3],
}
KINDS = [
    "sgd (baseline)",
    "powersgd r1",
    "powersgd r2",
    "sparsified random-k",
    "sparsified block",
    "signum majority vote",
    "EF-signSGD",
    "decentralized ring",
]


def _worker(rank, ws, kinds, epochs):
    from adaptrain.workloads.digits import DigitsNet, digits_datasets

    train, test = digits_datasets(seed=0)
    x, y = train.tensors
    xt, yt = test.tensors
    per = GLOBAL_BATCH // ws
    out = {}
    for kind, lr in kinds:
        model = DigitsNet(hidden=64, conv=False, seed=0)
        opt = _make(kind, model, ws, rank, lr)
        g = torch.Generator().manual_seed(1)  # same shuffles on all workers
        t0 = time.perf_counter()
        for _ in range(epochs):
            perm = torch.randperm(len(y), generator=g)
            for b in range(len(y) // GLOBAL_BATCH):
                idx = perm[b * GLOBAL_BATCH + rank * per : b * GLOBAL_BATCH + (rank + 1) * per]
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
                opt.step()
        with torch.no_grad():
            loss = float(torch.nn.functional.cross_entropy(model(x), y))
            acc = float((model(xt).argmax(1) == yt).float().mean())
        out[(kind, lr)] = (loss, acc, time.perf_counter() - t0)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--tol", type=float, default=0.10, help="allowed absolute loss excess (nats)")
    args = ap.parse_args(argv)
    print(
        f"# machine: {platform.platform()}, torch {torch.__version__}, python {sys.version.split()[0]}"
    )
    print(
        f"# digits MLP 64-64-10, {args.world_size} gloo workers, global batch {GLOBAL_BATCH}, "
        f"{args.epochs} epochs; criterion: final train loss <= baseline + {args.tol}\n"
    )
    runs = [(k, lr) for k in KINDS for lr in GRIDS[k]]
    res = spawn(_worker, args.world_size, args=(runs, args.epochs), timeout=590)[0]
    best = {k: min(GRIDS[k], key=lambda lr, k=k: res[(k, lr)][0]) for k in KINDS}
    base = res[("sgd (baseline)", best["sgd (baseline)"])][0]
    print("Each optimizer's lr is the best (lowest final loss) of its 3-point grid.\n")
    print("| optimizer | lr grid | best lr | final train loss | Δ vs SGD | test acc | within tol |")
    print("|---|---|---|---|---|---|---|")
    for kind in KINDS:
        loss, acc, _ = res[(kind, best[kind])]
        ok = loss <= base + args.tol
        print(
            f"| {kind} | {GRIDS[kind]} | {best[kind]} | {loss:.4f} | {loss - base:+.4f} | "
            f"{acc:.3f} | {'yes' if ok else 'NO'} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
