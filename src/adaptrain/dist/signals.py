"""Graceful stop on SIGINT/SIGTERM that every replica agrees on (distributed glue).

Protocol (AdaptDL's, made explicit):

1. :func:`install` (called by ``init_process_group`` and by the data loader, main thread only)
   replaces the SIGINT/SIGTERM handlers. The first signal only records its number; a second
   signal restores the previous handler and re-raises, forcing an immediate exit.
2. At every optimizer-step boundary the training data loader calls :func:`poll_stop`. It returns
   the result of the *previous* poll's asynchronous allreduce (max of the replicas' recorded
   signal numbers) and starts the next one. The allreduce overlaps the step's compute, and since
   every replica reads the same reduced value at the same step, all of them stop after the same
   step, even when only one of them got the signal (as when torchrun forwards SIGTERM, or a
   user presses Ctrl-C on one node).
3. :func:`graceful_exit` saves every State once (``save_all_states``: rank 0 writes, then a
   barrier so no replica exits before the checkpoint is complete), destroys the process group and
   raises ``SystemExit(128 + signum)``: **exit code 143 after SIGTERM, 130 after SIGINT**, on
   every replica (torchrun therefore reports the interrupted run as failed, as it should: the job
   is not finished; rerun it with the same ``ADAPTRAIN_CHECKPOINT_PATH`` to resume).
"""

from __future__ import annotations

import logging
import signal
import threading
from concurrent.futures import Future
from typing import Any

import torch.distributed as dist

from adaptrain.dist import checkpoint, collective

__all__ = [
    "exit_flag",
    "get_exit_flag",
    "graceful_exit",
    "install",
    "installed",
    "poll_stop",
    "reset",
    "uninstall",
]

logger = logging.getLogger(__name__)

_signum = 0  # first signal received by this process, 0 if none
_previous: dict[int, Any] = {}
_pending: Future | None = None


def _handler(signum: int, frame: Any) -> None:
    global _signum
    if _signum:
        # Second signal: give up on the graceful path.
        logger.warning("got %s again, forcing exit", signal.Signals(signum).name)
        signal.signal(signum, _previous.get(signum, signal.SIG_DFL))
        signal.raise_signal(signum)
        return
    _signum = signum
    logger.info(
        "got %s, exiting gracefully after the current step... send the signal again to force exit",
        signal.Signals(signum).name,
    )


def install() -> bool:
    """Install the SIGINT/SIGTERM handlers (idempotent); False off the main thread."""
    if installed():
        return True
    if threading.current_thread() is not threading.main_thread():
        return False
    for sig in (signal.SIGINT, signal.SIGTERM):
        _previous[sig] = signal.signal(sig, _handler)
    return True


def installed() -> bool:
    """True when this module's handlers are the current SIGINT/SIGTERM handlers."""
    return signal.getsignal(signal.SIGTERM) is _handler


def exit_flag() -> int:
    """The signal number received by this process (0 if none)."""
    return _signum


def get_exit_flag() -> bool:
    """Whether this process received SIGINT or SIGTERM (``adaptdl._signal`` name)."""
    return bool(_signum)


def poll_stop() -> int:
    """Collective, once per step on every replica: the agreed signal number, or 0 to go on.

    Returns what the previous call's asynchronous allreduce (max over replicas) found, and
    starts the next one unless a stop was agreed.
    """
    global _pending
    agreed = _pending.result() if _pending is not None else 0
    _pending = None
    if not agreed:
        _pending = collective.allreduce_async(_signum, max)
    return int(agreed)


def graceful_exit(signum: int) -> None:
    """Checkpoint once (rank 0 writes), wait for everybody, and exit with ``128 + signum``."""
    saved = checkpoint.save_all_states()
    name = signal.Signals(signum).name if signum in signal.Signals._value2member_map_ else signum
    logger.info("stopping on %s: %s", name, "checkpoint saved" if saved else "checkpointing is off")
    collective.teardown()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    raise SystemExit(128 + signum)


def uninstall() -> None:
    """Put back the SIGINT/SIGTERM handlers that :func:`install` replaced (main thread only)."""
    if installed() and threading.current_thread() is threading.main_thread():
        for sig, previous in _previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        _previous.clear()


def reset() -> None:
    """Forget a received signal and any pending poll, and uninstall (tests, in-process restarts)."""
    global _signum, _pending
    if _pending is not None:
        try:
            _pending.result(timeout=30)
        except Exception:  # noqa: BLE001 - the group may be gone already
            pass
    _signum = 0
    _pending = None
    uninstall()


checkpoint.register_reset_hook(reset)
