"""Fixtures shared by the tests of ``adaptrain.torch`` and its checkpointed state."""

import pytest

from adaptrain import checkpoint


@pytest.fixture
def fresh_checkpoints(monkeypatch):
    """No checkpoint directory, and an empty State registry before and after the test."""
    monkeypatch.delenv("ADAPTRAIN_CHECKPOINT_PATH", raising=False)
    checkpoint.reset()
    yield
    checkpoint.reset()
