"""The genetic searches' operators (``adaptrain.sched._kernels``) against independent
references on small random inputs: pymoo's NSGA-II non-dominated sorting and a brute-force
one, numpy's summation, and short pure-Python versions of the crowding distance, the weighted
evaluation, the repair, the sparse mutation, the tournaments and crossover, the dropping of
duplicates and the survival step. Where an operator uses random numbers, the reference draws
them from a copy of the search's generator, and both generators end in the same state."""

from __future__ import annotations

import math
import os
import signal
import threading

import numpy as np
import pytest
from _sched_cases import concave

from adaptrain.sched import JobInfo, NodeInfo, PolluxPolicy, _kernels
from adaptrain.sched._plan import _UNSCHEDULED_PENALTY, WeightedGeneticSearch
from adaptrain.sched.pollux import _crowding, nondominated_ranks


def _bits(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float64).reshape(-1).view(np.int64)


def _copy_rng(rng: np.random.Generator) -> np.random.Generator:
    out = np.random.default_rng()
    out.bit_generator.state = rng.bit_generator.state
    return out


def _cluster(rng: np.random.Generator, jobs_n: int):
    """Six nodes of 1-5 GPUs and ``jobs_n`` jobs (random replica bounds, ages, restarts, some
    non-preemptible) with a current allocation within capacity: ``(jobs, nodes, base)``."""
    nodes = {i: NodeInfo(int(c)) for i, c in enumerate(rng.integers(1, 6, size=6))}
    jobs, base = {}, {}
    free = {i: n.gpus for i, n in nodes.items()}
    for j in range(jobs_n):
        max_r = int(rng.integers(1, 20))
        key = f"j{j}"
        jobs[key] = JobInfo(
            creation_timestamp=float(j),
            attained_service=float(rng.uniform(0, 1e4)),
            min_replicas=int(rng.integers(0, min(max_r, 3) + 1)),
            max_replicas=max_r,
            speedup_fn=concave(float(rng.uniform(0.3, 1.0))),
            preemptible=bool(rng.random() < 0.8),
            num_restarts=int(rng.integers(0, 4)),
            age=float(rng.uniform(0, 1e4)),
        )
        alloc = []
        for n in rng.permutation(list(nodes)):
            take = min(free[int(n)], int(rng.integers(0, 4)), max_r - len(alloc))
            alloc += [int(n)] * take
            free[int(n)] -= take
        if alloc and len(alloc) >= jobs[key].min_replicas:
            base[key] = alloc
    return jobs, nodes, base


def _objectives(rng: np.random.Generator, n: int, m: int = 2) -> np.ndarray:
    """``n`` points of ``m`` objectives with few distinct values: ties within and across
    fronts, sometimes negative."""
    levels = int(rng.integers(1, 12))
    F = rng.integers(0, levels, size=(n, m)) * rng.choice([1.0, 0.37])
    F = F + rng.choice([0.0, 1e-3]) * rng.random((n, m))
    return -F if rng.random() < 0.3 else F


def _peeled_ranks(F: np.ndarray) -> np.ndarray:
    """Non-dominated fronts by brute force: the points no remaining point dominates, peeled
    off one front at a time."""
    dominates = np.all(F[:, None] <= F[None], axis=2) & np.any(F[:, None] < F[None], axis=2)
    rank = np.full(len(F), -1)
    left, k = np.ones(len(F), dtype=bool), 0
    while left.any():
        front = left & ~dominates[left].any(axis=0)
        rank[front] = k
        left &= ~front
        k += 1
    return rank


def _reference_crowding(F: np.ndarray, rank: np.ndarray) -> np.ndarray:
    """Per front and objective, in a stable sort by value: the two ends infinite, each inner
    point ``(next - previous) / (max - min)`` (0 on a flat front); summed over objectives."""
    dist = np.zeros(len(F))
    for k in np.unique(rank):
        members = np.flatnonzero(rank == k)
        for m in range(F.shape[1]):
            idx = members[np.argsort(F[members, m], kind="stable")]
            f = F[idx, m]
            span = f[-1] - f[0]
            for i, j in enumerate(idx):
                if i == 0 or i == len(idx) - 1:
                    dist[j] += np.inf
                else:
                    dist[j] += (f[i + 1] - f[i - 1]) / span if span > 0 else 0.0
    return dist


def test_row_sum_adds_in_numpys_pairwise_order():
    """Every length up to 700 (blocks of 8, of 128, and halves of longer rows), values of
    mixed sign over 16 orders of magnitude, so another order of additions would show."""
    rng = np.random.default_rng(0)
    differ = 0
    for n in range(701):
        for _ in range(3):
            x = rng.standard_normal(n) * 10.0 ** rng.integers(-8, 8, size=n)
            differ += bool((_bits(_kernels._row_sum(x)) != _bits(x.sum())).any())
    assert differ == 0
    # a plain running sum differs from numpy's on such rows: the check above has teeth
    x = rng.standard_normal(300) * 10.0 ** rng.integers(-8, 8, size=300)
    running = 0.0
    for v in x:
        running += v
    assert running != x.sum()


def test_ranks_match_pymoo_and_brute_force_on_ties_and_fronts():
    from pymoo.util.nds.non_dominated_sorting import NonDominatedSorting

    rng = np.random.default_rng(1)
    for trial in range(300):
        F = _objectives(rng, int(rng.integers(1, 50)))
        rank = nondominated_ranks(F)
        assert rank.dtype == np.int64
        np.testing.assert_array_equal(rank, _peeled_ranks(F), err_msg=f"trial {trial}")
        expected = np.empty(len(F), dtype=np.int64)
        for k, front in enumerate(NonDominatedSorting().do(F)):
            expected[front] = k
        np.testing.assert_array_equal(rank, expected, err_msg=f"trial {trial}")
    assert nondominated_ranks(np.zeros((0, 2))).shape == (0,)
    with pytest.raises(ValueError, match=r"\(n, 2\)"):
        nondominated_ranks(np.zeros((3, 3)))


def test_crowding_matches_a_per_front_reference():
    """Pareto fronts and arbitrary front labels, two and three objectives, ties and flat
    fronts: the same distances to the last bit."""
    rng = np.random.default_rng(2)
    for trial in range(300):
        n, m = int(rng.integers(0, 60)), int(rng.choice([2, 3]))
        F = _objectives(rng, n, m)
        if m == 2 and rng.random() < 0.5:
            rank = _peeled_ranks(F)
        else:
            rank = rng.integers(0, int(rng.integers(1, 6)), size=n)
        got = _crowding(F, rank)
        np.testing.assert_array_equal(
            _bits(got), _bits(_reference_crowding(F, rank)), err_msg=f"trial {trial}"
        )


def _reference_objectives(search: WeightedGeneticSearch, states, base) -> np.ndarray:
    """``(-FITNESS, -utility)`` per candidate from the formula of :mod:`adaptrain.sched._plan`,
    one job at a time (speedups read from the search's table)."""
    P, J, N = states.shape
    had = base.astype(np.int64).sum(axis=1)
    out = np.empty((P, 2))
    for p in range(P):
        total = sum(int(search._cap[k]) for k in range(N) if states[p, :, k].sum() > 0)
        terms, utils, unscheduled = [], [], 0
        for j in range(J):
            row = states[p, j].astype(np.int64)
            r, n = int(row.sum()), int(np.count_nonzero(row))
            s = search._table[j, min(n, search._nmax), min(r, search._rmax)]
            unscheduled += s <= 0
            rho = search._restart_factor[j]
            if r > had[j] > 0:  # a running job that grows
                rho = min(rho, 1.0 - search._grow_costs[j])
            changed = bool((row != base[j]).any())
            terms.append(s * (rho if changed else 1.0) * search._weights[j])
            utils.append(s / r * (r / total) if r > 0 else 0.0)
        out[p] = -(math.fsum(terms) - _UNSCHEDULED_PENALTY * unscheduled), -math.fsum(utils)
    return out


@pytest.mark.parametrize("grow", ["none", "uniform", "per-job"])
def test_evaluation_matches_the_fitness_formula(grow):
    """Random candidates (within and beyond capacity, rows equal to the current allocation,
    empty rows) on random clusters, with and without growth costs."""
    rng = np.random.default_rng(3)
    for trial in range(25):
        jobs, nodes, base = _cluster(rng, int(rng.integers(1, 30)))
        search = WeightedGeneticSearch(grow_cost=0.2 if grow == "uniform" else 0.0)
        weights = {k: float(rng.uniform(0.1, 2.0)) for k in jobs}
        costs = {k: float(rng.uniform(0, 0.5)) for k in jobs} if grow == "per-job" else None
        _, _, base_m, _ = search._prepare(jobs, nodes, base, weights, costs)
        P, (J, N) = int(rng.integers(1, 40)), base_m.shape
        states = rng.integers(0, 4, size=(P, J, N)).astype(base_m.dtype)
        states[rng.random((P, J)) < 0.3] = 0
        keep = rng.random((P, J)) < 0.4
        states[keep] = np.broadcast_to(base_m, (P, J, N))[keep]
        got = search._evaluate(states, base_m)
        want = _reference_objectives(search, states, base_m)
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, err_msg=f"trial {trial}")


def _reference_repair(search: PolluxPolicy, states: np.ndarray, rng: np.random.Generator):
    """The repair of :class:`PolluxPolicy`'s docstring, cell by cell, its random orders of
    nodes drawn from ``rng``."""
    out = states.astype(np.int64).copy()
    P, J, N = out.shape
    pinned, rows = search._pinned, search._pinned_rows.astype(np.int64)
    max_rep, max_nodes = search._max_rep, search.max_nodes_per_job
    for p in range(P):
        out[p, pinned] = rows
        if not search.interference_avoidance:
            continue
        multi = [np.count_nonzero(out[p, j]) > 1 for j in range(J)]
        for k in range(N):
            taken = any(multi[j] and out[p, j, k] > 0 for j in np.flatnonzero(pinned))
            seen = 0  # the artifact's rule: from a node's second multi-node job on, every
            for j in range(J):  # later job loses its replicas there, multi-node or not
                if pinned[j]:
                    continue
                here = multi[j] and out[p, j, k] > 0
                seen += here
                if seen > 1 or (here and taken):
                    out[p, j, k] = 0
    cut = [
        (p, j)
        for p in range(P)
        for j in range(J)
        if not search._sparse_draws
        or out[p, j].sum() > max_rep[j]
        or np.count_nonzero(out[p, j]) > max_nodes
    ]
    for (p, j), draws in zip(cut, rng.random((len(cut), N))):
        kept, kept_nodes, row = 0, 0, np.zeros(N, dtype=np.int64)
        for k in np.argsort(draws, kind="stable"):  # nodes in a random order
            c = min(out[p, j, k], max_rep[j] - kept)
            if c > 0 and kept_nodes < max_nodes:
                row[k], kept, kept_nodes = c, kept + c, kept_nodes + 1
        out[p, j] = row
    left = np.maximum(search._cap - rows.sum(axis=0), 0)  # what the pinned jobs leave
    for p in range(P):
        out[p, pinned] = rows
        used = np.zeros(N, dtype=np.int64)
        for j in np.flatnonzero(~pinned):  # capacity in job order
            for k in range(N):
                out[p, j, k] = min(out[p, j, k], max(left[k] - used[k], 0))
                used[k] += out[p, j, k]
            if out[p, j].sum() < search._min_rep[j]:  # its GPUs stay taken
                out[p, j] = 0
    return out


@pytest.mark.parametrize("cls", [WeightedGeneticSearch, PolluxPolicy])
def test_repair_matches_a_reference(cls):
    """Random candidates (beyond capacity, over the replica and node bounds, several
    multi-node jobs per node) on random clusters with pinned jobs, with sparse draws (the
    weighted search: a random order of nodes only for the rows over a bound) and a draw for
    every row (our Pollux); the result meets every bound."""
    rng = np.random.default_rng(4)
    for trial in range(40):
        jobs, nodes, base = _cluster(rng, int(rng.integers(1, 20)))
        search = cls(seed=trial)
        search.max_nodes_per_job = int(rng.integers(1, 7))
        search.interference_avoidance = bool(rng.random() < 0.8)
        keys, node_keys = sorted(jobs), sorted(nodes)
        base_m = search._matrix(base, keys, node_keys)
        search._setup([jobs[k] for k in keys], [nodes[k] for k in node_keys], base_m)
        P, (J, N) = int(rng.integers(1, 30)), base_m.shape
        states = rng.integers(0, 6, size=(P, J, N)).astype(base_m.dtype)
        states[rng.random((P, J, N)) < 0.5] = 0
        ref_rng = _copy_rng(search.rng)
        got = search._repair(states)
        assert got.dtype == np.int16
        np.testing.assert_array_equal(
            got, _reference_repair(search, states, ref_rng), err_msg=f"trial {trial}"
        )
        assert search.rng.bit_generator.state == ref_rng.bit_generator.state, f"trial {trial}"
        free = ~search._pinned
        for p in range(P):
            np.testing.assert_array_equal(got[p, search._pinned], search._pinned_rows)
        assert np.all(got.sum(axis=1) <= search._cap[None])
        assert np.all(got[:, free] <= states[:, free])
        reps, spread = got.sum(axis=2)[:, free], np.count_nonzero(got, axis=2)[:, free]
        assert np.all(reps <= search._max_rep[free]) and np.all(spread <= search.max_nodes_per_job)
        assert np.all((reps == 0) | (reps >= search._min_rep[free]))
        if search.interference_avoidance:  # a preemptible multi-node job alone on its nodes
            multi = (np.count_nonzero(got, axis=2) > 1)[:, :, None] & (got > 0)
            shared = multi.sum(axis=1) > 1  # (candidate, node)
            assert not np.any(multi[:, free] & shared[:, None, :])


def _reference_sparse_mutation(search, states, base, rng) -> np.ndarray:
    """The sparse mutation, cell by cell: rows reset to the current allocation (draw < 0.1),
    rows picked (draw < 0.1) with their cells zeroed (draw < 0.1), then each cell redrawn
    with probability ``p1 + p2 - p1 p2`` (a job on a node with a free GPU) or ``p1`` (any
    other job; ``p1 = 1 / jobs`` on a node with a free GPU, else 0; ``p2 = 1 / jobs there``),
    uniformly between its count (at most the node's GPUs) and the node's GPUs."""
    P, J, N = states.shape
    cap = search._cap
    out = states.astype(np.int64).copy()
    rows = rng.random((2, P, J))
    for p in range(P):
        for j in range(J):
            if rows[0, p, j] < 0.1:
                out[p, j] = base[j]
    picked = [(p, j) for p in range(P) for j in range(J) if rows[1, p, j] < 0.1]
    cells = rng.random(len(picked) * N + P * J * N)
    for i, (p, j) in enumerate(picked):
        for k in range(N):
            if cells[i * N + k] < 0.1:
                out[p, j, k] = 0
    at, mutating = len(picked) * N, []
    for p in range(P):
        for k in range(N):
            free = cap[k] - out[p, :, k].sum() >= 1
            p1 = (1.0 if free else 0.0) / max(J, 1)
            p2 = 1.0 / max(int(np.count_nonzero(out[p, :, k])), 1)
            for j in range(J):
                prob = p1 + p2 - p1 * p2 if free and out[p, j, k] > 0 else p1
                if cells[at + (p * J + j) * N + k] < prob:
                    mutating.append((p, j, k))
    mutating.sort()  # in C order
    high = np.array([cap[k] for _, _, k in mutating], dtype=np.int64)
    low = np.minimum(np.array([out[c] for c in mutating], dtype=np.int64), high)
    for c, v in zip(mutating, rng.integers(low, high + 1)):
        out[c] = v
    return out


def test_sparse_mutation_matches_a_reference():
    rng = np.random.default_rng(5)
    for trial in range(40):
        jobs, nodes, base = _cluster(rng, int(rng.integers(1, 20)))
        search = WeightedGeneticSearch(seed=trial)
        keys, node_keys = sorted(jobs), sorted(nodes)
        base_m = search._matrix(base, keys, node_keys)
        search._setup([jobs[k] for k in keys], [nodes[k] for k in node_keys], base_m)
        P, (J, N) = int(rng.integers(1, 40)), base_m.shape
        states = search._repair(rng.integers(0, 4, size=(P, J, N)).astype(base_m.dtype))
        ref_rng = _copy_rng(search.rng)
        got = search._mutation(states, base_m)
        assert got.dtype == np.int16
        want = _reference_sparse_mutation(search, states, base_m, ref_rng)
        np.testing.assert_array_equal(got, want, err_msg=f"trial {trial}")
        assert search.rng.bit_generator.state == ref_rng.bit_generator.state, f"trial {trial}"


def _tournament(rank, crowd, a, b):
    better = rank[b] < rank[a] or (rank[b] == rank[a] and crowd[b] > crowd[a])
    return b if better else a


def test_breed_matches_tournaments_and_crossover():
    """``b`` wins a tournament on a lower rank, or on the same rank with a larger crowding
    distance; the crossover swaps the first ``point`` jobs where the coin falls below 0.9."""
    rng = np.random.default_rng(6)
    for trial in range(100):
        P, J, N = int(rng.integers(1, 20)), int(rng.integers(1, 8)), int(rng.integers(1, 6))
        pop = rng.integers(0, 5, size=(P, J, N)).astype(np.int16)
        rank = rng.integers(0, 3, size=P)
        crowd = rng.choice([0.0, 0.5, 1.0, np.inf], size=P)
        m = int(rng.integers(1, 15))
        a1, b1, a2, b2 = (rng.integers(P, size=m) for _ in range(4))
        points, coin = rng.integers(J, size=(m, 1)), rng.random((m, 1))
        got = _kernels.breed(pop, rank, crowd, a1, b1, a2, b2, points, coin)

        first, second = [], []
        for i in range(m):
            x = pop[_tournament(rank, crowd, a1[i], b1[i])]
            y = pop[_tournament(rank, crowd, a2[i], b2[i])]
            cut = points[i, 0] if coin[i, 0] < 0.9 else 0
            first.append(np.concatenate([y[:cut], x[cut:]]))
            second.append(np.concatenate([x[:cut], y[cut:]]))
        assert got.dtype == pop.dtype
        np.testing.assert_array_equal(got, np.stack(first + second), err_msg=f"trial {trial}")


def test_fresh_rows_drops_duplicates():
    """Rows of the new batch found in the population, in the children so far, or earlier in
    the batch are dropped, the others kept in order (rows differing in one cell only)."""
    rng = np.random.default_rng(7)
    for trial in range(200):
        J, N = int(rng.integers(1, 12)), int(rng.integers(1, 17))
        pool = rng.integers(0, 3, size=(int(rng.integers(1, 6)), J, N)).astype(np.int16)
        variants = pool[rng.integers(len(pool), size=20)].copy()
        one = rng.random(20) < 0.5  # a one-cell change
        variants[one, rng.integers(J), rng.integers(N)] += 1
        pop, off, new = (variants[rng.integers(20, size=int(rng.integers(0, 30)))] for _ in "pon")
        seen = {row.tobytes() for row in pop} | {row.tobytes() for row in off}
        want = []
        for i, row in enumerate(new):
            if row.tobytes() not in seen:
                seen.add(row.tobytes())
                want.append(i)
        got = _kernels.fresh_rows(pop, off, new)
        np.testing.assert_array_equal(got, want, err_msg=f"trial {trial}")


def test_survive_keeps_the_best_by_rank_then_crowding():
    """Parents and children ranked and crowded together; the first ``size`` by (rank,
    -crowding) kept in a stable order, with their objectives, ranks and recomputed crowding."""
    rng = np.random.default_rng(8)
    for trial in range(150):
        n, m = int(rng.integers(1, 30)), int(rng.integers(1, 30))
        J, N = int(rng.integers(1, 5)), int(rng.integers(1, 5))
        pop = rng.integers(0, 9, size=(n, J, N)).astype(np.int16)
        off = rng.integers(0, 9, size=(m, J, N)).astype(np.int16)
        F, F_off = _objectives(rng, n), _objectives(rng, m)
        size = int(rng.integers(1, n + m + 1))
        got = _kernels.survive(pop, off, F, F_off, size)
        merged, Fm = np.concatenate([pop, off]), np.concatenate([F, F_off])
        rank = _peeled_ranks(Fm)
        crowd = _reference_crowding(Fm, rank)
        order = sorted(range(n + m), key=lambda i: (rank[i], -crowd[i]))[:size]
        want = (merged[order], Fm[order], rank[order])
        want += (_reference_crowding(want[1], want[2]),)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, w, err_msg=f"trial {trial}")
        np.testing.assert_array_equal(_bits(got[3]), _bits(want[3]))


def _ctrl_c_in_kernel(*args, **kwargs):
    """What CPython raises when a Ctrl-C is handled as a compiled kernel returns (numba runs a
    little Python code while boxing its results, and boxing the next result with the
    interrupt set fails the same way)."""
    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as exc:
            raise SystemError(
                "<function _numba_unpickle> returned a result with an exception set"
            ) from exc
    except SystemError as exc:
        raise SystemError(
            "CPUDispatcher(<function survive>) returned a result with an exception set"
        ) from exc


@pytest.mark.parametrize("entry", ["pollux", "refine", "fitness"])
def test_a_ctrl_c_during_a_kernel_reaches_the_caller_as_keyboard_interrupt(entry, monkeypatch):
    rng = np.random.default_rng(8)
    jobs, nodes, base = _cluster(rng, 6)
    weights = dict.fromkeys(jobs, 1.0)

    def search():
        if entry == "pollux":
            return PolluxPolicy(pop_size=4, generations=1).optimize(jobs, nodes, base, 0.0)
        if entry == "refine":
            return WeightedGeneticSearch(pop_size=4, generations=1).refine(
                jobs, nodes, base, weights, base
            )
        return WeightedGeneticSearch().fitness(jobs, nodes, base, weights, base)

    for cls in (PolluxPolicy, WeightedGeneticSearch):
        monkeypatch.setattr(cls, "_evaluate", _ctrl_c_in_kernel)
    with pytest.raises(KeyboardInterrupt):
        search()

    def broken(*args, **kwargs):
        raise SystemError("another failure")

    for cls in (PolluxPolicy, WeightedGeneticSearch):  # any other SystemError as it is
        monkeypatch.setattr(cls, "_evaluate", broken)
    with pytest.raises(SystemError, match="another failure"):
        search()


def test_a_real_sigint_during_kernel_calls_is_a_keyboard_interrupt(sigint_raises):
    """SIGINTs sent while kernels run: numba handles each as it boxes a kernel's results, and
    CPython then raises a chain of SystemErrors; the searches' entry points raise the
    KeyboardInterrupt behind it (the loop runs until the signal is in, so none lands later)."""
    rng = np.random.default_rng(9)
    pop = rng.integers(0, 3, size=(60, 30, 16)).astype(np.int16)
    F = rng.random((60, 2))
    _kernels.survive(pop, pop, F, F, 60)  # compiled (or loaded) before the clock starts

    def loop():
        while True:
            _kernels.survive(pop, pop, F, F, 60)

    for delay in (0.001, 0.003, 0.01):
        timer = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT))
        try:
            with pytest.raises((SystemError, KeyboardInterrupt)) as raw:
                timer.start()  # inside the block: the interrupt cannot escape the test
                loop()  # numba 0.68: a chain of SystemErrors
        finally:
            timer.join()
        cause = raw.value
        while isinstance(cause, SystemError):
            cause = cause.__cause__
        assert isinstance(cause, KeyboardInterrupt)
        timer = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT))
        try:
            with pytest.raises(KeyboardInterrupt):
                timer.start()
                _kernels.interruptible(loop)()
        finally:
            timer.join()
