"""remaining_epochs_until / current_epoch / finished_epochs, restart-consistent."""

from __future__ import annotations

import pytest

from adaptrain import checkpoint
from adaptrain.torch import current_epoch, finished_epochs, remaining_epochs_until

pytestmark = pytest.mark.usefixtures("fresh_checkpoints")


def test_consecutive_loops_continue_the_count():
    assert current_epoch() is None and finished_epochs() == 0
    seen = []
    for e in remaining_epochs_until(3):
        assert current_epoch() == e == finished_epochs()
        seen.append(e)
    assert finished_epochs() == 3 and current_epoch() is None
    seen += list(remaining_epochs_until(5))
    assert seen == [0, 1, 2, 3, 4]
    assert list(remaining_epochs_until(4)) == []  # already past it


def test_nested_loops_and_bad_argument():
    for _ in remaining_epochs_until(1):
        with pytest.raises(RuntimeError, match="overlapping"):
            next(iter(remaining_epochs_until(2)))
    with pytest.raises(ValueError, match="epoch="):
        next(iter(remaining_epochs_until(2.5)))
    import numpy as np

    assert list(remaining_epochs_until(np.int64(3))) == [1, 2]  # numpy integers are ints


def test_break_counts_the_epoch_as_finished():
    for e in remaining_epochs_until(10):
        if e == 2:
            break
    assert finished_epochs() == 3 and current_epoch() is None


def test_resume_in_the_interrupted_epoch(monkeypatch, tmp_path):
    monkeypatch.setenv("ADAPTRAIN_CHECKPOINT_PATH", str(tmp_path))
    for e in remaining_epochs_until(5):
        if e == 2:
            checkpoint.save_all_states()  # interrupted inside epoch 2
            break
    checkpoint.reset()  # restarted process
    assert finished_epochs() == 2
    assert list(remaining_epochs_until(5)) == [2, 3, 4]


def test_an_exception_leaving_the_loop_finishes_the_epoch_as_documented(
    monkeypatch, tmp_path
) -> None:
    monkeypatch.setenv("ADAPTRAIN_CHECKPOINT_PATH", str(tmp_path))
    # Saved outside the loop after an error: the interrupted epoch 1 counts as finished.
    with pytest.raises(ZeroDivisionError):
        try:
            for e in remaining_epochs_until(5):
                if e == 1:
                    1 / 0  # noqa: B018
        finally:
            assert current_epoch() is None and finished_epochs() == 2
            checkpoint.save_all_states()
    checkpoint.reset()
    assert finished_epochs() == 2
    # Saved inside the loop body: the epoch is still current and is resumed after a restart.
    checkpoint.reset()
    with pytest.raises(ZeroDivisionError):
        for e in remaining_epochs_until(5):
            try:
                if e == 3:
                    1 / 0  # noqa: B018
            except ZeroDivisionError:
                checkpoint.save_all_states()
                raise
    checkpoint.reset()
    assert finished_epochs() == 3
    assert list(remaining_epochs_until(5)) == [3, 4]
