"""Step-time overhead of AdaptiveDataParallel (statistics on) over plain DistributedDataParallel.

All variants wrap the same model on the same 2-process gloo group and train on the same batches
(digits, fixed batch size): plain DDP; a second plain DDP (the A/A control: how far two
identical variants read apart); DDP with torch's Python ``allreduce_hook`` (what any
Python communication hook costs); ADP with its default sampled statistics (one step in 62 at a
fixed batch),
warmed up past the early every-step phase (the steady state of a run longer than ~4000 steps);
optionally the same with ``max_stats_interval=32`` (``adp32``, the previous default,
one step in 32; ``--steps`` a multiple of 992 then); and ADP sampling every step
(``max_stats_interval=1``, AdaptDL's cadence and the cost of the first ~100 steps).
Each of ``--reps`` repetitions runs a block of ``--steps`` steps of each (rotating order),
timing every step; the ratio of a block's mean step time to the adjacent DDP block's is one
paired sample and the median over repetitions is reported (robust to load that drifts, and to
preemption spikes on a shared machine). ``--steps`` must be a multiple of every timed ADP's
sampling interval (62 by default), so that every block holds the same number of sampled steps.
A 95% confidence interval of each median (binomial order statistics) is printed: on a 2-core
host the paired ratios scatter by +-15%, so resolving 1% takes thousands of repetitions.
(Interleaving the variants step by step instead gives no narrower spread, and the A/A control
then reads 0.92-0.95, a bias from the models' alternating use of the caches.)

With ``--launches K`` the repetitions are split over K fresh launches, each building its
variants in another order and memory layout; their samples are pooled, and the mean of the
per-launch medians is given with a 95% interval over launches (one launch's own interval is
too narrow when launches disagree, as launches can). The first ~3 steps of a
block after another model's cost 2.5-4 ms more than the rest (the caches refill; measured at
3.2 ms steps), 1.3-2% of a 62-step block and possibly unequal between variants; ``--steps 248``
(four samples per ADP block) cuts that share to ~0.4%.

    python benchmarks/bench_overhead.py [--reps 21] [--steps 62] [--configs 0 1 2 3]
                                        [--variants ddp ddp2 adp] [--launches 1]
                                        [--out overhead_run.md]
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
    ("MLP 64-1024-1024-10 (1.1M params), batch 128/replica", 1024, 128),
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


VARIANTS = ("ddp", "ddp2", "pyhook", "adp", "adp32", "adp1")
DEFAULT_VARIANTS = ("ddp", "ddp2", "pyhook", "adp", "adp1")


def _worker(
    rank: int,
    ws: int,
    width: int,
    bsz: int,
    reps: int,
    steps: int,
    variants: tuple[str, ...],
    launch: int = 0,
) -> list[float]:
    import torch.distributed as dist
    from sklearn.datasets import load_digits

    from adaptrain.torch.parallel import AdaptiveDataParallel

    X, y = load_digits(return_X_y=True)
    X = torch.tensor(X / 16.0, dtype=torch.float32)
    y = torch.tensor(y)
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    def build(name: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        m = _model(width)
        opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
        if name in ("ddp", "ddp2"):  # ddp2: a second plain DDP, the A/A control
            return DistributedDataParallel(m), opt
        if name == "pyhook":  # torch's own Python all-reduce hook, for reference
            hooked = DistributedDataParallel(m)
            hooked.register_comm_hook(dist.group.WORLD, default_hooks.allreduce_hook)
            return hooked, opt
        interval = {"adp": None, "adp32": 32, "adp1": 1}[name]
        kw = {} if interval is None else {"max_stats_interval": interval}
        return AdaptiveDataParallel(m, opt, name=f"bench-{name}", **kw), opt

    # Launch 0 builds the variants in the fixed order; a later launch (--launches) in an order
    # drawn from its index (the same on both ranks) with a spacer allocation between them, so
    # that which variant lands where in memory varies between launches and a per-layout offset
    # averages out over the launches instead of biasing every block of one run.
    order = [k for k in VARIANTS if k in variants]
    spacers = []
    if launch:
        rng = torch.Generator().manual_seed(1000 + launch)
        order = [order[i] for i in torch.randperm(len(order), generator=rng).tolist()]
    models = {}
    for name in order:
        if launch:
            size = int(torch.randint(1, 1 << 16, (1,), generator=rng))
            spacers.append(torch.empty(size))
        models[name] = build(name)
    models = {k: models[k] for k in VARIANTS if k in models}  # timing rotation as before
    adp, opt_adp = models["adp"]
    adp32, opt_adp32 = models.get("adp32", (None, None))
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
    warm = 0  # the sampled ADPs past their early every-step phase (same count on both ranks)
    for name, (sampled, sampled_opt) in (("adp", (adp, opt_adp)), ("adp32", (adp32, opt_adp32))):
        if name not in variants:
            continue
        settled = sampled.gns.settled_interval()
        if steps % settled:
            raise ValueError(
                f"steps={steps} is not a multiple of {name}'s sampling interval ({settled}): "
                "blocks would hold different numbers of sampled steps"
            )
        while sampled.gns.sample_interval() < settled:
            step(sampled, sampled_opt, batches[warm % 16])
            warm += 1
    names = [k for k in models if k in variants]
    n0 = adp.gns.num_updates
    wall = {k: [] for k in names}
    cpu = {k: [] for k in names}
    for r in range(reps):
        dist.barrier()
        for name in names[r % len(names) :] + names[: r % len(names)]:  # rotate the order
            model, opt = models[name]
            for i in range(steps):
                w, c = step(model, opt, batches[i % 16])
                wall[name].append(w)
                cpu[name].append(c)
    assert adp.gns.num_updates > 0  # the statistics really were collected
    timed = reps * steps
    info = {
        "warm": warm,
        "interval": adp.gns.sample_interval(),
        "sampled_share": (adp.gns.num_updates - n0) / timed,
    }
    return wall, cpu, info


def _block_sums(times: list[float], reps: int, n: int) -> list[float]:
    """Total step time of each block of ``n`` steps.

    Paired samples compare block sums (i.e. mean steps), not medians: with sampled statistics
    one step in up to 62 is slower, and the median step would hide it; a preemption spike
    inflates one block, which the median over repetitions then discards.
    """
    return [sum(times[k * n : (k + 1) * n]) for k in range(reps)]


def _median_ci(xs: list[float]) -> tuple[float, float]:
    """Distribution-free 95% confidence interval of the median (scipy's binomial quantile test)."""
    from scipy.stats import quantile_test

    ci = quantile_test(xs, q=statistics.median(xs), p=0.5).confidence_interval(0.95)
    return float(ci.low), float(ci.high)


def _launch_ci(xs: list[float]) -> tuple[float, float, float]:
    """Mean of the per-launch medians and its 95% t-interval (NaN with fewer than 2 launches).

    Each launch is one draw of the memory layout and thread placement, so its offset is shared
    by all its blocks: the pooled median's binomial interval treats those blocks as
    independent and is too narrow when launches disagree. This interval counts launches.
    """
    from scipy.stats import t

    if len(xs) < 2 or any(x != x for x in xs):
        return float("nan"), float("nan"), float("nan")
    m = statistics.fmean(xs)
    h = t.ppf(0.975, len(xs) - 1) * statistics.stdev(xs) / len(xs) ** 0.5
    return m, m - h, m + h


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--steps", type=int, default=62)
    ap.add_argument("--out", default=None, help="write a markdown report here")
    ap.add_argument(
        "--launches",
        type=int,
        default=1,
        help="split --reps over this many fresh 2-process launches, each building its variants "
        "in a different order and memory layout, and pool their paired samples (default 1: one "
        "launch, the fixed order). The per-launch medians and a CI over launches are reported: "
        "two launches of the same code can disagree by more than one launch's CI",
    )
    ap.add_argument(
        "--configs",
        type=int,
        nargs="+",
        default=list(range(len(CONFIGS))),
        help="indices into CONFIGS to run (default: all)",
    )
    ap.add_argument(
        "--variants",
        nargs="+",
        default=list(DEFAULT_VARIANTS),
        choices=VARIANTS,
        help="variants to time (default: all but adp32; ddp and adp are always kept). Fewer variants "
        "put each ADP block closer in time to its DDP block",
    )
    args = ap.parse_args(argv)
    if args.reps < 2:
        ap.error(f"--reps {args.reps}: at least 2 repetitions (the spread needs two)")
    if not 1 <= args.launches <= args.reps // 2:
        ap.error(f"--launches {args.launches}: give 1 to reps/2 launches (2+ repetitions each)")
    if any(not 0 <= i < len(CONFIGS) for i in args.configs):
        ap.error(f"--configs {args.configs}: indices must lie in 0..{len(CONFIGS) - 1}")
    variants = tuple(k for k in VARIANTS if k in set(args.variants) | {"ddp", "adp"})
    rows = []
    med = statistics.median
    nan = float("nan")
    n = args.steps
    for label, width, bsz in (CONFIGS[i] for i in args.configs):
        reps_of = [
            args.reps // args.launches + (j < args.reps % args.launches)
            for j in range(args.launches)
        ]
        ratio = {k: [] for k in ("adp", "adp32", "adp1", "pyhook", "ddp2")}
        both, per_launch, walls = [], [], []
        cpu = {k: 0.0 for k in variants}
        for j, reps_j in enumerate(reps_of):
            wall, cpu_j, info = spawn(
                _worker, 2, args=(width, bsz, reps_j, n, variants, j), timeout=3600
            )[0]
            # block r of each variant against block r of DDP (adjacent in time)
            sums = {k: _block_sums(wall[k], reps_j, n) for k in variants}
            for k in ratio:
                if k in variants:
                    ratio[k] += [a / d for a, d in zip(sums[k], sums["ddp"])]
            if "ddp2" in variants:
                both += [
                    2 * a / (d + d2) for a, d, d2 in zip(sums["adp"], sums["ddp"], sums["ddp2"])
                ]
            for k in variants:
                cpu[k] += sum(cpu_j[k])
            walls += wall["ddp"]
            launch = {"adp": med(ratio["adp"][-reps_j:])}
            if "ddp2" in variants:
                launch["ddp2"] = med(ratio["ddp2"][-reps_j:])
            per_launch.append(launch)
            if args.launches > 1:
                print(
                    f"  launch {j + 1}/{args.launches}: ADP/DDP {launch['adp']:.3f}"
                    + (f", A/A {launch['ddp2']:.3f}" if "ddp2" in launch else ""),
                    flush=True,
                )
        for k in ratio:
            ratio[k] = ratio[k] or [nan]
        q = statistics.quantiles(ratio["adp"], n=4)
        row = {
            "label": label,
            "adp": med(ratio["adp"]),
            "iqr": (q[0], q[2]),
            "ci": _median_ci(ratio["adp"]),
            "ci_aa": _median_ci(ratio["ddp2"]) if "ddp2" in variants else (nan, nan),
            # CPU: total process time of all steps (per-step CPU clocks are too coarse)
            "cpu": cpu["adp"] / cpu["ddp"],
            "adp32": med(ratio["adp32"]),
            "cpu32": cpu["adp32"] / cpu["ddp"] if "adp32" in variants else nan,
            "adp1": med(ratio["adp1"]),
            "pyhook": med(ratio["pyhook"]),
            "ddp2": med(ratio["ddp2"]),
            # against both plain-DDP instances: cancels a per-instance (memory layout) offset
            "adp_both": med(both) if both else nan,
            "launches": per_launch,
            "launch_ci": _launch_ci([x["adp"] for x in per_launch]),
            "launch_ci_aa": _launch_ci([x.get("ddp2", nan) for x in per_launch]),
            "ms": med(walls) * 1e3,
            "info": info,
        }
        rows.append(row)
        print(
            f"{label}: ADP sampled/DDP paired median {row['adp']:.3f} (IQR {q[0]:.3f}-{q[2]:.3f}, "
            f"95% CI of the median {row['ci'][0]:.3f}-{row['ci'][1]:.3f}), "
            f"CPU {row['cpu']:.3f}; interval 32 {row['adp32']:.3f} (CPU {row['cpu32']:.3f}); "
            f"ADP every step/DDP {row['adp1']:.3f}; torch Python hook/DDP {row['pyhook']:.3f}; "
            f"DDP again/DDP {row['ddp2']:.3f} (CI {row['ci_aa'][0]:.3f}-{row['ci_aa'][1]:.3f}); "
            f"ADP/both DDPs {row['adp_both']:.3f}; DDP step {row['ms']:.2f} ms; {info}",
            flush=True,
        )
        if args.launches > 1:
            lc, la = row["launch_ci"], row["launch_ci_aa"]
            print(
                f"  over {args.launches} launches: mean of the launch medians ADP/DDP {lc[0]:.3f} "
                f"(95% CI {lc[1]:.3f}-{lc[2]:.3f}), A/A {la[0]:.3f} ({la[1]:.3f}-{la[2]:.3f})",
                flush=True,
            )
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            f.write("# AdaptiveDataParallel overhead over DistributedDataParallel\n\n")
            f.write(
                f"Command: `python benchmarks/bench_overhead.py --reps {args.reps} "
                f"--steps {args.steps} --launches {args.launches} "
                f"--configs {' '.join(map(str, args.configs))} "
                f"--variants {' '.join(variants)} "
                f"--out {args.out}`\n\n"
            )
            f.write(
                f"Machine: {platform.platform()}, {os.cpu_count()} CPU cores, "
                f"Python {sys.version.split()[0]}, torch {torch.__version__}, "
                "2 gloo processes on 127.0.0.1, 1 thread each.\n\n"
            )
            f.write(
                "| model, batch | ADP (default sampling) / DDP step time (median of "
                "paired block means) | IQR | 95% CI of the median | its CPU time / DDP's | ADP, one in 32 / DDP (CPU) | "
                "ADP every step / DDP | torch's Python allreduce_hook / DDP | DDP again / DDP "
                "(noise floor) | ADP / mean of both DDPs | DDP step (ms) | warm-up steps, share of timed steps sampled |\n"
                "|---|---|---|---|---|---|---|---|---|---|---|---|\n"
            )
            for r in rows:
                f.write(
                    f"| {r['label']} | **{r['adp']:.3f}×** | {r['iqr'][0]:.3f}–{r['iqr'][1]:.3f} "
                    f"| {r['ci'][0]:.3f}–{r['ci'][1]:.3f} "
                    f"| {r['cpu']:.3f}× | {r['adp32']:.3f}× ({r['cpu32']:.3f}×) | "
                    f"{r['adp1']:.3f}× | {r['pyhook']:.3f}× | {r['ddp2']:.3f}× "
                    f"({r['ci_aa'][0]:.3f}–{r['ci_aa'][1]:.3f}) | {r['adp_both']:.3f}× | {r['ms']:.2f} | "
                    f"{r['info']['warm']}, {r['info']['sampled_share']:.3f} |\n"
                )
            if args.launches > 1:
                f.write(
                    f"\nOver {args.launches} launches (mean of the per-launch medians, 95% "
                    "t-interval over launches; per-launch medians ADP/DDP | A/A):\n\n"
                )
                for r in rows:
                    lc, la = r["launch_ci"], r["launch_ci_aa"]
                    each = ", ".join(
                        f"{x['adp']:.3f} | {x.get('ddp2', nan):.3f}" for x in r["launches"]
                    )
                    f.write(
                        f"- {r['label']}: ADP/DDP **{lc[0]:.3f}×** ({lc[1]:.3f}–{lc[2]:.3f}), "
                        f"A/A {la[0]:.3f}× ({la[1]:.3f}–{la[2]:.3f}); launches: {each}\n"
                    )
            f.write(
                f"\nVariants timed: {', '.join(variants)}. "
                f"{args.reps} repetitions; each runs a block of {args.steps} steps of plain "
                "DDP, a second plain DDP (A/A control), DDP with torch's Python `allreduce_hook`, "
                "ADP (default sampling, after the warm-up steps that take it past its every-step "
                "phase), optionally the same with `max_stats_interval=32`, and ADP sampling every step "
                "(`max_stats_interval=1`), rotating order, SGD with momentum, scale 1; per-step "
                "wall time on rank 0; one paired sample = ratio of two adjacent blocks' mean "
                "step times; CPU = total process time of all blocks.\n"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
