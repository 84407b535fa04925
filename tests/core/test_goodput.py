"""Tests of the goodput model: golden values, AdaptDL 0.2.11 semantics, properties, the fit."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import scipy.optimize
from hypothesis import example, given, settings
from hypothesis import strategies as st

from adaptrain.core import goodput as G
from adaptrain.goodput import GoodputFunction, GradParams, PerfParams, fit_perf_params

# alpha_c, beta_c, alpha_n, beta_n, alpha_r, beta_r, gamma
P1 = PerfParams(0.1, 0.01, 0.5, 0.05, 0.2, 0.02, 1.0)
P2 = P1._replace(gamma=2.0)
GRAD = GradParams(sqr=1.0, var=1.0)

RNG = np.random.RandomState(0)
RANDOM_PERF = [PerfParams(*RNG.gamma(2.0, 2.0, 7)) for _ in range(4)]
RANDOM_GRAD = [GradParams(*RNG.gamma(2.0, 2.0, 2)) for _ in range(3)]

# this module's examples per property (loading a profile here would change every module's)
SETTINGS = settings(max_examples=40, deadline=None)


# ------------------------------------------------------------------ golden values (by hand)


def test_golden_throughput_single_replica():
    fn = GoodputFunction(P1, GRAD, 32)
    # T_accum = 0.1 + 0.01·32 = 0.42; no network for one replica (1e-8 stand-in).
    assert fn.throughput(1, 1, 32, 0) == pytest.approx(32 / 0.42, rel=1e-6)


def test_golden_throughput_intra_node_no_overlap():
    fn = GoodputFunction(P1, GRAD, 32)
    # 4 replicas on 1 node: T_net = 0.2 + 0.02·(4 − 2) = 0.24; γ = 1 sums: 0.66 s for 128 samples.
    assert fn.throughput(1, 4, 32, 0) == pytest.approx(128 / 0.66, rel=1e-12)
    # 2 replicas: retrogression term vanishes (max(0, 1e-8)).
    assert fn.throughput(1, 2, 32, 0) == pytest.approx(64 / (0.42 + 0.2), rel=1e-9)


def test_golden_throughput_inter_node_with_accumulation():
    fn = GoodputFunction(P1, GRAD, 32)
    # 4 replicas on 2 nodes: T_net = 0.5 + 0.05·2 = 0.6; T_optim = 0.42 + 0.6 = 1.02;
    # one extra accumulation step: T_step = 0.42 + 1.02 = 1.44 for 4·32·2 = 256 samples.
    assert fn.throughput(2, 4, 32, 1) == pytest.approx(256 / 1.44, rel=1e-12)


def test_golden_throughput_overlap_gamma_two():
    fn = GoodputFunction(P2, GRAD, 32)
    t_optim = math.hypot(0.42, 0.24)
    assert fn.throughput(1, 4, 32, 0) == pytest.approx(128 / t_optim, rel=1e-12)


def test_golden_efficiency_and_goodput():
    fn = GoodputFunction(P1, GRAD, 32)
    # scale 2: gain = (1 + 1)/(1/2 + 1) = 4/3, efficiency = 2/3.
    assert fn.efficiency(32) == pytest.approx(1.0)
    assert fn.efficiency(64) == pytest.approx(2 / 3)
    assert fn.efficiency(np.array([32, 64, 128])) == pytest.approx([1.0, 2 / 3, 0.4])
    assert fn.evaluate(1, 2, 32, 0) == pytest.approx(64 / 0.62 * 2 / 3)
    assert fn(1, 2, 32, 0) == fn.evaluate(1, 2, 32, 0)


def test_efficiency_limits():
    # Pure noise (sqr = 0): gain = scale, efficiency 1 at every batch size.
    assert GoodputFunction(P1, (0.0, 1.0), 32).efficiency(320) == pytest.approx(1.0)
    # No noise (var = 0): gain = 1, efficiency = 1/scale.
    assert GoodputFunction(P1, (1.0, 0.0), 32).efficiency(320) == pytest.approx(0.1)
    # Empty statistics: gain 1 as in AdaptDL's np.where(denom > 0, ..., 1).
    assert GoodputFunction(P1, (0.0, 0.0), 32).efficiency(64) == pytest.approx(0.5)


def test_optimize_golden_single_replica_default():
    fn = GoodputFunction(P1, GRAD, 32)
    goodput, bsz, steps = fn.optimize(1, 1)
    assert (bsz, steps) == (32, 0)
    assert isinstance(goodput, float) and isinstance(bsz, int) and isinstance(steps, int)
    assert goodput == pytest.approx(32 / 0.42)


def test_optimize_golden_pure_noise_takes_largest_batch():
    # sqr = 0: efficiency is 1 everywhere, throughput grows with the batch → largest batch.
    fn = GoodputFunction(P1, (0.0, 1.0), 32)
    goodput, bsz, steps = fn.optimize(1, 4, max_batch_size=1024)
    assert (bsz, steps) == (256, 0)
    assert goodput == pytest.approx(1024 / (0.1 + 2.56 + 0.24))


def test_optimize_golden_no_noise_takes_smallest_batch():
    # var = 0: efficiency = 1/scale and throughput grows sub-linearly → smallest batch.
    fn = GoodputFunction(P1, (1.0, 0.0), 32)
    goodput, bsz, steps = fn.optimize(1, 4, max_batch_size=1024)
    assert (bsz, steps) == (8, 0)
    assert goodput == pytest.approx(32 / (0.1 + 0.08 + 0.24))


# ------------------------------------------------------------------ AdaptDL semantics


@pytest.mark.parametrize("perf", RANDOM_PERF)
@pytest.mark.parametrize("grad", RANDOM_GRAD)
def test_evaluate_invariants(perf, grad):
    """AdaptDL's invariants: monotone/concave throughput, sublinear scaling, efficiency."""
    init = 16
    fn = GoodputFunction(perf, grad, init)
    grid = itertools.product([1, 2, 3, 4], [1, 2, 4, 8], [8, 12, 16, 20, 24], [0, 1, 2, 3, 4])
    nodes, replicas, bsz, steps = map(np.array, zip(*grid))
    keep = (nodes <= replicas) & (init <= replicas * bsz * (steps + 1))
    nodes, replicas, bsz, steps = nodes[keep], replicas[keep], bsz[keep], steps[keep]
    goodput = fn(nodes, replicas, bsz, steps)
    thr = fn.throughput(nodes, replicas, bsz, steps)
    batch = replicas * bsz * (steps + 1)
    eff = fn.efficiency(batch)
    assert np.all(thr >= 0) and np.all((eff >= 0) & (eff <= 1 + 1e-12))
    np.testing.assert_allclose(goodput, thr * eff)
    order = np.argsort(batch, kind="stable")
    assert np.all(np.diff(eff[order]) <= 1e-12)
    key = np.stack([nodes, replicas, steps])
    _, group = np.unique(key, axis=1, return_inverse=True)
    for g in np.unique(group):
        idx = np.flatnonzero(group == g)
        idx = idx[np.argsort(bsz[idx])]
        dx, dy = np.diff(bsz[idx]), np.diff(thr[idx])
        assert np.all(dy >= 0)  # more samples per micro-batch, more throughput ...
        assert np.all(dx[:-1] * dy[1:] - dx[1:] * dy[:-1] <= 1e-9)  # ... diminishing returns
    key = np.stack([nodes, bsz, steps])
    _, group = np.unique(key, axis=1, return_inverse=True)
    for g in np.unique(group):
        idx = np.flatnonzero(group == g)
        idx = idx[np.argsort(replicas[idx])]
        assert np.all(np.diff((thr / replicas)[idx]) <= 1e-9)  # sub-linear in replicas


def test_network_time_model():
    p = P1
    single = G.predict_network_time(p, 1, 1)
    assert single < 1e-7  # effectively zero for one replica
    assert G.predict_network_time(p, 1, 2) == pytest.approx(0.2)
    assert G.predict_network_time(p, 1, 6) == pytest.approx(0.2 + 0.02 * 4)
    assert G.predict_network_time(p, 2, 2) == pytest.approx(0.5)  # inter-node wins
    assert G.predict_network_time(p, 3, 6) == pytest.approx(0.5 + 0.05 * 4)
    out = G.predict_network_time(p, np.array([[1], [2]]), np.array([1, 2, 4]))
    assert out.shape == (2, 3)


@pytest.mark.parametrize("perf", RANDOM_PERF)
def test_optimize_no_bounds_matches_adaptdl(perf):
    fn = GoodputFunction(perf, RANDOM_GRAD[0], 128)
    goodput, bsz, steps = fn.optimize(1, 3)
    assert bsz == 43 and steps == 0 and isinstance(goodput, float)
    replicas = np.arange(1, 6)
    for nodes in (np.ones_like(replicas), replicas):
        goodput, bsz, steps = fn.optimize(nodes, replicas)
        assert goodput.shape == bsz.shape == steps.shape == (5,)
        np.testing.assert_array_equal(bsz, np.ceil(128 / replicas).astype(int))
        assert bsz[0] == 128 and np.all(steps == 0)


@pytest.mark.parametrize("perf", RANDOM_PERF)
@pytest.mark.parametrize("grad", RANDOM_GRAD)
def test_optimize_bounds_and_accumulation(perf, grad):
    fn = GoodputFunction(perf, grad, 128)
    goodput, bsz, steps = fn.optimize(1, 1, max_batch_size=1280, atomic_bsz_range=(64, 256))
    assert (bsz, steps) == (128, 0)  # one replica, no accumulation: stays at the initial batch
    replicas = np.arange(1, 20)
    for nodes in (np.ones_like(replicas), replicas):
        goodput, bsz, steps = fn.optimize(
            nodes, replicas, max_batch_size=1280, atomic_bsz_range=(64, 256), accumulation=True
        )
        ok = goodput > 0
        assert np.all(bsz[ok] >= 64) and np.all(bsz <= 256)
        assert np.all((bsz * replicas * (steps + 1))[ok] < 1280 + (replicas * (steps + 1))[ok])
        assert np.all((steps >= 0) & (steps <= 15))
        # A single replica above the initial batch accumulates at least once.
        assert replicas[0] == 1 and (bsz[0] * (steps[0] + 1) == 128 or steps[0] >= 1)
    # Infeasible range (the initial batch needs 32 per replica): every candidate is invalid.
    goodput, _, _ = fn.optimize(1, 4, max_batch_size=1024, atomic_bsz_range=(8, 16))
    assert goodput == 0.0
    # A minimum micro-batch above max_batch_size / replicas wins over max_batch_size (AdaptDL).
    goodput, bsz, _ = fn.optimize(4, 4, max_batch_size=1024, atomic_bsz_range=(300, 400))
    assert goodput > 0 and bsz == 300
    # Edge case from AdaptDL's tests.
    goodput, bsz, steps = fn.optimize(4, 4, max_batch_size=1024, atomic_bsz_range=(128, 128))
    assert goodput > 0 and bsz == 128 and steps == 0


def test_optimize_broadcast_shapes():
    fn = GoodputFunction(P1, GRAD, 32)
    nodes = np.array([[1], [2]])
    replicas = np.array([[2, 4, 8]])
    goodput, bsz, steps = fn.optimize(nodes, replicas, max_batch_size=512)
    assert goodput.shape == bsz.shape == steps.shape == (2, 3)
    for i, j in itertools.product(range(2), range(3)):
        g, b, s = fn.optimize(int(nodes[i, 0]), int(replicas[0, j]), max_batch_size=512)
        assert (g, b, s) == (goodput[i, j], bsz[i, j], steps[i, j])
    # One scalar and one array gives arrays (AdaptDL's .item() would fail here).
    goodput, bsz, steps = fn.optimize(1, np.array([1, 2, 4]), max_batch_size=512)
    assert goodput.shape == (3,)


def _reference_optimize(fn, nodes, replicas, max_batch, lo, hi, accumulation):
    """Scalar re-statement of AdaptDL's candidate rule, one candidate at a time, without the
    candidates whose rounded-up total passes max_batch (unless the smallest one does)."""
    init = fn.init_batch_size
    min_batch = max(init, lo * replicas)
    # a single replica's smallest local batch: the initial batch, or the micro-batch floor
    single = max(math.ceil(init), lo)
    best = (-1.0, None, None)
    limit = None
    for batch in np.geomspace(min_batch, max_batch, G.NUM_CANDIDATES):
        local = batch / replicas
        if accumulation:
            steps = math.ceil(local / hi - 1e-8) - 1
            if replicas == 1 and local > single + 1e-8:
                steps = max(steps, 1)
            bsz = math.ceil(local / (steps + 1) - 1e-8)
        else:
            steps = 0
            bsz = single if replicas == 1 else math.ceil(local - 1e-8)
        total = replicas * bsz * (steps + 1)
        limit = max(max_batch, total) if limit is None else limit
        ok = lo <= bsz <= hi and total <= limit
        value = fn.evaluate(nodes, replicas, bsz, steps) if ok else 0.0
        if value > best[0]:
            best = (value, bsz, steps)
    return best


#: Random optimize() problems: performance and gradient parameters, initial batch, placement,
#: max batch (a multiple of the initial), local-batch bounds, accumulation.
_PROBLEMS = dict(
    perf=st.tuples(*[st.floats(1e-3, 1.0)] * 6, st.floats(1.0, 10.0)),
    grad=st.tuples(st.floats(0.0, 10.0), st.floats(0.0, 10.0)),
    init=st.integers(1, 64),
    nodes_replicas=st.integers(1, 16).flatmap(lambda r: st.tuples(st.integers(1, r), st.just(r))),
    max_mult=st.floats(1.0, 40.0),
    lo=st.integers(1, 16),
    hi_extra=st.integers(0, 256),
    accumulation=st.booleans(),
)


@SETTINGS
@given(**_PROBLEMS)
def test_optimize_is_max_over_candidates(
    perf, grad, init, nodes_replicas, max_mult, lo, hi_extra, accumulation
):
    nodes, replicas = nodes_replicas
    fn = GoodputFunction(perf, grad, init)
    max_batch = init * max_mult
    hi = lo + hi_extra
    got = fn.optimize(nodes, replicas, max_batch, (lo, hi), accumulation)
    ref = _reference_optimize(fn, nodes, replicas, max_batch, lo, hi, accumulation)
    assert got[0] == pytest.approx(ref[0], rel=1e-12, abs=0)
    if got[0] > 0:
        assert fn.evaluate(nodes, replicas, got[1], got[2]) == pytest.approx(got[0], rel=1e-12)


@SETTINGS
@given(
    perf=st.tuples(*[st.floats(1e-3, 1.0)] * 6, st.floats(1.0, 10.0)),
    grad=st.tuples(st.floats(0.0, 10.0), st.floats(0.0, 10.0)),
    init=st.integers(1, 64),
    replicas=st.integers(2, 16),
    max_mult=st.floats(1.0, 20.0),
)
def test_optimize_near_max_of_brute_force_grid(perf, grad, init, replicas, max_mult):
    """Against every integer atomic batch (multi-replica, no accumulation, no range).

    Goodput of a batch between two consecutive candidates ``c1 < c2`` is at most
    ``(c2/c1) · max(goodput(c1), goodput(c2))`` (throughput grows at most linearly with the
    batch and efficiency falls at most linearly), so optimize is within that ratio.
    """
    fn = GoodputFunction(perf, grad, init)
    max_batch = init * max_mult
    goodput, bsz, steps = fn.optimize(1, replicas, max_batch)
    lo_local = math.ceil(max(init, replicas) / replicas - 1e-8)
    hi_local = math.ceil(max_batch / replicas - 1e-8)
    grid = np.arange(lo_local, hi_local + 1)
    brute = fn.evaluate(1, replicas, grid, 0)
    cand = np.ceil(np.geomspace(max(init, replicas), max_batch, G.NUM_CANDIDATES) / replicas - 1e-8)
    ratio = np.max(cand[1:] / cand[:-1]) if cand.size > 1 else 1.0
    assert goodput <= np.max(brute) * (1 + 1e-12)
    assert goodput >= np.max(brute) / ratio * (1 - 1e-12)


@SETTINGS
@given(
    grad=st.tuples(st.floats(0.0, 1e3), st.floats(0.0, 1e3)),
    init=st.floats(1.0, 512.0),
    batches=st.lists(st.floats(1.0, 1e4), min_size=2, max_size=20),
)
def test_efficiency_at_most_one_and_decreasing(grad, init, batches):
    fn = GoodputFunction(P1, grad, init)
    batch = np.sort(init * np.asarray(batches))
    eff = fn.efficiency(batch)
    assert np.all(eff <= 1 + 1e-12) and np.all(eff > 0)
    assert np.all(np.diff(eff) <= 1e-12)
    assert fn.efficiency(init) == pytest.approx(1.0)


@SETTINGS
@given(
    alpha_c=st.floats(1e-3, 1.0),
    beta_c=st.floats(1e-4, 0.1),
    gamma=st.floats(1.0, 10.0),
    bsz=st.integers(1, 512),
    steps=st.integers(0, 4),
)
def test_throughput_monotone_in_replicas_without_network_cost(alpha_c, beta_c, gamma, bsz, steps):
    fn = GoodputFunction(PerfParams(alpha_c, beta_c, 0, 0, 0, 0, gamma), GRAD, 1)
    replicas = np.arange(1, 33)
    nodes = np.where(replicas > 8, 2, 1)
    thr = fn.throughput(nodes, replicas, bsz, steps)
    assert np.all(np.diff(thr) > 0)
    # And exactly linear: each replica adds one replica's worth of samples.
    np.testing.assert_allclose(thr / replicas, thr[0], rtol=1e-5)  # 1e-8 s single-replica stand-in


def _rounded_total(init, replicas, max_atomic, accumulation, batch):
    """AdaptDL's integer split of a total ``batch`` (see _reference_optimize), as a total."""
    local = batch / replicas
    if accumulation:
        steps = math.ceil(local / max_atomic - 1e-8) - 1
        if replicas == 1 and local > init + 1e-8:
            steps = max(steps, 1)
        return replicas * math.ceil(local / (steps + 1) - 1e-8) * (steps + 1)
    return init if replicas == 1 else replicas * math.ceil(local - 1e-8)


@SETTINGS
@given(**_PROBLEMS, min_frac=st.floats(0.0, 1.0))
def test_optimize_min_batch_size_bounds_every_candidate(
    perf, grad, init, nodes_replicas, max_mult, min_frac, lo, hi_extra, accumulation
):
    nodes, replicas = nodes_replicas
    fn = GoodputFunction(perf, grad, init)
    max_batch = init * max_mult
    bounds = (lo, lo + hi_extra)
    plain = fn.optimize(nodes, replicas, max_batch, bounds, accumulation)
    assert (
        fn.optimize(nodes, replicas, max_batch, bounds, accumulation, min_batch_size=None) == plain
    )
    # At or below the initial batch it changes nothing (AdaptDL's search starts there).
    below = fn.optimize(nodes, replicas, max_batch, bounds, accumulation, min_batch_size=init)
    assert below == plain
    min_batch = init + min_frac * (max_batch - init)
    got = fn.optimize(nodes, replicas, max_batch, bounds, accumulation, min_batch_size=min_batch)
    if got[0] > 0:
        total = replicas * got[1] * (got[2] + 1)
        assert min_batch <= total and lo <= got[1] <= lo + hi_extra
        # past max_batch only as far as the initial batch (or the minimum micro-batch) forces
        forced = _rounded_total(
            init, replicas, lo + hi_extra, accumulation, max(init, lo * replicas)
        )
        assert total <= max(max_batch, forced)
        assert fn.evaluate(nodes, replicas, got[1], got[2]) == pytest.approx(got[0], rel=1e-12)


def test_optimize_min_batch_size_examples():
    fn = GoodputFunction(P1, (1.0, 0.0), 32)  # no noise: the smallest batch wins
    assert fn.optimize(1, 4, 512) == fn.optimize(1, 4, 512, min_batch_size=None)
    assert fn.optimize(1, 4, 512)[1] == 8
    _, atomic, steps = fn.optimize(1, 4, 512, min_batch_size=256)
    assert (atomic, steps) == (64, 0)  # the smallest total allowed
    _, atomic, steps = fn.optimize(1, 3, 512, min_batch_size=100.5)  # rounded up: 3 × 34
    assert (atomic, steps) == (34, 0)
    # 3 × 34 = 102 > 100 = max: no candidate (the bound does not force a total past the max)
    assert fn.optimize(1, 3, 100, min_batch_size=100)[0] == 0.0
    assert fn.optimize(1, 4, 100, min_batch_size=100)[1:] == (25, 0)
    # a single replica without accumulation only runs the initial batch
    assert fn.optimize(1, 1, 512, min_batch_size=64)[0] == 0.0
    assert fn.optimize(1, 1, 512, accumulation=True, min_batch_size=64)[1:] == (32, 1)
    for bad in (513, math.nan, math.inf):
        with pytest.raises(ValueError, match="min_batch_size"):
            fn.optimize(1, 4, 512, min_batch_size=bad)


@pytest.mark.parametrize("init", [32.5, 7.25, 32.000000001, 31.999999999])
def test_optimize_with_a_non_integer_initial_batch(init):
    # 32.5 used to give a single replica atomic_bsz = int(32.5) = 32 < 32.5, and evaluate
    # raised; the search now starts at ceil(init) (AdaptDL's integers are unchanged).
    fn = GoodputFunction(P1, GRAD, init)
    for replicas in range(1, 9):
        for accumulation in (False, True):
            for bounds in (None, (1, 8), (5, 1000)):
                good, atomic, steps = fn.optimize(1, replicas, 4 * init, bounds, accumulation)
                total = replicas * atomic * (steps + 1)
                assert total >= init and (good > 0 or bounds == (1, 8)), (replicas, bounds)
                if replicas == 1 and not accumulation:
                    assert (atomic, steps) == (math.ceil(init), 0)
    # an integral float is the integer
    assert GoodputFunction(P1, GRAD, 32.0).optimize(1, 3, 128, None, True) == GoodputFunction(
        P1, GRAD, 32
    ).optimize(1, 3, 128, None, True)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(max_batch_size=1e9),  # no upper bound on the micro-batch: it defaults to 1e9
        dict(max_batch_size=512, atomic_bsz_range=(1, 10**9)),  # "unbounded" micro-batch
        dict(max_batch_size=2**40),
    ],
)
@pytest.mark.parametrize("replicas", [1, 4])
def test_optimize_accumulation_never_gives_negative_steps(kwargs, replicas):
    # accum = ceil(local / max_atomic - 1e-8) - 1 was -1 when local < 1e-8 · max_atomic: a
    # total of 0 samples, and evaluate raised "below init_batch_size".
    fn = GoodputFunction(P1, GRAD, 32)
    good, atomic, steps = fn.optimize(1, replicas, accumulation=True, **kwargs)
    assert good > 0 and steps >= 0 and replicas * atomic * (steps + 1) >= 32
    nodes = np.ones(3, dtype=int)
    goods, _, steps = fn.optimize(nodes, np.array([1, 2, 4]), accumulation=True, **kwargs)
    assert np.all(goods > 0) and np.all(steps >= 0)


def test_efficiency_keeps_its_bounds_at_extreme_statistics():
    batch = np.array([32, 40, 64, 320])
    scale = batch / 32
    for grad in [(1e308, 1e308), (1e300, 1e308), (0.0, 5e-324), (5e-324, 5e-324), (1.0, 1e-310)]:
        eff = GoodputFunction(P1, grad, 32).efficiency(batch)
        assert np.all(np.isfinite(eff)), grad
        assert np.all((eff >= 1 / scale * (1 - 1e-12)) & (eff <= 1 + 1e-12)), (grad, eff)
    # a subnormal noise with no signal is still pure noise: efficiency 1 (gain = scale)
    np.testing.assert_allclose(GoodputFunction(P1, (0.0, 5e-324), 32).efficiency(batch), 1.0)
    # a broken (infinite or NaN) statistic claims no progress, as adaptrain.core.gns.gain: 1/scale
    for grad in [(1.0, math.inf), (math.inf, 1.0), (math.inf, math.inf), (math.nan, 1.0)]:
        fn = GoodputFunction(P1, grad, 32)
        np.testing.assert_allclose(fn.efficiency(batch), 1 / scale, rtol=1e-12)
        good, atomic, _ = fn.optimize(1, 4, 512)
        assert math.isfinite(good) and atomic == 8


# ------------------------------------------------------------------ bad input


def test_bad_init_batch_size():
    for bad in (0, -4, float("nan")):
        with pytest.raises(ValueError, match="init_batch_size"):
            GoodputFunction(P1, GRAD, bad)


def test_bad_params_length():
    with pytest.raises(ValueError, match="perf_params"):
        GoodputFunction(P1[:6], GRAD, 32)
    with pytest.raises(ValueError, match="grad_params"):
        GoodputFunction(P1, (1.0,), 32)


def test_optimize_bad_input():
    fn = GoodputFunction(P1, GRAD, 32)
    with pytest.raises(ValueError, match="max_batch_size=16"):
        fn.optimize(1, 1, max_batch_size=16)
    with pytest.raises(ValueError, match="num_nodes"):
        fn.optimize(0, 1)
    with pytest.raises(ValueError, match="num_nodes"):
        fn.optimize(3, 2)
    with pytest.raises(ValueError, match="atomic_bsz_range"):
        fn.optimize(1, 2, 128, (64, 32))
    with pytest.raises(ValueError, match="atomic_bsz_range"):
        fn.optimize(1, 2, 128, (-1, 32))


def test_optimize_rejects_a_non_finite_or_unrepresentable_max_batch_size():
    # inf used to end in "batch size [[32], [0], ...] is below init_batch_size", and a total
    # past int64 wrapped around to negative batch sizes.
    fn = GoodputFunction(P1, GRAD, 32)
    for bad in (math.inf, 1e19, 1e300):
        for accumulation in (False, True):
            with pytest.raises(ValueError, match="max_batch_size=.*at most 2\\*\\*53"):
                fn.optimize(1, 4, max_batch_size=bad, accumulation=accumulation)
    assert fn.optimize(1, 4, max_batch_size=2**53)[0] > 0


def test_nan_or_infinite_gamma_perf_params_are_rejected():
    for i in range(7):
        with pytest.raises(ValueError, match="perf_params"):
            GoodputFunction(P1[:i] + (math.nan,) + P1[i + 1 :], GRAD, 32)
    with pytest.raises(ValueError, match="gamma"):
        GoodputFunction(P1._replace(gamma=math.inf), GRAD, 32)
    # an infinite cost is meaningful (that link is never worth it): throughput 0 across it
    fn = GoodputFunction(P1._replace(alpha_n=math.inf), GRAD, 32)
    assert fn.throughput(2, 4, 32, 0) == 0.0 and fn.throughput(1, 4, 32, 0) > 0


def test_evaluate_below_initial_batch():
    fn = GoodputFunction(P1, GRAD, 32)
    with pytest.raises(ValueError, match="init_batch_size=32"):
        fn.evaluate(1, 1, 16, 0)


def test_fit_bad_input():
    with pytest.raises(ValueError, match="equal length"):
        fit_perf_params([1, 1], [1, 2], [32], [0.1], [0.1])
    with pytest.raises(ValueError, match="equal length"):
        fit_perf_params([], [], [], [], [])
    with pytest.raises(ValueError, match="accum_step_time"):
        fit_perf_params([1], [1], [32], [-0.1], [0.1])
    with pytest.raises(ValueError, match="optim_step_time"):
        fit_perf_params([1], [1], [32], [0.1], [float("nan")])
    with pytest.raises(ValueError, match="exceeds"):
        fit_perf_params([2], [1], [32], [0.1], [0.1])


# ------------------------------------------------------------------ fit


def _synthetic(params, configs, batches):
    nodes, replicas, bsz = map(np.array, zip(*[(n, r, b) for (n, r) in configs for b in batches]))
    t_accum = G.predict_accum_time(params, bsz)
    t_net = G.predict_network_time(params, nodes, replicas)
    t_optim = np.exp(G.predict_log_optim_time(params, t_accum, t_net))
    return nodes, replicas, bsz, t_accum, t_optim


FULL_CONFIGS = [(1, 1), (1, 2), (1, 4), (1, 8), (2, 2), (2, 4), (4, 8), (4, 16)]


@pytest.mark.parametrize(
    "true",
    [
        PerfParams(0.05, 0.002, 0.3, 0.02, 0.1, 0.005, 2.0),
        PerfParams(0.2, 0.001, 0.5, 0.05, 0.05, 0.01, 1.0),
        PerfParams(0.01, 0.001, 0.08, 0.004, 0.04, 0.002, 4.0),
    ],
)
def test_fit_recovers_known_params(true):
    data = _synthetic(true, FULL_CONFIGS, [16, 64, 256])
    fit = fit_perf_params(*data)
    np.testing.assert_allclose(fit, true, rtol=0.05)
    nodes, replicas, bsz, t_accum, t_optim = data
    pred_a = G.predict_accum_time(fit, bsz)
    pred_o = np.exp(
        G.predict_log_optim_time(fit, pred_a, G.predict_network_time(fit, nodes, replicas))
    )
    np.testing.assert_allclose(pred_a, t_accum, rtol=1e-3)
    np.testing.assert_allclose(pred_o, t_optim, rtol=1e-3)


@settings(max_examples=15, deadline=None)
@given(
    alphas=st.tuples(*[st.floats(1e-2, 1.0)] * 3),
    beta_c=st.floats(1e-4, 1e-2),
    ratios=st.tuples(st.floats(0.0, 0.2), st.floats(0.0, 0.2)),
    gamma=st.floats(1.0, 4.0),
)
def test_fit_predicts_noiseless_times(alphas, beta_c, ratios, gamma):
    true = PerfParams(
        alphas[0], beta_c, alphas[1], alphas[1] * ratios[0], alphas[2], alphas[2] * ratios[1], gamma
    )
    nodes, replicas, bsz, t_accum, t_optim = _synthetic(true, FULL_CONFIGS, [16, 64, 256])
    fit = fit_perf_params(nodes, replicas, bsz, t_accum, t_optim)
    fn_true = GoodputFunction(true, GRAD, 1)
    fn_fit = GoodputFunction(fit, GRAD, 1)
    np.testing.assert_allclose(
        fn_fit.throughput(nodes, replicas, bsz, 0),
        fn_true.throughput(nodes, replicas, bsz, 0),
        rtol=0.05,
    )
    assert 1.0 <= fit.gamma <= 10.0 and min(fit) >= 1e-8


def test_fit_priors_with_few_observations():
    # One atomic batch size: alpha_c fixed to half the mean accumulation time.
    fit = fit_perf_params([1, 1], [1, 2], [32, 32], [0.1, 0.1], [0.1, 0.3])
    assert fit.alpha_c == pytest.approx(0.05)
    # No multi-node data: inter-node at least 1.1 × intra-node; no >2 replicas: betas fixed.
    assert fit.alpha_n >= 1.1 * fit.alpha_r * (1 - 1e-12)
    assert fit.beta_r == pytest.approx(1e-8) and fit.beta_n == pytest.approx(1.1e-8)
    # Single replica only: both network models stay at their floor.
    fit = fit_perf_params([1, 1], [1, 1], [16, 64], [0.1, 0.3], [0.1, 0.3])
    assert fit.alpha_r == pytest.approx(1e-8) and fit.beta_r == pytest.approx(1e-8)
    assert fit.alpha_c + 16 * fit.beta_c == pytest.approx(0.1, rel=1e-3)
    assert fit.alpha_c + 64 * fit.beta_c == pytest.approx(0.3, rel=1e-3)
    assert isinstance(fit, PerfParams) and all(isinstance(v, float) for v in fit)


@settings(max_examples=15, deadline=None)
@given(
    replicas=st.integers(2, 8),
    bsz=st.integers(1, 512),
    t_accum=st.floats(1e-4, 1.0),
    net_ratio=st.floats(0.0, 3.0),
)
@example(replicas=2, bsz=1, t_accum=0.0078125, net_ratio=0.0)  # no network time: the search
@example(replicas=3, bsz=64, t_accum=1e-4, net_ratio=1e-3)  # 0.1 µs: the priors matter
@example(replicas=5, bsz=95, t_accum=0.6848038034977489, net_ratio=2.517578125)  # search stalls
def test_single_configuration_closed_form_is_the_search_minimum(replicas, bsz, t_accum, net_ratio):
    """One single-node configuration with ≥ 2 replicas: the closed form fits both times exactly
    and is a minimum of the objective: no higher than the iterative search's, and no perturbation
    lowers it. The search predicts the same throughputs wherever it reaches that floor."""
    args = ([1], [replicas], [bsz], [t_accum], [t_accum * (1.0 + net_ratio)])
    closed = fit_perf_params(*args)
    fn = GoodputFunction(closed, GRAD, bsz)
    if G._single_configuration_fit(*(np.array(v, float) for v in args)) is not None:
        assert closed.gamma == 1.0 and closed.alpha_c == pytest.approx(t_accum / 2)
        assert float(fn.throughput(1, replicas, bsz, 0)) == pytest.approx(
            replicas * bsz / args[4][0], rel=1e-6
        )
    else:  # a network time of ≲ 20 µs: the search, whose priors move it off the exact fit
        assert t_accum * net_ratio < 1e-4
    with pytest.MonkeyPatch.context() as m:  # the iterative search on the same data
        m.setattr(G, "_single_configuration_fit", lambda *a: None)
        searched = fit_perf_params(*args)
    data = G._FitProblem(
        np.array([bsz], float),
        np.maximum(np.array([replicas - 2.0]), 1e-8),
        np.array([False]),
        np.array([True]),
        np.log(args[3]),
        np.log(args[4]),
    )
    f_closed = G._objective(np.array(closed), data)[0]
    f_searched = G._objective(np.array(searched), data)[0]
    assert f_closed <= f_searched + 1e-9
    if closed != searched:  # a minimum, not just better than one search: no perturbation of a
        # free parameter (beta_r only upwards, from its bound) and no step along the valley of
        # exact fits (gamma up, alpha_r re-solved to fit the optimizer step) lowers the objective
        theta = np.array(closed)
        moves = [(i, f) for i in (1, 4) for f in (1 - 1e-2, 1 - 1e-4, 1 + 1e-4, 1 + 1e-2)]
        moves += [(5, f) for f in (10.0, 1e4)] if replicas > 2 else []
        for i, f in moves:
            t = theta.copy()
            t[i] *= f
            assert G._objective(t, data)[0] >= f_closed - 1e-12, (i, f)
        o, m = args[4][0], max(replicas - 2.0, 1e-8)
        for dg in (1e-4, 1e-2, 1e-1, 1.0):
            t = theta.copy()
            t[6] = 1.0 + dg
            t[4] = (o ** t[6] - t_accum ** t[6]) ** (1.0 / t[6]) - t[5] * m
            if t[4] > 0:
                assert G._objective(t, data)[0] >= f_closed - 1e-12, dg
    if f_searched - f_closed < 1e-7:  # where the search reached the floor it predicts the same;
        # elsewhere it stopped up the flat valley of exact fits (e.g. gamma 1.21, objective 5e-5)
        fn_s = GoodputFunction(searched, GRAD, bsz)
        sizes = np.array([1, bsz, 4 * bsz])
        np.testing.assert_allclose(
            fn.throughput(1, replicas, sizes, 0), fn_s.throughput(1, replicas, sizes, 0), rtol=1e-2
        )


@pytest.mark.parametrize("scale", [1e-30, 1e100, 1e200, 1e300])
def test_fit_of_huge_and_tiny_times_does_not_crash(scale):
    # Times ≳ 1e99 s raised OverflowError from the priors' Python-float powers (ar**3). (The
    # fit is not scale-free near its 1e-8 lower bounds, so only a finite fit is asserted.)
    true = PerfParams(0.05, 0.002, 0.3, 0.02, 0.1, 0.005, 2.0)
    nodes, replicas, bsz, t_accum, t_optim = _synthetic(true, FULL_CONFIGS[:5], [16, 64])
    fit = fit_perf_params(nodes, replicas, bsz, t_accum * scale, t_optim * scale)
    assert all(math.isfinite(v) for v in fit) and 1.0 <= fit.gamma <= 10.0


def test_fit_memo_takes_the_same_path_as_scipys_jac_true():
    # _multi_start hands scipy a value and a gradient sharing one evaluation (keyed on the
    # point's bytes) instead of jac=True (scipy's own memo, which compares arrays): the same
    # iterates, evaluations and minimum, to the last bit, on the fit's real objective.
    true = PerfParams(0.05, 0.002, 0.3, 0.02, 0.1, 0.005, 2.0)
    nodes, replicas, bsz, t_accum, t_optim = _synthetic(true, FULL_CONFIGS[:6], [16, 64])
    t_optim = t_optim * np.exp(RNG.normal(0, 0.05, t_optim.shape))
    m = np.maximum(replicas - 2, 1e-8)
    data = G._FitProblem(
        bsz.astype(float),
        m,
        nodes > 1,
        (nodes == 1) & (replicas > 1),
        np.log(t_accum),
        np.log(t_optim),
    )
    points = []

    def fun(z, smooth=False):
        points.append(z.tobytes())
        theta = np.concatenate([np.exp(z[:6]), z[6:]])
        f, g = G._objective(theta, data, smooth=smooth)
        g[:6] *= theta[:6]
        return f, g

    z0 = np.concatenate([np.log(np.full(6, 0.05)), [1.5]])
    bounds = [(-20.0, 5.0)] * 6 + [(1.0, 10.0)]
    for smooth in (True, False):
        points.clear()
        ref = scipy.optimize.minimize(
            fun,
            z0,
            args=(smooth,),
            jac=True,
            method="L-BFGS-B",
            bounds=bounds,
            options=G._LBFGSB_OPTIONS,
        )
        ref_points = list(points)
        points.clear()
        value, grad = G._memo(fun, smooth)
        got = scipy.optimize.minimize(
            value, z0, jac=grad, method="L-BFGS-B", bounds=bounds, options=G._LBFGSB_OPTIONS
        )
        assert ref.nit > 5 and points == ref_points  # one evaluation per point, in order
        assert got.x.tobytes() == ref.x.tobytes() and got.fun == ref.fun
        assert (got.nfev, got.nit) == (ref.nfev, ref.nit)


def test_single_configuration_closed_form_only_where_exact():
    # One replica (no network term to absorb T_optim − T_accum), two configurations, or a
    # multi-node one: the search runs (the closed form returns None).
    one = [np.array([v], float) for v in (1, 1, 32, 0.1, 0.12)]
    assert G._single_configuration_fit(*one) is None
    multi = [np.array([v], float) for v in (2, 4, 32, 0.1, 0.2)]
    assert G._single_configuration_fit(*multi) is None
    two = [np.array(v, float) for v in ([1, 1], [2, 2], [16, 32], [0.1, 0.15], [0.12, 0.2])]
    assert G._single_configuration_fit(*two) is None
    slower = [np.array([v], float) for v in (1, 2, 32, 0.1, 0.09)]  # T_optim < T_accum
    assert G._single_configuration_fit(*slower) is None
    no_net = [np.array([v], float) for v in (1, 2, 32, 0.1, 0.1)]  # the priors move the minimum
    assert G._single_configuration_fit(*no_net) is None
    real = [np.array([v], float) for v in (1, 2, 4, 0.004, 0.0045)]  # a 0.5 ms all-reduce
    assert G._single_configuration_fit(*real) is not None


def test_objective_gradient_matches_finite_differences():
    nodes, replicas, bsz, t_accum, t_optim = _synthetic(P2, FULL_CONFIGS, [16, 64])
    t_optim = t_optim * np.exp(RNG.normal(0, 0.1, t_optim.shape))  # away from the optimum
    inter = nodes > 1
    intra = ~inter & (replicas > 1)
    m = np.maximum(replicas - 2, 1e-8)
    data = G._FitProblem(bsz.astype(float), m, inter, intra, np.log(t_accum), np.log(t_optim))
    for _ in range(5):
        theta = np.concatenate([RNG.uniform(0.01, 1.0, 6), RNG.uniform(1.0, 5.0, 1)])
        _, grad = G._objective(theta, data)
        numeric = scipy.optimize.approx_fprime(theta, lambda t: G._objective(t, data)[0], 1e-7)
        np.testing.assert_allclose(grad, numeric, rtol=1e-3, atol=1e-5)


def test_fit_then_optimize_end_to_end():
    """Fit on measurements of a few allocations, then plan for a bigger one."""
    true = PerfParams(0.05, 0.002, 0.3, 0.02, 0.1, 0.005, 2.0)
    data = _synthetic(true, [(1, 1), (1, 2), (1, 4), (2, 4), (2, 8)], [32, 64])
    fit = fit_perf_params(*data)
    fn_true = GoodputFunction(true, (1.0, 4.0), 64)
    fn_fit = GoodputFunction(fit, (1.0, 4.0), 64)
    got = fn_fit.optimize(4, 16, max_batch_size=4096, atomic_bsz_range=(16, 512))
    want = fn_true.optimize(4, 16, max_batch_size=4096, atomic_bsz_range=(16, 512))
    assert got[0] == pytest.approx(want[0], rel=0.05)


@settings(max_examples=10, deadline=None)
@given(
    alphas=st.tuples(*[st.floats(1e-2, 1.0)] * 3),
    beta_c=st.floats(1e-4, 1e-2),
    ratios=st.tuples(st.floats(0.0, 0.3), st.floats(0.0, 0.3)),
    gamma=st.floats(1.0, 10.0),
)
def test_fit_objective_no_worse_than_truth(alphas, beta_c, ratios, gamma):
    """The priors may pull the fit off the true parameters (e.g. large γ), but the search
    must reach an objective at least as low as the one at the truth."""
    true = PerfParams(
        alphas[0], beta_c, alphas[1], alphas[1] * ratios[0], alphas[2], alphas[2] * ratios[1], gamma
    )
    nodes, replicas, bsz, t_accum, t_optim = _synthetic(true, FULL_CONFIGS, [16, 64, 256])
    fit = fit_perf_params(nodes, replicas, bsz, t_accum, t_optim)
    inter = nodes > 1
    intra = ~inter & (replicas > 1)
    args = (bsz.astype(float), np.maximum(replicas - 2, 1e-8), inter, intra)
    data = G._FitProblem(*args, np.log(t_accum), np.log(t_optim))
    f_true = G._objective(np.array(true), data)[0]
    f_fit = G._objective(np.array(fit), data)[0]
    assert f_fit <= f_true * 1.05 + 1e-4  # single-start AdaptDL is often 2-10x worse


def test_goodput_model_does_not_import_torch():
    # The efficiency uses adaptrain.core.gns.gain, which must not import torch for numpy input.
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from adaptrain.core.goodput import GoodputFunction\n"
        "fn = GoodputFunction((0.1, 0.01, 0.5, 0.05, 0.2, 0.02, 1.0), (1.0, 1.0), 32)\n"
        "fn.optimize([1, 2], [4, 8], 512, accumulation=True)\n"
        "fn.efficiency(64)\n"
        "assert 'torch' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_public_reexports():
    import adaptrain.core as core
    import adaptrain.goodput as public

    assert public.__all__ == ["PerfParams", "GradParams", "GoodputFunction", "fit_perf_params"]
    assert public.GoodputFunction is G.GoodputFunction
    for name in core.__all__:
        assert hasattr(core, name), name
