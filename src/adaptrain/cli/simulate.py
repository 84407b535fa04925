"""``adaptrain simulate WORKLOAD.csv``: replay a cluster workload trace under a policy."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from collections.abc import Callable

logger = logging.getLogger(__name__)

NAME = "simulate"
HELP = "replay a cluster workload trace under a scheduling policy (trace-driven simulator)"

POLICIES = ("waterfill", "pollux", "tiresias", "optimus", "fifo")


def make_policy(name: str, seed: int = 0, *, cluster=None):
    """Build a policy by name (``waterfill`` is our default) for ``cluster`` (a
    :class:`~adaptrain.sched.ClusterSpec`; default: its defaults). Tiresias and Optimus take
    no cluster facts; the other policies price restarts (and waterfill also speedups and rounds)
    with it."""
    from adaptrain.sched import (
        ClusterSpec,
        FifoPolicy,
        OptimusPolicy,
        PolluxPolicy,
        TiresiasPolicy,
        WaterfillPolicy,
    )

    cluster = ClusterSpec() if cluster is None else cluster
    if name == "waterfill":
        return WaterfillPolicy(cluster=cluster, seed=seed)
    if name == "pollux":
        return PolluxPolicy(cluster=cluster, seed=seed)
    if name == "tiresias":
        return TiresiasPolicy()
    if name == "optimus":
        return OptimusPolicy()
    if name == "fifo":
        return FifoPolicy()
    raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")


def _check_settings(args: argparse.Namespace) -> None:
    """Raise ``ValueError`` naming the first bad cluster/simulation setting and its fix."""
    if not (math.isfinite(args.interval) and args.interval > 0):
        raise ValueError(f"--interval {args.interval} must be a number of seconds > 0")
    if args.nodes < 1:
        raise ValueError(f"--nodes {args.nodes} must be >= 1")
    if args.gpus_per_node < 1:
        raise ValueError(f"--gpus-per-node {args.gpus_per_node} must be >= 1")
    if not (math.isfinite(args.restart_delay) and args.restart_delay >= 0):
        raise ValueError(
            f"--restart-delay {args.restart_delay} must be a number of seconds >= 0 "
            "(0: free restarts)"
        )
    if args.seed < 0:
        raise ValueError(f"--seed must be >= 0, got {args.seed}")
    if args.fit_workers < 0:
        raise ValueError(
            f"--fit-workers {args.fit_workers} must be >= 0 (0: every fit in the main process)"
        )
    if not 0.0 <= args.interference < 1.0:
        raise ValueError(
            f"--interference {args.interference} must lie in [0, 1): the fraction of goodput "
            "lost by multi-node jobs sharing nodes (1 would stop them)"
        )


def _json_safe(value):
    """``value`` with non-finite floats (e.g. the mean JCT of no jobs) as ``None`` (null)."""
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from adaptrain.sim.traces import default_traces_dir

    default = default_traces_dir()
    parser.add_argument("workload", metavar="WORKLOAD.csv", help="workload file (artifact format)")
    parser.add_argument(
        "--policy",
        action="append",
        choices=POLICIES,
        help="policy to run (repeat to compare several; default: waterfill, ours)",
    )
    parser.add_argument(
        "--traces",
        default=default,
        required=default is None,
        help=f"folder of per-model profiles (default: {default})",
    )
    parser.add_argument("--interval", type=float, default=60.0, help="scheduling interval, s (> 0)")
    parser.add_argument(
        "--nodes",
        type=int,
        default=16,
        help="number of nodes (a Tiresias job asking for more GPUs than the cluster has, or "
        "than the traces measure, is capped at that size, with a warning)",
    )
    parser.add_argument("--gpus-per-node", type=int, default=4, help="GPUs per node")
    parser.add_argument("--restart-delay", type=float, default=30.0, help="restart cost, s (>= 0)")
    parser.add_argument(
        "--interference",
        type=float,
        default=0.0,
        help="slowdown of co-located multi-node jobs, a fraction in [0, 1)",
    )
    parser.add_argument(
        "--rounds-only",
        action="store_true",
        help="a new job waits for the next round, as in the Pollux artifact's simulator (use it "
        "to reproduce the artifact's figures); by default pollux and waterfill place a job as "
        "it arrives, on free GPUs, as AdaptDL's allocator does",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the genetic searches (pollux, waterfill)"
    )
    parser.add_argument(
        "--fit-workers",
        type=int,
        default=1 if (os.cpu_count() or 1) >= 2 else 0,
        help="processes that compute the jobs' goodput refits ahead while the policy decides "
        "(the same results, sooner; default: 1 on 2 or more cpus, else 0)",
    )
    parser.add_argument("--json", action="store_true", help="print a JSON object instead of text")
    parser.add_argument("--plot", metavar="FILE.png", help="JCT CDF and allocations over time")
    parser.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress on stderr (a terminal gets a bar; a log, a plain line every 30 s)",
    )


class _Where:
    """What ``run`` is doing, for the message of a Ctrl-C."""

    def __init__(self) -> None:
        self.policy: str | None = None  # the policy being simulated
        self.index = 0  # its number, from 1
        self.count = 0  # policies asked for
        self.sim = None  # its Simulator
        self.plotting: str | None = None  # the plot file being written


def run(args: argparse.Namespace) -> int:
    """The command, exiting 130 after a one-line message on Ctrl-C (no traceback): results are
    printed and the plot written only once every policy has been simulated, so an interrupted
    simulation leaves nothing behind (``--plot``'s folder excepted, created up front). A SIGTERM
    stops it the same way (its fit workers stopped), exiting 143."""
    from adaptrain.procs import raise_if_interrupted, recorded_interrupts, sigterm_as_interrupt

    where = _Where()
    terminated: list[int] = []
    try:
        with sigterm_as_interrupt() as terminated, recorded_interrupts() as interrupts:
            return _run(args, where, lambda *_: raise_if_interrupted(terminated, interrupts))
    except KeyboardInterrupt:
        # On a terminal, over the "^C" it echoed (a bar has already ended its line).
        start = "\r" if sys.stderr.isatty() and not terminated else ""
        print(f"{start}adaptrain simulate: {_interrupted(where)}", file=sys.stderr, flush=True)
        return 143 if terminated else 130


def _interrupted(where: _Where) -> str:
    if where.plotting:
        return f"interrupted while writing the plot {where.plotting}; it may be incomplete"
    if where.sim is None:
        return "interrupted before the simulation started; nothing was written"
    sim = where.sim
    done = sum(j.completion_time is not None for j in sim.jobs)
    return (
        f"interrupted while simulating {where.policy} (policy {where.index} of {where.count}) "
        f"at {sim.current_time:.0f} s simulated time, {done} of {len(sim.jobs)} jobs finished; "
        "nothing was written"
    )


def _run(args: argparse.Namespace, where: _Where, check: Callable[..., None]) -> int:
    """The command; ``check()`` raises again, each round, a SIGINT or SIGTERM Python dropped
    (:func:`adaptrain.procs.recorded_interrupts`)."""
    from adaptrain.sched import ClusterSpec
    from adaptrain.sim.simulator import SimulationStalled, Simulator
    from adaptrain.sim.traces import load_applications, load_workload

    names = args.policy or ["waterfill"]
    try:
        _check_settings(args)
        if args.plot:
            _prepare_plot(args.plot)
        if os.path.isdir(args.workload):
            raise ValueError(f"{args.workload!r} is a folder; give a WORKLOAD.csv file")
        try:
            workload = load_workload(args.workload)
        except UnicodeDecodeError as exc:
            raise ValueError(
                f"workload {args.workload!r} is not a UTF-8 CSV file ({exc.reason} at byte "
                f"{exc.start})"
            ) from None
        if not workload:
            print(f"adaptrain simulate: warning: {args.workload!r} has no jobs", file=sys.stderr)
        apps = load_applications(args.traces, sorted({w.application for w in workload}))
        cluster = ClusterSpec(
            gpus_per_node=args.gpus_per_node,
            round_seconds=args.interval,
            restart_delay=args.restart_delay,
        )
        sims = {
            name: Simulator(
                workload,
                apps,
                make_policy(name, seed=args.seed, cluster=cluster),
                num_nodes=args.nodes,
                cluster=cluster,
                interference=args.interference,
                record_timeline=bool(args.plot),
                arrival_allocation=not args.rounds_only,
                fit_workers=args.fit_workers,
            )
            for name in names
        }
    except ValueError as exc:
        print(f"adaptrain simulate: {exc}", file=sys.stderr)
        return 2
    results = {}
    where.count = len(sims)
    for index, (name, sim) in enumerate(sims.items(), 1):
        where.policy, where.index, where.sim = name, index, sim
        try:
            results[name] = sim.run(progress=not args.no_progress and not args.json, callback=check)
            check()
        except SimulationStalled as exc:
            print(f"adaptrain simulate: {name}: {exc}", file=sys.stderr)
            return 1
    if args.json:
        out = {n: _json_safe(r.summary()) for n, r in results.items()}
        print(json.dumps(out[names[0]] if len(names) == 1 else out, indent=2, allow_nan=False))
    else:
        print(f"workload: {os.path.basename(args.workload)}  ({len(workload)} jobs)")
        for name, r in results.items():
            s = r.summary()
            print(
                f"{name:>10}: avg JCT {s['avg_jct']:.1f} s  p50 {s['p50_jct']:.1f} s  "
                f"p99 {s['p99_jct']:.1f} s  makespan {s['makespan']:.0f} s  "
                f"GPU util {100 * s['gpu_utilization']:.1f}%  "
                f"policy {s['policy_s_per_round'] * 1e3:.2f} ms/round  "
                f"placed on arrival {s['arrivals_placed']}/{s['num_jobs']}"
            )
    if args.plot:
        from adaptrain.sim.plot import plot_results

        where.plotting = args.plot
        try:
            plot_results(results, args.plot, gpus=args.nodes * args.gpus_per_node)
        except OSError as exc:
            print(
                f"adaptrain simulate: --plot {args.plot}: cannot write it ({exc})", file=sys.stderr
            )
            return 1
        if not args.json:
            print(f"plot written to {args.plot}")
    return 0


def _prepare_plot(path: str) -> None:
    """Before simulating: matplotlib is importable, ``path``'s folder exists (created if
    missing) and ``path`` can be written; ``ValueError`` otherwise."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise ValueError(f"--plot {path} needs matplotlib: pip install matplotlib") from exc
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--plot {path}: cannot create folder {folder!r} ({exc})") from exc
    if os.path.isdir(path):
        raise ValueError(f"--plot {path} is a folder; give a file name such as {path}/out.png")
    existed = os.path.exists(path)
    try:  # writable? (found now, not after a simulation of minutes)
        with open(path, "ab"):
            pass
    except OSError as exc:
        raise ValueError(f"--plot {path}: cannot write it ({exc})") from exc
    if not existed:
        os.remove(path)
