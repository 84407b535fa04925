"""Genetic refinement of waterfill's answer: Pollux's search, our weighted-goodput objective.

The local search of :mod:`adaptrain.sched.waterfill` moves GPUs one receiver and one donor at a
time, so it stops in local optima (e.g. where swapping GPUs between three jobs, or moving a job
to other nodes to free a whole node, would pay). This module reuses the NSGA-II-style search of
:class:`~adaptrain.sched.pollux.PolluxPolicy` (crossover over jobs, mutations, repair for
capacity, replica bounds and interference avoidance, warm-started population; Qiao et al.,
OSDI'21, Sec. 4.2) on a different fitness, the weighted sum of speedups

    FITNESS(A) = sum_j w_j * s_j(A_j) * rho_j^[A_j != A_j^cur]  -  M * #{j : s_j(A_j) = 0},

with ``s_j`` the job's speedup over one GPU (not rebased), ``w_j`` waterfill's remaining-work
weight, ``rho_j = max(age - d * restarts, 0) / (age + d)`` Pollux's restart factor (at most
``1 - grow_cost`` for a running job that grows: waterfill's ``grow_payback``) and ``M`` a
large constant so that every job runs when it can. The search is seeded with waterfill's
local-search allocation; its best candidate replaces that allocation only if its fitness is
strictly higher, so the refinement never returns a worse answer (by this fitness) than the seed.

Speed: the operators are Pollux's with the same distributions, but random numbers are drawn
only where an operator acts (the rows a mutation zeroes, the cells it redraws, the rows a
repair must cut to their bounds) instead of for every (candidate, job, node) cell, and each
generation breeds 1.5 x ``pop_size`` children at once, so that the duplicates it drops rarely
call for a second batch; :class:`PolluxPolicy` itself keeps the artifact's dense draws. The
objectives are evaluated by a compiled loop (:func:`adaptrain.sched._kernels.evaluate_weighted`),
as the operators are, and the speedup table holds only the cells a search can look up
(:meth:`PolluxPolicy._table_cells`: within the nodes' capacities).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import numpy as np

from . import _kernels
from .config import ClusterSpec
from .policy_base import Allocation, JobInfo, NodeInfo, NodeKey
from .pollux import PolluxPolicy, _crowding, nondominated_ranks

logger = logging.getLogger(__name__)

__all__ = ["WeightedGeneticSearch", "check_min_nodes"]

_UNSCHEDULED_PENALTY = 10.0


def check_min_nodes(min_nodes: int) -> None:
    """Raise ``ValueError`` unless ``min_nodes`` (the node floor of a multi-node job) is an
    integer >= 2."""
    if isinstance(min_nodes, bool) or not isinstance(min_nodes, int) or min_nodes < 2:
        raise ValueError(
            f"min_nodes={min_nodes!r} must be an integer >= 2 (2: a multi-node job packed on "
            "as few nodes as hold it)"
        )


class WeightedGeneticSearch(PolluxPolicy):
    """Pollux's genetic search maximising ``sum_j w_j s_j`` (see the module docstring).

    Not a policy by itself: :meth:`refine` takes the jobs, their weights and a seed allocation.
    With more than ``max_jobs_full`` jobs it runs proportionally fewer generations; with
    ``patience`` it stops after that many generations in a row without a fitter candidate
    (the best FITNESS in the population; ``None``: every generation runs). With ``min_nodes``
    above 2 a placement on 2 .. ``min_nodes - 1`` nodes (at most the cluster's) is worth
    nothing (:class:`~adaptrain.sched.WaterfillPolicy`'s node floor).
    Its warm-start population and random generator round-trip through ``state_dict``.
    """

    name = "waterfill-genetic"
    _sparse_draws = True  # random draws only where the operators act (see PolluxPolicy)
    _offspring_factor = 1.5  # one batch of children per generation, mostly (see PolluxPolicy)

    def __init__(
        self,
        pop_size: int = 50,
        generations: int = 50,
        restart_delay: float = 30.0,
        seed: int | None = 0,
        max_jobs_full: int = 40,
        grow_cost: float = 0.0,
        patience: int | None = None,
        min_nodes: int = 2,
    ) -> None:
        check_min_nodes(min_nodes)
        self.min_nodes = min_nodes
        super().__init__(
            pop_size=pop_size,
            generations=generations,
            seed=seed,
            cluster=ClusterSpec(restart_delay=restart_delay),
        )
        if max_jobs_full < 1:
            raise ValueError(f"max_jobs_full={max_jobs_full} must be >= 1")
        if not 0.0 <= grow_cost <= 1.0:
            raise ValueError(f"grow_cost={grow_cost} must lie in [0, 1]")
        if patience is not None and patience < 1:
            raise ValueError(
                f"patience={patience} must be >= 1 generation, or None (all generations run)"
            )
        self.max_jobs_full = max_jobs_full
        self.grow_cost = grow_cost
        self.patience = patience
        self.last_generations = 0  # generations the last refine() ran
        self.last_fitness = -np.inf  # FITNESS of the allocation the last refine() returned
        self._weights = np.zeros(0)
        self._grow_costs = np.zeros(0)

    def _speedup_table(
        self, jobs: list[JobInfo], fair_nodes: int, fair_replicas: int
    ) -> np.ndarray:
        """Speedups over one GPU (not rebased to a fair share), clipped at 0, on the cells of
        :meth:`_table_cells`; 0 elsewhere and where ``r`` exceeds the job's maximum."""
        n_grid, r_grid = self._grid()
        # placements on 2 .. min_nodes - 1 nodes (at most the cluster's) are worth nothing:
        # those cells are left at 0, not computed
        floor = min(self.min_nodes, int(np.count_nonzero(self._cap > 0)))
        valid = self._cells & ~((n_grid >= 2) & (n_grid < floor))
        table = np.zeros((len(jobs), *valid.shape))
        for j, job in enumerate(jobs):
            ok = valid & (r_grid <= job.max_replicas)
            fn = job.speedup_fn
            vals = r_grid[ok] if fn is None else fn(n_grid[ok], r_grid[ok])
            table[j][ok] = np.maximum(np.asarray(vals, dtype=np.float64), 0.0)
        return table

    def _evaluate(self, states: np.ndarray, base: np.ndarray) -> np.ndarray:
        """Per candidate ``(-FITNESS, -utility)``, both minimised (compiled:
        :func:`adaptrain.sched._kernels.evaluate_weighted`). The utility is Pollux's: the
        jobs' speedups per replica weighted by their shares of the GPUs on the nodes in use."""
        return _kernels.evaluate_weighted(
            states,
            base,
            self._table,
            self._nmax,
            self._rmax,
            self._restart_factor,
            self._grow_costs,
            self._weights,
            self._cap,
            _UNSCHEDULED_PENALTY,
        )

    def _prepare(self, jobs, nodes, base_allocations, weights, grow_costs=None, other=None):
        """Order jobs and nodes, set up the speedup tables, weights and growth costs
        (``grow_costs`` per job, else ``grow_cost``); the base matrix and the matrix of the
        allocations ``other`` (a seed, evaluated as is: its cells join the speedup table)."""
        job_keys = sorted(
            jobs, key=lambda k: (jobs[k].attained_service, jobs[k].creation_timestamp, k)
        )
        node_keys = sorted(nodes)
        base = self._matrix(base_allocations, job_keys, node_keys)
        state = self._matrix(other or {}, job_keys, node_keys)
        self._setup([jobs[k] for k in job_keys], [nodes[k] for k in node_keys], base, [state])
        self._weights = np.array([float(weights[k]) for k in job_keys])
        grow_costs = grow_costs or {}
        self._grow_costs = np.array([float(grow_costs.get(k, self.grow_cost)) for k in job_keys])
        return job_keys, node_keys, base, state

    @_kernels.interruptible
    def refine(
        self,
        jobs: Mapping[str, JobInfo],
        nodes: Mapping[NodeKey, NodeInfo],
        base_allocations: Mapping[str, Sequence[NodeKey]],
        weights: Mapping[str, float],
        seed_allocations: Mapping[str, Sequence[NodeKey]],
        grow_costs: Mapping[str, float] | None = None,
    ) -> Allocation:
        """The best allocation found, or ``seed_allocations`` unless strictly improved on.

        ``grow_costs`` (``{key: share}``) replaces ``grow_cost`` for the jobs it lists. Its
        FITNESS is left in :attr:`last_fitness`.
        """
        if not jobs or sum(int(n.gpus) for n in nodes.values()) == 0:
            self.last_fitness = 0.0
            return {}
        job_keys, node_keys, base, seed = self._prepare(
            jobs, nodes, base_allocations, weights, grow_costs, seed_allocations
        )
        if self._prev_states is None:
            pop = base[None].copy()
        else:
            pop = self._adapt_prev(job_keys, node_keys)
        pop = np.concatenate([self._repair(pop), seed[None]])
        F = self._evaluate(pop, base)
        seed_fit = float(F[-1, 0])
        rank = nondominated_ranks(F)
        crowd = _crowding(F, rank)
        # work per generation grows with the number of jobs: beyond max_jobs_full jobs, run
        # proportionally fewer generations (a deterministic bound on the cost per round)
        gens = max(1, min(self.generations, self.generations * self.max_jobs_full // len(job_keys)))
        # early stop: `patience` generations in a row without a fitter candidate
        best_f, stall = float(F[:, 0].min()), 0
        for ran in range(1, gens + 1):
            pop, F, rank, crowd = self._generation(pop, F, rank, crowd, base)
            self.last_generations = ran
            if self.patience is None:
                continue
            f = float(F[:, 0].min())
            best_f, stall = (f, 0) if f < best_f else (best_f, stall + 1)
            if stall >= self.patience:
                break
        self._remember(pop, job_keys, node_keys)
        best = int(np.argmin(F[:, 0]))
        if not F[best, 0] < seed_fit - 1e-9 * max(1.0, abs(seed_fit)):
            self.last_fitness = -seed_fit
            return {k: list(v) for k, v in seed_allocations.items()}
        self.last_fitness = -float(F[best, 0])
        out = self._allocations(pop[best], job_keys, node_keys)
        return self._keep_pinned(out, job_keys, base_allocations)

    @_kernels.interruptible
    def fitness(
        self,
        jobs: Mapping[str, JobInfo],
        nodes: Mapping[NodeKey, NodeInfo],
        base_allocations: Mapping[str, Sequence[NodeKey]],
        weights: Mapping[str, float],
        allocations: Mapping[str, Sequence[NodeKey]],
        grow_costs: Mapping[str, float] | None = None,
    ) -> float:
        """FITNESS(allocations) of the module docstring (higher is better)."""
        if not jobs:
            return 0.0
        _, _, base, state = self._prepare(
            jobs, nodes, base_allocations, weights, grow_costs, allocations
        )
        return -float(self._evaluate(state[None], base)[0, 0])
