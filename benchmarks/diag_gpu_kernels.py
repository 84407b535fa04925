"""Diagnostic (GPU): which kernels, copies and host synchronisations ADP adds to a DDP step.

    python benchmarks/diag_gpu_kernels.py [--widths 1024 4096] [--blocks 31]

One process, NCCL, on a CUDA GPU. For the MLP 64-W-W-10 at batch 32 (W = 1024: 1.1M parameters,
4096: 17.1M), builds plain DDP and AdaptiveDataParallel (default statistics, warmed until the
sampling interval has settled), then:

* times ``--blocks`` alternating blocks of 62 steps of each (one sampled ADP step per block)
  and prints the median step times and the median paired ratio;
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


def worker(rank, ws, width, blocks):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_overhead import _model
    from torch.profiler import ProfilerActivity, profile

    from adaptrain.torch.parallel import AdaptiveDataParallel

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    models = {}
    x = torch.randn(32, 64, device=dev)
    y = torch.randint(0, 10, (32,), device=dev)
    for name in ("ddp", "adp"):
        m = _model(width).to(dev)
        opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
        model = (
            DistributedDataParallel(m) if name == "ddp" else AdaptiveDataParallel(m, opt, name="x")
        )
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
    times = {"ddp": [], "adp": []}
    for r in range(blocks):
        for name in ("ddp", "adp") if r % 2 == 0 else ("adp", "ddp"):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(62):
                step(*models[name])
            torch.cuda.synchronize()
            times[name].append((time.perf_counter() - t0) / 62 * 1e6)
    out["median_us"] = {k: statistics.median(v) for k, v in times.items()}
    out["ratio"] = statistics.median(a / d for a, d in zip(times["adp"], times["ddp"]))
    for name in ("ddp", "adp"):
        model, opt = models[name]
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(62):
                step(model, opt)
            torch.cuda.synchronize()
        rows = []
        for e in prof.key_averages():
            rows.append(
                (
                    e.key,
                    e.count,
                    e.cpu_time_total / 62,
                    getattr(e, "self_device_time_total", 0) / 62,
                )
            )
        out[name] = rows
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--widths", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--blocks", type=int, default=31)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("diag_gpu_kernels.py needs a CUDA GPU")
    for width in a.widths:
        r = spawn(worker, 1, args=(width, a.blocks), backend="nccl", timeout=600)[0]
        print(
            f"##### width {width}: interval {r['interval']} median us {r['median_us']} ratio {r['ratio']:.4f}"
        )
        d = {k: (c, t, g) for k, c, t, g in r["ddp"]}
        a = {k: (c, t, g) for k, c, t, g in r["adp"]}
        for nm, rows in (("ddp", r["ddp"]), ("adp", r["adp"])):
            print(f"-- {nm}: total self device us/step {sum(g for _, _, _, g in rows):.1f}")
            for k, c, t, g in sorted(rows, key=lambda z: -z[3])[:8]:
                print(f"   {k[:70]:70s} n={c:5d} cpu={t:8.1f} dev={g:7.1f}")
        print("-- differing counts / device time > 1us")
        for k in sorted(set(d) | set(a)):
            cd, td, gd = d.get(k, (0, 0, 0))
            ca, ta, ga = a.get(k, (0, 0, 0))
            if cd != ca or abs(gd - ga) > 1.0 or "ynchron" in k:
                print(
                    f"   {k[:70]:70s} ddp n={cd} cpu={td:.1f} dev={gd:.1f} | adp n={ca} cpu={ta:.1f} dev={ga:.1f}"
                )
