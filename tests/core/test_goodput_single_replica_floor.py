"""GoodputFunction.optimize: a single replica whose minimum micro-batch exceeds the initial batch.

AdaptDL clamps the micro-batch up to the minimum and returns that configuration's goodput; a
job bounded so must not look unable to run on one GPU. Where the bounds admit the initial batch
the search is unchanged (the scheduler's recorded figures depend on it).
"""

from __future__ import annotations

import numpy as np
import pytest

from adaptrain.core.goodput import GoodputFunction, PerfParams

PERF = PerfParams(0.1, 0.01, 0.2, 0.01, 0.1, 0.01, 1.0)


@pytest.mark.parametrize("accumulation", [False, True])
@pytest.mark.parametrize("round_past_max", [False, True])
@pytest.mark.parametrize("max_batch_size", [128, 256, 384, 1000, 4096])
def test_single_replica_runs_at_the_minimum_micro_batch(
    accumulation, round_past_max, max_batch_size
):
    fn = GoodputFunction(PERF, (1.0, 1.0), 128)
    goodput, atomic, accum = fn.optimize(
        1,
        1,
        max_batch_size=max_batch_size,
        atomic_bsz_range=(256, 256),
        accumulation=accumulation,
        round_past_max=round_past_max,
    )
    assert (atomic, accum) == (256, 0)
    assert goodput > 0 and goodput == fn.evaluate(1, 1, 256, 0)


def test_single_replica_floor_with_room_to_grow():
    """With a larger maximum micro-batch and accumulation, the search still grows from there."""
    fn = GoodputFunction(PerfParams(0.5, 1e-4, 0.2, 0.01, 0.1, 0.01, 1.0), (0.01, 100.0), 128)
    goodput, atomic, accum = fn.optimize(
        1, 1, max_batch_size=4096, atomic_bsz_range=(256, None), accumulation=True
    )
    assert goodput > fn.evaluate(1, 1, 256, 0) > 0
    assert atomic >= 256 and accum >= 1 and atomic * (accum + 1) <= 4096
    # the same allocation in an array, beside more replicas (the speedup table's call)
    g, a, s = fn.optimize(
        [1, 1, 2],
        [1, 2, 4],
        max_batch_size=4096,
        atomic_bsz_range=(256, None),
        accumulation=True,
        round_past_max=True,
    )
    assert np.all(g > 0) and np.all(a >= 256)
    assert (g[0], a[0], s[0]) == (goodput, atomic, accum)


def test_single_replica_floor_below_min_batch_size():
    """Without accumulation a single replica stays at its smallest batch: a larger
    ``min_batch_size`` leaves it infeasible, as at the initial batch."""
    fn = GoodputFunction(PERF, (1.0, 1.0), 128)
    kw = {"max_batch_size": 1024, "atomic_bsz_range": (256, 512)}
    assert fn.optimize(1, 1, min_batch_size=300, **kw)[0] == 0.0
    assert fn.optimize(1, 1, min_batch_size=256, **kw)[1:] == (256, 0)


# Outputs of the search where the bounds admit the initial batch, recorded before the
# single-replica floor existed: the floor must leave them as they were.
_PERF2 = (0.05, 0.002, 0.3, 0.02, 0.05, 0.005, 2.5)
_UNCHANGED = [
    (
        (0.01, 5.0),
        128,
        {
            "max_batch_size": 4096,
            "atomic_bsz_range": (32, 256),
            "accumulation": True,
            "round_past_max": True,
        },
        (
            [451.31282051516786, 1349.2740556688107, 1677.256212884455, 5118.668848242252],
            [246, 251, 253, 256],
            [1, 0, 1, 0],
        ),
    ),
    (
        (0.01, 5.0),
        128,
        {"max_batch_size": 4096, "atomic_bsz_range": (128, 512), "accumulation": True},
        (
            [469.7412766215823, 1398.0091759134586, 1807.809915794591, 5118.668848242252],
            [498, 496, 498, 256],
            [1, 0, 0, 0],
        ),
    ),
    (
        (3.0, 0.1),
        100.5,
        {
            "max_batch_size": 2000,
            "atomic_bsz_range": (None, 64),
            "accumulation": True,
            "round_past_max": True,
        },
        (
            [330.74900706916793, 806.2409469146156, 290.37216082350915, 176.71772767876266],
            [51, 34, 29, 28],
            [1, 0, 0, 0],
        ),
    ),
    (
        (1.0, 1.0),
        32,
        {"max_batch_size": 1024, "accumulation": False, "min_batch_size": 48},
        (
            [0.0, 418.6039584578017, 155.64371233582773, 104.86121187254136],
            [32, 20, 61, 61],
            [0, 0, 0, 0],
        ),
    ),
]


@pytest.mark.parametrize("grad, init, kwargs, expected", _UNCHANGED)
def test_bounds_admitting_the_initial_batch_are_unchanged(grad, init, kwargs, expected):
    fn = GoodputFunction(_PERF2, grad, init)
    goodput, atomic, accum = fn.optimize([1, 1, 2, 4], [1, 3, 4, 16], **kwargs)
    assert goodput.tolist() == pytest.approx(expected[0], rel=1e-12, abs=0.0)
    assert atomic.tolist() == expected[1] and accum.tolist() == expected[2]
