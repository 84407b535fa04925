"""Start-up of a ``spawn``ed gloo group whose children wrap a model in DDP, by fork-server preload.

``adaptrain.dist.spawn`` starts its children from a fork server that has imported a few modules
once. DDP's constructor imports ``torch._dynamo`` (about 1.3 s on a 2-core machine), and a test
child that loads sklearn's bundled digits imports sklearn (about 1 s); without them preloaded,
every child pays those imports again. Arms, each in its own fresh interpreter (a process keeps
the fork server it started first):

- ``before``: the earlier, smaller preload (torch, torch.distributed, numpy);
- ``default``: the current preload (adds torch._dynamo);
- ``sklearn``: the default plus ``preload=["sklearn.datasets"]`` (what the test session uses).

In each interpreter one call starts the fork server (its time is reported apart), then
``--calls`` calls each run a 2-process group whose children load the digits, build a small
DDP model and take one step; the median call time is that interpreter's figure. ``--rounds``
rounds run every arm once, in a rotating order; the table gives each arm's median over rounds,
and its ratio to ``before`` in the same round (median over rounds).

    python benchmarks/bench_spawn.py [--rounds 5] [--calls 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

ARMS = ("before", "default", "sklearn")


def _child(rank: int, world_size: int) -> float:
    import torch
    import torch.nn.functional as F
    from sklearn.datasets import load_digits
    from torch.nn.parallel import DistributedDataParallel

    X, y = load_digits(return_X_y=True)
    x = torch.tensor(X[:32] / 16.0, dtype=torch.float32)
    model = DistributedDataParallel(torch.nn.Linear(64, 10))
    F.cross_entropy(model(x), torch.tensor(y[:32])).backward()
    return float(model.module.weight.grad.norm())


def _arm(arm: str, calls: int) -> dict:
    """One interpreter's figures (run in a fresh process by :func:`main`)."""
    import importlib

    # the module itself: adaptrain.dist re-exports its function under the same name
    sp = importlib.import_module("adaptrain.dist.spawn")

    if arm == "before":  # the earlier preload (a private list, for this reference only)
        sp._PRELOAD = ["torch", "torch.distributed", "numpy"]
    preload = ["sklearn.datasets"] if arm == "sklearn" else []
    t0 = time.perf_counter()
    sp.spawn(max, 1, init=False, preload=preload)  # starts the fork server
    start = time.perf_counter() - t0
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        sp.spawn(_child, 2, timeout=120)
        times.append(time.perf_counter() - t0)
    return {"start": start, "call": statistics.median(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)  # one interpreter's run
    args = ap.parse_args()
    if args.arm:
        print(json.dumps(_arm(args.arm, args.calls)))
        return
    rows: dict[str, list[dict]] = {a: [] for a in ARMS}
    for r in range(args.rounds):
        order = ARMS[r % len(ARMS) :] + ARMS[: r % len(ARMS)]
        for arm in order:
            out = subprocess.run(
                [sys.executable, __file__, "--arm", arm, "--calls", str(args.calls)],
                capture_output=True,
                text=True,
                check=True,
                timeout=900,
            ).stdout
            rows[arm].append(json.loads(out.strip().splitlines()[-1]))
        print(
            f"round {r + 1}/{args.rounds}: "
            + ", ".join(f"{a} {rows[a][-1]['call']:.2f} s" for a in ARMS),
            flush=True,
        )
    print(f"\n{args.rounds} rounds x {args.calls} calls of a 2-process group (median per call)")
    print(f"{'arm':>8} {'server start s':>15} {'call s':>8} {'/ before':>9}")
    for a in ARMS:
        start = statistics.median(x["start"] for x in rows[a])
        call = statistics.median(x["call"] for x in rows[a])
        ratio = statistics.median(
            x["call"] / b["call"] for x, b in zip(rows[a], rows["before"], strict=True)
        )
        print(f"{a:>8} {start:>15.2f} {call:>8.2f} {ratio:>9.2f}")


if __name__ == "__main__":
    main()
