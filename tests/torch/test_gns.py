"""GradientNoiseScale: the estimate against the exact truth, API, checkpoint state."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from adaptrain.dist.spawn import spawn
from adaptrain.torch.gradient_noise_scale import GradientNoiseScale

TIMEOUT = 240


def _digits():
    from sklearn.datasets import load_digits

    X, y = load_digits(return_X_y=True)
    return X / 16.0, y


def _truth(W: np.ndarray, b: np.ndarray, B0: int) -> tuple[float, float]:
    """Exact |G|² and tr(Σ)/B0 of softmax regression from all per-sample gradients."""
    X, y = _digits()
    logits = X @ W.T + b
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    d = p.copy()
    d[np.arange(len(y)), y] -= 1.0  # dloss/dlogits per sample
    per_sample = np.concatenate([(d[:, :, None] * X[:, None, :]).reshape(len(y), -1), d], axis=1)
    G = per_sample.mean(0)
    tr_cov = float((per_sample**2).sum(1).mean() - G @ G)  # population covariance trace
    return float(G @ G), tr_cov / B0


def _estimate(rank, ws, steps, b):
    from adaptrain.torch.parallel import AdaptiveDataParallel

    X, y = _digits()
    X = torch.tensor(X, dtype=torch.float32)
    y = torch.tensor(y)
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 10)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # fixed weights: a fixed truth
    adp = AdaptiveDataParallel(model, opt)
    g = torch.Generator().manual_seed(1234)
    for _ in range(steps):
        idx = torch.randint(0, len(y), (ws, b), generator=g)[rank]  # i.i.d. with replacement
        opt.zero_grad()
        F.cross_entropy(adp(X[idx]), y[idx]).backward()
        opt.step()
    adp.gns.flush()
    W = model.weight.detach().double().numpy()
    bias = model.bias.detach().double().numpy()
    return adp.gns.sqr_avg(), adp.gns.var_avg(), W, bias


def test_estimate_within_10_percent_of_exact_truth():
    ws, b = 2, 64
    out = spawn(_estimate, ws, args=(1000, b), timeout=TIMEOUT)
    sqr, var, W, bias = out[0]
    assert out[1][:2] == (sqr, var)
    true_sqr, true_var = _truth(W, bias, B0=ws * b)
    assert abs(sqr - true_sqr) <= 0.1 * true_sqr, (sqr, true_sqr)
    assert abs(var - true_var) <= 0.1 * true_var, (var, true_var)


def test_api_golden_values_and_state_round_trip():
    gns = GradientNoiseScale(num_replicas=2)
    assert gns.gain(8.0) == 1.0 and gns.sqr_avg() == 0.0 and gns.var_avg() == 0.0
    state = gns.state_dict()
    state.update(sqr=(0.5, 0.5, 3), var=(2.0, 0.5, 3), progress=7.5)
    gns.load_state_dict(state)
    assert gns.sqr_avg() == 1.0 and gns.var_avg() == 4.0
    assert gns.gain(4.0) == pytest.approx((4.0 + 1.0) / (4.0 / 4.0 + 1.0))
    assert gns.raw_var_avg.tolist() == [4.0]
    assert gns.get_progress() == 7.5
    other = GradientNoiseScale(num_replicas=2)
    other.load_state_dict(gns.state_dict())
    assert other.state_dict() == gns.state_dict()
    gns.load_state_dict({**state, "sqr": (-0.1, 0.5, 3)})  # a negative raw average is clipped
    assert gns.sqr_avg() == 0.0 and gns.raw_sqr_avg.tolist() == [-0.2]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_replicas": 0},
        {"num_replicas": 2, "smoothing": 1.0},
        {"num_replicas": 2, "window_fraction": 0.0},
    ],
)
def test_bad_arguments_raise(kwargs):
    with pytest.raises(ValueError):
        GradientNoiseScale(**kwargs)


def test_gain_fast_path_agrees_with_core():
    from adaptrain.core import gns as core_gns

    gns = GradientNoiseScale(num_replicas=2)
    for sqr, var in [(1.0, 4.0), (0.0, 3.0), (2.0, 0.0), (1e-3, 1.0)]:
        state = gns.state_dict()
        state.update(sqr=(sqr, 1.0, 1), var=(var, 1.0, 1))
        gns.load_state_dict(state)
        for scale in (1.0, 2.0, 7.5, 64.0):
            assert gns.gain(scale) == pytest.approx(core_gns.gain(sqr, var, scale), rel=1e-12)


def test_growing_window_forgets_the_early_transient():
    """A start with large gradients and little noise, then a steady state: after 8× as many
    steady steps the growing window reports the steady noise scale, AdaptDL's fixed 0.999
    memory still mostly the start (the lag that kept early batch-size decisions too small)."""
    from adaptrain.core import gns as core_gns

    start, steady = (100.0, 99.5), (2.0, 1.5)  # (local, total) of 2 replicas
    ratio = {}
    for frac in (0.25, None):
        gns = GradientNoiseScale(num_replicas=2, window_fraction=frac)
        for local, total in [start] * 50 + [steady] * 400:
            assert gns._take_sample(2, True, 1.0, local, total)
        ratio[frac] = gns.var_avg() / gns.sqr_avg()
        state = gns.state_dict()
        again = GradientNoiseScale(num_replicas=2, window_fraction=frac)
        again.load_state_dict(state)
        for g in (gns, again):  # save -> load -> replay
            g._take_sample(2, True, 1.0, *steady)
        assert again.state_dict() == gns.state_dict()
    est = core_gns.unbiased_estimate(*steady, 2, 0.5)
    truth = est.var / est.sqr
    assert ratio[0.25] == pytest.approx(truth, rel=0.05)
    assert ratio[None] < 0.2 * truth


@pytest.mark.parametrize("bad", [(float("inf"), 1.0), (2.0, float("nan"))])
def test_non_finite_sample_is_skipped_and_its_scale_carried_to_the_next(bad, caplog):
    """An overflowed step (inf/NaN statistics, e.g. fp16 before GradScaler backs off) leaves
    the averages alone, warns, and its scale counts towards the next sample's span."""
    steady = (2.0, 1.5)
    gns, ref = GradientNoiseScale(num_replicas=2), GradientNoiseScale(num_replicas=2)
    for g in (gns, ref):
        assert g._take_sample(2, True, 1.0, *steady)
    averages = gns.averages()
    with caplog.at_level("WARNING", logger="adaptrain.torch.gradient_noise_scale"):
        assert not gns._take_sample(2, True, 1.0, *bad)
    assert "non-finite" in caplog.text
    assert gns.averages() == averages
    assert gns._take_sample(2, True, 1.0, *steady)
    assert ref._take_sample(2, True, 1.0, *steady, span=2.0)  # one sample over both steps
    assert gns.state_dict() == ref.state_dict()


def test_adaptdl_accumulation_accessors():
    """AdaptDL's accumulation bookkeeping on GradientNoiseScale: micro-batches counted until
    the step ends (or a reset), gradients zeroed only at a step's first micro-batch."""
    gns = GradientNoiseScale(num_replicas=2)
    assert (gns.accum_count, gns.should_zero_grad, gns.accum_scale) == (0, True, 1.0)
    gns.count_micro_batch()
    gns.count_micro_batch()
    assert (gns.accum_count, gns.should_zero_grad) == (2, False)
    gns.finish_step(1.0)  # the optimizer step ends the accumulation
    assert (gns.accum_count, gns.should_zero_grad) == (0, True)
    gns.count_micro_batch()
    gns.reset_accumulation()
    assert gns.accum_count == 0
    gns.set_accum_scale(2.5)
    assert gns.accum_scale == 2.5
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="accum_scale"):
            gns.set_accum_scale(bad)
    assert gns.accum_scale == 2.5


def test_sample_interval_cache_follows_scale_and_loaded_history():
    from adaptrain.core.gns import sample_interval

    g = GradientNoiseScale(num_replicas=2)
    state = g.state_dict()
    g.load_state_dict({**state, "history": 1e6})
    assert g.settled_interval(1.0) == 62  # 1000-step memory, 16 samples in it
    assert g.sample_interval(1.0) == 62  # the memory is full: remembered for scale 1
    assert g._settled == (1.0, 62)
    assert g.sample_interval(1.0) == 62
    assert g.sample_interval(8.0) == sample_interval(0.999, 1e6, 0.25, 8.0) == 7
    assert g._settled == (8.0, 7)
    g.load_state_dict({**state, "history": 100.0})  # a shorter history: recomputed
    assert g.sample_interval(1.0) == sample_interval(0.999, 100.0, 0.25, 1.0) == 1
    assert g._settled is None  # still growing: not remembered
    capped = GradientNoiseScale(num_replicas=2, max_interval=32)
    capped.load_state_dict({**state, "history": 1e6})
    assert capped.settled_interval(1.0) == capped.sample_interval(1.0) == 32  # at the cap
