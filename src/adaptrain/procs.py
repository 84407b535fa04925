"""Child processes that never outlive the process that started them.

The processes adaptrain starts (the simulator's fit workers, the demo's torchrun agent and its
replicas) call :func:`die_with_parent` first thing, with the process id of the parent that
started them: when that parent dies, however it dies (SIGTERM, SIGINT, SIGKILL, a crash), the
child gets a signal and ends too, instead of running on orphaned.

On Linux this is ``prctl(PR_SET_PDEATHSIG)``: the kernel sends the signal as the parent exits.
The kernel sends it when the *thread* that started the child ends, so start such children from
a thread that outlives them (the main thread, or the thread that also stops them). The request
is cleared in a child of a set-user-ID or set-group-ID program's exec, so it is made by the
child itself. Elsewhere a daemon thread watches :func:`os.getppid` (a process whose parent
died is handed to another one) and sends the signal within :data:`POLL_SECONDS`.

Either way the parent may already have died before the request: the child then compares its
parent with the one expected and signals itself at once.

:func:`sigterm_as_interrupt` is the parent's side: within it a SIGTERM stops the program the way
a Ctrl-C does, so its ``finally`` blocks stop its children cleanly (and multiprocessing's
resource tracker, which exits once no process holds its pipe, goes with them).
:func:`recorded_interrupts` keeps a record of those signals, so a long loop can raise one again
that Python dropped.

This module imports neither torch nor any other part of adaptrain.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator

__all__ = [
    "POLL_SECONDS",
    "die_with_parent",
    "raise_if_interrupted",
    "recorded_interrupts",
    "sigterm_as_interrupt",
]

logger = logging.getLogger(__name__)

#: How often the watch thread (where ``prctl`` is missing) reads the parent's process id.
POLL_SECONDS = 0.5

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _prctl_pdeathsig(sig: int) -> bool:
    """``prctl(PR_SET_PDEATHSIG, sig)``; False where it is not available or fails."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return False
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    if prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        logger.debug("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
        return False
    return True


def _watch(parent: int, sig: int, kill_after: float | None, signal_it: bool) -> None:
    """The watch thread: once ``parent`` is no longer this process's parent, send ``sig``
    (``signal_it``: the kernel has not done so), and SIGKILL ``kill_after`` seconds later."""
    while os.getppid() == parent:
        time.sleep(POLL_SECONDS)
    if signal_it:
        os.kill(os.getpid(), sig)
    if kill_after is not None:
        time.sleep(kill_after)
        os.kill(os.getpid(), getattr(signal, "SIGKILL", sig))


def die_with_parent(
    parent: int | None = None,
    sig: int = signal.SIGTERM,
    *,
    kill_after: float | None = None,
) -> bool:
    """Make this process receive ``sig`` when its parent dies (see the module's docstring).

    ``parent``: the process id of the parent that started this one, as it passed it (its
    ``os.getpid()``): if this process's parent is already another one, that parent has died and
    ``sig`` is sent at once. None takes the current parent (no check: call it first thing).
    ``kill_after``: seconds after the parent's death at which a process still alive (one that
    handles ``sig`` and is slow to end) is killed with SIGKILL; None: never.

    Returns True where the kernel delivers the signal (Linux), False where a daemon thread
    watches the parent instead. Idempotent in effect: a later call replaces the signal.
    """
    if parent is None:
        parent = os.getppid()
    kernel = _prctl_pdeathsig(sig)
    if not kernel or kill_after is not None:
        threading.Thread(
            target=_watch,
            args=(parent, sig, kill_after, not kernel),
            name="adaptrain-parent-watch",
            daemon=True,
        ).start()
    if os.getppid() != parent:  # it died before the request was made
        logger.debug("parent %d already gone: sending signal %d to this process", parent, sig)
        os.kill(os.getpid(), sig)
    return kernel


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[list[int]]:
    """Within the block, a SIGTERM is handled as a SIGINT: by the SIGINT handler in force when
    it arrives (a ``KeyboardInterrupt`` by default, or a handler that holds it for a moment),
    so the program's ``finally`` blocks and ``except KeyboardInterrupt`` run and stop its
    children. Where SIGINT is ignored (a background job started by a script) it raises
    ``KeyboardInterrupt`` all the same. Yields the list of SIGTERMs received, so the caller can
    exit with 143 rather than 130. Off the main thread, where no handler can be set, it changes
    nothing."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def on_sigterm(signum: int, frame: object) -> None:
        received.append(signum)
        handler = signal.getsignal(signal.SIGINT)
        if callable(handler) and handler is not signal.default_int_handler:
            handler(signum, frame)  # (told it is a SIGTERM)
        else:
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield received
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


@contextlib.contextmanager
def recorded_interrupts() -> Iterator[list[int]]:
    """Within the block, a SIGINT (or a SIGTERM that :func:`sigterm_as_interrupt` hands to it)
    raises ``KeyboardInterrupt`` as Python's default handler does, and is also recorded in the
    list yielded, so a long loop can raise it again where it was lost.

    It can be lost: a handler's exception that lands while a ``__del__`` method, a weakref
    callback or a garbage collection runs is printed ("Exception ignored in ...") and dropped,
    and the program goes on as if never interrupted. numba's and llvmlite's objects run such
    code all the time, so a simulation interrupted at an unlucky moment would run on to its end.
    A loop that checks the list each turn (:func:`raise_if_interrupted`) stops at the next one
    instead, and such a dropped interrupt, recorded, is not printed. Where SIGINT
    is not handled by Python's default handler (ignored, or a handler of the program's own), or
    off the main thread, nothing changes (the list stays empty)."""
    received: list[int] = []
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield received
        return

    def on_sigint(signum: int, frame: object) -> None:
        received.append(signum)
        raise KeyboardInterrupt

    previous_hook = sys.unraisablehook

    def hook(unraisable: sys.UnraisableHookArgs) -> None:
        if isinstance(unraisable.exc_value, KeyboardInterrupt) and received:
            return  # dropped, but recorded: the loop raises it again (no traceback printed)
        previous_hook(unraisable)

    signal.signal(signal.SIGINT, on_sigint)
    sys.unraisablehook = hook
    try:
        yield received
    finally:
        sys.unraisablehook = previous_hook
        signal.signal(signal.SIGINT, signal.default_int_handler)


def raise_if_interrupted(*records: list[int]) -> None:
    """Raise ``KeyboardInterrupt`` if any of ``records`` (the lists :func:`recorded_interrupts`
    and :func:`sigterm_as_interrupt` yield) holds a signal: one Python dropped, raised again."""
    if any(records):
        raise KeyboardInterrupt
