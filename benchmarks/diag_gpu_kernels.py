"""Diagnostic (GPU): which kernels, copies and host synchronisations ADP adds to a DDP step.

    python benchmarks/diag_gpu_kernels.py [--widths 1024 4096] [--blocks 31] [--no-profile]

One process, NCCL, on a CUDA GPU. For the MLP 64-W-W-10 at batch 32 (W = 1024: 1.1M parameters,
4096: 17.1M), builds plain DDP and AdaptiveDataParallel (default statistics, warmed until the
sampling interval has settled), then:

* times ``--blocks`` rotating blocks of 62 steps of DDP, ADP (one sampled step per block) and
  ADP with statistics off (no sampled step, no host synchronisation), and prints the median
  step times and the median paired ratios to DDP;
* profiles one 62-step block of each with ``torch.profiler`` (CPU and CUDA) and prints, per
  step, every operator, kernel and CUDA runtime call whose count or device time differs between
  the two, and every synchronisation.

It answers "is ADP's extra time GPU work or host time?": a row present only under ADP is work
ADP adds. Not a benchmark (the profiler perturbs the timings it does not report).
"""

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from adaptrain.dist.spawn import spawn

# plain DDP, ADP (default sampled statistics), ADP with statistics off (no sampled step, so no
# host synchronisation: its bookkeeping and the scaling rule's step hooks only)
VARIANTS = ("ddp", "adp", "adp-nostats")


def worker(rank, ws, width, blocks, profile_too):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_overhead import _model
    from torch.profiler import ProfilerActivity, profile

    from adaptrain.torch.parallel import AdaptiveDataParallel

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    models = {}
    x = torch.randn(32, 64, device=dev)
    y = torch.randint(0, 10, (32,), device=dev)
    for name in VARIANTS:
        m = _model(width).to(dev)
        opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
        if name == "ddp":
            model = DistributedDataParallel(m)
        else:
            model = AdaptiveDataParallel(m, opt, name=name)
            if name == "adp-nostats":
                model.gns._collector = None  # no sampled steps: bookkeeping and hooks only
        models[name] = (model, opt)

    def step(model, opt):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    for model, opt in models.values():
        for _ in range(30):
            step(model, opt)
    adp = models["adp"][0]
    while adp.gns.sample_interval() < adp.gns.settled_interval():
        step(*models["adp"])
    out = {"interval": adp.gns.sample_interval()}
    times = {n: [] for n in VARIANTS}
    for r in range(blocks):
        k = r % len(VARIANTS)
        for name in VARIANTS[k:] + VARIANTS[:k]:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(62):
                step(*models[name])
            torch.cuda.synchronize()
            times[name].append((time.perf_counter() - t0) / 62 * 1e6)
    out["median_us"] = {k: statistics.median(v) for k, v in times.items()}
    out["ratio"] = {
        n: statistics.median(a / d for a, d in zip(times[n], times["ddp"])) for n in VARIANTS[1:]
    }
    for name in ("ddp", "adp") if profile_too else ():
        model, opt = models[name]
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(62):
                step(model, opt)
            torch.cuda.synchronize()
        out[name] = [  # (name, count, CPU µs per step, own device µs per step)
            (e.key, e.count, e.cpu_time_total / 62, e.self_device_time_total / 62)
            for e in prof.key_averages()
        ]
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--widths", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--blocks", type=int, default=31)
    ap.add_argument("--no-profile", action="store_true", help="the timings only")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("diag_gpu_kernels.py needs a CUDA GPU")
    for width in a.widths:
        args = (width, a.blocks, not a.no_profile)
        r = spawn(worker, 1, args=args, backend="nccl", timeout=600)[0]
        med = ", ".join(f"{n} {v:.0f}" for n, v in r["median_us"].items())
        ratio = ", ".join(f"{n} {v:.4f}" for n, v in r["ratio"].items())
        print(f"##### width {width}: interval {r['interval']}; median us/step: {med}")
        print(f"      median paired ratio to ddp: {ratio}")
        if a.no_profile:
            continue
        d = {k: (c, t, g) for k, c, t, g in r["ddp"]}
        o = {k: (c, t, g) for k, c, t, g in r["adp"]}
        for nm, rows in (("ddp", r["ddp"]), ("adp", r["adp"])):
            print(f"-- {nm}: total self device us/step {sum(g for _, _, _, g in rows):.1f}")
            for k, c, t, g in sorted(rows, key=lambda z: -z[3])[:8]:
                print(f"   {k[:70]:70s} n={c:5d} cpu={t:8.1f} dev={g:7.1f}")
        print("-- differing counts / device time > 1us")
        for k in sorted(set(d) | set(o)):
            cd, td, gd = d.get(k, (0, 0, 0))
            ca, ta, ga = o.get(k, (0, 0, 0))
            if cd != ca or abs(gd - ga) > 1.0 or "ynchron" in k:
                print(
                    f"   {k[:70]:70s} ddp n={cd} cpu={td:.1f} dev={gd:.1f} | "
                    f"adp n={ca} cpu={ta:.1f} dev={ga:.1f}"
                )
