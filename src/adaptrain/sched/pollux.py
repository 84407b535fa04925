"""Pollux's cluster-wide goodput policy: a vectorised genetic search over allocations.

Qiao et al., "Pollux: Co-adaptive Cluster Scheduling for Goodput-Optimized Deep Learning",
OSDI'21, Sec. 4.2. A candidate is a (jobs x nodes) matrix ``A`` of replica counts. Its fitness is
the power mean (p = -1) of the jobs' speedups

    FITNESS_p(A) = ( 1/J * sum_j (s_j(A_j) + 1e-3)^p )^(1/p),

where ``s_j`` is job j's speedup over a fair share (one node, ``ceil(GPUs / J)`` replicas),
scaled by the job's dominant share x number of nodes (nodes with GPUs), and multiplied by the
restart penalty ``max(age - 30 * restarts, 0) / (age + 30)`` when ``A_j`` differs from the
current allocation.
As in the artifact, the search is two-objective (fitness and cluster utility) with NSGA-II
survival, single-point crossover over jobs, three mutations (reset a job to its current
allocation, zero some entries, increase some entries on nodes with free GPUs) and a repair step
keeping every non-preemptible running job's allocation (``JobInfo.preemptible``) and enforcing
interference avoidance (at most one multi-node job per node), per-job maximum
replicas, node capacity (jobs with least attained service first) and minimum replicas. The
final population warm-starts the next round. The returned allocation maximises the fitness.

A generation's operators (tournaments and crossover, the repair, the sparse mutation, the
dropping of duplicates, the non-dominated sorting, crowding distance and survival) run as
loops compiled by numba (:mod:`adaptrain.sched._kernels`), with the random numbers drawn here
from the search's generator; the candidates' evaluation and the artifact's dense mutation are
numpy code. ``tests/sched/test_policies.py`` checks the sorting and crowding against pymoo's
implementations (ranks equal; crowding equal up to pymoo's averaging over objectives).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence

import numpy as np

from . import _kernels
from ._counts import count_nodes, rows_differ, sum_jobs, sum_nodes
from .config import ClusterSpec
from .policy_base import Allocation, JobInfo, NodeInfo, NodeKey

logger = logging.getLogger(__name__)

__all__ = ["PolluxPolicy", "nondominated_ranks"]


def nondominated_ranks(F: np.ndarray) -> np.ndarray:
    """Pareto rank (0 = non-dominated) of each row of the (n, 2) array ``F`` (minimised).

    Sort by (f0, f1); each point joins the first front none of whose members dominates it. In
    that order a front's smallest f1 never exceeds the next front's, so a bisection finds it.
    """
    F = np.asarray(F, dtype=np.float64)
    if F.ndim != 2 or F.shape[1] != 2:
        raise ValueError(f"expected an (n, 2) objective array, got shape {F.shape}")
    return _kernels.nondominated_ranks(F)


def _crowding(F: np.ndarray, rank: np.ndarray) -> np.ndarray:
    """NSGA-II crowding distance within each front (boundary points: infinity; see
    :func:`adaptrain.sched._kernels.crowding`)."""
    return _kernels.crowding(np.asarray(F, dtype=np.float64), np.asarray(rank, dtype=np.int64))


_STATE_DTYPE = np.int16  # replica counts per (job, node) cell


class PolluxPolicy:
    """Genetic-algorithm Pollux policy (``pop_size`` x ``generations`` per round)."""

    name = "pollux"
    # Random draws for every cell (the artifact's operators), or only where an operator acts
    # (same distributions, a different random stream; a subclass's choice)
    _sparse_draws = False
    # Children bred per batch, over pop_size: a batch of duplicates is bred again, so a larger
    # first batch (once the population converges) saves a second round of operators
    _offspring_factor = 1.0

    def __init__(
        self,
        pop_size: int = 100,
        generations: int = 100,
        p: float = -1.0,
        interference_avoidance: bool = True,
        max_nodes_per_job: int = 16,
        seed: int | None = 0,
        cluster: ClusterSpec | None = None,
    ) -> None:
        if pop_size < 2 or generations < 1:
            raise ValueError(f"pop_size={pop_size} must be >= 2 and generations={generations} >= 1")
        self.pop_size = pop_size
        self.generations = generations
        #: the cluster's facts; the restart penalty uses its ``restart_delay``
        self.cluster = ClusterSpec() if cluster is None else cluster
        self.restart_delay = self.cluster.restart_delay
        self.p = p
        self.interference_avoidance = interference_avoidance
        self.max_nodes_per_job = max_nodes_per_job
        self.rng = np.random.default_rng(seed)
        self._prev_states: np.ndarray | None = None
        self._prev_jobs: list[str] = []
        self._prev_nodes: list[NodeKey] = []

    def state_dict(self) -> dict:
        """Warm-start population, its job/node keys and the generator state."""
        return {
            "prev_states": None if self._prev_states is None else self._prev_states.copy(),
            "prev_jobs": list(self._prev_jobs),
            "prev_nodes": list(self._prev_nodes),
            "rng": self.rng.bit_generator.state,
        }

    def load_state_dict(self, state: dict) -> None:
        prev = state["prev_states"]
        self._prev_states = None if prev is None else np.array(prev, dtype=_STATE_DTYPE)
        self._prev_jobs = list(state["prev_jobs"])
        self._prev_nodes = list(state["prev_nodes"])
        self.rng.bit_generator.state = state["rng"]

    def allocate_job(self, job: JobInfo, nodes: Mapping[NodeKey, NodeInfo]) -> list[NodeKey]:
        """AdaptDL's placement of one job arriving between rounds (``PolluxPolicy.allocate_job``
        in ``adaptdl_sched``): ``max(min_replicas, 1)`` replicas on the first node with that
        many free GPUs (``nodes[n].gpus``), non-preemptible nodes first, then by key; ``[]`` if
        none has room."""
        need = max(job.min_replicas, 1)
        for n in sorted(nodes, key=lambda n: (nodes[n].preemptible, n)):
            if int(nodes[n].gpus) >= need:
                return [n] * need
        return []

    # ---- problem setup ----------------------------------------------------------------------
    def _setup(
        self,
        jobs: list[JobInfo],
        nodes: list[NodeInfo],
        base: np.ndarray | None = None,
        extra: Sequence[np.ndarray] = (),
    ) -> None:
        """Tables for ``jobs`` on ``nodes`` (at least one GPU in all). ``base`` (jobs x nodes)
        is the current allocation: a non-preemptible job's non-empty row is pinned. ``extra``:
        other (jobs x nodes) matrices the caller evaluates without repair (a seed)."""
        J = len(jobs)
        self._cap = np.array([n.gpus for n in nodes], dtype=np.int64)
        if self._cap.max(initial=0) > np.iinfo(_STATE_DTYPE).max:
            raise ValueError(
                f"a node with {self._cap.max()} GPUs: the genetic search counts at most "
                f"{np.iinfo(_STATE_DTYPE).max} replicas per node; split it into several nodes"
            )
        total = int(self._cap.sum())
        N = int(np.count_nonzero(self._cap > 0))  # a node without GPUs counts as no node
        self._share = 1.0 / total  # dominant share of one replica (one GPU)
        fair_replicas = math.ceil(1.0 / self._share / J)
        fair_nodes = min(math.ceil(N * self._share), fair_replicas)
        self._max_rep = np.array([j.max_replicas for j in jobs], dtype=np.int64)
        self._min_rep = np.array([j.min_replicas for j in jobs], dtype=np.int64)
        if base is None:
            base = np.zeros((J, len(nodes)), dtype=_STATE_DTYPE)
        preemptible = np.array([j.preemptible for j in jobs], dtype=bool)
        self._pinned = ~preemptible & (base.sum(axis=1) > 0)  # (J,)
        self._pinned_rows = base[self._pinned].copy()
        rmax = int(min(self._max_rep.max(initial=1), total))
        nmax = min(N, self.max_nodes_per_job, rmax)
        self._nmax, self._rmax = nmax, rmax
        self._cells = self._table_cells(base, extra)
        self._table = self._speedup_table(jobs, fair_nodes, fair_replicas)
        self._scale = self._share * N
        restarts = np.array([j.num_restarts for j in jobs], dtype=np.float64)
        age = np.array([j.age for j in jobs], dtype=np.float64)
        d = self.restart_delay
        # d = 0 and age 0: a free restart (factor 1), not 0/0
        self._restart_factor = np.divide(
            np.maximum(age - restarts * d, 0.0),
            age + d,
            out=np.ones_like(age),
            where=(age + d) > 0,
        )

    def _table_cells(self, base: np.ndarray, extra: Sequence[np.ndarray] = ()) -> np.ndarray:
        """The (nodes, replicas) cells of the speedup table a search can look up, (nmax + 1,
        rmax + 1) booleans: ``1 <= n <= r`` with ``r`` at most what the ``n`` largest nodes
        hold (a repaired candidate keeps within the nodes' capacities), the row ``n = nmax``
        (where :meth:`_speedups` clips a larger count of nodes), and the cells of the rows of
        ``base`` and ``extra``, which are evaluated without repair.

        Only these cells are computed. Each one is a goodput search over tens of batch sizes
        (memoised per job model, whose gradient statistics change every epoch), and on nodes
        of 4 GPUs up to about half of the ``n <= r`` grid lies beyond capacity, never looked up. A
        speedup is computed cell by cell, so the cells looked up read as with the whole grid.
        """
        nmax, rmax = self._nmax, self._rmax
        n_grid, r_grid = self._grid()
        most = np.concatenate([[0], np.cumsum(np.sort(self._cap)[::-1])])[: nmax + 1]
        cells = (n_grid >= 1) & (n_grid <= r_grid) & ((r_grid <= most[:, None]) | (n_grid == nmax))
        for states in (base, *extra):
            states = np.asarray(states, dtype=_STATE_DTYPE)[None]
            n = np.minimum(count_nodes(states), nmax)
            r = np.minimum(sum_nodes(states), rmax)
            on = n > 0  # a job without GPUs reads the table's (0, 0), always 0
            cells[n[on], r[on]] = True
        return cells

    def _grid(self) -> tuple[np.ndarray, np.ndarray]:
        """The nodes and the replicas of each cell of a (nmax + 1, rmax + 1) speedup table."""
        return np.meshgrid(np.arange(self._nmax + 1), np.arange(self._rmax + 1), indexing="ij")

    def _speedup_table(
        self, jobs: list[JobInfo], fair_nodes: int, fair_replicas: int
    ) -> np.ndarray:
        """Speedups ``S[j, n, r]`` for ``n <= _nmax`` nodes and ``r <= _rmax`` replicas,
        rebased to the fair share (``fair_nodes``, ``fair_replicas``), on the cells of
        :meth:`_table_cells`; 0 elsewhere and where ``r`` exceeds the job's maximum."""
        n_grid, r_grid = self._grid()
        valid = self._cells
        table = np.zeros((len(jobs), *valid.shape))
        for j, job in enumerate(jobs):
            fn = job.speedup_fn
            if fn is None:
                fn_r = None
            elif hasattr(fn, "rebased"):
                fn_r = fn.rebased(fair_nodes, fair_replicas)
            else:
                fn_r = fn
            ok = valid & (r_grid <= job.max_replicas)
            if fn_r is None:
                table[j][ok] = r_grid[ok] / fair_replicas
            else:
                table[j][ok] = fn_r(n_grid[ok], r_grid[ok])
        return table

    def _speedups(self, states: np.ndarray) -> np.ndarray:
        """Each candidate's speedup per job."""
        n = np.minimum(count_nodes(states), self._nmax)
        r = np.minimum(sum_nodes(states), self._rmax)
        _, n_size, r_size = self._table.shape  # table[j, n, r], by its flat (C-order) index
        job = np.arange(states.shape[1])[None, :] * (n_size * r_size)
        return np.take(self._table, job + n * r_size + r)

    def _evaluate(self, states: np.ndarray, base: np.ndarray) -> np.ndarray:
        speedups = self._speedups(states)
        scaled = speedups * self._scale
        restart = rows_differ(states, base)
        scaled = scaled * np.where(restart, self._restart_factor[None], 1.0)
        p = self.p
        J = states.shape[1]
        if p == 0:
            mean = np.exp(np.log(np.maximum(scaled, 1e-3)).sum(axis=1) / J)
        else:
            mean = (((scaled + 1e-3) ** p).sum(axis=1) / J) ** (1.0 / p)
        return np.column_stack([-mean, -self._utilities(states, speedups)])

    def _utilities(self, states: np.ndarray, speedups: np.ndarray) -> np.ndarray:
        """Each candidate's cluster utility: the jobs' speedups per replica weighted by their
        shares of the GPUs on the nodes in use."""
        reps = sum_nodes(states)
        active = sum_jobs(states) > 0
        total = (active @ self._cap)[:, None]  # GPUs on the nodes in use
        with np.errstate(divide="ignore", invalid="ignore"):
            shares = np.where(reps > 0, reps / total, 0.0)
            util = np.where(reps > 0, speedups / reps, 0.0)
        return (util * shares).sum(axis=1)

    # ---- genetic operators ------------------------------------------------------------------
    def _mutation(self, states: np.ndarray, base: np.ndarray) -> np.ndarray:
        """Mutated copies of ``states`` (see the module docstring). With sparse draws, random
        numbers only for the rows and cells the operators act on, the rest compiled
        (:mod:`adaptrain.sched._kernels`: ``mutate_rows``, then ``mutate_cells``); else the
        artifact's dense draws (:meth:`_dense_mutation`)."""
        if not self._sparse_draws:
            return self._dense_mutation(states, base)
        P, J, N = states.shape
        # a reset draw per (candidate, job) row, then a draw picking rows to zero: one call
        draws = self.rng.random((2, P, J))
        out, picked = _kernels.mutate_rows(
            np.ascontiguousarray(states, dtype=_STATE_DTYPE),
            np.asarray(base, dtype=_STATE_DTYPE),
            draws,
        )
        # a zeroing draw per node of each picked row, then one per cell: again one call
        cells, low, high = _kernels.mutate_cells(
            out, draws[1], self.rng.random(picked * N + P * J * N), self._cap
        )
        out.reshape(-1)[cells] = self.rng.integers(low, high)
        return out

    def _dense_mutation(self, states: np.ndarray, base: np.ndarray) -> np.ndarray:
        """:meth:`_mutation` with a random draw for every row and cell, as the artifact's."""
        rng = self.rng
        P, J, N = states.shape
        reset = np.nonzero(rng.random((P, J)) < 0.1)  # rows back to the current allocation
        states = states.copy()
        states[reset] = base[reset[1]]
        prob = np.where(rng.random((P, J)) < 0.1, 0.1, 0.0)
        states[rng.random(states.shape) < prob[:, :, None]] = 0
        # A cell mutates with probability p1 + p2 - p1 p2: p1 = 1/J on a node with a free GPU
        # (any job), p2 = 1/(jobs there) for a job already on such a node. Both depend on
        # (candidate, node) only, so they are computed per node and broadcast over jobs.
        has_free = self._cap[None] - sum_jobs(states) >= 1  # (P, N)
        on_free = (states > 0) & has_free[:, None, :]  # (P, J, N)
        prob1 = has_free / max(J, 1)  # (P, N)
        prob2 = 1.0 / np.maximum(sum_jobs(on_free), 1)  # (P, N), where on_free
        both = prob1 + prob2 - prob1 * prob2
        m = rng.random(states.shape) < np.where(on_free, both[:, None, :], prob1[:, None, :])
        hi = np.broadcast_to(self._cap[None, None, :], states.shape)
        r = rng.integers(np.minimum(states, hi), hi + 1)
        return np.where(m, r, states).astype(_STATE_DTYPE)

    def _repair(self, states: np.ndarray) -> np.ndarray:
        """Candidates made feasible (see the module docstring), compiled
        (:func:`~adaptrain.sched._kernels.repair_bounds`, then
        :func:`~adaptrain.sched._kernels.repair_fill`): non-preemptible running jobs keep their
        allocation and the others yield to them; on each node only the first multi-node job
        keeps its replicas; a row over its job's replica or node bound is cut to it, keeping
        nodes in a random order; node capacity goes to jobs in job order; a job left below
        its minimum gets nothing."""
        P, J, N = states.shape
        out, rows = _kernels.repair_bounds(
            np.ascontiguousarray(states, dtype=_STATE_DTYPE),
            self._pinned,
            self._pinned_rows,
            bool(self.interference_avoidance),
            self._max_rep,
            int(self.max_nodes_per_job),
        )
        if not self._sparse_draws:  # a random order of nodes for every row (the artifact's)
            rows = np.arange(P * J, dtype=np.int64)
        draws = self.rng.random((rows.size, N))
        return _kernels.repair_fill(
            out,
            rows,
            draws,
            self._max_rep,
            int(self.max_nodes_per_job),
            self._pinned,
            self._pinned_rows,
            self._cap,
            self._min_rep,
        )

    def _keep_pinned(
        self,
        out: Allocation,
        job_keys: list[str],
        base_allocations: Mapping[str, Sequence[NodeKey]],
    ) -> Allocation:
        """``out`` with each pinned job's allocation as given (its own order of nodes: a
        reordered list would read as a restart)."""
        for j in np.flatnonzero(self._pinned):
            key = job_keys[j]
            alloc = list(base_allocations.get(key, ()))
            if sorted(alloc) == sorted(out.get(key, [])):
                out[key] = alloc
        return out

    # ---- main entry -------------------------------------------------------------------------
    @_kernels.interruptible
    def optimize(
        self,
        jobs: Mapping[str, JobInfo],
        nodes: Mapping[NodeKey, NodeInfo],
        base_allocations: Mapping[str, list[NodeKey]],
        time: float,
    ) -> Allocation:
        """One Pollux round: allocations maximising the fitness found by the genetic search."""
        if not jobs or sum(int(n.gpus) for n in nodes.values()) == 0:
            return {}
        job_keys = sorted(
            jobs,
            key=lambda k: (
                not (not jobs[k].preemptible and base_allocations.get(k)),
                jobs[k].attained_service,
                jobs[k].creation_timestamp,
            ),
        )
        node_keys = sorted(nodes, key=lambda k: (nodes[k].preemptible, k))
        base = self._matrix(base_allocations, job_keys, node_keys)
        self._setup([jobs[k] for k in job_keys], [nodes[k] for k in node_keys], base)
        if self._prev_states is None:
            pop = base[None].copy()
        else:
            pop = self._adapt_prev(job_keys, node_keys)
        pop = self._repair(pop)
        F = self._evaluate(pop, base)
        rank = nondominated_ranks(F)
        crowd = _crowding(F, rank)
        for _ in range(self.generations):
            pop, F, rank, crowd = self._generation(pop, F, rank, crowd, base)
        self._remember(pop, job_keys, node_keys)
        front = np.flatnonzero(nondominated_ranks(F) == 0)
        best = front[np.argmin(F[front, 0])]
        out = self._allocations(pop[best], job_keys, node_keys)
        return self._keep_pinned(out, job_keys, base_allocations)

    def _remember(self, pop: np.ndarray, job_keys: list[str], node_keys: list[NodeKey]) -> None:
        """Keep the final population as the next round's warm start."""
        self._prev_states = pop.copy()
        self._prev_jobs = list(job_keys)
        self._prev_nodes = list(node_keys)

    @staticmethod
    def _matrix(
        allocations: Mapping[str, Sequence[NodeKey]], job_keys: list[str], node_keys: list[NodeKey]
    ) -> np.ndarray:
        """Allocations as a jobs x nodes matrix of replica counts (unknown keys ignored)."""
        jidx = {k: i for i, k in enumerate(job_keys)}
        nidx = {k: i for i, k in enumerate(node_keys)}
        out = np.zeros((len(job_keys), len(node_keys)), dtype=_STATE_DTYPE)
        for key, alloc in allocations.items():
            if key in jidx:
                for node in alloc:
                    if node in nidx:
                        out[jidx[key], nidx[node]] += 1
        return out

    @staticmethod
    def _allocations(
        state: np.ndarray, job_keys: list[str], node_keys: list[NodeKey]
    ) -> Allocation:
        """A jobs x nodes matrix of replica counts as allocations (node keys in order)."""
        out: Allocation = {}
        for j, key in enumerate(job_keys):
            alloc: list[NodeKey] = []
            for n, node in enumerate(node_keys):
                alloc.extend([node] * int(state[j, n]))
            out[key] = alloc
        return out

    def _generation(self, pop, F, rank, crowd, base: np.ndarray):
        """One NSGA-II generation: children bred by tournaments, crossover, mutation and repair
        (duplicates of the population dropped, up to five batches), then the fittest
        ``pop_size`` of parents and children by (rank, -crowding)."""
        rng = self.rng
        n_mate = max(1, int(self.pop_size * self._offspring_factor) // 2)
        P, J = len(pop), pop.shape[1]
        off = pop[:0]
        for _ in range(5):  # refill if duplicates were dropped
            # two tournaments, then the crossover's draws
            a1, b1 = rng.integers(P, size=n_mate), rng.integers(P, size=n_mate)
            a2, b2 = rng.integers(P, size=n_mate), rng.integers(P, size=n_mate)
            points, coin = rng.integers(J, size=(n_mate, 1)), rng.random((n_mate, 1))
            new = _kernels.breed(pop, rank, crowd, a1, b1, a2, b2, points, coin)
            new = self._repair(self._mutation(new, base))
            new = new[_kernels.fresh_rows(pop, off, new)]  # no duplicates of pop, off or new
            off = np.concatenate([off, new])
            if len(off) >= self.pop_size:
                break
        off = off[: self.pop_size]
        if len(off) == 0:
            return pop, F, rank, crowd
        F_off = self._evaluate(off, base)
        # the survivors keep their ranks: every front but the last is taken whole, and a
        # point's dominators lie in earlier fronts (so recomputing them gives the same)
        return _kernels.survive(pop, off, F, F_off, self.pop_size)

    def _adapt_prev(self, job_keys: list[str], node_keys: list[NodeKey]) -> np.ndarray:
        prev = self._prev_states
        states = np.zeros((len(prev), len(job_keys), len(node_keys)), dtype=_STATE_DTYPE)
        prev_j = {k: i for i, k in enumerate(self._prev_jobs)}
        prev_n = {k: i for i, k in enumerate(self._prev_nodes)}
        dst = [i for i, k in enumerate(job_keys) if k in prev_j]
        src = [prev_j[job_keys[i]] for i in dst]
        for n, key in enumerate(node_keys):
            if key in prev_n:
                states[:, dst, n] = prev[:, src, prev_n[key]]
        return states
