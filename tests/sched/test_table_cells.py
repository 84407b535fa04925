"""The genetic searches' speedup tables hold only the (nodes, replicas) cells a search can look
up (``PolluxPolicy._table_cells``): every lookup falls on a computed cell, and the searches
return the same allocations, populations and generator states as with the whole grid."""

from __future__ import annotations

import collections

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adaptrain.sched import JobInfo, NodeInfo, PolluxPolicy
from adaptrain.sched._counts import count_nodes, sum_nodes
from adaptrain.sched._plan import WeightedGeneticSearch


def _speedup(a: float, c: float):
    """Sub-linear in replicas, slower across nodes, computed cell by cell (like a goodput
    model), so that a missing cell would read 0 instead."""

    def fn(n, r):
        n = np.asarray(n, dtype=float)
        r = np.asarray(r, dtype=float)
        return np.where(r > 0, r**a / (1.0 + c * np.maximum(n - 1, 0)), 0.0)

    return fn


def _whole_grid(self, base, extra=()):
    n, r = self._grid()
    return (n >= 1) & (n <= r)


def _check_lookups(search, states):
    """Assert that every (candidate, job) of ``states`` reads a computed cell of the speedup
    table, at ``(min(nodes, nmax), min(replicas, rmax))`` as both searches' evaluations do."""
    n = np.minimum(count_nodes(states), search._nmax)
    r = np.minimum(sum_nodes(states), search._rmax)
    on = n > 0  # a job without GPUs reads the table's (0, 0): speedup 0
    looked_up = search._cells[n[on], r[on]]
    assert looked_up.all(), (
        f"lookup of an uncomputed cell: {np.stack([n[on], r[on]])[:, ~looked_up]}"
    )
    search.lookups += int(on.sum())


class _WholeSearch(WeightedGeneticSearch):
    _table_cells = _whole_grid


class _CheckedSearch(WeightedGeneticSearch):
    lookups = 0

    def _evaluate(self, states, base):
        _check_lookups(self, states)
        return super()._evaluate(states, base)


class _WholePollux(PolluxPolicy):
    _table_cells = _whole_grid


class _CheckedPollux(PolluxPolicy):
    lookups = 0

    def _evaluate(self, states, base):
        _check_lookups(self, states)
        return super()._evaluate(states, base)


@st.composite
def clusters(draw):
    """Unequal nodes, jobs with replica bounds, some non-preemptible, and a current allocation
    within capacity (one job's allocation may span nodes)."""
    caps = draw(st.lists(st.integers(1, 5), min_size=1, max_size=6))
    nodes = {i: NodeInfo(c) for i, c in enumerate(caps)}
    free = collections.Counter({i: c for i, c in enumerate(caps)})
    jobs, base = {}, {}
    for j in range(draw(st.integers(1, 8))):
        max_r = draw(st.integers(1, 20))
        key = f"j{j}"
        jobs[key] = JobInfo(
            creation_timestamp=float(j),
            attained_service=draw(st.floats(0, 1e4)),
            min_replicas=draw(st.integers(0, min(max_r, 3))),
            max_replicas=max_r,
            speedup_fn=_speedup(draw(st.floats(0.3, 1.0)), draw(st.floats(0.0, 0.5))),
            preemptible=draw(st.booleans()),
            num_restarts=draw(st.integers(0, 3)),
            age=draw(st.floats(0, 1e4)),
        )
        alloc = []
        for n in draw(st.permutations(list(nodes))):
            take = min(free[n], draw(st.integers(0, 4)), max_r - len(alloc))
            alloc += [n] * take
            free[n] -= take
        if len(alloc) >= jobs[key].min_replicas:
            base[key] = alloc
    return jobs, nodes, base


SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _state(search):
    state = search.state_dict()
    return state["prev_states"], state["prev_jobs"], state["prev_nodes"], state["rng"]


def _assert_same_state(a, b):
    pa, pb = _state(a), _state(b)
    np.testing.assert_array_equal(pa[0], pb[0])
    assert pa[1:] == pb[1:]


@SETTINGS
@given(clusters(), st.integers(0, 2**31 - 1), st.integers(1, 16))
def test_refinement_looks_up_computed_cells_and_matches_the_whole_grid(case, seed, max_nodes):
    jobs, nodes, base = case
    kwargs = dict(pop_size=10, generations=6, seed=seed, grow_cost=0.2)
    checked, whole = _CheckedSearch(**kwargs), _WholeSearch(**kwargs)
    checked.max_nodes_per_job = whole.max_nodes_per_job = max_nodes
    weights = {k: 1.0 / (1 + i) for i, k in enumerate(jobs)}
    seed_alloc = dict(base)
    for _ in range(3):  # warm-started rounds, each seeded with the last answer
        out_c = checked.refine(jobs, nodes, base, weights, seed_alloc)
        out_w = whole.refine(jobs, nodes, base, weights, seed_alloc)
        assert out_c == out_w
        assert checked.last_fitness == whole.last_fitness
        _assert_same_state(checked, whole)
        got = checked.fitness(jobs, nodes, base, weights, out_c)
        assert got == whole.fitness(jobs, nodes, base, weights, out_c)
        seed_alloc = out_c


@SETTINGS
@given(clusters(), st.integers(0, 2**31 - 1))
def test_pollux_looks_up_computed_cells_and_matches_the_whole_grid(case, seed):
    jobs, nodes, base = case
    checked = _CheckedPollux(pop_size=10, generations=5, seed=seed)
    whole = _WholePollux(pop_size=10, generations=5, seed=seed)
    for _ in range(2):
        assert checked.optimize(jobs, nodes, base, 0.0) == whole.optimize(jobs, nodes, base, 0.0)
        _assert_same_state(checked, whole)


def test_the_lookup_check_is_live():
    """The checked search does look cells up, and flags one left out of the table."""
    nodes = {i: NodeInfo(4) for i in range(3)}
    jobs = {
        f"j{j}": JobInfo(float(j), max_replicas=8, speedup_fn=_speedup(0.7, 0.2)) for j in range(3)
    }
    base = {"j0": [0, 0, 1, 1], "j1": [2]}
    search = _CheckedSearch(pop_size=10, generations=3, seed=0)
    search.refine(jobs, nodes, base, {k: 1.0 for k in jobs}, base)
    assert search.lookups > 0

    class Short(_CheckedSearch):
        def _table_cells(self, base, extra=()):
            cells = super()._table_cells(base, extra)
            cells[2, 4] = False  # j0's current allocation: 4 replicas on 2 nodes
            return cells

    with pytest.raises(AssertionError, match="uncomputed cell"):
        Short(pop_size=10, generations=3, seed=0).refine(
            jobs, nodes, base, {k: 1.0 for k in jobs}, base
        )


def test_cells_stop_at_capacity_and_keep_the_clipped_row():
    """Nodes of 4, 4 and 2 GPUs: one node holds at most 4 replicas, two at most 8; the row of
    the most nodes a job may span (2 here) stays whole, for counts clipped to it."""
    search = WeightedGeneticSearch(seed=0)
    search.max_nodes_per_job = 2
    jobs = [JobInfo(0.0, max_replicas=10, speedup_fn=_speedup(0.8, 0.1))]
    search._setup(jobs, [NodeInfo(4), NodeInfo(4), NodeInfo(2)])
    cells = search._cells
    assert cells.shape == (3, 11)
    assert not cells[0].any()
    np.testing.assert_array_equal(np.flatnonzero(cells[1]), [1, 2, 3, 4])
    np.testing.assert_array_equal(np.flatnonzero(cells[2]), np.arange(2, 11))
    table = search._table[0]
    assert table[1, 5] == 0.0 and table[1, 4] > 0.0 and table[2, 10] > 0.0
    # a current allocation beyond capacity (say a node shrank) still has its cell computed
    base = np.array([[6, 0, 0]], dtype=np.int16)
    search._setup(jobs, [NodeInfo(4), NodeInfo(4), NodeInfo(2)], base)
    assert search._cells[1, 6] and search._table[0, 1, 6] > 0.0
