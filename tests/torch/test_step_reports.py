"""The per-step report helpers of AdaptiveDataParallel equal the calls they replace."""

from __future__ import annotations

import numpy as np
import pytest

from adaptrain import checkpoint
from adaptrain.torch import _metrics
from adaptrain.torch.gradient_noise_scale import GradientNoiseScale


@pytest.fixture(autouse=True)
def _fresh_state():
    checkpoint.reset()
    yield
    checkpoint.reset()


def test_update_step_is_update_progress_and_update_grad_params():
    _metrics.update_progress(3.5)
    _metrics.update_grad_params(0.25, 4.0)
    expected = _metrics._state().to_dict()
    checkpoint.reset()  # a fresh metrics state, created by the call itself
    _metrics.update_step(3.5, (0.25, 4.0))
    assert _metrics._state().to_dict() == expected
    assert _metrics.get_progress() == 3.5 and type(_metrics.get_progress()) is float


def test_advance_progress_is_set_progress_of_get_progress_plus_gain():
    a, b = GradientNoiseScale(num_replicas=1), GradientNoiseScale(num_replicas=1)
    for gain in (1.0, 1.75, np.float64(2.5), 1):
        b.set_progress(b.get_progress() + gain)
        assert a.advance_progress(gain) == b.get_progress() == a.get_progress()
        assert type(a.get_progress()) is float
