"""The default policy, "waterfill": remaining-work-weighted goodput, local search + genetic search.

Pollux (OSDI'21) maximises a fairness power mean of speedups. This policy maximises a weighted
sum of speedups (Smith's rule for mean completion time, with elastic, sub-linear speedups):

    maximise  sum_j w_j * U(s_j(r_j)) - sum_{j restarted} w_j * k_j,
    w_j = 1 / (1 + R_j / theta) / s_j(f_j) ** gamma,
    k_j = U(s_j(r_j^cur)) * c_j,  or  max(U(s_j(r_j^cur)) * c_j, U(s_j(r_j)) * g_j) if it grows,
    c_j = d * (restarts_j + 1) / (age_j + d),   g_j = d / min(H * round, T_j),
    s.t.      sum_j r_j <= GPUs,  min_j <= r_j <= max_j,

where ``s_j(r)`` is job ``j``'s goodput speedup on ``r`` replicas packed on
``ceil(r / gpus_per_node)`` nodes, ``R_j`` its remaining seconds of work on one GPU (weight 1
while unknown: a new job comes first), ``f_j`` its max-min fair share of the GPUs, ``U`` the
identity (``p = 1``) or a power/log utility, ``d`` the cluster's restart delay, ``c_j`` Pollux's
restart penalty and ``g_j`` the least share of its new speed a running job pays to grow
(repaid within ``H`` rounds, or before its end ``T_j``). The configuration
(:mod:`adaptrain.sched.config`) groups the settings by rule:

- :class:`~adaptrain.sched.config.Objective`: ``theta``, ``p`` and ``gamma`` (``future_gamma``);
- :class:`~adaptrain.sched.config.Exploration`: a job's speedup beyond the largest size it has
  run on is its model's extrapolation; long jobs are valued there at least at
  ``s(r0) (r / r0) ** beta``, may grow to ``growth x r0`` replicas, start on up to
  ``first_replicas``, and get credit for the steps of a growth (``ramp_credit``);
- :class:`~adaptrain.sched.config.Growth`: the payback ``H`` of a growth;
- :class:`~adaptrain.sched.config.Arrivals`: while jobs arrive sparsely, a longer ``theta`` and
  payback and no work prior for a job never run;
- :class:`~adaptrain.sched.config.Sharing`: jobs of one application share a pooled throughput
  fit, a remaining-work prior, and a calibration of the model by their measured step times;
- :class:`~adaptrain.sched.config.Search`: the search and the node floor of multi-node jobs.

The search: a warm-started local search starts from the current replica counts, admits
waiting jobs, hands free GPUs out in chunks of up to two nodes to the largest weighted gain per
GPU and moves chunks from the job losing least to the job gaining most while that pays.
Placement keeps unchanged jobs on their nodes, packs multi-node jobs on the emptiest nodes (at
most one per node: interference avoidance) and best-fits the others. A non-preemptible running
job keeps its allocation. With ``Search(method="genetic")`` (the default) that answer seeds a
genetic search (:mod:`adaptrain.sched._plan`, Pollux's NSGA-II-style search over (jobs x nodes)
matrices) that replaces it only when strictly better.

A job that arrives between rounds is placed at once on free GPUs (:meth:`allocate_job`), as
AdaptDL's allocator does. ``docs/scheduling.md`` gives each rule's reason and measured effect
on the Pollux artifact's workloads, with the commands that reproduce them.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping

import numpy as np

from ._arrivals import ArrivalRate
from ._calibration import ThroughputCalibration
from ._plan import WeightedGeneticSearch
from ._profiles import ApplicationProfiles
from .config import Arrivals, ClusterSpec, Exploration, Growth, Objective, Search, Sharing
from .policy_base import Allocation, JobInfo, NodeInfo, NodeKey
from .speedup import ExploringSpeedup, LinearSpeedup, PowerSpeedup, RampSpeedup

logger = logging.getLogger(__name__)

__all__ = ["WaterfillPolicy"]


def _unmeasured(job: JobInfo) -> bool:
    """A job that has never run and has no goodput model (no speedup, or the linear guess)."""
    return job.max_profiled_replicas == 0 and (
        job.speedup_fn is None or isinstance(job.speedup_fn, LinearSpeedup)
    )


def _fair_shares(caps: Mapping[str, int], total: int) -> dict[str, float]:
    """Max-min fair shares of ``total`` GPUs, job ``k`` taking at most ``caps[k]``: equal
    shares, a job capped below its share giving the rest to the others (water-filling)."""
    out: dict[str, float] = {}
    left, order = float(total), sorted(caps, key=lambda k: caps[k])
    for i, k in enumerate(order):
        even = left / (len(order) - i)
        if caps[k] > even:  # this job and every larger one get an even share
            return {**out, **{j: even for j in order[i:]}}
        out[k] = float(caps[k])
        left -= caps[k]
    return out


def _best_fit(r: int, free: Mapping[NodeKey, int]) -> NodeKey | None:
    """The fullest node with at least ``r`` free GPUs (ties: lowest key), or ``None``."""
    fits = [n for n in free if free[n] >= r]
    return min(fits, key=lambda n: (free[n], n)) if fits else None


class WaterfillPolicy:
    """Remaining-work-weighted goodput maximisation: warm-started local search, refined by a
    genetic search (``search="genetic"``, default) or not (``search="local"``)."""

    name = "waterfill"

    def __init__(
        self,
        *,
        cluster: ClusterSpec | None = None,
        objective: Objective | None = None,
        exploration: Exploration | None = None,
        growth: Growth | None = None,
        arrivals: Arrivals | None = None,
        sharing: Sharing | None = None,
        search: Search | None = None,
        seed: int | None = 0,
    ) -> None:
        self.cluster = ClusterSpec() if cluster is None else cluster
        self.objective = Objective() if objective is None else objective
        self.exploration = Exploration() if exploration is None else exploration
        self.growth = Growth() if growth is None else growth
        self.arrivals = Arrivals() if arrivals is None else arrivals
        self.sharing = Sharing() if sharing is None else sharing
        self.search_config = Search() if search is None else search
        for name, value, kind in (
            ("cluster", self.cluster, ClusterSpec),
            ("objective", self.objective, Objective),
            ("exploration", self.exploration, Exploration),
            ("growth", self.growth, Growth),
            ("arrivals", self.arrivals, Arrivals),
            ("sharing", self.sharing, Sharing),
            ("search", self.search_config, Search),
        ):
            if not isinstance(value, kind):
                raise TypeError(
                    f"{name}={value!r} must be an adaptrain.sched.{kind.__name__} (or None for "
                    "the defaults)"
                )
        self.seed = seed
        # the settings the rules read, by their names in the module docstring
        c, o, e, g, a, sh = (
            self.cluster,
            self.objective,
            self.exploration,
            self.growth,
            self.arrivals,
            self.sharing,
        )
        self.gpus_per_node, self.round_seconds = c.gpus_per_node, c.round_seconds
        self.restart_delay = c.restart_delay
        self.theta, self.p, self.future_gamma = o.theta, o.p, o.future_gamma
        self.explore_beta, self.explore_horizon = e.beta, e.horizon
        self.explore_observed, self.explore_growth = e.observed, e.growth
        self.first_replicas, self.first_beta = e.first_replicas, e.first_beta
        self.ramp_credit, self.ramp_doublings = e.ramp_credit, e.ramp_doublings
        self.grow_payback, self.payback_remaining = g.payback, g.payback_remaining
        self.sparse_theta, self.sparse_rate = a.sparse_theta, a.sparse_rate
        self.sparse_payback, self.sparse_work = a.sparse_payback, a.sparse_work
        self.rate_window = a.rate_window
        self.search = self.search_config.method
        self.min_nodes = self.search_config.min_nodes
        #: whether the latest round saw sparse arrivals (below ``sparse_rate``); the round's
        #: ``theta_now`` and ``payback_now`` follow from it
        self.sparse_now = False
        self._arrivals = ArrivalRate(window=a.rate_window)
        self._profiles = (
            ApplicationProfiles(work_prior=sh.work, pool=sh.pool) if sh.profiles else None
        )
        self._calibration = ThroughputCalibration() if sh.calibrate else None
        self._genetic: WeightedGeneticSearch | None = None
        if self.search == "genetic":
            self._genetic = WeightedGeneticSearch(
                self.search_config.pop_size,
                self.search_config.generations,
                self.restart_delay,
                seed,
                grow_cost=self._grow_cost(),
                min_nodes=self.min_nodes,
            )

    def _grow_cost(self) -> float:
        """The least share of its new speed a running job that grows pays for its restart:
        ``restart_delay / (grow_payback * round_seconds)``, at most 1 (0 without
        ``grow_payback``)."""
        if self.payback_now is None or self.restart_delay <= 0:
            return 0.0
        return min(1.0, self.restart_delay / (self.payback_now * self.round_seconds))

    def _grow_costs(
        self, jobs: Mapping[str, JobInfo], base_allocations: Mapping[str, list[NodeKey]]
    ) -> dict[str, float]:
        """Per running job, the least share of its new speed it pays to grow when its
        remaining time at its current size, ``T = remaining_work / s(current)``, is shorter
        than the payback horizon: ``restart_delay / T`` (at most 1; see "Payback before the
        end" in the module docstring). Jobs not listed pay :meth:`_grow_cost`."""
        d = self.restart_delay
        if not self.payback_remaining or d <= 0:
            return {}
        horizon = math.inf if self.payback_now is None else self.payback_now * self.round_seconds
        out = {}
        for k, job in jobs.items():
            r = len(base_allocations.get(k, []))
            rem, fn = job.remaining_work, job.speedup_fn
            if not r or rem is None or fn is None:
                continue
            s = max(float(fn(-(-r // self.gpus_per_node), r)), 1e-9)
            t_rem = rem / s
            if t_rem < horizon:
                out[k] = min(1.0, d / max(t_rem, 1e-9))
        return out

    def state_dict(self) -> dict:
        """What the policy has learnt: the genetic search's warm-start population and generator
        state (with ``Search(method="genetic")``); ``"arrivals"``, the jobs seen for the arrival
        rate (when an :class:`Arrivals` setting depends on it); ``"profiles"``, the
        applications' shared throughput fits (``Sharing(profiles=True)``); ``"calibration"``,
        their measured step times (``Sharing(calibrate=True)``)."""
        out: dict = {}
        if self._genetic is not None:
            out.update(self._genetic.state_dict())
        if self._gated():
            out["arrivals"] = self._arrivals.state_dict()
        if self._profiles is not None:
            out["profiles"] = self._profiles.state_dict()
        if self._calibration is not None:
            out["calibration"] = self._calibration.state_dict()
        return out

    def load_state_dict(self, state: dict) -> None:
        state = dict(state)
        arrivals = state.pop("arrivals", None)
        if arrivals is not None:
            self._arrivals.load_state_dict(arrivals)
        profiles = state.pop("profiles", None)
        if profiles is not None and self._profiles is not None:
            self._profiles.load_state_dict(profiles)
        calibration = state.pop("calibration", None)
        if calibration is not None and self._calibration is not None:
            self._calibration.load_state_dict(calibration)
        if self._genetic is not None and state:
            self._genetic.load_state_dict(state)

    def _gated(self) -> bool:
        """Whether any setting depends on the arrival rate."""
        return self.arrivals.gated

    def sparse_arrivals(self, jobs: Mapping[str, JobInfo], gpus: int, now: float) -> bool:
        """Whether the arrival rate seen over the last ``rate_window`` is below
        ``sparse_rate`` per GPU-hour (``False`` before an hour of arrivals is seen, and when
        no setting depends on it). Notes the jobs' creation timestamps."""
        if not self._gated():
            return False
        for k, job in jobs.items():
            self._arrivals.observe(k, job.creation_timestamp)
        rate = self._arrivals.rate(now, gpus)
        return rate is not None and rate < self.sparse_rate

    @property
    def theta_now(self) -> float:
        """The latest round's ``theta``: ``sparse_theta`` while arrivals were sparse (see
        "Sparse arrivals" in the module docstring), else ``theta``."""
        if self.sparse_now and self.sparse_theta is not None:
            return self.sparse_theta
        return self.theta

    @property
    def payback_now(self) -> float | None:
        """The latest round's growth payback: ``sparse_payback`` while arrivals were sparse,
        else ``grow_payback``."""
        if self.sparse_now and self.sparse_payback is not None:
            return self.sparse_payback
        return self.grow_payback

    def replica_bound(self, job: JobInfo) -> int:
        """The most replicas this policy gives ``job`` now: up to ``first_replicas`` for a job
        never run and unmodelled, else up to ``explore_growth`` times the largest size it has
        run on (with ``Sharing(profiles=True)``, the most any job of its application has run on);
        within its ``replica_limit``, and never below the allocator's ``max_replicas`` (see the
        module docstring)."""
        if self._profiles is not None:
            job = self._profiles.bound_view(job)
        limit = job.replica_limit
        if limit is None or job.max_replicas >= limit:
            return job.max_replicas
        if self.first_replicas is not None and _unmeasured(job):
            grown = self.first_replicas
        elif self.explore_growth is not None:
            grown = math.floor(self.explore_growth * job.max_profiled_replicas)
        else:
            return job.max_replicas
        return max(job.max_replicas, min(limit, grown))

    def allocate_job(self, job: JobInfo, nodes: Mapping[NodeKey, NodeInfo]) -> list[NodeKey]:
        """A place for one job that arrives between rounds, on free GPUs only
        (``nodes[n].gpus`` free on node ``n``): up to :meth:`replica_bound` replicas on one
        node, the fullest node that holds them all (best fit) or else the one with the most
        free GPUs (ties: lowest key); ``[]`` if no node has ``max(min_replicas, 1)`` free.

        Nobody else moves, so nothing is restarted; the next round re-plans the job with all
        the others. A new job thus starts as it arrives instead of at the next round (half a
        round sooner on average), as under AdaptDL's allocator."""
        want = self.replica_bound(job)
        need = max(job.min_replicas, 1)
        free = {n: int(info.gpus) for n, info in nodes.items() if int(info.gpus) >= need}
        if not free:
            return []
        node = _best_fit(want, free)
        if node is None:
            node = min(free, key=lambda n: (-free[n], n))
        return [node] * min(want, free[node])

    def _widen(self, jobs: Mapping[str, JobInfo]) -> Mapping[str, JobInfo]:
        """The jobs with ``max_replicas`` set to :meth:`replica_bound`, and a job that has never
        run valued at ``r ** first_beta`` (see the module docstring)."""
        out = dict(jobs)
        for k, job in jobs.items():
            changes = {}
            bound = self.replica_bound(job)
            if bound != job.max_replicas:
                changes["max_replicas"] = bound
            if self.first_replicas is not None and _unmeasured(job):
                changes["speedup_fn"] = PowerSpeedup(self.first_beta)
            if changes:
                out[k] = dataclasses.replace(job, **changes)
        return out

    def _explore(self, jobs: Mapping[str, JobInfo]) -> Mapping[str, JobInfo]:
        """Jobs whose speedup beyond their largest tried size is made optimistic (see the
        module docstring); the others unchanged."""
        if self.explore_beta is None:
            return jobs
        out = dict(jobs)
        for k, job in jobs.items():
            r0, fn = job.max_profiled_replicas, job.speedup_fn
            if fn is None or job.remaining_work is None or not 1 <= r0 < job.max_replicas:
                continue
            fn = ExploringSpeedup(
                fn, r0, self.explore_beta, self.gpus_per_node, observed=self.explore_observed
            )
            if job.remaining_work > self.explore_horizon * max(fn.s0, 1e-9):
                out[k] = dataclasses.replace(job, speedup_fn=fn)
        return out

    def _ramp(self, jobs, keys, weight, curves, current, total, rel_cost, need, grow):
        """Jobs held by their exploration cap, with the step to the cap credited by the ramp
        it unlocks (see the module docstring): ``{key: JobInfo}``, the others left out."""
        g = self.gpus_per_node
        tops = {}
        for k in keys:
            job = jobs[k]
            r0, cap, limit = job.max_profiled_replicas, job.max_replicas, job.replica_limit
            if job.speedup_fn is not None and limit is not None and 1 <= r0 < cap < limit:
                top = min(r0 * 2**self.ramp_doublings, limit, total)
                if top > cap:
                    tops[k] = top
        if not tops:
            return {}
        # where the ramps would end: the plan with the caps lifted, every job competing
        lifted = dict(curves)
        for k, top in tops.items():
            lifted[k] = self._utility(self._curve(jobs[k], top))
        plan = self._local_search(keys, weight, lifted, current, total, rel_cost, need, grow)
        out: dict[str, JobInfo] = {}
        d = self.restart_delay
        for k in tops:
            job = jobs[k]
            cap, far = job.max_replicas, plan[k]
            if far <= cap:
                continue
            fn = job.speedup_fn
            gain = float(fn(-(-far // g), far)) - float(fn(-(-cap // g), cap))
            # one round's gain, a one-off, as a rate over the job's restart horizon (as the
            # restart penalty converts its one-off loss): round * (restarts + 1) / (age + d)
            rate = min(1.0, self.round_seconds * (job.num_restarts + 1) / max(job.age + d, 1e-9))
            bonus = self.ramp_credit * rate * gain
            if bonus > 0:
                speedup = RampSpeedup(fn, job.max_profiled_replicas, cap, bonus)
                out[k] = dataclasses.replace(job, speedup_fn=speedup)
        return out

    def _curve(self, job: JobInfo, rmax: int) -> np.ndarray:
        """s(r) for r = 0..rmax on packed placements (``r`` if the job has no model yet)."""
        r = np.arange(1, rmax + 1)
        n = np.ceil(r / self.gpus_per_node).astype(np.int64)
        fn = job.speedup_fn
        s = r.astype(np.float64) if fn is None else np.asarray(fn(n, r), dtype=np.float64)
        return np.concatenate([[0.0], np.maximum(s, 0.0)])

    def _weights(
        self,
        jobs: Mapping[str, JobInfo],
        keys: list[str],
        speedups: Mapping[str, np.ndarray] | None = None,
        total: int | None = None,
    ) -> dict[str, float]:
        """Remaining-work (or attained-service) weights, divided by ``s_future ** future_gamma``
        when ``speedups`` (``{key: s(0..rmax)}``, from :meth:`_curve`) and ``total`` are given
        (see the module docstring)."""
        theta = self.theta_now
        out = {}
        for k in keys:  # unknown remaining work (a new job): the largest weight
            rem = jobs[k].remaining_work
            out[k] = 1.0 if rem is None else (1.0 + rem / theta) ** -1.0
        if not self.future_gamma or speedups is None or total is None:
            return out
        # each job capped at its goodput peak within its bound (none if it may have no GPU)
        peak = {k: int(np.argmax(speedups[k][1:])) + 1 if len(speedups[k]) > 1 else 0 for k in keys}
        share = _fair_shares(peak, total)
        for k in keys:
            job = jobs[k]
            if job.speedup_fn is None or job.remaining_work is None or not peak[k]:
                continue  # no model or a new job: its speed to come is unknown
            r = min(max(1, int(share[k])), len(speedups[k]) - 1)
            out[k] *= max(1.0, float(speedups[k][r])) ** (-self.future_gamma)
        return out

    def _utility(self, s: np.ndarray) -> np.ndarray:
        """``s`` (p = 1), ``s**p / p`` or ``log s`` (p = 0). Only differences between sizes
        r >= 1 matter: every job gets its first GPU before the search moves GPUs."""
        if self.p == 1.0:
            return s
        out = np.zeros_like(s)
        pos = s > 0
        out[pos] = np.log(s[pos]) if self.p == 0.0 else s[pos] ** self.p / self.p
        return out

    def optimize(
        self,
        jobs: Mapping[str, JobInfo],
        nodes: Mapping[NodeKey, NodeInfo],
        base_allocations: Mapping[str, list[NodeKey]],
        time: float,
    ) -> Allocation:
        """One round: replica counts by local search, then placement."""
        total = sum(int(n.gpus) for n in nodes.values())
        if not jobs or total == 0:
            return {}
        # this round's theta_now and payback_now follow; the work prior (None: the instance's)
        self.sparse_now = self.sparse_arrivals(jobs, total, time)
        prior = self.sparse_work if self.sparse_now else None
        if self._profiles is not None:  # throughput fits shared within applications
            self._profiles.observe(jobs, base_allocations)
            jobs = {k: self._profiles.share(job, prior) for k, job in jobs.items()}
        if self._calibration is not None:  # models corrected where measured
            self._calibration.observe(jobs)
            jobs = {k: self._calibration.calibrate(job) for k, job in jobs.items()}
        grow = self._grow_costs(jobs, base_allocations)
        jobs = self._explore(self._widen(jobs))
        keys = sorted(jobs, key=lambda k: (jobs[k].attained_service, jobs[k].creation_timestamp))
        raw = {k: self._curve(jobs[k], min(jobs[k].max_replicas, total)) for k in keys}
        weight = self._weights(jobs, keys, raw, total)
        curves = {k: self._utility(raw[k]) for k in keys}
        d = self.restart_delay
        rel_cost = {
            k: min(
                1.0,
                # d = 0: restarts are free (also for a job of age 0)
                d * (jobs[k].num_restarts + 1) / (jobs[k].age + d) if d > 0 else 0.0,
            )
            for k in keys
        }
        current = {k: min(len(base_allocations.get(k, [])), len(curves[k]) - 1) for k in keys}
        need = {k: max(1, jobs[k].min_replicas) for k in keys}
        # non-preemptible running jobs keep their allocation: the search sizes the others on
        # the GPUs left, placement puts them first (the genetic refinement pins them too)
        pinned = {}
        for k in keys:
            alloc = [n for n in base_allocations.get(k, []) if n in nodes]
            if not jobs[k].preemptible and alloc:
                pinned[k] = alloc
        movable = [k for k in keys if k not in pinned]
        left = total - sum(len(a) for a in pinned.values())
        if self.ramp_credit is not None:  # credit the steps to the caps (in both searches)
            ramped = self._ramp(jobs, movable, weight, curves, current, left, rel_cost, need, grow)
            jobs = {**jobs, **ramped}
            for k in ramped:
                curves[k] = self._utility(self._curve(jobs[k], len(curves[k]) - 1))
        target = self._local_search(movable, weight, curves, current, left, rel_cost, need, grow)
        for k in movable:  # honour minimum replicas: below it a job gets nothing
            if target[k] < jobs[k].min_replicas:
                target[k] = 0
        target.update({k: len(a) for k, a in pinned.items()})
        placed = self._place(keys, target, nodes, base_allocations, need, pinned)
        if self._genetic is None:
            return placed
        self._genetic.grow_cost = self._grow_cost()  # this round's payback
        out = self._genetic.refine(jobs, nodes, base_allocations, weight, placed, grow)
        return out if self._genetic.last_fitness > -np.inf else placed

    def _local_search(
        self, keys, weight, curves, current, total, rel_cost, need, grow=None
    ) -> dict[str, int]:
        """Start from the current sizes; admit waiting jobs, fill free GPUs, then move GPUs
        between jobs while the weighted utility gain beats the loss plus restart costs.
        ``grow`` (``{key: cost}``, from :meth:`_grow_costs`) overrides the growth floor."""
        g = self.gpus_per_node
        target = {k: current[k] for k in keys}
        free = total - sum(target.values())
        penalty = {k: weight[k] * abs(curves[k][current[k]]) * rel_cost[k] for k in keys}
        grow_cost = self._grow_cost()
        grow = grow or {}

        def value(k: str, r: int) -> float:
            v = weight[k] * curves[k][r]
            if current[k] and r != current[k]:
                cost = penalty[k]
                if r > current[k]:  # a growth repays its restart within grow_payback rounds
                    cost = max(cost, weight[k] * abs(curves[k][r]) * grow.get(k, grow_cost))
                v -= cost
            return v

        def best_grow(k: str) -> tuple[float, int]:
            r, rmax = target[k], len(curves[k]) - 1
            best, best_d = 0.0, 0
            for d in range(1, min(rmax - r, 2 * g) + 1):
                gain = (value(k, r + d) - value(k, r)) / d
                if gain > best + 1e-12:
                    best, best_d = gain, d
            return best, best_d

        def shrink_loss(k: str) -> float:
            r = target[k]
            if r <= need[k]:
                return np.inf
            return value(k, r) - value(k, r - 1)

        # 1. admit waiting jobs (one GPU each), taking GPUs from the cheapest donors if needed
        waiting = sorted(
            (k for k in keys if target[k] == 0 and len(curves[k]) > 1), key=lambda k: -weight[k]
        )
        for k in waiting:
            n = need[k]
            if n > len(curves[k]) - 1:
                continue
            if free >= n:
                target[k], free = n, free - n
                continue
            donor = min(keys, key=shrink_loss)
            if n == 1 and shrink_loss(donor) < value(k, 1) - value(k, 0):
                target[donor] -= 1
                target[k] = 1
        # 2. fill free GPUs greedily, 3. then move GPUs while it pays
        for _ in range(4 * total):
            gains = {k: best_grow(k) for k in keys if target[k] > 0}
            if not gains:
                break
            k_up = max(gains, key=lambda k: gains[k][0])
            gain, d = gains[k_up]
            if gain <= 0:
                break
            if free > 0:
                d = min(d, free)
                target[k_up] += d
                free -= d
                continue
            # no free GPU: take d GPUs from the donor losing least (not the receiver)
            donors = [k for k in keys if k != k_up and target[k] - d >= need[k]]
            if not donors:
                break
            loss = {k: (value(k, target[k]) - value(k, target[k] - d)) / d for k in donors}
            k_down = min(loss, key=loss.get)
            if gain <= loss[k_down] + 1e-9:
                break
            target[k_down] -= d
            target[k_up] += d
        return target

    def _place(self, keys, target, nodes, base_allocations, need, pinned=None) -> Allocation:
        """Nodes for the chosen sizes; a job that does not fit gets the largest size that
        does, but never less than its minimum (then nothing). ``pinned`` jobs (``{key: nodes}``,
        non-preemptible) keep their nodes, placed first."""
        g = self.gpus_per_node
        cap = {n: int(info.gpus) for n, info in nodes.items()}
        free = dict(cap)
        multi_owner: dict[int, bool] = {n: False for n in nodes}
        out: Allocation = {}
        for k, alloc in (pinned or {}).items():
            counts = {n: alloc.count(n) for n in set(alloc)}
            for n, c in counts.items():
                free[n] -= c
                if len(counts) > 1:
                    multi_owner[n] = True
            out[k] = list(alloc)
        for k in keys:  # keep placements whose size is unchanged
            if k in out:
                continue
            alloc = list(base_allocations.get(k, []))
            if alloc and len(alloc) == target[k] and all(n in free for n in alloc):
                counts = {n: alloc.count(n) for n in set(alloc)}
                if all(free[n] >= c for n, c in counts.items()):
                    multi = len(counts) > 1
                    if multi and any(multi_owner[n] for n in counts):
                        continue
                    for n, c in counts.items():
                        free[n] -= c
                        if multi:
                            multi_owner[n] = True
                    out[k] = alloc
        pending = [k for k in keys if target[k] > 0 and k not in out]
        pending.sort(key=lambda k: -target[k])
        for k in pending:
            r, alloc = target[k], None
            while r >= need[k]:
                alloc = self._fit(r, free, multi_owner, g, self.min_nodes)
                if alloc is not None:
                    break
                r -= 1
            if alloc is None:
                continue
            counts = {n: alloc.count(n) for n in set(alloc)}
            for n, c in counts.items():
                free[n] -= c
                if len(counts) > 1:
                    multi_owner[n] = True
            out[k] = alloc
        return out

    @staticmethod
    def _fit(
        r: int, free: dict, multi_owner: dict, g: int, min_nodes: int = 2
    ) -> list[NodeKey] | None:
        """Nodes for ``r`` replicas (``free`` GPUs per node, changed by the caller): one node,
        the fullest that holds them all; else nodes without another multi-node job, emptiest
        first, on at least ``min_nodes`` of them (at most the cluster's) where enough such
        nodes have free GPUs, split as evenly as their free GPUs allow, else packed on as few
        as hold them; ``None`` if they do not fit, or only on over one node more than packed."""
        if r <= g:
            n = _best_fit(r, free)
            if n is not None:
                return [n] * r
        # multi-node: nodes without another multi-node job, emptiest first
        cand = sorted(
            (n for n in free if free[n] > 0 and not multi_owner[n]), key=lambda n: (-free[n], n)
        )
        if sum(free[n] for n in cand) < r:
            return None
        packed, spread = math.ceil(r / g), min(min_nodes, len(free))
        if min_nodes > 2 and packed < spread and r >= spread and len(cand) >= spread:
            # the `spread` emptiest nodes, least free first: each takes its even share of
            # what is left, or all it has, and the emptier ones make up the rest
            chosen = sorted(cand[:spread], key=lambda n: (free[n], n))
            alloc, left = [], r
            for i, n in enumerate(chosen):
                take = min(free[n], math.ceil(left / (spread - i)))
                alloc.extend([n] * take)
                left -= take
            if left == 0:
                return sorted(alloc)
        alloc: list[int] = []
        for n in cand:
            take = min(free[n], r - len(alloc))
            alloc.extend([n] * take)
            if len(alloc) == r:
                break
        if len(set(alloc)) > packed + 1:
            return None  # too fragmented; try a smaller size
        return sorted(alloc)
