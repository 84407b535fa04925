"""Trace-driven cluster simulator with the semantics of the Pollux OSDI'21 artifact.

Every round of the cluster's ``round_seconds`` (:class:`~adaptrain.sched.config.ClusterSpec`):
(1) each job advances through its measured profile: a reallocated
job first waits ``restart_delay`` seconds (checkpoint-restart), then makes statistical progress
at ``gain / step_time`` per second where ``gain = (var + sqr) / (var / s + sqr)`` (``s`` = batch
size over the initial one, ``sqr``/``var`` from ``validation-<bsz>.csv`` for the current epoch) and
``step_time`` comes from the placement traces (with gradient accumulation
``step + accum_steps * (step - sync)``); crossing the progress recorded at the end of an epoch
moves to the next epoch; finishing the last epoch completes the job; (2) the policy sees every
submitted, unfinished job and returns an allocation; changed allocations restart their job.

Arrivals between rounds (``arrival_allocation=True``, the default): a job submitted between two
rounds is offered, at its submission time, to the policy's ``allocate_job(job, free_nodes)`` if
the policy has one, with the GPUs free at that moment (those no job holds; a job that completed
earlier in the round has freed its own). Its placement starts then, with its restart delay, and
no other job moves; the next round sees it as any running job. This is AdaptDL's allocator,
which places each new job as it arrives and re-optimises every job each round. With
``arrival_allocation=False``, or a policy without ``allocate_job`` (Tiresias and Optimus here),
a new job waits for the next round, as in the artifact simulator.

Adaptive jobs (no fixed batch size) learn their goodput model online exactly like AdaptDL
(:mod:`adaptrain.sim.job`). What the policy sees of a job is built by the scheduler's own rule,
:func:`adaptrain.sched.jobs.job_info`, from what the job reports, as a service does.
JCT = completion time - submission time.

Times: as in the artifact, the time to cross an epoch boundary is rounded to whole seconds when
the round length, the job's clock and its restart delay are whole (the standard configuration:
60 s rounds, 30 s restarts); otherwise (e.g. 45.5 s rounds) it is kept exact.

Limits: a job never gets more replicas than the cluster has GPUs nor more than its application's
traces measure (64 in the artifact's traces: no throughput is known beyond). A fixed-size
(Tiresias) job asking for more is capped at that size, with a warning, so that a comparison on a
smaller cluster still runs every policy. Nodes hold at most as many GPUs as the traces measure
on one node (4 in the artifact's traces), and a fixed batch size (Tiresias, Optimus) lies in its
application's range (at least its smallest local batch per replica for a fixed-size job): both
are checked up front, with a ``ValueError``. Job names must be unique. :meth:`Simulator.run` raises
:class:`SimulationStalled` when every job has been submitted but none has been allocated a GPU
for ``stall_rounds`` rounds in a row (a policy that can never place the remaining jobs).
"""

from __future__ import annotations

import logging
import math
import sys
import time as _time
import types
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from adaptrain.sched.config import ClusterSpec
from adaptrain.sched.jobs import JobReport, job_info
from adaptrain.sched.policy_base import Allocation, JobInfo, NodeInfo, check_allocations

from .fitworkers import FitPrefetcher
from .job import SHARED_MEMOS, GoodputMemos, SimJob, job_kind_for_policy
from .traces import Application, WorkloadJob

logger = logging.getLogger(__name__)

__all__ = ["SimResult", "SimulationStalled", "Simulator"]


class SimulationStalled(RuntimeError):
    """Every job has been submitted, some are unfinished, and none runs any more."""


#: Seconds (wall clock) between two progress lines when stderr is not a terminal.
PROGRESS_LINE_EVERY = 30.0


def _stderr_is_terminal() -> bool:
    try:
        return bool(sys.stderr is not None and sys.stderr.isatty())
    except (AttributeError, ValueError):  # replaced by an object without isatty, or closed
        return False


class _Progress:
    """Progress of :meth:`Simulator.run` on stderr.

    On a terminal, a tqdm bar (simulated seconds, jobs done). Elsewhere (a log file, a pipe, a
    CI log) no bar, whose ``\\r`` redraws would fill the log, but a plain line after the first
    round, then at most every :data:`PROGRESS_LINE_EVERY` seconds, and one at the end: the rule
    of ``adaptrain demo``'s bar.
    """

    def __init__(self, sim: Simulator) -> None:
        self.name = getattr(sim.policy, "name", "sim")
        self.total = len(sim.jobs)
        self.start = _time.perf_counter()
        self.next_line = self.start  # the first round gets a line
        self.bar = None
        if _stderr_is_terminal():
            from tqdm import tqdm

            self.bar = tqdm(total=None, unit="sim-s", desc=self.name, mininterval=1.0)

    def _line(self, sim: Simulator, what: str) -> None:
        done = sum(j.completion_time is not None for j in sim.jobs)
        wall = _time.perf_counter() - self.start
        print(
            f"{self.name}: {what} {done}/{self.total} jobs, {sim.current_time:.0f} s simulated "
            f"in {wall:.0f} s",
            file=sys.stderr,
            flush=True,
        )

    def update(self, sim: Simulator) -> None:
        if self.bar is not None:
            done = sum(j.completion_time is not None for j in sim.jobs)
            self.bar.update(sim.interval)
            self.bar.set_postfix(done=f"{done}/{self.total}", refresh=False)
        elif _time.perf_counter() >= self.next_line:
            self._line(sim, "done")
            self.next_line = _time.perf_counter() + PROGRESS_LINE_EVERY

    def close(self, sim: Simulator, finished: bool) -> None:
        if self.bar is not None:
            self.bar.close()
        elif finished:
            self._line(sim, "finished")


@dataclass
class SimResult:
    """Outcome of one simulation."""

    jcts: dict[str, float]
    makespan: float
    gpu_utilization: float
    policy_seconds: list[float]
    timeline: list[dict] = field(default_factory=list)
    restarts: dict[str, int] = field(default_factory=dict)
    #: jobs placed as they arrived, between rounds (``allocate_job``)
    arrivals_placed: int = 0

    @property
    def avg_jct(self) -> float:
        return float(np.mean(list(self.jcts.values()))) if self.jcts else float("nan")

    def percentile_jct(self, q: float) -> float:
        return float(np.percentile(list(self.jcts.values()), q)) if self.jcts else float("nan")

    @property
    def policy_s_per_round(self) -> float:
        return float(np.mean(self.policy_seconds)) if self.policy_seconds else 0.0

    def summary(self) -> dict[str, float]:
        return {
            "avg_jct": self.avg_jct,
            "p50_jct": self.percentile_jct(50),
            "p99_jct": self.percentile_jct(99),
            "makespan": self.makespan,
            "gpu_utilization": self.gpu_utilization,
            "policy_s_per_round": self.policy_s_per_round,
            "rounds": len(self.policy_seconds),
            "avg_restarts": float(np.mean(list(self.restarts.values()))) if self.restarts else 0.0,
            "num_jobs": len(self.jcts),
            "arrivals_placed": self.arrivals_placed,
        }


class Simulator:
    """A cluster of ``num_nodes`` nodes replaying a workload under a policy.

    ``cluster`` holds the cluster's facts (GPUs per node, round length, restart delay); by
    default the policy's own ``cluster`` where it has one, else :class:`ClusterSpec`'s
    defaults. A policy whose ``cluster`` differs from the simulator's is refused with a
    ``ValueError``: it would price its decisions for another cluster.

    ``fit_workers`` > 0 computes the adaptive jobs' goodput refits ahead in that many worker
    processes while the policy decides each round (:mod:`adaptrain.sim.fitworkers`), with the
    same results bit for bit: 1 uses the second core of a 2-core machine. The workers live
    for one :meth:`run` and start with ``spawn``, so a script that simulates with them must
    guard its entry point with ``if __name__ == "__main__":``.
    """

    def __init__(
        self,
        workload: Sequence[WorkloadJob],
        applications: Mapping[str, Application],
        policy,
        *,
        num_nodes: int = 16,
        cluster: ClusterSpec | None = None,
        interference: float = 0.0,
        check: bool = True,
        record_timeline: bool = False,
        arrival_allocation: bool = True,
        fit_workers: int = 0,
        memos: GoodputMemos | None = None,
    ) -> None:
        own = getattr(policy, "cluster", None)
        if cluster is None:
            cluster = own if isinstance(own, ClusterSpec) else ClusterSpec()
        elif not isinstance(cluster, ClusterSpec):
            raise ValueError(f"cluster={cluster!r} must be an adaptrain.sched.ClusterSpec")
        if isinstance(own, ClusterSpec) and own != cluster:
            raise ValueError(
                f"the policy's cluster {own} differs from the simulator's {cluster}: give both "
                "the same ClusterSpec (the policy prices its decisions with it)"
            )
        if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1:
            raise ValueError(f"num_nodes={num_nodes!r} must be an int >= 1")
        self.cluster = cluster
        gpus_per_node, restart_delay = cluster.gpus_per_node, cluster.restart_delay
        if not 0.0 <= interference < 1.0:
            raise ValueError(
                f"interference={interference} must lie in [0, 1): the fraction of goodput a "
                "multi-node job loses on shared nodes (1 would stop it)"
            )
        if isinstance(fit_workers, bool) or not isinstance(fit_workers, int) or fit_workers < 0:
            raise ValueError(
                f"fit_workers={fit_workers!r} must be an int >= 0 (0: no worker processes; "
                "1 on a 2-core machine)"
            )
        _check_unique_names([w.name for w in workload])
        _check_gpus_per_node(gpus_per_node, workload, applications)
        self.policy = policy
        self.applications = applications
        self.fit_workers = fit_workers
        self.memos = SHARED_MEMOS if memos is None else memos
        self._prefetch = None  # a FitPrefetcher while run() holds workers
        #: what the fit workers did in the last run() (:meth:`FitPrefetcher.stats`), or {}
        self.prefetch_stats: dict[str, float] = {}
        self.kind = job_kind_for_policy(getattr(policy, "name", ""))
        self.num_nodes = num_nodes
        self.gpus_per_node = gpus_per_node
        self.interval = cluster.round_seconds
        self.interference = interference
        self.check = check
        self.record_timeline = record_timeline
        self.arrival_allocation = arrival_allocation
        self.current_time = 0.0
        self.jobs: list[SimJob] = []
        capacity = num_nodes * gpus_per_node
        capped: list[str] = []
        for w in workload:
            if w.application not in applications:
                raise ValueError(
                    f"job {w.name!r} uses application {w.application!r}; known: {sorted(applications)}"
                )
            app = applications[w.application]
            if not math.isfinite(w.time):
                raise ValueError(
                    f"job {w.name!r} has submission time={w.time}; it must be a finite number "
                    "of seconds (the job would never be submitted)"
                )
            kw: dict = {
                "restart_delay": restart_delay,
                "max_nodes": max(64, num_nodes),
                "max_replicas": max(256, capacity),
                "memos": self.memos,
            }
            if self.kind == "fixed":
                if w.num_replicas < 1:
                    raise ValueError(
                        f"job {w.name!r} asks for num_replicas={w.num_replicas}; a fixed-size "
                        "job needs >= 1"
                    )
                replicas = min(w.num_replicas, self.replica_cap(app))
                if replicas < w.num_replicas:
                    capped.append(f"{w.name} ({w.num_replicas} -> {replicas})")
                _check_batch_size(w, app, replicas)
                kw.update(target_num_replicas=replicas, target_batch_size=w.batch_size)
            elif self.kind == "batch":
                _check_batch_size(w, app, None)
                kw.update(target_batch_size=w.batch_size)
            else:
                kw.update(adaptive=True)
                if app.name == "ncf":  # as in the artifact: ncf runs at a fixed batch size
                    kw.update(target_batch_size=32768)
            self.jobs.append(SimJob(w.name, app, w.time, **kw))
        if capped:
            logger.warning(
                "%d fixed-size job(s) ask for more replicas than the cluster (%d GPUs) has or "
                "than their application's traces measure; capped at that size: %s",
                len(capped),
                capacity,
                ", ".join(capped[:10]) + (", ..." if len(capped) > 10 else ""),
            )
        self.allocations: Allocation = {}
        self._by_name = {j.name: j for j in self.jobs}
        self.arrivals_placed = 0  # jobs placed on arrival, between rounds
        self.policy_seconds: list[float] = []
        self.policy_seconds_arrivals: list[float] = []  # allocate_job calls, not rounds
        self.used_gpu_rounds: list[int] = []
        self.timeline: list[dict] = []

    def replica_cap(self, app: Application) -> int:
        """The most replicas any job of ``app`` may get: the cluster's GPUs, and the largest
        replica count its traces measure (no throughput is known beyond)."""
        return min(self.num_nodes * self.gpus_per_node, app.max_measured_replicas)

    def node_infos(self) -> dict[int, NodeInfo]:
        return {i: NodeInfo(self.gpus_per_node) for i in range(self.num_nodes)}

    def job_info(self, job: SimJob, now: float | None = None) -> JobInfo:
        """What the policy sees of ``job`` at time ``now`` (default: the current round): the
        scheduler's :func:`~adaptrain.sched.jobs.job_info` of what the job reports."""
        now = self.current_time if now is None else now
        return job_info(self.job_report(job), cluster_replicas=self.replica_cap(job.app), now=now)

    def job_report(self, job: SimJob) -> JobReport:
        """What ``job`` reports, as a service would hear it from a real job."""
        app = job.app
        common = {
            "submitted": job.submission_time,
            "attained_service": job.attained_service,
            "num_restarts": job.num_restarts or 0,
            "application": app.name,
            "epoch": job.epoch,
        }
        if self.kind == "fixed":
            return JobReport(replicas=job.target_num_replicas, **common)
        # as in the artifact, a scaled ncf job runs on one replica at a fixed batch size
        common["max_replicas"] = 1 if app.name == "ncf" else None
        if self.kind == "batch":
            return JobReport(
                batch_size=job.target_batch_size,
                min_local_bsz=app.min_local_bsz,
                step_time_fn=job.step_time_fn(self.gpus_per_node),
                remaining_steps=job.remaining_steps(),
                **common,
            )
        return JobReport(
            profile=types.MappingProxyType(job.profile),
            speedup_fn=job.speedup_fn(),
            remaining_work=job.remaining_work(),
            max_batch_size=app.max_batch_size,
            min_local_bsz=app.min_local_bsz,
            **common,
        )

    def active_jobs(self) -> list[SimJob]:
        return [
            j
            for j in self.jobs
            if self.current_time >= j.submission_time and j.completion_time is None
        ]

    def step(self) -> None:
        """One scheduling round: advance jobs by ``interval``, then re-run the policy."""
        seconds = self.interval
        interfere_nodes = self._interfere_nodes()
        start, end = self.current_time, self.current_time + seconds
        # before the first round (at ``start``) a job submitted at ``start`` is an arrival too
        arriving = self._arriving(start, end, first=not self.used_gpu_rounds)
        running: Iterable[SimJob] = [j for j in self.jobs if j.name not in arriving]
        if self._prefetch is not None:  # each job once its fits computed ahead are in
            running = self._prefetch.order(running)
        for job in running:
            job.step(seconds, interference=self._slowdown(job.name, interfere_nodes))
        for job in arriving.values():  # in order of submission, after the running jobs
            self._arrive(job, start, end, interfere_nodes)
        self.current_time = end
        active = self.active_jobs()
        if active:
            infos = {j.name: self.job_info(j) for j in active}
            nodes = self.node_infos()
            base = {k: v for k, v in self.allocations.items() if k in infos}
            if self._prefetch is not None:  # step the jobs ahead while the policy decides
                shared = self._interfere_nodes()
                self._prefetch.submit(
                    active, self.interval, lambda j: self._slowdown(j.name, shared)
                )
            t0 = _time.perf_counter()
            allocations = self.policy.optimize(infos, nodes, base, self.current_time)
            self.policy_seconds.append(_time.perf_counter() - t0)
            allocations = {k: list(v) for k, v in allocations.items() if v}
            if self.check:
                check_allocations(allocations, infos, nodes, policy=self.policy)
            moved = []  # jobs on a new placement (not on equal counts on other nodes)
            for job in self.jobs:
                new, old = allocations.get(job.name), base.get(job.name)
                if new != old:
                    placement = job.placement
                    job.reallocate(_placement(new or []))
                    if job.placement != placement:
                        moved.append(job)
            self.allocations = allocations
            if self._prefetch is not None:  # their copies stepped on the old placement
                self._prefetch.discard(j.name for j in moved)
                shared = self._interfere_nodes()
                self._prefetch.submit(
                    moved, self.interval, lambda j: self._slowdown(j.name, shared), late=True
                )
        else:
            self.allocations = {}
        self.used_gpu_rounds.append(sum(len(a) for a in self.allocations.values()))
        if self.record_timeline:
            self.timeline.append(
                {
                    "time": self.current_time,
                    "allocations": {k: len(v) for k, v in self.allocations.items()},
                }
            )

    def _interfere_nodes(self) -> set[int]:
        """Nodes that two or more multi-node jobs share (none without ``interference``)."""
        if not self.interference:
            return set()
        count: dict[int, int] = {}
        for alloc in self.allocations.values():
            if len(set(alloc)) > 1:
                for n in set(alloc):
                    count[n] = count.get(n, 0) + 1
        return {n for n, c in count.items() if c > 1}

    def _slowdown(self, name: str, interfere_nodes: set[int]) -> float:
        alloc_set = set(self.allocations.get(name, ()))
        if len(alloc_set) > 1 and alloc_set & interfere_nodes:
            return self.interference
        return 0.0

    def _arriving(self, start: float, end: float, first: bool) -> dict[str, SimJob]:
        """Jobs no round has seen, by submission time: submitted in ``(start, end)``, or at
        ``start`` itself when ``first`` (no round has run yet; later, the round at ``start``
        saw them)."""
        if not self.arrival_allocation or getattr(self.policy, "allocate_job", None) is None:
            return {}
        jobs = [
            j
            for j in self.jobs
            if start < j.submission_time < end or (first and j.submission_time == start)
        ]
        jobs.sort(key=lambda j: j.submission_time)  # stable: ties keep the workload's order
        return {j.name: j for j in jobs}

    def _free_nodes(self, at: float) -> dict[int, NodeInfo]:
        """GPUs that no job holds at time ``at`` (jobs completed by then hold none)."""
        used: Counter = Counter()
        for name, alloc in self.allocations.items():
            done = self._by_name[name].completion_time
            if done is None or done > at:
                used.update(alloc)
        return {
            n: NodeInfo(self.gpus_per_node - used[n])
            for n in range(self.num_nodes)
            if used[n] < self.gpus_per_node
        }

    def _arrive(self, job: SimJob, start: float, end: float, interfere_nodes: set[int]) -> None:
        """Offer ``job``, submitted at ``t`` in ``[start, end)``, to ``allocate_job``; step it
        to ``end`` (idle before ``t``, then on its placement, restart delay first)."""
        t = job.submission_time
        job.step(t - start)  # no placement yet: only its clock moves
        free = self._free_nodes(t)
        alloc: list[int] = []
        if free:
            info = self.job_info(job, now=t)
            t0 = _time.perf_counter()
            alloc = list(self.policy.allocate_job(info, free) or [])
            self.policy_seconds_arrivals.append(_time.perf_counter() - t0)
            if alloc and self.check:
                check_allocations({job.name: alloc}, {job.name: info}, free, policy=self.policy)
        if alloc:
            job.reallocate(_placement(alloc))
            self.allocations[job.name] = alloc
            self.arrivals_placed += 1
        job.step(end - t, interference=self._slowdown(job.name, interfere_nodes))

    def all_complete(self) -> bool:
        return all(j.completion_time is not None for j in self.jobs)

    def run(
        self,
        *,
        progress: bool = False,
        max_time: float | None = None,
        callback: Callable[[Simulator], None] | None = None,
        stall_rounds: int = 100,
    ) -> SimResult:
        """Simulate until every job completes (or ``max_time`` seconds of simulated time).

        ``progress`` shows progress on stderr: a tqdm bar on a terminal, plain lines elsewhere
        (a log file gets no ``\\r`` redraws; see :class:`_Progress`).

        Raises :class:`SimulationStalled` once every job has been submitted and, for
        ``stall_rounds`` rounds in a row, unfinished jobs remain but none holds a GPU: the
        policy will not place them (e.g. a job larger than the cluster), and the simulation
        would otherwise never end.
        """
        if stall_rounds < 1:
            raise ValueError(f"stall_rounds={stall_rounds} must be >= 1")
        last_submission = max((j.submission_time for j in self.jobs), default=0.0)
        idle_rounds = 0
        shown = _Progress(self) if progress else None
        finished = False
        try:
            if self.fit_workers and self.kind == "adaptive":
                try:
                    self._prefetch = FitPrefetcher(self.applications, self.memos, self.fit_workers)
                except Exception as exc:  # noqa: BLE001 - the workers only save time
                    logger.warning(
                        "could not start %d fit worker(s) (%s: %s); simulating with every fit "
                        "in this process (the same results)",
                        self.fit_workers,
                        type(exc).__name__,
                        exc,
                    )
            while not self.all_complete():
                if max_time is not None and self.current_time >= max_time:
                    break
                self.step()
                if self.allocations or self.current_time < last_submission or self.all_complete():
                    idle_rounds = 0
                else:
                    idle_rounds += 1
                    if idle_rounds >= stall_rounds:
                        pending = [j.name for j in self.jobs if j.completion_time is None]
                        raise SimulationStalled(
                            f"simulation stalled at t={self.current_time:g} s: every job has "
                            f"been submitted, but for {idle_rounds} rounds policy "
                            f"{getattr(self.policy, 'name', self.policy)!r} placed none of the "
                            f"{len(pending)} unfinished job(s) {pending[:10]}; they cannot be "
                            "scheduled on this cluster (check their sizes against "
                            f"{self.num_nodes} x {self.gpus_per_node} GPUs)"
                        )
                if shown is not None:
                    shown.update(self)
                if callback is not None:
                    callback(self)
            finished = True
        finally:  # the bar ends its line also on Ctrl-C or a stall
            if self._prefetch is not None:  # (interrupted or failed: no wait for the workers)
                self._prefetch.close(wait=finished)
                self.prefetch_stats = self._prefetch.stats()
                self._prefetch = None
            if shown is not None:
                shown.close(self, finished)
        jcts = {
            j.name: j.completion_time - j.submission_time
            for j in self.jobs
            if j.completion_time is not None
        }
        ends = [j.completion_time for j in self.jobs if j.completion_time is not None]
        makespan = max(ends) if ends else self.current_time
        capacity = self.num_nodes * self.gpus_per_node
        util = float(np.mean(self.used_gpu_rounds)) / capacity if self.used_gpu_rounds else 0.0
        return SimResult(
            jcts=jcts,
            makespan=float(makespan),
            gpu_utilization=util,
            policy_seconds=list(self.policy_seconds),
            timeline=self.timeline,
            restarts={j.name: j.num_restarts or 0 for j in self.jobs},
            arrivals_placed=self.arrivals_placed,
        )


def _check_unique_names(names: Sequence[str]) -> None:
    """Raise ``ValueError`` naming the job names that occur more than once."""
    dups = sorted(name for name, count in Counter(names).items() if count > 1)
    if dups:
        raise ValueError(
            f"duplicate job names in the workload: {dups}; every job needs its own name "
            "(the simulator and the policies key jobs by name)"
        )


def _check_gpus_per_node(
    gpus_per_node: int, workload: Sequence[WorkloadJob], applications: Mapping[str, Application]
) -> None:
    """Raise ``ValueError`` if a node holds more GPUs than the traces of the workload's
    applications measure on one node (no step time is known for such a placement)."""
    used = sorted({w.application for w in workload if w.application in applications})
    if not used:
        return
    limit = min(applications[a].max_gpus_per_node for a in used)
    if gpus_per_node > limit:
        short = [a for a in used if applications[a].max_gpus_per_node == limit]
        raise ValueError(
            f"gpus_per_node={gpus_per_node} exceeds {limit}, the most GPUs per node that the "
            f"traces of {short} measure (placements.csv): no step time is known for more "
            f"replicas on one node; use gpus_per_node <= {limit} (and more nodes for a larger "
            "cluster)"
        )


def _check_batch_size(w: WorkloadJob, app: Application, replicas: int | None) -> None:
    """Raise ``ValueError`` unless a fixed batch size (Tiresias, Optimus) can be replayed:
    between the application's initial and largest batch sizes (its validated range) and, on
    a fixed number of ``replicas``, at least its smallest profiled local batch per replica."""
    lo, hi = app.init_batch_size, app.max_batch_size
    detail = f"between its initial ({lo}) and largest ({hi}) batch sizes"
    if replicas is not None and replicas * app.min_local_bsz > lo:
        lo = replicas * app.min_local_bsz
        detail += f", and >= {app.min_local_bsz} per replica on its {replicas} replicas"
    if not lo <= w.batch_size <= hi:
        raise ValueError(
            f"job {w.name!r} has batch_size={w.batch_size}, outside [{lo}, {hi}]: the fixed "
            f"batch sizes application {app.name!r} can replay ({detail}); fix the workload's "
            "batch_size column"
            + (" or num_replicas" if replicas is not None and lo > app.init_batch_size else "")
        )


def _placement(alloc: Sequence[int]) -> list[int]:
    """Replicas per node, in order of consecutive runs of the same node key."""
    placement: list[int] = []
    for i, node in enumerate(alloc):
        if i == 0 or node != alloc[i - 1]:
            placement.append(1)
        else:
            placement[-1] += 1
    return placement
