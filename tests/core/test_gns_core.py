"""Tests of the pure gradient-noise estimator (adaptrain.core.gns)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.sparse
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from adaptrain.core.gns import (
    GNSEstimate,
    b3_init,
    b3_rescale,
    b3_update,
    b3_value,
    clip_estimate,
    ema_init,
    ema_rescale,
    ema_update,
    ema_value,
    gain,
    is_finite,
    sqrt_gain,
    unbiased_estimate,
    window_smoothing,
)


def _estimates_from_micro_grads(g: np.ndarray, micro_scale: float) -> GNSEstimate:
    """Vectorised estimates: ``g`` has shape (draws, K, D), each row a micro-batch gradient."""
    k = g.shape[1]
    local = (g**2).sum(-1).mean(1)
    total = (g.mean(1) ** 2).sum(-1)
    return unbiased_estimate(local, total, k, micro_scale)


@pytest.mark.parametrize("k", [2, 4, 8])
def test_unbiased_on_synthetic_gaussian_gradients(k):
    rng = np.random.default_rng(0)
    d, b, b0, draws = 20, 4, 2, 40000
    mean = rng.normal(size=d) * 0.5  # |G|² ≈ 5
    a = rng.normal(size=(d, d)) / math.sqrt(d)
    cov = a @ a.T * 3.0  # per-sample covariance Σ
    g = rng.multivariate_normal(mean, cov / b, size=(draws, k))
    est = _estimates_from_micro_grads(g, micro_scale=b / b0)
    true_sqr, true_var = float(mean @ mean), float(np.trace(cov) / b0)
    for got, truth in ((est.sqr, true_sqr), (est.var, true_var)):
        se = got.std() / math.sqrt(draws)
        assert abs(got.mean() - truth) < 5 * se + 1e-12, (got.mean(), truth, se)
        assert abs(got.mean() - truth) < 0.03 * truth


def test_biased_naive_estimator_is_detected():
    """Control: |ḡ|² alone is biased by tr(Σ)/(K b); the test above would catch it."""
    rng = np.random.default_rng(1)
    g = rng.normal(1.0, 2.0, size=(20000, 4, 5))  # |G|² = 5, tr(Σ) = 20 with b = 1
    naive = (g.mean(1) ** 2).sum(-1).mean()
    assert naive == pytest.approx(5 + 20 / 4, rel=0.03)
    assert _estimates_from_micro_grads(g, 1.0).sqr.mean() == pytest.approx(5, rel=0.03)


def test_unbiased_estimate_works_on_tensors_and_rejects_bad_input():
    est = unbiased_estimate(torch.tensor([3.0]), torch.tensor([2.0]), 2, 0.5)
    assert torch.allclose(est.sqr, torch.tensor([1.0]))  # (2·2 − 3)/1
    assert torch.allclose(est.var, torch.tensor([1.0]))  # (3 − 2)·2·0.5
    with pytest.raises(ValueError, match="count=1"):
        unbiased_estimate(1.0, 1.0, 1, 1.0)
    with pytest.raises(ValueError, match="micro_scale"):
        unbiased_estimate(1.0, 1.0, 2, 0.0)


def test_ema_debiasing_constant_and_weights():
    state = ema_init(np.zeros(3))
    assert np.all(ema_value(state) == 0)
    value = np.array([1.0, -2.0, 3.0])
    for _ in range(5):
        state = ema_update(state, value, 0.9)
        np.testing.assert_allclose(ema_value(state), value, rtol=1e-12)  # no bias towards 0
    # Explicit weighted mean of a sequence: weights θ^(n-1-i)(1-θ), normalised.
    xs = [1.0, 4.0, -2.0, 7.0]
    theta, state = 0.7, ema_init(0.0)
    for x in xs:
        state = ema_update(state, x, theta)
    w = np.array([theta ** (len(xs) - 1 - i) for i in range(len(xs))])
    assert ema_value(state) == pytest.approx(float((w * xs).sum() / w.sum()), rel=1e-12)
    assert state.count == 4
    with pytest.raises(ValueError, match="smoothing"):
        ema_update(state, 1.0, 1.0)


def test_ema_skips_non_finite_and_rescales():
    state = ema_update(ema_init(0.0), 2.0, 0.5)
    for bad in (math.nan, math.inf, np.array([1.0, np.nan]), torch.tensor([-math.inf])):
        assert ema_update(state, bad, 0.5) is state
    assert not is_finite(1.0, torch.tensor([1.0, math.nan]))
    assert is_finite(1.0, np.ones(2), torch.ones(2))
    assert ema_value(ema_rescale(state, 0.25)) == pytest.approx(0.5)


def test_window_smoothing_grows_then_caps():
    assert window_smoothing(0.999, 0.0, 0.25) == 0.0  # the first sample replaces the average
    assert window_smoothing(0.999, 100.0, 0.25) == pytest.approx(1 - 1 / 26)  # memory ~26
    assert window_smoothing(0.999, 1e6, 0.25) == 0.999  # capped by the fixed rule
    assert window_smoothing(0.999, 5.0, None) == 0.999  # AdaptDL's fixed smoothing


def test_b3_average_mean_then_ema():
    theta = 0.75  # plain mean for the first 1/(1-θ) = 4 samples (counts 1..3), then EMA
    xs = [1.0, 2.0, 6.0, 10.0, 4.0]
    state = b3_init(0.0)
    values = []
    for x in xs:
        state = b3_update(state, x, theta)
        values.append(b3_value(state))
    assert values[:3] == pytest.approx([1.0, 1.5, 3.0])
    assert values[3] == pytest.approx(theta * 3.0 + (1 - theta) * 10.0)
    assert values[4] == pytest.approx(theta * values[3] + (1 - theta) * 4.0)
    assert b3_update(state, math.nan, theta) is state
    assert b3_value(b3_rescale(state, 2.0)) == pytest.approx(2 * values[4])


def test_clip_estimate_floors_and_keeps_nan():
    est = clip_estimate(GNSEstimate(np.array([-1.0, 2.0]), np.array([-3.0, np.nan])), 0.0, 1e-6)
    np.testing.assert_array_equal(est.sqr, [0.0, 2.0])
    assert est.var[0] == 1e-6 and np.isnan(est.var[1])
    t = clip_estimate(GNSEstimate(torch.tensor([-1.0]), torch.tensor([math.nan])), 0.0, 1e-6)
    assert t.sqr.item() == 0.0 and math.isnan(t.var.item())


@settings(max_examples=200, deadline=None)
@given(
    sqr=st.floats(-10, 1e6, allow_nan=False),
    var=st.floats(-10, 1e6, allow_nan=False),
    scale=st.floats(1.0, 1e4),
)
@example(sqr=0.0, var=2.2250738585e-313, scale=1.25)  # subnormal var: var/scale loses digits
@example(sqr=5e-324, var=0.0, scale=1.25)
def test_gain_bounds(sqr, var, scale):
    r = gain(sqr, var, scale)
    assert 1.0 - 1e-12 <= r <= scale * (1 + 1e-12)
    assert 1.0 - 1e-12 <= sqrt_gain(sqr, var, scale) <= math.sqrt(scale) * (1 + 1e-12)
    rt = gain(torch.tensor(sqr, dtype=torch.float64), torch.tensor(var, dtype=torch.float64), scale)
    assert float(rt) == pytest.approx(r, rel=1e-12)


def test_gain_limits():
    assert gain(0.0, 0.0, 8.0) == 1.0  # no statistics yet
    assert gain(1.0, 0.0, 8.0) == 1.0  # noiseless: no benefit from a larger batch
    assert gain(0.0, 1.0, 8.0) == pytest.approx(8.0)  # pure noise: linear scaling
    assert gain(1.0, 1.0, 1.0) == 1.0


_GRID = (math.nan, math.inf, -math.inf, 0.0, -1.0, 5e-324, 1e-3, 1.0, 1e300)


@pytest.mark.parametrize("scale", [0.5, 1.0, 4.0, 1e6, math.inf])
def test_gain_float_numpy_and_torch_paths_agree_on_non_finite_statistics(scale):
    # The float fast path used to return NaN for (1.0, nan) and (1.0, inf) (max(x, nan) depends
    # on the argument order) where numpy and torch give 1, and to divide by zero at var/inf.
    for sqr in _GRID:
        for var in _GRID:
            f = gain(sqr, var, scale)
            n = gain(np.float64(sqr), np.float64(var), scale)
            a = gain(np.array([sqr]), np.array([var]), scale)[0]
            t = float(
                gain(
                    torch.tensor(sqr, dtype=torch.float64),
                    torch.tensor(var, dtype=torch.float64),
                    scale,
                )
            )
            assert type(f) is float and (math.isfinite(f) or scale == math.inf), (sqr, var, f)
            assert f == n == a == t, (sqr, var, scale, f, n, a, t)
            if math.isnan(sqr) or math.isnan(var) or math.inf in (sqr, var):
                assert f == 1.0  # a broken statistic claims no progress


@pytest.mark.parametrize("scale", [0, 0.0, -1.0, math.nan, -math.inf])
def test_gain_rejects_a_non_positive_scale_on_every_path(scale):
    # scale=0 raised ZeroDivisionError on the float path and returned 0 (or 1) on numpy's.
    with pytest.raises(ValueError, match="scale=.*must be positive"):
        gain(1.0, 1.0, scale)
    with pytest.raises(ValueError, match="scale=.*must be positive"):
        gain(np.float64(1.0), 1.0, scale)
    with pytest.raises(ValueError, match="scale=.*must be positive"):
        gain(np.ones(3), np.ones(3), np.array([1.0, 2.0, scale]))
    with pytest.raises(ValueError, match="scale=.*must be positive"):
        gain(torch.tensor(1.0), torch.tensor(1.0), scale)
    with pytest.raises(ValueError, match="scale=.*must be positive"):
        gain(torch.tensor(1.0), torch.tensor(1.0), torch.tensor(scale))


# --------------------------------------------------------------------------------------------
# Truth test: a small network on sklearn's digits, exact full-data gradient and per-sample
# gradient covariance, against the averaged estimates from random micro-batches.


def _digits_per_sample_grads() -> np.ndarray:
    from sklearn.datasets import load_digits
    from torch.func import functional_call, grad, vmap

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float64)
    y = torch.tensor(y)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 16), torch.nn.Tanh(), torch.nn.Linear(16, 10)
    ).double()
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, xi, yi):
        out = functional_call(model, p, (xi.unsqueeze(0),))
        return torch.nn.functional.cross_entropy(out, yi.unsqueeze(0))

    per = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    return torch.cat([v.reshape(len(x), -1) for v in per.values()], 1).numpy()


def test_truth_on_digits_within_ten_percent():
    per = _digits_per_sample_grads()  # (N, D): exact per-sample gradients
    n = per.shape[0]
    full = per.mean(0)
    true_sqr = float(full @ full)
    tr_cov = float(((per - full) ** 2).sum(1).mean())  # population covariance trace
    rng = np.random.default_rng(0)
    k, b, b0, draws = 4, 16, 32, 6000
    idx = rng.integers(0, n, size=(draws * k, b))  # i.i.d. samples (with replacement)
    rows = np.repeat(np.arange(draws * k), b)
    pick = scipy.sparse.csr_matrix(
        (np.full(rows.size, 1.0 / b), (rows, idx.ravel())), (draws * k, n)
    )
    micro = (pick @ per).reshape(draws, k, -1)  # (draws, K, D) micro-batch mean gradients
    est = _estimates_from_micro_grads(micro, micro_scale=b / b0)
    assert est.sqr.mean() == pytest.approx(true_sqr, rel=0.10)
    assert est.var.mean() == pytest.approx(tr_cov / b0, rel=0.10)
    # and the same through a debiased EMA of the raw samples (what AdaScale averages)
    state_s, state_v = ema_init(0.0), ema_init(0.0)
    for s_, v_ in zip(est.sqr, est.var):
        state_s = ema_update(state_s, s_, 0.999)
        state_v = ema_update(state_v, v_, 0.999)
    assert ema_value(state_s) == pytest.approx(true_sqr, rel=0.10)
    assert ema_value(state_v) == pytest.approx(tr_cov / b0, rel=0.10)


def test_sample_interval_keeps_enough_samples_in_the_memory():
    from adaptrain.core.gns import sample_interval

    # early: the memory is short, every step is sampled
    assert sample_interval(0.999, 0.0, 0.25, 1.0) == 1
    assert sample_interval(0.999, 100.0, 0.25, 1.0) == 1  # memory 26 steps < 2 × 16 samples
    # memory 1 + 0.25·t steps, 16 samples in it: floor((1 + 0.25 t)/16)
    assert sample_interval(0.999, 500.0, 0.25, 1.0) == 7
    # capped at AdaptDL's memory (1000 steps) and at max_interval
    # the default cap (64) is above the rule's 1000 / 16 = 62 steps at scale 1
    assert sample_interval(0.999, 1e9, 0.25, 1.0) == 62
    assert sample_interval(0.999, 1e9, 0.25, 1.0, max_interval=32) == 32
    assert sample_interval(0.999, 1e9, 0.25, 1.0, max_interval=16) == 16
    assert sample_interval(0.999, 1e9, 0.25, 1.0, max_interval=64) == 62
    # at scale S a step covers S units: the memory holds S times fewer steps
    assert sample_interval(0.999, 1e9, 0.25, 8.0, max_interval=64) == 7
    assert sample_interval(0.999, 1e9, None, 1.0, samples_per_window=30, max_interval=64) == 33
    assert sample_interval(0.999, 1e9, 0.25, 1.0, max_interval=1) == 1  # AdaptDL: every step
