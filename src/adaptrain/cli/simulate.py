"""``adaptrain simulate WORKLOAD.csv``: replay a cluster workload trace under a policy."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

logger = logging.getLogger(__name__)

NAME = "simulate"
HELP = "replay a cluster workload trace under a scheduling policy (trace-driven simulator)"

POLICIES = ("waterfill", "pollux", "tiresias", "optimus")


def make_policy(name: str, seed: int = 0):
    """Build a policy by name (``waterfill`` is our default)."""
    from adaptrain.sched import OptimusPolicy, PolluxPolicy, TiresiasPolicy, WaterfillPolicy

    if name == "waterfill":
        return WaterfillPolicy()
    if name == "pollux":
        return PolluxPolicy(seed=seed)
    if name == "tiresias":
        return TiresiasPolicy()
    if name == "optimus":
        return OptimusPolicy()
    raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from adaptrain.sched.traces import default_traces_dir

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
    parser.add_argument("--interval", type=float, default=60.0, help="scheduling interval, s")
    parser.add_argument("--nodes", type=int, default=16, help="number of nodes")
    parser.add_argument("--gpus-per-node", type=int, default=4, help="GPUs per node")
    parser.add_argument("--restart-delay", type=float, default=30.0, help="restart cost, s")
    parser.add_argument(
        "--interference", type=float, default=0.0, help="slowdown of co-located multi-node jobs"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of Pollux's genetic search")
    parser.add_argument("--json", action="store_true", help="print a JSON object instead of text")
    parser.add_argument("--plot", metavar="FILE.png", help="JCT CDF and allocations over time")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from adaptrain.sched.simulator import Simulator
    from adaptrain.sched.traces import load_applications, load_workload

    try:
        workload = load_workload(args.workload)
        apps = load_applications(args.traces, sorted({w.application for w in workload}))
    except ValueError as exc:
        print(f"adaptrain simulate: {exc}", file=sys.stderr)
        return 2
    names = args.policy or ["waterfill"]
    results = {}
    for name in names:
        sim = Simulator(
            workload,
            apps,
            make_policy(name, seed=args.seed),
            num_nodes=args.nodes,
            gpus_per_node=args.gpus_per_node,
            interval=args.interval,
            restart_delay=args.restart_delay,
            interference=args.interference,
            record_timeline=bool(args.plot),
        )
        results[name] = sim.run(progress=not args.no_progress and not args.json)
    if args.json:
        out = {n: r.summary() for n, r in results.items()}
        print(json.dumps(out[names[0]] if len(names) == 1 else out, indent=2))
    else:
        print(f"workload: {os.path.basename(args.workload)}  ({len(workload)} jobs)")
        for name, r in results.items():
            s = r.summary()
            print(
                f"{name:>10}: avg JCT {s['avg_jct']:.1f} s  p50 {s['p50_jct']:.1f} s  "
                f"p99 {s['p99_jct']:.1f} s  makespan {s['makespan']:.0f} s  "
                f"GPU util {100 * s['gpu_utilization']:.1f}%  "
                f"policy {s['policy_s_per_round'] * 1e3:.2f} ms/round"
            )
    if args.plot:
        from adaptrain.sched.plot import plot_results

        plot_results(results, args.plot, gpus=args.nodes * args.gpus_per_node)
        if not args.json:
            print(f"plot written to {args.plot}")
    return 0
