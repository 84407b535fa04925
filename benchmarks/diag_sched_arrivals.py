"""Diagnostic: the arrival rate our policy's sparse-arrivals gate reads on each workload file.

    python benchmarks/diag_sched_arrivals.py [--loads 0.5 1.0 1.5 2.0] [--workloads 1 3 5 6]

Replays each file's submissions through the policy's estimator
(:class:`adaptrain.sched._arrivals.ArrivalRate`, ``WaterfillPolicy``'s defaults): at every
60 s round from time 0 to two hours after the last submission, the estimator notes the jobs
submitted by then and reads the rate per GPU-hour on the artifact's 64 GPUs. Prints, per file,
the rate's range over the rounds where it is defined (and the same in arrivals per hour on the
64 GPUs) and the rounds in which it is below ``sparse_rate`` (``WaterfillPolicy`` then weighs
remaining work with ``sparse_theta`` in place of ``theta``).

In a simulation the policy notes a job in the first round it is active, so this replay sees
each job at the same round unless the job ends before that round, less than a round after its
submission; a simulation is still the check that counts (``bench_sched.py``).
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)

# the artifact's traces, workloads and stored results beside the checkout
from _artifact import default_traces_dir

from adaptrain.sched import (
    Search,
    WaterfillPolicy,
)
from adaptrain.sched._arrivals import ArrivalRate
from adaptrain.sim.traces import load_workload

GPUS = 64


def replay(path: str, policy: WaterfillPolicy, interval: float = 60.0) -> dict:
    jobs = sorted(load_workload(path), key=lambda w: w.time)
    est = ArrivalRate(window=policy.rate_window)  # the policy's estimator, one hour's min span
    rates, opened, rounds, i, t = [], 0, 0, 0, 0.0
    end = jobs[-1].time + 2 * 3600.0
    while t <= end:
        while i < len(jobs) and jobs[i].time <= t:
            est.observe(jobs[i].name, jobs[i].time)
            i += 1
        rounds += 1
        rate = est.rate(t, GPUS)
        if rate is not None:
            rates.append(rate)
            opened += rate < policy.sparse_rate
        t += interval
    return {"jobs": len(jobs), "rounds": rounds, "rates": rates, "opened": opened}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--loads", nargs="+", default=["0.5", "1.0", "1.5", "2.0"])
    ap.add_argument("--workloads", nargs="+", type=int, default=[1, 3, 5, 6])
    args = ap.parse_args(argv)
    traces = default_traces_dir()
    if traces is None:
        raise SystemExit("no shared/data/pollux next to the checkout")
    data = os.path.dirname(traces)
    policy = WaterfillPolicy(search=Search(method="local"))
    print(f"sparse_rate {policy.sparse_rate} per GPU-hour = {policy.sparse_rate * GPUS:.2f}/h")
    print(f"{'load':>4} {'file':>11} {'jobs':>5}  rate per GPU-hour (per hour)    gate open")
    for load in args.loads:
        folder = "workloads" if load == "1.0" else f"workloads-{load}"
        for wl in args.workloads:
            r = replay(os.path.join(data, folder, f"workload-{wl}.csv"), policy)
            lo, hi = min(r["rates"]), max(r["rates"])
            print(
                f"{load:>4} {'workload-' + str(wl):>11} {r['jobs']:>5}  {lo:.3f}-{hi:.3f} "
                f"({lo * GPUS:5.1f}-{hi * GPUS:5.1f})   {r['opened']:>4} of {r['rounds']} rounds"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
