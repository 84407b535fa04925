"""The compiled kernels of the genetic searches (``adaptrain.sched._kernels``) compute what the
numpy code computes, bit for bit: sums in numpy's pairwise order, the non-dominated ranks and
crowding distance, the weighted search's evaluation, the repair and the sparse mutation (with
the generator left in the same state), and whole searches over warm-started rounds."""

from __future__ import annotations

import os
import signal
import threading

import numpy as np
import pytest
from test_table_cells import _speedup  # sub-linear in replicas, computed cell by cell

from adaptrain.sched import JobInfo, NodeInfo, PolluxPolicy, _kernels
from adaptrain.sched._plan import WeightedGeneticSearch
from adaptrain.sched.pollux import (
    _crowding,
    _crowding_numpy,
    _nondominated_ranks_numpy,
    nondominated_ranks,
)

pytestmark = pytest.mark.skipif(
    not _kernels.AVAILABLE, reason="numba is not installed: the searches run the numpy code"
)


def _bits(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float64).reshape(-1).view(np.int64)


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


def test_ranks_and_crowding_equal_numpys_on_ties_and_fronts():
    rng = np.random.default_rng(1)
    for _ in range(600):
        n = int(rng.integers(0, 130))
        levels = int(rng.integers(1, 20))  # few distinct values: ties within and across fronts
        F = rng.integers(0, levels, size=(n, 2)) * rng.choice([1.0, 0.37])
        F = F + rng.choice([0.0, 1e-3]) * rng.random((n, 2))
        if rng.random() < 0.3:
            F = -F
        rank = nondominated_ranks(F)
        np.testing.assert_array_equal(rank, _nondominated_ranks_numpy(F))
        np.testing.assert_array_equal(_bits(_crowding(F, rank)), _bits(_crowding_numpy(F, rank)))


def _cluster(rng: np.random.Generator, jobs_n: int):
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
            speedup_fn=_speedup(float(rng.uniform(0.3, 1.0)), float(rng.uniform(0, 0.5))),
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


@pytest.mark.parametrize("grow", ["none", "uniform", "per-job"])
def test_evaluation_equals_numpys(grow):
    """Random candidates (within and beyond capacity, rows equal to the current allocation,
    empty rows) on random clusters, with and without growth costs."""
    rng = np.random.default_rng(2)
    for trial in range(40):
        jobs, nodes, base = _cluster(rng, int(rng.integers(1, 40)))
        search = WeightedGeneticSearch(grow_cost=0.2 if grow == "uniform" else 0.0)
        weights = {k: float(rng.uniform(0.1, 2.0)) for k in jobs}
        costs = {k: float(rng.uniform(0, 0.5)) for k in jobs} if grow == "per-job" else None
        _, _, base_m, _ = search._prepare(jobs, nodes, base, weights, costs)
        P, (J, N) = int(rng.integers(1, 130)), base_m.shape
        states = rng.integers(0, 4, size=(P, J, N)).astype(base_m.dtype)
        states[rng.random((P, J)) < 0.3] = 0
        keep = rng.random((P, J)) < 0.4
        states[keep] = np.broadcast_to(base_m, (P, J, N))[keep]
        got, want = search._evaluate(states, base_m), search._evaluate_numpy(states, base_m)
        np.testing.assert_array_equal(_bits(got), _bits(want), err_msg=f"trial {trial}")


def _search_state(search):
    state = search.state_dict()
    return state["prev_states"], state["prev_jobs"], state["prev_nodes"], state["rng"]


def test_searches_read_the_same_with_and_without_kernels(monkeypatch):
    """Warm-started rounds of the weighted refinement and of our Pollux, each answer fed back
    as the next round's current allocation: allocations, fitness, populations and generator
    states are equal with the kernels and with the numpy code."""
    rng = np.random.default_rng(3)
    for trial in range(6):
        jobs, nodes, base = _cluster(rng, int(rng.integers(2, 25)))
        weights = {k: float(rng.uniform(0.1, 2.0)) for k in jobs}
        runs = {}
        for compiled in (True, False):
            monkeypatch.setattr(_kernels, "AVAILABLE", compiled)
            search = WeightedGeneticSearch(pop_size=20, generations=8, seed=trial, grow_cost=0.1)
            pollux = PolluxPolicy(pop_size=20, generations=8, seed=trial)
            cur, cur_p, trace = dict(base), dict(base), []
            for _ in range(3):
                out = search.refine(jobs, nodes, cur, weights, cur)
                out_p = pollux.optimize(jobs, nodes, cur_p, 0.0)
                trace.append((out, search.last_fitness, out_p))
                cur = {k: v for k, v in out.items() if v}
                cur_p = {k: v for k, v in out_p.items() if v}
            runs[compiled] = (trace, _search_state(search), _search_state(pollux))
        (t1, s1, p1), (t0, s0, p0) = runs[True], runs[False]
        assert t1 == t0, f"trial {trial}"
        for a, b in ((s1, s0), (p1, p0)):
            np.testing.assert_array_equal(a[0], b[0])
            assert a[1:] == b[1:]


@pytest.mark.parametrize("cls", [WeightedGeneticSearch, PolluxPolicy])
def test_repair_equals_numpys(cls):
    """Random candidates (beyond capacity, over the replica and node bounds, several
    multi-node jobs per node) on random clusters with pinned jobs: the same repaired
    candidates and the generator in the same state after (the same draws), with sparse draws
    (the weighted search) and a draw for every row (our Pollux)."""
    rng = np.random.default_rng(4)
    for trial in range(60):
        jobs, nodes, base = _cluster(rng, int(rng.integers(1, 30)))
        search = cls(seed=trial)
        search.max_nodes_per_job = int(rng.integers(1, 7))
        search.interference_avoidance = bool(rng.random() < 0.8)
        keys = sorted(jobs)
        node_keys = sorted(nodes)
        base_m = search._matrix(base, keys, node_keys)
        search._setup([jobs[k] for k in keys], [nodes[k] for k in node_keys], base_m)
        P, (J, N) = int(rng.integers(1, 130)), base_m.shape
        states = rng.integers(0, 6, size=(P, J, N)).astype(base_m.dtype)
        states[rng.random((P, J, N)) < 0.5] = 0
        start = search.rng.bit_generator.state
        got = search._repair(states)
        after = search.rng.bit_generator.state
        search.rng.bit_generator.state = start
        monkey = _kernels.AVAILABLE
        try:
            _kernels.AVAILABLE = False
            want = search._repair(states)
        finally:
            _kernels.AVAILABLE = monkey
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want, err_msg=f"trial {trial}")
        assert after == search.rng.bit_generator.state, f"trial {trial}"


def test_sparse_mutation_equals_numpys():
    """The same mutated candidates and the generator in the same state after: the merged
    calls of the generator draw the numpy code's numbers in its order."""
    rng = np.random.default_rng(5)
    for trial in range(60):
        jobs, nodes, base = _cluster(rng, int(rng.integers(1, 30)))
        search = WeightedGeneticSearch(seed=trial)
        keys, node_keys = sorted(jobs), sorted(nodes)
        base_m = search._matrix(base, keys, node_keys)
        search._setup([jobs[k] for k in keys], [nodes[k] for k in node_keys], base_m)
        P, (J, N) = int(rng.integers(1, 130)), base_m.shape
        states = search._repair(rng.integers(0, 4, size=(P, J, N)).astype(base_m.dtype))
        start = search.rng.bit_generator.state
        got = search._mutation(states, base_m)
        after = search.rng.bit_generator.state
        search.rng.bit_generator.state = start
        want = search._mutation_numpy(states, base_m)
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want, err_msg=f"trial {trial}")
        assert after == search.rng.bit_generator.state, f"trial {trial}"


@pytest.mark.parametrize("cls", [WeightedGeneticSearch, PolluxPolicy])
def test_generation_equals_numpys(cls, monkeypatch):
    """Whole generations (tournaments, crossover, mutation, repair, the dropping of
    duplicates, survival) from random populations with few distinct candidates (children
    often repeat them, so more batches are bred, and in converged populations none may be
    new), tied ranks and crowding: the same population, objectives, ranks and crowding, and
    the generator in the same state after, as the numpy code."""
    rng = np.random.default_rng(6)
    for trial in range(40):
        jobs, nodes, base = _cluster(rng, int(rng.integers(1, 25)))
        search = cls(pop_size=int(rng.integers(2, 40)), seed=trial)
        keys, node_keys = sorted(jobs), sorted(nodes)
        if cls is WeightedGeneticSearch:
            weights = {k: float(rng.uniform(0.1, 2.0)) for k in jobs}
            _, _, base_m, _ = search._prepare(jobs, nodes, base, weights)
        else:
            base_m = search._matrix(base, keys, node_keys)
            search._setup([jobs[k] for k in keys], [nodes[k] for k in node_keys], base_m)
        (J, N), distinct = base_m.shape, int(rng.integers(1, 6))
        rows = search._repair(rng.integers(0, 4, size=(distinct, J, N)).astype(base_m.dtype))
        pop = rows[rng.integers(distinct, size=search.pop_size)]
        F = search._evaluate(pop, base_m)
        rank = nondominated_ranks(F)
        crowd = _crowding(F, rank)
        start = search.rng.bit_generator.state
        got = search._generation(pop, F, rank, crowd, base_m)
        after = search.rng.bit_generator.state
        search.rng.bit_generator.state = start
        monkeypatch.setattr(_kernels, "AVAILABLE", False)
        want = search._generation(pop, F, rank, crowd, base_m)
        monkeypatch.setattr(_kernels, "AVAILABLE", True)
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype, f"trial {trial}"
            np.testing.assert_array_equal(_bits(g), _bits(w), err_msg=f"trial {trial}")
        assert after == search.rng.bit_generator.state, f"trial {trial}"


def test_fresh_rows_equal_numpys_dedupe():
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
        keep = _kernels.fresh_rows(pop, off, new)
        want = PolluxPolicy._dedupe(np.concatenate([pop, off]), new)
        np.testing.assert_array_equal(new[keep], want, err_msg=f"trial {trial}")


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
