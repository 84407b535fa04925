"""The genetic operators' sparse random draws (waterfill's refinement) against the dense ones
(Pollux's, as in the artifact): the same distributions, and in-bound rows left as they are."""

from __future__ import annotations

import numpy as np
import pytest

from adaptrain.sched import JobInfo, LinearSpeedup, NodeInfo, PolluxPolicy
from adaptrain.sched._plan import WeightedGeneticSearch

CAPS = (4, 2, 3, 1)  # unequal nodes: a draw bounded by the wrong node's capacity shows


def _policy(sparse: bool, seed: int, max_reps=(3, 6, 2, 5, 1), max_nodes: int = 16):
    pol = PolluxPolicy(seed=seed, max_nodes_per_job=max_nodes)
    pol._sparse_draws = sparse
    jobs = [
        JobInfo(creation_timestamp=float(j), max_replicas=m, speedup_fn=LinearSpeedup())
        for j, m in enumerate(max_reps)
    ]
    pol._setup(jobs, [NodeInfo(c) for c in CAPS])
    return pol


def _population(rng, n: int, jobs: int = 5) -> np.ndarray:
    states = np.zeros((n, jobs, len(CAPS)), dtype=np.int16)
    for node, cap in enumerate(CAPS):  # within each node's capacity
        for _ in range(cap):
            states[np.arange(n), rng.integers(jobs, size=n), node] += rng.random(n) < 0.6
    return states


def test_subclass_uses_sparse_draws_and_pollux_dense():
    assert WeightedGeneticSearch._sparse_draws and not PolluxPolicy._sparse_draws


def test_sparse_mutation_matches_dense_in_distribution():
    rng = np.random.default_rng(1)
    start = _population(rng, 1)[0]
    base = _population(rng, 1)[0]
    stats = {}
    for sparse in (False, True):
        pol = _policy(sparse, seed=7 if sparse else 8)
        draws = np.concatenate(
            [pol._mutation(np.repeat(start[None], 500, axis=0), base) for _ in range(16)]
        )
        assert draws.dtype == np.int16
        hi = np.array(CAPS)[None, None, :]
        assert np.all((draws >= 0) & (draws <= np.maximum(hi, start[None]))), "out of range"
        stats[sparse] = (draws.mean(axis=0), (draws != start[None]).mean(axis=0))
    mean_dense, changed_dense = stats[False]
    mean_sparse, changed_sparse = stats[True]
    # 8000 draws a cell: standard errors ~0.006 (probabilities) and ~0.015 (means); 5-7 sigma
    np.testing.assert_allclose(changed_sparse, changed_dense, atol=0.04)
    np.testing.assert_allclose(mean_sparse, mean_dense, atol=0.1)
    assert changed_dense.max() > 0.1  # the operators did act


def test_sparse_repair_keeps_in_bound_rows_and_meets_every_bound():
    rng = np.random.default_rng(2)
    states = _population(rng, 300)
    dense, sparse = _policy(False, 3, max_nodes=2), _policy(True, 3, max_nodes=2)
    in_bound = (states.sum(axis=2) <= dense._max_rep[None]) & (
        np.count_nonzero(states, axis=2) <= 2
    )
    assert 0 < in_bound.mean() < 1  # both kinds of rows occur
    out_dense, out_sparse = dense._repair(states), sparse._repair(states)
    # the random node order matters only for rows over a bound
    ok = np.all(in_bound, axis=1)
    np.testing.assert_array_equal(out_sparse[ok], out_dense[ok])
    for out in (out_dense, out_sparse):
        assert out.dtype == np.int16
        assert np.all(out.sum(axis=2) <= dense._max_rep[None])
        assert np.all(np.count_nonzero(out, axis=2) <= 2)
        assert np.all(out.sum(axis=1) <= np.array(CAPS)[None])
        assert np.all(out <= states)  # repair only removes replicas


@pytest.mark.parametrize("sparse", [False, True])
def test_repair_cuts_an_oversized_row_to_its_bound(sparse):
    pol = _policy(sparse, 0, max_reps=(3, 1, 1, 1, 1))
    states = np.zeros((64, 5, len(CAPS)), dtype=np.int16)
    states[:, 0] = CAPS  # job 0 on all 10 GPUs, bound 3
    out = pol._repair(states)
    assert np.all(out[:, 0].sum(axis=1) == 3)
    kept = {tuple(row) for row in out[:, 0]}
    assert len(kept) > 1  # which nodes keep replicas is random


def _reference_repair(states, caps, min_rep):
    """The repair's deterministic steps, cell by cell: interference avoidance as in the
    artifact (from the second multi-node job on a node, every later job's replicas there go),
    node capacity in job order, then jobs below their minimum get nothing."""
    out = states.astype(np.int64).copy()
    P, J, N = out.shape
    for p in range(P):
        multi = [np.count_nonzero(out[p, j]) > 1 for j in range(J)]
        for n in range(N):
            seen = 0
            for j in range(J):
                seen += multi[j] and out[p, j, n] > 0
                if seen > 1:
                    out[p, j, n] = 0
        for n in range(N):
            used = 0
            for j in range(J):
                out[p, j, n] = min(out[p, j, n], caps[n] - used)
                used += out[p, j, n]
        for j in range(J):
            if out[p, j].sum() < min_rep[j]:
                out[p, j] = 0
    return out


@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_repair_matches_a_cell_by_cell_reference(sparse, seed):
    # bounds loose enough that no row is cut at random: the repair is then deterministic
    rng = np.random.default_rng(seed)
    pol = _policy(sparse, seed, max_reps=(10,) * 5)
    pol._min_rep = np.array([0, 2, 0, 3, 1])
    states = rng.integers(0, 4, size=(200, 5, len(CAPS))).astype(np.int16)
    states[rng.random(states.shape) < 0.5] = 0
    out = pol._repair(states)
    assert out.dtype == np.int16
    np.testing.assert_array_equal(out, _reference_repair(states, CAPS, pol._min_rep))


def test_generation_carries_the_ranks_and_crowding_of_its_survivors():
    # a generation reuses the merged population's ranks for the survivors: they must equal a
    # fresh non-dominated sort of the survivors (and the crowding, a fresh computation)
    from adaptrain.sched.pollux import _crowding, nondominated_ranks

    pol = _policy(True, 4)
    rng = np.random.default_rng(4)
    base = _population(rng, 1)[0]
    pop = pol._repair(_population(rng, 40))
    F = pol._evaluate(pop, base)
    rank = nondominated_ranks(F)
    crowd = _crowding(F, rank)
    for _ in range(15):
        pop, F, rank, crowd = pol._generation(pop, F, rank, crowd, base)
        np.testing.assert_array_equal(rank, nondominated_ranks(F))
        np.testing.assert_array_equal(crowd, _crowding(F, rank))
    assert rank.max() > 0  # several fronts survived


@pytest.mark.parametrize("jobs", [0, 1, 5, 16, 17, 40])
@pytest.mark.parametrize("nodes", [1, 3, 4, 16, 17])
def test_count_helpers_equal_numpy(jobs, nodes):
    """The BLAS-backed reductions of ``_counts`` return numpy's integers exactly, including
    odd node counts and empty arrays."""
    from adaptrain.sched import _counts

    rng = np.random.default_rng(jobs * 100 + nodes)
    states = (rng.integers(0, 9, (7, jobs, nodes)) * (rng.random((7, jobs, nodes)) < 0.4)).astype(
        np.int16
    )
    states[0, : min(jobs, 2)] = 32767  # the int16 ceiling adds exactly too
    base = states[1].copy()
    for got, want in [
        (_counts.sum_nodes(states), states.sum(axis=2)),
        (_counts.count_nodes(states), np.count_nonzero(states, axis=2)),
        (_counts.sum_jobs(states), states.sum(axis=1)),
        (_counts.sum_jobs(states > 0), (states > 0).sum(axis=1)),
        (_counts.rows_differ(states, base), np.any(states != base[None], axis=2)),
        (_counts.rows_differ(states, base.astype(np.int64)), np.any(states != base[None], axis=2)),
    ]:
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
    if jobs:
        assert _counts.rows_differ(states, base)[1].sum() == 0  # base is candidate 1
