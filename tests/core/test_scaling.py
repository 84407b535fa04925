"""Tests of the pure learning-rate scaling factors (adaptrain.core.scaling)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptrain.core.scaling import (
    adascale_factor,
    legw_factor,
    linear_factor,
    sqrt_adascale_factor,
    sqrt_factor,
)

# this module's examples per property (loading a profile here would change every module's)
SETTINGS = settings(max_examples=60, deadline=None)

stats = st.floats(0.0, 1e6, allow_nan=False)
scales = st.floats(1.0, 1e4, allow_nan=False)


def test_adascale_golden():
    # r = (var + sqr) / (var/S + sqr): var = sqr = 1, S = 4 → 2 / 1.25 = 1.6.
    assert adascale_factor(4.0, sqr=1.0, var=1.0) == pytest.approx(1.6)
    assert sqrt_adascale_factor(4.0, sqr=1.0, var=1.0) == pytest.approx(math.sqrt(1.6))
    # Pure noise → linear scaling; no noise → no scaling.
    assert adascale_factor(8.0, sqr=0.0, var=3.0) == pytest.approx(8.0)
    assert adascale_factor(8.0, sqr=3.0, var=0.0) == pytest.approx(1.0)
    # Scale 1 is always 1.
    assert adascale_factor(1.0, sqr=2.0, var=5.0) == pytest.approx(1.0)


def test_adascale_negative_raw_statistics_are_clipped():
    # A raw average can dip below zero; it is clipped at 0, so the gain stays in [1, S].
    assert adascale_factor(4.0, sqr=-1.0, var=2.0) == pytest.approx(4.0)
    assert adascale_factor(4.0, sqr=2.0, var=-1.0) == pytest.approx(1.0)


def test_empty_statistics():
    # Both statistics 0 (no estimate yet): factor 1 (no scaling).
    assert adascale_factor(4.0, sqr=0.0, var=0.0) == pytest.approx(1.0)


@SETTINGS
@given(scale=scales, sqr=stats, var=stats)
def test_adascale_bounds_and_sqrt_variant(scale, sqr, var):
    r = adascale_factor(scale, sqr, var)
    assert 1.0 - 1e-9 <= r <= scale * (1 + 1e-9)
    assert sqrt_adascale_factor(scale, sqr, var) == pytest.approx(math.sqrt(r), rel=1e-12)


@SETTINGS
@given(s1=scales, s2=scales, sqr=stats, var=stats)
def test_adascale_monotone_in_scale_and_sublinear(s1, s2, sqr, var):
    lo, hi = sorted((s1, s2))
    r_lo, r_hi = adascale_factor(lo, sqr, var), adascale_factor(hi, sqr, var)
    assert r_lo <= r_hi * (1 + 1e-12)
    # Gain per unit scale (the statistical efficiency) does not increase with scale.
    assert r_hi / hi <= r_lo / lo * (1 + 1e-12)


@SETTINGS
@given(scale=scales)
def test_linear_and_sqrt(scale):
    assert linear_factor(scale) == scale
    assert sqrt_factor(scale) == pytest.approx(math.sqrt(scale))
    # The statistics and progress are ignored by the static rules.
    assert linear_factor(scale, 1.0, 2.0, 3.0) == scale
    assert sqrt_factor(scale, 1.0, 2.0, 3.0) == pytest.approx(math.sqrt(scale))


def test_legw_golden():
    # S = 4, 2 warm-up epochs of 100 steps: warm-up lasts 4 · 2 · 100 = 800 steps, peak 2.
    assert legw_factor(4.0, progress=0.0, base_warmup_epochs=2, steps_per_epoch=100) == 0.0
    assert legw_factor(4.0, 200.0, 2, 100) == pytest.approx(0.5)
    assert legw_factor(4.0, 400.0, 2, 100) == pytest.approx(1.0)
    assert legw_factor(4.0, 800.0, 2, 100) == pytest.approx(2.0)
    assert legw_factor(4.0, 5000.0, 2, 100) == pytest.approx(2.0)
    # No warm-up: the peak right away (AdaptDL: progress < 0 is never true).
    assert legw_factor(9.0, 0.0, 0, 100) == pytest.approx(3.0)


@SETTINGS
@given(
    scale=scales,
    p1=st.floats(0.0, 1e6),
    p2=st.floats(0.0, 1e6),
    epochs=st.floats(0.0, 10.0),
    steps=st.floats(1.0, 1e4),
)
def test_legw_monotone_and_capped(scale, p1, p2, epochs, steps):
    lo, hi = sorted((p1, p2))
    f_lo = legw_factor(scale, lo, epochs, steps)
    f_hi = legw_factor(scale, hi, epochs, steps)
    assert 0.0 <= f_lo <= f_hi * (1 + 1e-12) + 1e-300
    assert f_hi <= math.sqrt(scale) * (1 + 1e-12)


@pytest.mark.parametrize(
    "call",
    [
        lambda: adascale_factor(0.0, 1.0, 1.0),
        lambda: sqrt_adascale_factor(-1.0, 1.0, 1.0),
        lambda: linear_factor(0.0),
        lambda: sqrt_factor(-2.0),
        lambda: legw_factor(0.0, 1.0, 1.0, 10.0),
        lambda: linear_factor(math.inf),
        lambda: sqrt_factor(math.nan),
        lambda: adascale_factor(math.inf, 1.0, 1.0),
        lambda: legw_factor(math.inf, 1.0, 1.0, 10.0),
    ],
)
def test_bad_scale(call):
    with pytest.raises(ValueError, match="scale="):
        call()


def test_legw_bad_arguments():
    with pytest.raises(ValueError, match="base_warmup_epochs=-1"):
        legw_factor(2.0, 0.0, -1, 10.0)
    with pytest.raises(ValueError, match="steps_per_epoch=0"):
        legw_factor(2.0, 0.0, 1, 0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"base_warmup_epochs": math.nan}, "base_warmup_epochs=nan"),
        ({"base_warmup_epochs": math.inf}, "base_warmup_epochs=inf"),
        ({"steps_per_epoch": math.nan}, "steps_per_epoch=nan"),
        ({"steps_per_epoch": math.inf}, "steps_per_epoch=inf"),
        ({"progress": math.nan}, "progress=nan"),
    ],
)
def test_legw_non_finite_arguments_are_errors_not_a_nan_or_zero_lr(kwargs, match):
    # Each used to pass the checks and give a NaN factor (or 0 for ever: an infinite warm-up).
    args = {"scale": 4.0, "progress": 10.0, "base_warmup_epochs": 2.0, "steps_per_epoch": 10.0}
    with pytest.raises(ValueError, match=match):
        legw_factor(**{**args, **kwargs})
