"""Restart-consistent epoch loop (``adaptdl.torch.epoch`` equivalent).

The training program is a loop over epochs, each holding loops over data loaders. A
checkpoint-restart may happen between any two iterations of any data-loader loop; after the
restart the program runs again from the top, finished epochs are skipped, and data-loader loops
already finished in the current epoch are skipped (see :mod:`adaptrain.torch.data`). Code right
before an epoch loop and right before a data-loader loop must therefore be idempotent::

    for epoch in remaining_epochs_until(30):
        lr_scheduler.step()      # WRONG: runs again after a restart inside this epoch
        for batch in train_loader: ...
        for batch in valid_loader: ...
        lr_scheduler.step()      # OK: nothing can restart between here and the epoch's end

The number of finished epochs is a checkpointed :class:`~adaptrain.checkpoint.State`.
"""

from __future__ import annotations

import logging
import numbers
import pickle
from collections.abc import Iterator
from typing import BinaryIO

from adaptrain.dist import checkpoint

__all__ = ["current_epoch", "finished_epochs", "remaining_epochs_until"]

logger = logging.getLogger(__name__)


class _EpochState(checkpoint.State):
    def __init__(self) -> None:
        super().__init__("adaptrain-epoch")
        self.finished_epochs = 0
        self.current_epoch: int | None = None

    def save(self, fileobj: BinaryIO) -> None:
        pickle.dump({"finished_epochs": int(self.finished_epochs)}, fileobj)

    def load(self, fileobj: BinaryIO) -> None:
        self.finished_epochs = int(pickle.load(fileobj)["finished_epochs"])


_STATE: _EpochState | None = None


def _state() -> _EpochState:
    global _STATE
    if _STATE is None:
        _STATE = _EpochState()
        checkpoint.load_state(_STATE)
    return _STATE


def _reset() -> None:
    global _STATE
    _STATE = None


checkpoint.register_reset_hook(_reset)


def remaining_epochs_until(epoch: int) -> Iterator[int]:
    """Yield the epochs from :func:`finished_epochs` up to ``epoch`` (exclusive).

    After a checkpoint-restart, epochs finished before the restart are skipped and the
    interrupted epoch is resumed. Consecutive loops continue the count::

        for e in remaining_epochs_until(30): ...   # 0..29
        for e in remaining_epochs_until(60): ...   # 30..59

    When an epoch counts as finished (as in AdaptDL): as soon as the loop leaves its body for
    that epoch, in any way: the body runs to its end, ``break`` leaves the loop, or an
    exception propagates out of the loop. (Python closes the generator as the exception
    unwinds past the ``for``; inside the generator that cannot be told from a ``break``.) So a
    checkpoint taken after an exception has left the loop, in an ``except`` or ``finally``
    around it, records the interrupted epoch as finished, and a restart from it skips the rest
    of that epoch::

        try:
            for epoch in remaining_epochs_until(30):
                train_one_epoch()                # raises in epoch 7
        finally:
            checkpoint.save_all_states()         # WRONG: records 8 finished epochs

    Checkpoint while the epoch is still current instead: leave it to adaptrain's preemption
    path (on SIGTERM/SIGINT the training data loader saves at a step boundary inside the loop
    body, before the ``SystemExit`` it raises unwinds the loop, so a restart resumes the
    interrupted epoch at its position), or call :func:`~adaptrain.checkpoint.save_all_states`
    inside the loop body, at a point every replica reaches (it is collective), e.g. after a
    data-loader loop. To keep the error's epoch, save in an ``except`` *inside* the loop body,
    and only if the error happens on every replica at the same point (otherwise the others
    never join the save).

    Raises:
        RuntimeError: if called inside another epoch loop.
        ValueError: if ``epoch`` is not an integer.
    """
    if isinstance(epoch, bool) or not isinstance(epoch, numbers.Integral):
        raise ValueError(f"epoch={epoch!r} must be an int (the epoch to stop before)")
    epoch = int(epoch)  # numpy integers too (e.g. np.int64 from a config array)
    if current_epoch() is not None:
        raise RuntimeError("overlapping epoch loops detected: finish the current one first")
    state = _state()
    if state.finished_epochs < epoch:
        logger.info("starting at epoch %s", state.finished_epochs)
    else:
        logger.info("skipping all epochs up to %s", epoch)
    while state.finished_epochs < epoch:
        state.current_epoch = state.finished_epochs
        try:
            yield state.current_epoch
        finally:
            # Also on break or an exception leaving the loop (both arrive as GeneratorExit,
            # indistinguishable here): the epoch counts as finished (see the docstring).
            state.finished_epochs += 1
            state.current_epoch = None


def current_epoch() -> int | None:
    """The current epoch inside :func:`remaining_epochs_until`, else None."""
    return _state().current_epoch


def finished_epochs() -> int:
    """Number of epochs finished so far (restart-consistent); equals :func:`current_epoch` inside."""
    return _state().finished_epochs
