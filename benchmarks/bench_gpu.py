"""GPU figures: AdaptiveDataParallel's step-time overhead over DDP on CUDA, and PowerSGD's cost.

Needs a CUDA GPU; one process, NCCL (NCCL takes one rank per device, and a lent machine has one
GPU, so the all-reduce is local: these figures are the per-step compute and host cost that
adaptrain adds on a GPU, not communication).

Part 1 (overhead): plain DDP, a second plain DDP (A/A control), ADP with its default sampled
statistics (warmed past the every-step phase) and ADP sampling every step, on the same batches;
each repetition runs a block of ``--steps`` steps of each variant (rotating order) between two
``torch.cuda.synchronize()`` calls; a paired sample is a variant's block time over the adjacent
DDP block's; the median over ``--reps`` repetitions is reported with the 95% confidence
interval of the median. Models: MLPs (1.1M and 17M parameters) at batch 32 and 256, and the
character LM (2-layer GRU of width 512, 64-character windows).

Part 2 (PowerSGD): one compress + all-reduce + decompress of a model's gradients by
:func:`adaptrain.dist.hooks.powersgd_hook` against torch's ``powerSGD_hook`` (same rank,
error feedback, warm start, every matrix compressed), paired, median of repetitions.

    python benchmarks/bench_gpu.py [--reps 15] [--steps 62] [--out benchmarks/results/gpu.md]
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
from bench_overhead import _median_ci, _model
from torch.nn.parallel import DistributedDataParallel

from adaptrain.dist.spawn import spawn


def _charlm() -> torch.nn.Module:
    from adaptrain.workloads.charlm import CharLM

    return CharLM(embed_dim=64, hidden=512, num_layers=2, seed=0)


CONFIGS = [  # (label, model factory key, batch); the parameter count is added at run time
    ("MLP 64-1024-1024-10, batch 32", "mlp1024", 32),
    ("MLP 64-1024-1024-10, batch 256", "mlp1024", 256),
    ("MLP 64-4096-4096-10, batch 32", "mlp4096", 32),
    ("MLP 64-4096-4096-10, batch 256", "mlp4096", 256),
    ("char LM, 2-layer GRU 512, batch 32 x 64 chars", "charlm", 32),
    ("char LM, 2-layer GRU 512, batch 256 x 64 chars", "charlm", 256),
]
VARIANTS = ("ddp", "ddp2", "adp", "adp1")


def _make(key: str) -> torch.nn.Module:
    if key == "charlm":
        return _charlm()
    return _model(int(key[3:]))  # the MLP 64-width-width-10 of bench_overhead


def _batches(key: str, bsz: int, dev: torch.device, n: int = 8):
    g = torch.Generator().manual_seed(0)
    if key == "charlm":
        from adaptrain.workloads.charlm import VOCAB_SIZE

        xs = [torch.randint(0, VOCAB_SIZE, (bsz, 65), generator=g) for _ in range(n)]
        return [(x[:, :-1].to(dev), x[:, 1:].to(dev)) for x in xs]
    return [
        (
            torch.randn(bsz, 64, generator=g).to(dev),
            torch.randint(0, 10, (bsz,), generator=g).to(dev),
        )
        for _ in range(n)
    ]


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def _overhead_worker(rank: int, ws: int, key: str, bsz: int, reps: int, steps: int) -> dict:
    from adaptrain.torch.parallel import AdaptiveDataParallel

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    models = {}
    for name in VARIANTS:
        m = _make(key).to(dev)
        opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
        if name.startswith("ddp"):
            model = DistributedDataParallel(m)
        else:
            kw = {"max_stats_interval": 1} if name == "adp1" else {}
            model = AdaptiveDataParallel(m, opt, name=name, **kw)
        models[name] = (model, opt)
    batches = _batches(key, bsz, dev)

    def step(model, opt, b):
        opt.zero_grad()
        x, y = b
        _loss(model(x), y).backward()
        opt.step()

    for model, opt in models.values():
        for i in range(10):
            step(model, opt, batches[i % len(batches)])
    adp, adp_opt = models["adp"]
    warm = 0
    settled = adp.gns.settled_interval()
    if steps % settled:
        raise ValueError(f"--steps {steps} must be a multiple of the sampling interval {settled}")
    while adp.gns.sample_interval() < settled:
        step(adp, adp_opt, batches[warm % len(batches)])
        warm += 1
    times = {n: [] for n in VARIANTS}
    for r in range(reps):
        for name in VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]:
            model, opt = models[name]
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for i in range(steps):
                step(model, opt, batches[i % len(batches)])
            torch.cuda.synchronize()
            times[name].append(time.perf_counter() - t0)
    return {
        "times": times,
        "warm": warm,
        "interval": adp.gns.sample_interval(),
        "params": sum(p.numel() for p in adp.parameters()),
    }


def _powersgd_worker(rank: int, ws: int, key: str, rank_r: int, reps: int, steps: int) -> dict:
    import torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook as th
    from bench_compression import _Bucket

    from adaptrain.dist.hooks import PowerSGDHookState, powersgd_hook

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    shapes = [tuple(p.shape) for p in _make(key).parameters()]
    bucket = _Bucket(shapes, torch.Generator().manual_seed(1))
    bucket.source, bucket.buf = bucket.source.to(dev), bucket.buf.to(dev)
    ours = PowerSGDHookState(rank=rank_r, reuse_query=True, error_feedback=True,
                             min_compression_rate=0)  # fmt: skip
    theirs = th.PowerSGDState(process_group=None, matrix_approximation_rank=rank_r,
                              start_powerSGD_iter=2, min_compression_rate=0,
                              use_error_feedback=True, warm_start=True, random_seed=0)  # fmt: skip

    def run(hook, state):
        bucket.reset()
        hook(state, bucket).wait()

    for _ in range(5):
        run(powersgd_hook, ours)
        run(th.powerSGD_hook, theirs)
    t = {"ours": [], "torch": []}
    for r in range(reps):
        order = [("ours", powersgd_hook, ours), ("torch", th.powerSGD_hook, theirs)]
        for name, hook, state in order if r % 2 == 0 else order[::-1]:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(steps):
                run(hook, state)
            torch.cuda.synchronize()
            t[name].append((time.perf_counter() - t0) / steps)
    return t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--steps", type=int, default=62)
    ap.add_argument("--configs", type=int, nargs="+", default=list(range(len(CONFIGS))))
    ap.add_argument("--powersgd-ranks", type=int, nargs="*", default=[1, 4])
    ap.add_argument("--out", default=None, help="write a markdown report here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (this benchmark measures the CUDA/NCCL path)")
    med = statistics.median
    lines = []
    for label, key, bsz in (CONFIGS[i] for i in args.configs):
        (res,) = spawn(_overhead_worker, 1, args=(key, bsz, args.reps, args.steps),
                       backend="nccl", timeout=1800)  # fmt: skip
        t = res["times"]
        ratio = {k: [a / d for a, d in zip(t[k], t["ddp"])] for k in ("ddp2", "adp", "adp1")}
        ci, ci_aa = _median_ci(ratio["adp"]), _median_ci(ratio["ddp2"])
        step_us = 1e6 * med(t["ddp"]) / args.steps
        row = (
            f"| {label} ({res['params'] / 1e6:.1f}M params) | {step_us:.0f} | **{med(ratio['adp']):.3f}×** | {ci[0]:.3f}–{ci[1]:.3f} "
            f"| {med(ratio['adp1']):.3f}× | {med(ratio['ddp2']):.3f}× ({ci_aa[0]:.3f}–{ci_aa[1]:.3f}) "
            f"| {1e6 * med([(a - d) for a, d in zip(t['adp'], t['ddp'])]) / args.steps:+.0f} |"
        )
        print(row, flush=True)
        lines.append(row)
    prow = []
    for r in args.powersgd_ranks:
        for key in ("mlp1024", "mlp4096", "charlm"):
            (t,) = spawn(_powersgd_worker, 1, args=(key, r, args.reps, 20), backend="nccl",
                         timeout=1800)  # fmt: skip
            ratios = [a / b for a, b in zip(t["ours"], t["torch"])]
            row = (
                f"| {key} | {r} | {1e3 * med(t['ours']):.3f} | {1e3 * med(t['torch']):.3f} "
                f"| **{med(ratios):.3f}×** ({min(ratios):.3f}–{max(ratios):.3f}) |"
            )
            print(row, flush=True)
            prow.append(row)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        name = torch.cuda.get_device_name(0)
        with open(args.out, "w") as f:
            f.write("# GPU figures\n\n")
            f.write(
                f"Command: `python benchmarks/bench_gpu.py --reps {args.reps} --steps "
                f"{args.steps} --configs {' '.join(map(str, args.configs))}`\n\nMachine: {name}, {os.cpu_count()} CPU cores, "
                f"{platform.platform()}, Python {sys.version.split()[0]}, torch "
                f"{torch.__version__}, CUDA {torch.version.cuda}, NCCL "
                f"{'.'.join(map(str, torch.cuda.nccl.version()))}; one process, NCCL.\n\n"
            )
            f.write(
                "## AdaptiveDataParallel / DDP step time on the GPU\n\n"
                "| model, batch | DDP step (µs) | ADP (default sampling) / DDP, median | 95% CI "
                "| ADP sampling every step / DDP | DDP again / DDP (CI) | ADP − DDP per step, median of "
                "paired blocks (µs) |\n"
                "|---|---|---|---|---|---|---|\n"
            )
            f.write("\n".join(lines) + "\n\n")
            f.write(
                "## PowerSGD hook: ours / torch's `powerSGD_hook` on the GPU\n\n"
                "| gradients of | rank | ours (ms) | torch (ms) | ours / torch, median (range) |\n"
                "|---|---|---|---|---|\n"
            )
            f.write("\n".join(prow) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
