"""ADP's fixed cost per step in microseconds, on a model small enough that it dominates.

``bench_overhead.py`` measures ratios at 1.5-10 ms steps, where this shared machine's scatter
(an A/A control of 0.97-1.04x) hides a cost of 1-2%. Here the same comparison runs on a tiny
MLP (a few hundred microseconds per step), so the difference can be read in microseconds:
each of ``--rounds`` rounds runs a chunk of ``--steps`` steps of every variant (the order
rotating between rounds), and the forward, backward and optimizer-step times of a chunk are
averaged; one paired sample is a variant's chunk mean minus the adjacent DDP chunk's, and the
median over rounds is reported, with the ratio of whole steps. Variants: plain DDP, a second
plain DDP (A/A control), ADP with its default sampled statistics (warmed up to one sample in
62 steps), and ADP with statistics off (its bookkeeping and the scaling rule's step hooks
only). The expected ratio at a step of ``T`` microseconds is ``1 + cost / T``.

Run it with ``--world-size 1``: with two gloo processes the all-reduce of even a tiny model
takes ~1.5 ms with a scatter of tens of microseconds (the A/A control read +71 us), while
in one process the A/A control stays within ±1.5 us. One process pairs consecutive steps for
its samples (two hooked steps per sample instead of one), so its sampling cost is an upper
bound of the multi-replica one; the bookkeeping and step hooks are the same code.

    python benchmarks/bench_overhead_us.py --world-size 1 [--rounds 40] [--steps 124]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from bench_overhead import _model  # the same MLP, 64-width-width-10
from torch.nn.parallel import DistributedDataParallel

from adaptrain.dist.spawn import spawn

PHASES = ("forward", "backward", "step", "whole")


def _worker(rank: int, ws: int, width: int, rounds: int, steps: int) -> dict:
    from adaptrain.torch.parallel import AdaptiveDataParallel

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g)
    models = {}
    for name in ("ddp", "ddp2", "adp", "adp-nostats"):
        m = _model(width)
        opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
        if name.startswith("ddp"):
            model = DistributedDataParallel(m)
        else:
            model = AdaptiveDataParallel(m, opt, name=name)
            if name == "adp-nostats":
                model.gns._collector = None  # no sampling: bookkeeping and step hooks only
        models[name] = (model, opt)

    def step(model, opt):
        opt.zero_grad()
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        return t1 - t0, t2 - t1, t3 - t2, t3 - t0

    for model, opt in models.values():
        for _ in range(20):
            step(model, opt)
    adp, adp_opt = models["adp"]
    warm = 0
    while adp.gns.sample_interval() < adp.gns.settled_interval():  # past the every-step phase
        step(adp, adp_opt)
        warm += 1
    names = list(models)
    chunks = {n: {p: [] for p in PHASES} for n in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            model, opt = models[name]
            sums = [0.0] * 4
            for _ in range(steps):
                for i, t in enumerate(step(model, opt)):
                    sums[i] += t
            for p, s in zip(PHASES, sums):
                chunks[name][p].append(s / steps)
    return {"chunks": chunks, "warm": warm, "interval": adp.gns.sample_interval()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=1)
    ap.add_argument("--width", type=int, default=32, help="hidden width of the tiny MLP")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument(
        "--steps", type=int, default=124, help="steps per chunk (a multiple of the interval, 62)"
    )
    args = ap.parse_args(argv)
    from adaptrain.torch.gradient_noise_scale import GradientNoiseScale

    settled = GradientNoiseScale(num_replicas=1).settled_interval(1.0)  # ADP's defaults
    if args.steps % settled:
        ap.error(f"--steps {args.steps} must be a multiple of {settled} (the sampling interval)")
    out = spawn(_worker, args.world_size, args=(args.width, args.rounds, args.steps), timeout=900)[
        0
    ]
    ch = out["chunks"]
    base = statistics.median(ch["ddp"]["whole"]) * 1e6
    print(
        f"{args.world_size} gloo process(es), MLP 64-{args.width}-{args.width}-10, batch 16, "
        f"{args.rounds} rounds x {args.steps} steps; DDP step {base:.0f} us; ADP warmed "
        f"{out['warm']} steps, sampling one step in {out['interval']}"
    )
    print("| variant | forward | backward | optimizer step | whole step | whole step / DDP |")
    print("|---|---|---|---|---|---|")
    for name in ("ddp2", "adp", "adp-nostats"):
        cells = []
        for p in PHASES:
            diff = [(a - b) * 1e6 for a, b in zip(ch[name][p], ch["ddp"][p])]
            cells.append(f"{statistics.median(diff):+.1f} us")
        ratio = statistics.median(a / b for a, b in zip(ch[name]["whole"], ch["ddp"]["whole"]))
        print(f"| {name} − DDP | " + " | ".join(cells) + f" | {ratio:.3f}× |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
