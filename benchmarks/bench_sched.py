"""Scheduler benchmark: average JCT of each policy on the Pollux artifact's workloads.

    python benchmarks/bench_sched.py [--workloads 1 3 5 6] [--policies waterfill tiresias ...]
                                     [--load 1.0] [--seed 0] [--traces DIR] [--json OUT.json]

For every (workload, policy) it replays the full workload in our simulator and prints the
average JCT, its ratio to the authors' stored figure for the same policy (fidelity) and to the
stored Pollux figure (the target for our policy is <= 0.90), the policy's seconds per round
and the wall time of the whole simulation. All figures of one table come from one run.
``--seed`` seeds the genetic searches (our policy's refinement and Pollux's); Tiresias and
Optimus are deterministic. The seed-to-seed scatter of our policy is 1-3% on one file.

Besides the CLI's policies, ``waterfill-noexplore`` is our default policy with its exploration
beyond each job's largest tried size turned off (``WaterfillPolicy(explore_beta=None)``), the
same-run reference for what that exploration brings; ``waterfill-noramp`` likewise turns off the
ramp credit (``WaterfillPolicy(ramp_credit=None)``), ``waterfill-cap2`` keeps AdaptDL's 2x
exploration cap (``explore_growth=None``) and ``waterfill-first1`` starts every job on one GPU
(``first_replicas=None``).

``waterfill-nofuture`` keeps each job's remaining-work weight undivided by its speed to come
(``future_gamma=None``): the session-25 default, the same-run reference for session 27's change.

``waterfill-nogrow`` prices a running job's growth by Pollux's restart penalty alone
(``grow_payback=None``): the session-27 default, the same-run reference for session 28's change.

``waterfill-flatexplore`` values every long job beyond its tried size at ``s(r0) (r / r0) ** 0.5``
at least, without capping the exponent by the job's scaling so far (``explore_observed=False``).

Arrivals: ``waterfill`` places a job as it arrives, on free GPUs (``allocate_job``, as AdaptDL's
allocator does); ``waterfill-rounds`` makes new jobs wait for the next round instead. ``pollux``
runs with new jobs waiting for the round, as in the artifact's simulator that produced the
stored figures (fidelity); ``pollux-arrive`` adds AdaptDL's placement on arrival (one GPU on
the first node with room). Tiresias and Optimus place jobs only at rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))

from adaptrain.cli.simulate import POLICIES, make_policy  # noqa: E402
from adaptrain.sched import PolluxPolicy, WaterfillPolicy  # noqa: E402
from adaptrain.sched.simulator import Simulator  # noqa: E402
from adaptrain.sched.traces import default_traces_dir, load_applications, load_workload  # noqa: E402

VARIANTS = {
    "waterfill-noexplore": lambda seed: WaterfillPolicy(explore_beta=None, seed=seed),
    # without the credit for the ramp a capped job's next step unlocks (session 12)
    "waterfill-noramp": lambda seed: WaterfillPolicy(ramp_credit=None, seed=seed),
    # AdaptDL's exploration cap (2x the largest size tried) instead of our 4x (session 23)
    "waterfill-cap2": lambda seed: WaterfillPolicy(explore_growth=None, seed=seed),
    # a job never run starts on 1 GPU (the allocator's rule) instead of up to 4 (session 24)
    "waterfill-first1": lambda seed: WaterfillPolicy(first_replicas=None, seed=seed),
    # three independent genetic refinements per round, the fittest kept (about 3x the time)
    "waterfill-3runs": lambda seed: WaterfillPolicy(genetic_runs=3, seed=seed),
    # exploration's floor exponent not capped by the job's observed scaling (session 25)
    "waterfill-flatexplore": lambda seed: WaterfillPolicy(explore_observed=False, seed=seed),
    # weights not divided by the job's speed at its fair share (the session-25 default)
    "waterfill-nofuture": lambda seed: WaterfillPolicy(future_gamma=None, seed=seed),
    # growth priced by Pollux's restart penalty alone (the session-27 default)
    "waterfill-nogrow": lambda seed: WaterfillPolicy(grow_payback=None, seed=seed),
    # new jobs wait for the next round (session 25)
    "waterfill-rounds": lambda seed: WaterfillPolicy(seed=seed),
    # our Pollux with AdaptDL's placement of a job on arrival (session 25)
    "pollux-arrive": lambda seed: PolluxPolicy(seed=seed),
}
# the simulator's rule for new jobs: placed on arrival, or waiting for the next round
ROUNDS_ONLY = {"pollux", "waterfill-rounds"}


def _policy(name: str, seed: int = 0):
    return VARIANTS[name](seed) if name in VARIANTS else make_policy(name, seed)


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
    parser.add_argument("--load", default="1.0", choices=["0.5", "1.0", "1.5", "2.0"])
    parser.add_argument("--traces", default=default_traces_dir())
    parser.add_argument("--json", help="also write the rows to this JSON file")
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the genetic searches (waterfill's refinement, Pollux); default 0",
    )
    args = parser.parse_args()
    if not args.traces:
        parser.error("no traces found; pass --traces DIR")
    data_dir = os.path.dirname(os.path.normpath(args.traces))
    wdir = "workloads" if args.load == "1.0" else f"workloads-{args.load}"
    apps = load_applications(args.traces)
    print(
        f"machine: {platform.machine()} {platform.processor() or ''} {os.cpu_count()} cpus, "
        f"python {platform.python_version()}"
    )
    header = (
        f"{'workload':>10} {'policy':>19} {'avg JCT s':>10} {'stored s':>9} {'/stored':>8} "
        f"{'/Pollux':>8} {'p99 s':>8} {'s/round':>9} {'wall s':>7}"
    )
    print(header)
    rows = []
    for wl in args.workloads:
        name = f"workload-{wl}"
        workload = load_workload(os.path.join(data_dir, wdir, f"{name}.csv"))
        pollux = stored_avg(data_dir, "pollux", args.load, name)
        for pol in args.policies:
            t0 = time.perf_counter()
            res = Simulator(
                workload, apps, _policy(pol, args.seed), arrival_allocation=pol not in ROUNDS_ONLY
            ).run()
            wall = time.perf_counter() - t0
            s = res.summary()
            ref = stored_avg(data_dir, pol, args.load, name)
            row = {
                "workload": name,
                "load": args.load,
                "policy": pol,
                "seed": args.seed,
                "avg_jct": s["avg_jct"],
                "stored_same_policy": ref,
                "ratio_to_stored_same_policy": s["avg_jct"] / ref if ref else None,
                "ratio_to_stored_pollux": s["avg_jct"] / pollux if pollux else None,
                "p99_jct": s["p99_jct"],
                "policy_s_per_round": s["policy_s_per_round"],
                "wall_s": wall,
            }
            rows.append(row)
            fmt = lambda v, f: format(v, f) if v is not None else "-"  # noqa: E731
            print(
                f"{name:>10} {pol:>19} {s['avg_jct']:10.1f} {fmt(ref, '9.1f'):>9} "
                f"{fmt(row['ratio_to_stored_same_policy'], '8.3f'):>8} "
                f"{fmt(row['ratio_to_stored_pollux'], '8.3f'):>8} {s['p99_jct']:8.0f} "
                f"{s['policy_s_per_round']:9.4f} {wall:7.1f}",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
