"""Diagnostic: how much of our policy's gap to the target comes from learned goodput models?

    python benchmarks/diag_sched_models.py --workloads 3 [--modes learned full full-nocap]
                                           [--load 1.0] [--seed 0] [--isolated]
    python benchmarks/diag_sched_models.py --workloads 3 --modes learned restart-free \
        free-shrink free-grow free-explore free-regrow --seed 0

Replays a workload under our default policy with three views of each job:

* ``learned``: what every policy sees in the simulator (and in a real cluster): the throughput
  model each job fits online to the configurations it has run on, and ``max_replicas`` capped at
  twice the largest replica count it has run on (the artifact's exploration rule; our policy
  widens it to ``explore_growth`` = 4 times);
* ``full``: the throughput model fitted once to *all* of the application's measurements
  (``placements.csv`` + ``scalability.csv``), the cap kept: a perfect-knowledge model;
* ``full-nocap``: the same model without any cap (a job may jump to any size at once).

Gradient statistics (the statistical efficiency) are the job's current ones in all three.
``full`` and ``full-nocap`` use knowledge no policy has, so they are bounds for what better
models or faster exploration could bring, not results. Prints avg JCT / the stored Pollux
figure and the same ratio per application.

Two more modes (not run by default) ask what the 30 s restarts cost, with the learned models:

* ``restart-free``: a running job's restarts cost nothing (a start-up still under way goes on),
  while its first placement still waits the restart delay;
* ``no-delay``: nothing waits (``Simulator(restart_delay=0)``).

Four more make only one kind of restart free, as ``restart-free`` does for all of them:

* ``free-shrink``: a running job's shrinks (to fewer replicas, or to none);
* ``free-grow``: its growths (to more replicas; a re-placement after a preemption counts as one);
* ``free-explore``: the growths past the largest size it has run on (``max_profiled_replicas``
  before the change): the steps of its exploration ramp;
* ``free-regrow``: the other growths, to a size it has run on before.

A move at the same size is free only under ``restart-free``. In all of these the policy still
prices a restart at 30 s, so it makes the default's decisions until the first restart whose
cost differs; the difference to ``learned`` is what those restarts cost the file, not what a
policy for cheaper restarts would reach. ``--seed`` seeds the policy's genetic search
(default 0).

With ``--isolated`` every job is simulated *alone* on the 64-GPU cluster (submitted at the same
offset into its 60 s round, so the wait for its first round is the same): the mean of these JCTs
is what the policy would reach if jobs never competed for GPUs, a reference for how much of the
JCT any policy can still remove by sharing the cluster better (about a bound: with one job the
policy simply grows it as fast as the exploration cap allows to its best goodput).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)

# the artifact's traces, workloads and stored results beside the checkout
from _artifact import default_traces_dir

from adaptrain.core.goodput import GoodputFunction, fit_perf_params
from adaptrain.sched import (
    ClusterSpec,
    WaterfillPolicy,
)
from adaptrain.sched.speedup import SpeedupFunction
from adaptrain.sim.simulator import SimJob, Simulator
from adaptrain.sim.traces import load_applications, load_workload


class FullModelSimulator(Simulator):
    """Policies see each application's model fitted to all its measurements."""

    def __init__(self, *args, full_params: dict, cap: bool, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.full_params = full_params
        self.cap = cap

    def job_info(self, job, now=None):
        info = super().job_info(job, now=now)
        app = job.app
        if job.perf_params is None or app.name == "ncf":  # ncf runs at one GPU anyway
            return info
        fn = SpeedupFunction(
            GoodputFunction(self.full_params[app.name], job.grad_params, app.init_batch_size),
            max_batch_size=app.max_batch_size,
            atomic_bsz_range=(app.min_local_bsz, app.max_local_bsz),
            accumulation=True,
        )
        info.speedup_fn = fn
        info.remaining_work = job.remaining_work(fn)
        if not self.cap:
            info.max_replicas = min(
                self.num_nodes * self.gpus_per_node, app.max_batch_size // app.min_local_bsz
            )
        return info


RESTART_KINDS = ("shrink", "move", "explore", "regrow")
# the restart kinds each mode makes free (see the module docstring)
FREE_KINDS = {
    "restart-free": frozenset(RESTART_KINDS),
    "free-shrink": frozenset({"shrink"}),
    "free-grow": frozenset({"explore", "regrow"}),
    "free-explore": frozenset({"explore"}),
    "free-regrow": frozenset({"regrow"}),
}


def restart_kind(old: int, new: int, largest_run: int) -> str:
    """The kind of a running job's change from ``old`` to ``new`` replicas, ``largest_run``
    the most it has run on: ``shrink``, ``move`` (the same size), ``explore`` (a growth past
    ``largest_run``) or ``regrow`` (a growth to a size within it)."""
    if new < old:
        return "shrink"
    if new == old:
        return "move"
    return "explore" if new > largest_run else "regrow"


class _FreeRestartJob(SimJob):
    """A simulated job whose restarts of the kinds in ``free_kinds`` cost nothing (every kind
    by default): only its first placement, and its other restarts, wait the restart delay (a
    start-up still under way when it is resized goes on)."""

    free_kinds: frozenset = FREE_KINDS["restart-free"]

    def reallocate(self, placement) -> None:
        first, pending = self.num_restarts is None, self.rescale_time
        kind = restart_kind(sum(self.placement), sum(placement or ()), self.max_profiled_replicas)
        super().reallocate(placement)
        if placement and not first and kind in self.free_kinds:
            self.rescale_time = pending


class FreeRestartSimulator(Simulator):
    """The simulator with the restarts of the kinds in ``free_kinds`` free (every kind by
    default; see ``restart-free`` and the ``free-*`` modes above)."""

    def __init__(self, *args, free_kinds: frozenset = FREE_KINDS["restart-free"], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        for job in self.jobs:
            job.__class__ = _FreeRestartJob
            job.free_kinds = frozenset(free_kinds)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", nargs="+", default=["3"])
    parser.add_argument(
        "--modes",
        nargs="+",
        default=["learned", "full", "full-nocap"],
        choices=["learned", "full", "full-nocap", "no-delay", *FREE_KINDS],
    )
    parser.add_argument("--load", default="1.0", choices=["0.5", "1.0", "1.5", "2.0"])
    parser.add_argument(
        "--isolated", action="store_true", help="simulate every job alone on the cluster"
    )
    parser.add_argument("--traces", default=default_traces_dir())
    parser.add_argument("--seed", type=int, default=0, help="seed of the policy's genetic search")
    args = parser.parse_args()
    if not args.traces:
        parser.error("no traces found; pass --traces DIR")
    data_dir = os.path.dirname(os.path.normpath(args.traces))
    apps = load_applications(args.traces)
    full = {}
    for name, app in apps.items():
        m = app.measurements()
        full[name] = fit_perf_params(
            m["num_nodes"],
            m["num_replicas"],
            m["local_bsz"],
            m["step_time"] - m["sync_time"],
            m["step_time"],
        )
    summary = os.path.join(data_dir, "results-jobload", f"pollux-{args.load}", "summary.json")
    with open(summary) as f:
        stored = json.load(f)["jcts"]
    wdir = "workloads" if args.load == "1.0" else f"workloads-{args.load}"

    def simulate(workload, mode):
        policy = WaterfillPolicy(seed=args.seed)
        if mode == "learned":
            return Simulator(workload, apps, policy).run()
        if mode in FREE_KINDS:
            return FreeRestartSimulator(workload, apps, policy, free_kinds=FREE_KINDS[mode]).run()
        if mode == "no-delay":  # the policy knows restarts are free, too
            free = ClusterSpec(restart_delay=0.0)
            policy = WaterfillPolicy(cluster=free, seed=args.seed)
            return Simulator(workload, apps, policy, cluster=free).run()
        return FullModelSimulator(
            workload, apps, policy, full_params=full, cap=mode == "full"
        ).run()

    for wl in args.workloads:
        workload = load_workload(os.path.join(data_dir, wdir, f"workload-{wl}.csv"))
        ref = stored[f"workload-{wl}"]
        for mode in args.modes:
            t0 = time.time()
            if args.isolated:
                jcts, restarts = {}, 0
                for job in workload:
                    res = simulate([dataclasses.replace(job, time=job.time % 60.0)], mode)
                    jcts.update(res.jcts)
                    restarts += sum(res.restarts.values())
                res = dataclasses.replace(res, jcts=jcts, restarts={"all": restarts})
                mode = f"{mode}, isolated"
            else:
                res = simulate(workload, mode)
            ratio = sum(res.jcts.values()) / sum(ref[k] for k in res.jcts)
            by = collections.defaultdict(lambda: [0.0, 0.0])
            for k, v in res.jcts.items():
                by[k.rsplit("-", 1)[0]][0] += v
                by[k.rsplit("-", 1)[0]][1] += ref[k]
            per_app = ", ".join(f"{a} {o / p:.3f}" for a, (o, p) in sorted(by.items()))
            print(
                f"load {args.load} workload-{wl} {mode:10s} avg JCT {res.avg_jct:7.1f} s  / stored Pollux "
                f"{ratio:.3f}  restarts {sum(res.restarts.values())}  ({per_app})  "
                f"[{time.time() - t0:.0f} s]",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
