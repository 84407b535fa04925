"""Scheduler benchmark: average JCT of each policy on the Pollux artifact's workloads.

    python benchmarks/bench_sched.py [--workloads 1 3 5 6] [--policies waterfill tiresias ...]
                                     [--load 1.0 [0.5 ...]] [--seed 0 [1 2 ...]]
                                     [--processes 1] [--traces DIR] [--json OUT.json]

The whole table of the default policy's target (16 files, three seeds, two at a time):

    python benchmarks/bench_sched.py --load 0.5 1.0 1.5 2.0 --workloads 1 3 5 6 \
        --policies waterfill --seed 0 1 2 --processes 2

For every (workload, policy) it replays the full workload in the simulator and prints the
average JCT, its ratio to the authors' stored figure for the same policy (fidelity) and to the
stored Pollux figure (the target of the default policy is <= 0.90), the policy's seconds per
round and the wall time of the whole simulation. All figures of one table come from one run.
``--seed`` seeds the genetic searches (the default policy's and Pollux's); Tiresias and Optimus
are deterministic. The seed-to-seed scatter of the default policy is 1-3% on one file, so
``--seed 0 1 2`` runs every (workload, policy) once per seed (Tiresias and Optimus once) and
adds a ``median`` row: the median average JCT over the seeds and its ratios, the largest
seconds per round and the summed wall time. A closing summary lists, per policy, the files
whose ratio to stored Pollux is <= 0.90 by the median and under every seed. The JSON rows
(``--json``) carry the seed, or ``"median"``. A Ctrl-C ends the run with status 130 and loses
nothing finished: the rows printed so far stand, and ``--json`` gets them.
``--processes N`` runs N simulations side by side (a process pool); the figures are the same
(each simulation is deterministic given its seed), but the wall times then include the
contention: time a single file with ``--processes 1`` on an otherwise idle host.

The wall times swing with the host's speed at the hour, so the header and the closing lines
give a host probe: the time of 3 M pure-Python additions (median of 3), read before and after
the runs, the yardstick for comparing wall times taken at different hours. The header also
names numpy's SIMD extensions and the BLAS kernels numpy and scipy loaded: the JCTs are
deterministic on one host, and readings agree only between hosts that print the same two lines
(``docs/scheduling.md`` says why).

Besides the CLI's policies, named variants turn one rule of the default policy off, the
same-run reference for what that rule brings (``docs/scheduling.md``):
``waterfill-noexplore`` (``Exploration(beta=None)``), ``waterfill-noramp``
(``Exploration(ramp_credit=None)``), ``waterfill-cap2`` (AdaptDL's exploration cap,
``Exploration(growth=None)``), ``waterfill-first1`` (every job starts on one GPU,
``Exploration(first_replicas=None)``), ``waterfill-flatexplore``
(``Exploration(observed=False)``), ``waterfill-nofuture`` (``Objective(future_gamma=None)``),
``waterfill-nogrow`` (``Growth(payback=None, payback_remaining=False)``) and
``waterfill-noend`` (``Growth(payback_remaining=False)``).

Parameter screens: ``--set GROUP.FIELD=VALUE ...`` builds the ``waterfill`` policy with those
settings of its configuration (``adaptrain.sched.config``; values read as Python literals:
numbers, ``None``, ``True``; anything else as a string), every other setting at its default.
Its rows are labelled ``waterfill*`` and carry the settings in the JSON (``waterfill_kwargs``),
so a screen of one setting over seeds is one command:

    python benchmarks/bench_sched.py --load 1.0 --workloads 3 --policies waterfill \
        --seed 0 1 2 --processes 2 --set exploration.ramp_credit=2

Arrivals: ``waterfill`` places a job as it arrives, on free GPUs (``allocate_job``, as AdaptDL's
allocator does); ``waterfill-rounds`` makes new jobs wait for the next round instead. ``pollux``
runs with new jobs waiting for the round, as in the artifact's simulator that produced the
stored figures (fidelity); ``pollux-arrive`` adds AdaptDL's placement on arrival (one GPU on
the first node with room). Tiresias and Optimus place jobs only at rounds.
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import os
import platform
import statistics
import sys
import time

import numpy as np
import scipy

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)

# the artifact's traces, workloads and stored results beside the checkout
from _artifact import default_traces_dir

from adaptrain.cli.simulate import POLICIES, make_policy
from adaptrain.sched import (
    Arrivals,
    Exploration,
    Growth,
    Objective,
    PolluxPolicy,
    Search,
    Sharing,
    WaterfillPolicy,
)
from adaptrain.sim.simulator import Simulator
from adaptrain.sim.traces import load_applications, load_workload

VARIANTS = {
    "waterfill-noexplore": lambda seed: WaterfillPolicy(
        exploration=Exploration(beta=None), seed=seed
    ),
    # without the credit for the ramp a capped job's next step unlocks
    "waterfill-noramp": lambda seed: WaterfillPolicy(
        exploration=Exploration(ramp_credit=None), seed=seed
    ),
    # AdaptDL's exploration cap (2x the largest size tried) instead of 4x
    "waterfill-cap2": lambda seed: WaterfillPolicy(exploration=Exploration(growth=None), seed=seed),
    # a job never run starts on 1 GPU (the allocator's rule) instead of up to 4
    "waterfill-first1": lambda seed: WaterfillPolicy(
        exploration=Exploration(first_replicas=None), seed=seed
    ),
    # exploration's floor exponent not capped by the job's observed scaling
    "waterfill-flatexplore": lambda seed: WaterfillPolicy(
        exploration=Exploration(observed=False), seed=seed
    ),
    # weights not divided by the job's speed at its fair share
    "waterfill-nofuture": lambda seed: WaterfillPolicy(
        objective=Objective(future_gamma=None), seed=seed
    ),
    # growth priced by Pollux's restart penalty alone
    "waterfill-nogrow": lambda seed: WaterfillPolicy(
        growth=Growth(payback=None, payback_remaining=False), seed=seed
    ),
    # the growth floor's horizon not shortened to a job's remaining time
    "waterfill-noend": lambda seed: WaterfillPolicy(
        growth=Growth(payback_remaining=False), seed=seed
    ),
    # new jobs wait for the next round
    "waterfill-rounds": lambda seed: WaterfillPolicy(seed=seed),
    # our Pollux with AdaptDL's placement of a job on arrival
    "pollux-arrive": lambda seed: PolluxPolicy(seed=seed),
}
# the simulator's rule for new jobs: placed on arrival, or waiting for the next round
ROUNDS_ONLY = {"pollux", "waterfill-rounds"}


def blas_label() -> str:
    """The BLAS libraries numpy and scipy loaded, with the kernels each chose (threadpoolctl).
    OpenBLAS picks its kernels by CPU (``Haswell`` on AVX2 hosts, ``SkylakeX`` on AVX-512 ones)
    unless ``OPENBLAS_CORETYPE`` names them, and they set the summation order of the goodput
    fits' dot products and of L-BFGS-B's own: with ``OPENBLAS_CORETYPE=Sandybridge`` alone,
    workload-3 at load 1.0 read 0.930 of stored Pollux under seed 0, against 0.923 with this
    host's own ``Haswell`` (``docs/scheduling.md``)."""
    import scipy.optimize  # noqa: F401 - loads scipy's own BLAS, which the scan must find

    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return "BLAS unknown (threadpoolctl not installed)"
    libs = [
        f"{info.get('internal_api', '?')} {info.get('version') or '?'} "
        f"{info.get('architecture') or '?'}"
        for info in threadpool_info()
        if info.get("user_api") == "blas"
    ]
    # sorted: threadpoolctl lists the libraries in an order that can change from run to run
    return "BLAS: " + (", ".join(sorted(libs)) or "none found")


def search_label() -> str:
    """What runs the genetic searches' generations: numba's compiled kernels
    (``adaptrain.sched._kernels``), with numba's version."""
    import numba

    return f"compiled kernels (numba {numba.__version__})"


def simd_label() -> str:
    """numpy's SIMD extensions on this host (``np.show_config``). numpy's float64 ``exp`` and
    ``log`` and OpenBLAS's kernels pick a code path by CPU (AVX-512 where present) whose last
    bits can differ, and a simulation amplifies such bits into other schedules: the JCT
    figures are deterministic on one host, and only hosts that print the same line can be
    expected to agree (``docs/scheduling.md``)."""
    try:
        simd = np.show_config(mode="dicts")["SIMD Extensions"]
    except (KeyError, TypeError):  # a numpy without the dict form
        return "SIMD unknown"
    found = " ".join(simd.get("found", [])) or "none"
    missing = " ".join(simd.get("not found", [])) or "none"
    return f"SIMD found: {found}; not found: {missing}"


PROBE_ADDITIONS = 3_000_000  # the host probe's loop length (see host_probe)
PROBE_LABEL = f"{PROBE_ADDITIONS / 1e6:g} M Python additions, median of 3"


def host_probe(n: int = PROBE_ADDITIONS, reps: int = 3) -> float:
    """Seconds for ``n`` pure-Python additions, the median of ``reps`` timings: the host's
    speed at the hour, read beside the wall times (see the module docstring)."""
    # module-level code (names in a dict, as under ``python -c``), so the readings compare
    # with the same loop timed by hand
    code = compile(f"s = 0\nfor i in range({int(n)}):\n    s += i\n", "<host probe>", "exec")
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        exec(code, {})
        times.append(time.perf_counter() - t0)
    return float(statistics.median(times))


def _policy(name: str, seed: int = 0, settings: dict | None = None):
    if settings:  # a parameter screen (--set), the other parameters at their defaults
        if name != "waterfill":
            raise ValueError(f"--set configures the waterfill policy, not {name!r}")
        return waterfill_with(settings, seed)
    return VARIANTS[name](seed) if name in VARIANTS else make_policy(name, seed)


# the configuration groups of WaterfillPolicy (``--set GROUP.FIELD=VALUE``)
GROUPS = {
    "objective": Objective,
    "exploration": Exploration,
    "growth": Growth,
    "arrivals": Arrivals,
    "sharing": Sharing,
    "search": Search,
}
SETTABLE = tuple(f"{g}.{f.name}" for g, cls in GROUPS.items() for f in dataclasses.fields(cls))


def waterfill_with(settings: dict, seed: int = 0) -> WaterfillPolicy:
    """The default policy with ``settings`` (``{"group.field": value}``) changed."""
    groups: dict[str, dict] = {}
    for key, value in settings.items():
        group, _, field = key.partition(".")
        groups.setdefault(group, {})[field] = value
    return WaterfillPolicy(**{g: GROUPS[g](**fields) for g, fields in groups.items()}, seed=seed)


def parse_settings(items: list[str]) -> dict:
    """``GROUP.FIELD=VALUE`` strings as the default policy's settings: each value a Python
    literal (``2``, ``0.5``, ``None``, ``True``) or else the string as given. Raises
    ``ValueError`` naming a malformed item, an unknown or repeated key, or a value the policy
    rejects (it is built once here, so a bad screen fails before any simulation)."""
    out: dict = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(
                f"--set {item!r}: expected GROUP.FIELD=VALUE, e.g. exploration.ramp_credit=2"
            )
        if key not in SETTABLE:
            raise ValueError(
                f"--set {item!r}: the policy has no setting {key!r} (the seed comes from "
                f"--seed); choose from {', '.join(SETTABLE)}"
            )
        if key in out:
            raise ValueError(f"--set {item!r}: {key} is set twice")
        try:
            out[key] = ast.literal_eval(raw.strip())
        except (ValueError, SyntaxError):
            out[key] = raw.strip()
    try:
        waterfill_with(out)
    except (TypeError, ValueError) as e:
        raise ValueError(f"--set {' '.join(items)}: {e}") from None
    return out


# policies without random choices: one run stands for every seed
DETERMINISTIC = {"tiresias", "optimus"}
TARGET = 0.90  # our policy's target: avg JCT <= 0.90 x the stored Pollux figure


def median_row(rows: list[dict]) -> dict:
    """One (workload, policy)'s runs over several seeds as one row: the median average JCT,
    its ratios, the median p99 JCT, the largest policy seconds per round, the summed wall time,
    the ratio to stored Pollux of every seed (``ratios_to_stored_pollux``), and their mean and
    sample standard deviation (``ratio_mean``, ``ratio_sd``; ``None`` without a stored figure,
    the deviation also with one seed). The genetic search's seed moves a file's ratio by
    0.5-1.4 points (sd), so a lever needs about ten seeds to resolve a point."""
    if not rows:
        raise ValueError("median_row needs at least one row")
    avg = float(statistics.median(r["avg_jct"] for r in rows))
    first = rows[0]
    ref, pollux = first["stored_same_policy"], first["stored_pollux"]
    out = {
        "workload": first["workload"],
        "load": first["load"],
        "policy": first["policy"],
        "seed": "median",
        "seeds": [r["seed"] for r in rows],
        "avg_jct": avg,
        "stored_same_policy": ref,
        "stored_pollux": pollux,
        "ratio_to_stored_same_policy": avg / ref if ref else None,
        "ratio_to_stored_pollux": avg / pollux if pollux else None,
        "ratios_to_stored_pollux": [r["ratio_to_stored_pollux"] for r in rows],
        "p99_jct": float(statistics.median(r["p99_jct"] for r in rows)),
        "policy_s_per_round": max(r["policy_s_per_round"] for r in rows),
        "wall_s": sum(r["wall_s"] for r in rows),
    }
    ratios = [r["ratio_to_stored_pollux"] for r in rows]
    known = all(x is not None for x in ratios)
    out["ratio_mean"] = statistics.fmean(ratios) if known else None
    out["ratio_sd"] = statistics.stdev(ratios) if known and len(ratios) > 1 else None
    if "waterfill_kwargs" in first:  # a parameter screen's settings (--set)
        out["waterfill_kwargs"] = first["waterfill_kwargs"]
    return out


def target_summary(rows: list[dict], target: float = TARGET) -> dict[str, dict[str, list[str]]]:
    """Per policy, the files (``workload@load``) whose ratio to stored Pollux is <= ``target``
    by the median over seeds (``"median"``), by the mean over seeds (``"mean"``), under every
    seed (``"every_seed"``), and the others by the median (``"over"``). ``rows`` are
    :func:`median_row` rows, or single-seed rows (there the mean is the one run)."""
    out: dict[str, dict[str, list[str]]] = {}
    for r in rows:
        if r["ratio_to_stored_pollux"] is None:
            continue
        d = out.setdefault(r["policy"], {"median": [], "mean": [], "every_seed": [], "over": []})
        name = f"{r['workload']}@{r['load']}"
        ratios = r.get("ratios_to_stored_pollux") or [r["ratio_to_stored_pollux"]]
        if r["ratio_to_stored_pollux"] <= target:
            d["median"].append(name)
        else:
            d["over"].append(name)
        mean = r.get("ratio_mean")
        if (r["ratio_to_stored_pollux"] if mean is None else mean) <= target:
            d["mean"].append(name)
        if all(x <= target for x in ratios):
            d["every_seed"].append(name)
    return out


def stored_avg(data_dir: str, policy: str, load: str, workload: str) -> float | None:
    path = os.path.join(data_dir, "results-jobload", f"{policy}-{load}", "summary.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)["avgs"].get(workload)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", nargs="+", default=["1", "3", "5", "6"])
    parser.add_argument(
        "--policies", nargs="+", default=list(POLICIES), choices=[*POLICIES, *VARIANTS]
    )
    parser.add_argument("--load", nargs="+", default=["1.0"], choices=["0.5", "1.0", "1.5", "2.0"])
    parser.add_argument("--traces", default=default_traces_dir())
    parser.add_argument("--json", help="also write the rows to this JSON file")
    parser.add_argument(
        "--seed",
        type=int,
        nargs="+",
        default=[0],
        help="seed(s) of the genetic searches (waterfill's refinement, Pollux); default 0; "
        "several seeds add a median row per (workload, policy)",
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        help="simulations run side by side (default 1); wall times then include the contention",
    )
    parser.add_argument(
        "--fit-workers",
        type=int,
        default=None,
        help="processes per simulation that compute the jobs' goodput refits ahead, while the "
        "policy decides (the same results); default 1 with --processes 1 on >= 2 cpus, else 0",
    )
    parser.add_argument(
        "--set",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="WaterfillPolicy parameters for the waterfill policy (a parameter screen); its "
        "rows are labelled waterfill*",
    )
    args = parser.parse_args()
    if not args.traces:
        parser.error("no traces found; pass --traces DIR")
    if args.processes < 1:
        parser.error(f"--processes {args.processes} must be >= 1")
    if args.fit_workers is None:
        args.fit_workers = 1 if args.processes == 1 and (os.cpu_count() or 1) >= 2 else 0
    if args.fit_workers < 0:
        parser.error(f"--fit-workers {args.fit_workers} must be >= 0")
    try:
        settings = parse_settings(args.set)
    except ValueError as e:
        parser.error(str(e))
    if settings and "waterfill" not in args.policies:
        parser.error("--set configures the waterfill policy: add waterfill to --policies")
    print(
        f"machine: {platform.machine()} {platform.processor() or ''} {os.cpu_count()} cpus, "
        f"python {platform.python_version()}, {args.processes} simulation(s) at a time, "
        f"{args.fit_workers} fit worker(s) each"
    )
    print(f"numpy {np.__version__}, scipy {scipy.__version__}, {simd_label()}")
    print(f"genetic searches: {search_label()}")
    print(blas_label())
    if settings:
        given = ", ".join(f"{k}={v!r}" for k, v in settings.items())
        print(f"waterfill*: WaterfillPolicy({given}), the other parameters at their defaults")
    probe_before = host_probe()
    print(f"host probe: {probe_before:.3f} s ({PROBE_LABEL})")
    print(
        f"{'workload':>10} {'load':>4} {'policy':>19} {'seed':>6} {'avg JCT s':>10} "
        f"{'stored s':>9} {'/stored':>8} {'/Pollux':>8} {'p99 s':>8} {'s/round':>9} {'wall s':>7}"
    )
    groups = [
        [
            (
                args.traces,
                load,
                wl,
                pol,
                seed,
                settings if pol == "waterfill" else {},
                args.fit_workers,
            )
            for seed in (args.seed[:1] if pol in DETERMINISTIC else args.seed)
        ]
        for load in args.load
        for wl in args.workloads
        for pol in args.policies
    ]
    tasks = [t for g in groups for t in g]
    rows, final = [], []
    try:
        with contextlib.ExitStack() as stack:
            if args.processes == 1:
                results = map(_run, tasks)
            else:  # results come back in task order, each printed as soon as its turn comes
                pool = stack.enter_context(concurrent.futures.ProcessPoolExecutor(args.processes))
                # (an exit callback: it runs before the pool's own exit, which waits)
                stack.push(lambda kind, exc, tb: _stop_pool_if_interrupted(pool, exc))
                results = pool.map(_run, tasks)
            for g in groups:
                runs = []
                for _ in g:
                    runs.append(next(results))
                    rows.append(runs[-1])
                    _print_row(runs[-1])
                if len(runs) > 1:
                    rows.append(median_row(runs))
                    _print_row(rows[-1])
                    _print_mean(rows[-1])
                final.append(rows[-1])  # the median over seeds, or the single run
    except KeyboardInterrupt:
        # Nothing finished is lost: the rows printed so far are whole, and --json gets them.
        kept = f" and in {args.json}" if args.json else ""
        ran = sum(row["seed"] != "median" for row in rows)
        print(
            f"bench_sched: interrupted after {ran} of {len(tasks)} simulations; their rows are "
            f"above{kept}",
            file=sys.stderr,
            flush=True,
        )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=2)
        return 130
    how = "the median over seeds" if len(args.seed) > 1 else f"seed {args.seed[0]}"
    for pol, d in target_summary(final).items():
        line = f"{pol}: <= {TARGET:.2f} x stored Pollux on {len(d['median'])} of "
        line += f"{len(d['median']) + len(d['over'])} file(s) by "
        line += "its one run (deterministic)" if pol in DETERMINISTIC else how
        if len(args.seed) > 1 and pol not in DETERMINISTIC:
            line += f", {len(d['mean'])} by the mean, {len(d['every_seed'])} under every seed"
        print(line + (f"; over: {' '.join(d['over'])}" if d["over"] else ""))
    probe_after = host_probe()
    print(
        f"host probe: {probe_before:.3f} s before the runs, {probe_after:.3f} s after "
        f"({PROBE_LABEL})"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


def _stop_pool_if_interrupted(
    pool: concurrent.futures.ProcessPoolExecutor, exc: BaseException | None
) -> None:
    """On a KeyboardInterrupt, drop the simulations not started and end those under way, so
    that the pool's exit does not wait for them (they are lost either way). A terminal's
    Ctrl-C reaches the workers too; a SIGINT to this process alone does not."""
    if not isinstance(exc, KeyboardInterrupt):
        return
    # (ProcessPoolExecutor.terminate_workers() from Python 3.14; its worker table before,
    # read before shutdown() drops it)
    terminate = getattr(pool, "terminate_workers", None)
    if terminate is not None:
        terminate()
        return
    workers = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for proc in workers:
        proc.terminate()


def _print_row(row: dict) -> None:
    fmt = lambda v, f: format(v, f) if v is not None else "-"  # noqa: E731
    tag = "median" if row["seed"] == "median" else f"s{row['seed']}"
    print(
        f"{row['workload']:>10} {row['load']:>4} {row['policy']:>19} {tag:>6} "
        f"{row['avg_jct']:10.1f} {fmt(row['stored_same_policy'], '9.1f'):>9} "
        f"{fmt(row['ratio_to_stored_same_policy'], '8.3f'):>8} "
        f"{fmt(row['ratio_to_stored_pollux'], '8.3f'):>8} {row['p99_jct']:8.0f} "
        f"{row['policy_s_per_round']:9.4f} {row['wall_s']:7.1f}",
        flush=True,
    )


def _print_mean(row: dict) -> None:
    """The mean ratio to stored Pollux over a median row's seeds, its sd and standard error."""
    if row.get("ratio_mean") is None or row.get("ratio_sd") is None:
        return
    n = len(row["seeds"])
    print(
        f"{'':>10} {'':>4} {'':>19} {'mean':>6} over {n} seeds: {row['ratio_mean']:.4f} x stored "
        f"Pollux (sd {row['ratio_sd']:.4f}, standard error {row['ratio_sd'] / n**0.5:.4f})",
        flush=True,
    )


@functools.cache  # per process: the applications and their throughput memos, loaded once
def _applications(traces: str) -> dict:
    return load_applications(traces)


def _run(task: tuple) -> dict:
    """One simulation, ``task = (traces, load, workload number, policy, seed, settings[,
    fit_workers])`` (``settings``: :func:`parse_settings`'s keyword arguments, or empty;
    ``fit_workers``: the simulator's, default 0): its row."""
    traces, load, wl, pol, seed, settings, *rest = task
    fit_workers = rest[0] if rest else 0
    data_dir = os.path.dirname(os.path.normpath(traces))
    wdir = "workloads" if load == "1.0" else f"workloads-{load}"
    name = f"workload-{wl}"
    workload = load_workload(os.path.join(data_dir, wdir, f"{name}.csv"))
    t0 = time.perf_counter()
    res = Simulator(
        workload,
        _applications(traces),
        _policy(pol, seed, settings),
        arrival_allocation=pol not in ROUNDS_ONLY,
        fit_workers=fit_workers,
    ).run()
    wall = time.perf_counter() - t0
    s = res.summary()
    label = f"{pol}*" if settings else pol
    ref = None if settings else stored_avg(data_dir, pol, load, name)  # a screen has none
    pollux = stored_avg(data_dir, "pollux", load, name)
    row = {
        "workload": name,
        "load": load,
        "policy": label,
        "seed": seed,
        "avg_jct": s["avg_jct"],
        "stored_same_policy": ref,
        "stored_pollux": pollux,
        "ratio_to_stored_same_policy": s["avg_jct"] / ref if ref else None,
        "ratio_to_stored_pollux": s["avg_jct"] / pollux if pollux else None,
        "p99_jct": s["p99_jct"],
        "policy_s_per_round": s["policy_s_per_round"],
        "wall_s": wall,
    }
    if settings:
        row["waterfill_kwargs"] = dict(settings)
    return row


if __name__ == "__main__":
    sys.exit(main())
