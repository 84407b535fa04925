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
