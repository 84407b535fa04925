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

The NSGA-II machinery (non-dominated sorting, crowding distance) is vectorised numpy over the
whole population, as the issue allows; ``tests/sched/test_policies.py`` checks both against
pymoo's implementations (ranks equal; crowding equal up to pymoo's averaging over objectives).
With numba installed, a generation (tournaments and crossover, the repair, the sparse mutation,
the dropping of duplicates, the non-dominated sorting, crowding distance and survival, and the
weighted search's evaluation) runs as compiled loops with the same results and random draws
(:mod:`adaptrain.sched._kernels`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence

import numpy as np

from . import _kernels
from ._counts import count_nodes, cumsum_jobs, cumsum_row, rows_differ, sum_jobs, sum_nodes
from .policy_base import Allocation, JobInfo, NodeInfo

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
    if _kernels.AVAILABLE:  # compiled (adaptrain.sched._kernels): the same ranks
        return _kernels.nondominated_ranks(F)
    return _nondominated_ranks_numpy(F)


def _nondominated_ranks_numpy(F: np.ndarray) -> np.ndarray:
    """:func:`nondominated_ranks` in numpy and Python."""
    import bisect

    order = np.lexsort((F[:, 1], F[:, 0]))
    rank = np.empty(len(F), dtype=np.int64)
    mins: list[float] = []  # smallest f1 of each front
    f0_at_min: list[float] = []  # smallest f0 among that front's members attaining it
    col0, col1 = F[:, 0].tolist(), F[:, 1].tolist()  # Python floats: faster to compare
    for i in order.tolist():
        f0, f1 = col0[i], col1[i]
        k = bisect.bisect_left(mins, f1)
        while k < len(mins) and mins[k] == f1 and f0_at_min[k] < f0:
            k += 1
        if k == len(mins):
            mins.append(f1)
            f0_at_min.append(f0)
        elif f1 < mins[k]:
            mins[k] = f1
            f0_at_min[k] = f0
        rank[i] = k
    return rank


def _crowding(F: np.ndarray, rank: np.ndarray) -> np.ndarray:
    """NSGA-II crowding distance within each front (boundary points: infinity); compiled
    where numba is installed (:mod:`adaptrain.sched._kernels`, the same values)."""
    if _kernels.AVAILABLE:
        return _kernels.crowding(np.asarray(F, dtype=np.float64), np.asarray(rank, dtype=np.int64))
    return _crowding_numpy(F, rank)


def _crowding_numpy(F: np.ndarray, rank: np.ndarray) -> np.ndarray:
    """:func:`_crowding` in numpy."""
    n = len(F)
    dist = np.zeros(n)
    if n == 0:
        return dist
    # sorted by rank first, the fronts occupy the same positions for every objective
    r = np.sort(rank)
    lo = np.ones(n, dtype=bool)
    hi = np.ones(n, dtype=bool)
    lo[1:] = r[1:] != r[:-1]  # first of its front
    hi[:-1] = r[:-1] != r[1:]  # last of its front
    first, last = np.flatnonzero(lo), np.flatnonzero(hi)
    edge = lo | hi
    idx = np.flatnonzero(~edge)  # inner points
    front = (np.cumsum(lo) - 1)[idx]
    with np.errstate(divide="ignore", invalid="ignore"):
        for m in range(F.shape[1]):
            order = np.lexsort((F[:, m], rank))
            f = F[order, m]
            span = (f[last] - f[first])[front]  # sorted within each front: max - min
            d = np.empty(n)
            d[idx] = np.where(span > 0, (f[idx + 1] - f[idx - 1]) / span, 0.0)
            d[edge] = np.inf
            dist[order] += d
    return dist


def _breed_numpy(pop, rank, crowd, a1, b1, a2, b2, points, coin) -> np.ndarray:
    """:func:`adaptrain.sched._kernels.breed` in numpy: binary tournaments (``b`` wins on a
    lower rank, or on the same rank with a larger crowding distance), then a one-point
    crossover over jobs where ``coin < 0.9``; the first children, then the second."""

    def winners(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        better_b = (rank[b] < rank[a]) | ((rank[b] == rank[a]) & (crowd[b] > crowd[a]))
        return np.where(better_b, b, a)

    x, y = pop[winners(a1, b1)], pop[winners(a2, b2)]
    mask = ((np.arange(pop.shape[1])[None, :] < points) & (coin < 0.9))[:, :, None]
    return np.concatenate([np.where(mask, y, x), np.where(mask, x, y)])


_STATE_DTYPE = np.int16  # replica counts per (job, node) cell


def _fill_in_order(states: np.ndarray, cap: np.ndarray) -> np.ndarray:
    """Per (candidate, node), the replicas of ``states`` (candidates x jobs x nodes) kept in
    job order until the node's ``cap`` is reached (running sums in int32)."""
    st = cumsum_jobs(states)
    np.minimum(st, cap.astype(np.int32)[None, None, :], out=st)
    out = np.empty(st.shape, dtype=_STATE_DTYPE)
    out[:, :1] = st[:, :1]
    np.subtract(st[:, 1:], st[:, :-1], out=out[:, 1:], casting="unsafe")
    return out


def _row_bytes(states: np.ndarray) -> list[bytes]:
    """Each candidate's bytes (``row.tobytes()`` per row, in one call)."""
    flat = np.ascontiguousarray(states.reshape(len(states), math.prod(states.shape[1:])))
    return flat.view(np.dtype((np.void, flat.shape[1] * flat.itemsize))).ravel().tolist()


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
        restart_delay: float = 30.0,
        p: float = -1.0,
        interference_avoidance: bool = True,
        max_nodes_per_job: int = 16,
        seed: int | None = 0,
    ) -> None:
        if pop_size < 2 or generations < 1:
            raise ValueError(f"pop_size={pop_size} must be >= 2 and generations={generations} >= 1")
        self.pop_size = pop_size
        self.generations = generations
        self.restart_delay = restart_delay
        self.p = p
        self.interference_avoidance = interference_avoidance
        self.max_nodes_per_job = max_nodes_per_job
        self.rng = np.random.default_rng(seed)
        self._prev_states: np.ndarray | None = None
        self._prev_jobs: list[str] = []
        self._prev_nodes: list[int] = []

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

    def allocate_job(self, job: JobInfo, nodes: Mapping[int, NodeInfo]) -> list[int]:
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

    def _speedups(self, states: np.ndarray, reps: np.ndarray | None = None) -> np.ndarray:
        """Each candidate's speedup per job; ``reps`` = ``states.sum(axis=2)`` if the caller
        has it already."""
        n = np.minimum(count_nodes(states), self._nmax)
        r = np.minimum(sum_nodes(states) if reps is None else reps, self._rmax)
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

    def _utilities(
        self, states: np.ndarray, speedups: np.ndarray, reps: np.ndarray | None = None
    ) -> np.ndarray:
        reps = sum_nodes(states) if reps is None else reps
        active = sum_jobs(states) > 0
        total = (active @ self._cap)[:, None]  # GPUs on the nodes in use
        with np.errstate(divide="ignore", invalid="ignore"):
            shares = np.where(reps > 0, reps / total, 0.0)
            util = np.where(reps > 0, speedups / reps, 0.0)
        return (util * shares).sum(axis=1)

    # ---- genetic operators ------------------------------------------------------------------
    def _mutation(self, states: np.ndarray, base: np.ndarray) -> np.ndarray:
        """Mutated copies of ``states`` (see the module docstring); the sparse draws compiled
        where numba is installed (:mod:`adaptrain.sched._kernels`: the same values and
        random draws, merged into fewer calls of the generator)."""
        if not (_kernels.AVAILABLE and self._sparse_draws):
            return self._mutation_numpy(states, base)
        P, J, N = states.shape
        # the reset and the pick draws of the numpy code, one after the other in one call
        draws = self.rng.random((2, P, J))
        out, picked = _kernels.mutate_rows(
            np.ascontiguousarray(states, dtype=_STATE_DTYPE),
            np.asarray(base, dtype=_STATE_DTYPE),
            draws,
        )
        # the picked rows' zeroing draws, then one per cell: again one call
        cells, low, high = _kernels.mutate_cells(
            out, draws[1], self.rng.random(picked * N + P * J * N), self._cap
        )
        out.reshape(-1)[cells] = self.rng.integers(low, high)
        return out

    def _mutation_numpy(self, states: np.ndarray, base: np.ndarray) -> np.ndarray:
        """:meth:`_mutation` in numpy."""
        rng = self.rng
        P, J, N = states.shape
        reset = np.nonzero(rng.random((P, J)) < 0.1)  # rows back to the current allocation
        states = states.copy()
        states[reset] = base[reset[1]]
        if self._sparse_draws:  # draw only for the rows picked (the same distribution)
            picked = np.nonzero(rng.random((P, J)) < 0.1)
            zero = rng.random((picked[0].size, N)) < 0.1
            rows = states[picked]
            rows[zero] = 0
            states[picked] = rows
        else:
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
        if self._sparse_draws:  # a new count only for the cells mutated
            out = states.astype(_STATE_DTYPE)
            cells = np.flatnonzero(m)  # C order, as boolean indexing
            hi = self._cap[cells % N]
            out.reshape(-1)[cells] = rng.integers(np.minimum(states.reshape(-1)[cells], hi), hi + 1)
            return out
        hi = np.broadcast_to(self._cap[None, None, :], states.shape)
        r = rng.integers(np.minimum(states, hi), hi + 1)
        return np.where(m, r, states).astype(_STATE_DTYPE)

    def _repair(self, states: np.ndarray) -> np.ndarray:
        """Candidates made feasible (see the module docstring); compiled where numba is
        installed (:mod:`adaptrain.sched._kernels`: the same values and random draws)."""
        if not _kernels.AVAILABLE:
            return self._repair_numpy(states)
        P, J, N = states.shape
        out, rows = _kernels.repair_bounds(
            np.ascontiguousarray(states, dtype=_STATE_DTYPE),
            self._pinned,
            self._pinned_rows,
            bool(self.interference_avoidance),
            self._max_rep,
            int(self.max_nodes_per_job),
        )
        if not self._sparse_draws:  # a random order of nodes for every row, as below
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

    def _repair_numpy(self, states: np.ndarray) -> np.ndarray:
        """:meth:`_repair` in numpy."""
        states = states.copy()
        # non-preemptible running jobs keep their exact allocation, whatever the operators did;
        # the other jobs yield to them (capacity first, nodes of a pinned multi-node job)
        pinned, free = self._pinned, ~self._pinned
        any_pinned = bool(pinned.any())
        states[:, pinned] = self._pinned_rows[None]
        # interference avoidance: on each node only the first multi-node job (in job order,
        # by running counts over jobs) keeps its replicas
        if self.interference_avoidance:
            distributed = count_nodes(states) > 1
            mask = (states > 0) & distributed[:, :, None]
            if any_pinned:
                taken = mask[:, pinned].any(axis=1)  # (P, N): nodes of pinned multi-node jobs
                mask &= free[None, :, None]
                drop = (cumsum_jobs(mask) > 1) | (mask & taken[:, None, :])
                drop[:, pinned] = False
            else:
                drop = cumsum_jobs(mask) > 1
            states[drop] = 0
        # Max replicas per job and max nodes per job, filling nodes in a random order.
        P, J, N = states.shape
        flat = states.reshape(-1, N)  # a view: rows are (candidate, job) pairs
        if self._sparse_draws:  # only the rows over a bound (the others are unchanged)
            over = (sum_nodes(states) > self._max_rep[None]).reshape(-1) | (
                count_nodes(states).reshape(-1) > self.max_nodes_per_job
            )
            rows = np.flatnonzero(over)
            if rows.size:
                flat[rows] = self._cap_rows(flat[rows], self._max_rep[rows % J])
        else:
            flat[:] = self._cap_rows(flat, np.tile(self._max_rep, P))
        # Node capacity: pinned jobs keep theirs, then jobs earlier in priority order.
        if any_pinned:
            states[:, pinned] = self._pinned_rows[None]
            left = np.maximum(self._cap - self._pinned_rows.sum(axis=0), 0)
            states[:, free] = _fill_in_order(states[:, free], left)
        else:  # no copy of the (all free) jobs' rows
            states = _fill_in_order(states, self._cap)
        below = (sum_nodes(states) < self._min_rep[None, :]) & free[None, :]
        states[below] = 0
        return states.astype(_STATE_DTYPE, copy=False)

    def _cap_rows(self, rows: np.ndarray, max_rep: np.ndarray) -> np.ndarray:
        """Each row (replicas per node) cut to ``max_rep`` replicas and ``max_nodes_per_job``
        nodes, keeping nodes in a random order."""
        shuffle = np.argsort(self.rng.random(rows.shape), axis=1)
        st = np.take_along_axis(rows, shuffle, axis=1)
        st = np.diff(np.minimum(cumsum_row(st), max_rep[:, None]), axis=1, prepend=0)
        keep = np.diff(np.minimum(cumsum_row(st > 0), self.max_nodes_per_job), axis=1, prepend=0)
        st[keep == 0] = 0
        return np.take_along_axis(st, np.argsort(shuffle, axis=1), axis=1)

    def _keep_pinned(
        self, out: Allocation, job_keys: list[str], base_allocations: Mapping[str, Sequence[int]]
    ) -> Allocation:
        """``out`` with each pinned job's allocation as given (its own order of nodes: a
        reordered list would read as a restart)."""
        for j in np.flatnonzero(self._pinned):
            key = job_keys[j]
            alloc = list(base_allocations.get(key, ()))
            if sorted(alloc) == sorted(out.get(key, [])):
                out[key] = alloc
        return out

    @staticmethod
    def _dedupe(pop: np.ndarray, off: np.ndarray) -> np.ndarray:
        flat_pop = set(_row_bytes(pop))
        keep, seen = [], set()
        for i, key in enumerate(_row_bytes(off)):
            if key in flat_pop or key in seen:
                continue
            seen.add(key)
            keep.append(i)
        return off[keep]

    # ---- main entry -------------------------------------------------------------------------
    @_kernels.interruptible
    def optimize(
        self,
        jobs: Mapping[str, JobInfo],
        nodes: Mapping[int, NodeInfo],
        base_allocations: Mapping[str, list[int]],
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

    def _remember(self, pop: np.ndarray, job_keys: list[str], node_keys: list[int]) -> None:
        """Keep the final population as the next round's warm start."""
        self._prev_states = pop.copy()
        self._prev_jobs = list(job_keys)
        self._prev_nodes = list(node_keys)

    @staticmethod
    def _matrix(
        allocations: Mapping[str, Sequence[int]], job_keys: list[str], node_keys: list[int]
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
    def _allocations(state: np.ndarray, job_keys: list[str], node_keys: list[int]) -> Allocation:
        """A jobs x nodes matrix of replica counts as allocations (node keys in order)."""
        out: Allocation = {}
        for j, key in enumerate(job_keys):
            alloc: list[int] = []
            for n, node in enumerate(node_keys):
                alloc.extend([node] * int(state[j, n]))
            out[key] = alloc
        return out

    def _generation(self, pop, F, rank, crowd, base: np.ndarray):
        """One NSGA-II generation: children bred by tournaments, crossover, mutation and repair
        (duplicates of the population dropped, up to five batches), then the fittest
        ``pop_size`` of parents and children by (rank, -crowding). Compiled where numba is
        installed (:mod:`adaptrain.sched._kernels`: the same draws in the same order, the same
        population); numpy otherwise."""
        rng = self.rng
        compiled = _kernels.AVAILABLE
        breed = _kernels.breed if compiled else _breed_numpy
        n_mate = max(1, int(self.pop_size * self._offspring_factor) // 2)
        P, J = len(pop), pop.shape[1]
        off = pop[:0]
        for _ in range(5):  # refill if duplicates were dropped
            # two tournaments, then the crossover's draws
            a1, b1 = rng.integers(P, size=n_mate), rng.integers(P, size=n_mate)
            a2, b2 = rng.integers(P, size=n_mate), rng.integers(P, size=n_mate)
            points, coin = rng.integers(J, size=(n_mate, 1)), rng.random((n_mate, 1))
            new = breed(pop, rank, crowd, a1, b1, a2, b2, points, coin)
            new = self._repair(self._mutation(new, base))
            if compiled:
                new = new[_kernels.fresh_rows(pop, off, new)]
            else:
                new = self._dedupe(np.concatenate([pop, off]), new)
            off = np.concatenate([off, new])
            if len(off) >= self.pop_size:
                break
        off = off[: self.pop_size]
        if len(off) == 0:
            return pop, F, rank, crowd
        F_off = self._evaluate(off, base)
        if compiled:
            return _kernels.survive(pop, off, F, F_off, self.pop_size)
        merged = np.concatenate([pop, off])
        Fm = np.concatenate([F, F_off])
        rank = nondominated_ranks(Fm)
        crowd = _crowding(Fm, rank)
        order = np.lexsort((-crowd, rank))[: self.pop_size]
        pop, F = merged[order], Fm[order]
        # the survivors keep their ranks: every front but the last is taken whole, and a
        # point's dominators lie in earlier fronts (so recomputing them gives the same)
        rank = rank[order]
        return pop, F, rank, _crowding(F, rank)

    def _adapt_prev(self, job_keys: list[str], node_keys: list[int]) -> np.ndarray:
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
