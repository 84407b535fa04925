"""Python-float fast paths of adaptrain.core.gns agree with the numpy/torch paths."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from adaptrain.core.gns import EMAState, ema_init, ema_update, ema_value, is_finite


def test_is_finite_python_numbers():
    assert is_finite(1.0, 2, 0.0, -3.5)
    assert not is_finite(1.0, math.inf)
    assert not is_finite(math.nan)
    assert not is_finite(2, -math.inf, 1.0)
    assert is_finite(True, np.float64(1.0), torch.tensor(2.0))  # other types: general path
    assert not is_finite(1.0, np.float64(math.nan))


def test_ema_update_float_path_matches_numpy_path():
    rng = np.random.default_rng(0)
    fast, slow = ema_init(0.0), EMAState(np.float64(0.0), np.float64(0.0), 0)
    for x in rng.normal(size=50):
        theta = float(rng.uniform(0.5, 0.999))
        fast = ema_update(fast, float(x), theta)
        slow = ema_update(slow, np.float64(x), theta)  # numpy scalars take the general path
        assert type(fast.biased) is float
    assert fast.count == slow.count == 50
    assert fast.biased == float(slow.biased) and fast.weight == float(slow.weight)
    assert ema_value(fast) == float(ema_value(slow))


def test_ema_update_float_path_skips_non_finite_and_checks_smoothing():
    state = ema_update(ema_init(0.0), 2.0, 0.5)
    for bad in (math.nan, math.inf, -math.inf):
        assert ema_update(state, bad, 0.5) is state
    with pytest.raises(ValueError, match="smoothing"):
        ema_update(state, 1.0, 1.0)
