"""Graceful stop on SIGINT/SIGTERM that every replica agrees on (distributed glue).

Protocol (AdaptDL's, made explicit):

1. :func:`install` (called by ``init_process_group`` and by the data loader, main thread only)
   replaces the SIGINT/SIGTERM handlers. The first signal only records its number; a second
   signal restores the previous handler and re-raises, forcing an immediate exit.
2. At every optimizer-step boundary the training data loader calls :func:`poll_stop`. A call
   that *polls* returns the result of the previous poll's asynchronous allreduce (max of the
   replicas' recorded signal numbers) and starts the next one. The allreduce overlaps the
   steps' compute, and since every replica reads the same reduced value at the same step, all
   of them stop after the same step, even when only one of them got the signal (as when
   torchrun forwards SIGTERM, or a user presses Ctrl-C on one node). The allreduce is one int64
   tensor on a gloo group of its own, launched from the calling thread (gloo's threads carry
   it; no pickling, no Python thread): AdaptDL's object allreduce per step cost ~0.4 ms of a
   3 ms step on 2 CPU cores. Even this one costs 0.3–0.4 ms per step there (thread wake-ups on
   busy cores, ~12% of a 5 ms step), so with fast steps not every call polls: each poll also
   carries the number of steps each replica proposes until the next one (about
   :data:`POLL_PERIOD` seconds of its measured step time, at most :data:`MAX_POLL_STEPS`), and
   all replicas poll again after the smallest proposal, the same step on every replica. Steps
   slower than :data:`POLL_PERIOD` poll at every step, as before; a signal is acted on within
   about two poll periods plus two steps. A single process polls at every step.
3. :func:`graceful_exit` saves every State once (``save_all_states``: rank 0 writes, then a
   barrier so no replica exits before the checkpoint is complete), destroys the process group and
   leaves with **exit code 143 after SIGTERM, 130 after SIGINT**, on every replica (torchrun
   therefore reports the interrupted run as failed, as it should: the job is not finished; rerun
   it with the same ``ADAPTRAIN_CHECKPOINT_PATH`` to resume).

Periodic checkpoints ride on the same poll: every ``ADAPTRAIN_CHECKPOINT_INTERVAL`` seconds
(:func:`set_checkpoint_interval`; off when 0 or without ``ADAPTRAIN_CHECKPOINT_PATH``) rank 0
marks its next poll, and at the call that reads that poll's result every replica (the same step
on all of them, as for a stop) saves every State with
``checkpoint.save_all_states(background=True)``: the syncs and rank 0's serialisation into
memory on that step, the write in the background. Rank 0's clock alone decides, so the
replicas cannot disagree; its interval restarts after each periodic checkpoint. A crash (a
``kill -9``, a lost node) then loses at most about one interval of training plus two polls.

How the process leaves (:func:`set_exit_mode`, or ``graceful_exit(signum, mode=...)``):

``"fast"`` (default)
    ``SystemExit(128 + signum)`` is raised, so the user's ``finally`` blocks and context managers
    run as it unwinds, non-daemon threads are joined and **every atexit hook runs** (in the usual
    last-registered-first order); then the logging handlers, stdio and any open buffered file
    are flushed and the process ends with ``os._exit(128 + signum)``, skipping only the
    interpreter's finalisation (module teardown and garbage collection of what is left, 1–2 s
    with torch loaded on a busy machine, measured by ``benchmarks/bench_rescale.py``). Python
    never promised to run ``__del__`` for objects alive at exit, and the checkpoint is already
    fsynced and renamed into place, so nothing the job needs is lost. If the program catches the
    ``SystemExit`` and keeps training, the next :func:`poll_stop` (or :func:`reset`) disarms the
    fast path.
``"full"``
    ``SystemExit(128 + signum)`` and the interpreter's normal shutdown (the behaviour before the
    fast path; use it if objects' finalisers must run at exit).
``"immediate"``
    flush logging and stdio and ``os._exit(128 + signum)`` right after the checkpoint barrier:
    no ``finally`` block and no atexit hook runs. The quickest exit, for scripts that know they
    have nothing to clean up.

The fast path needs ``atexit._run_exitfuncs`` (CPython 3.8+); without it ``"fast"`` behaves as
``"full"``.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import io
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from multiprocessing import forkserver, resource_tracker
from typing import Any

import torch
import torch.distributed as dist

from adaptrain import env
from adaptrain.dist import checkpoint, collective

__all__ = [
    "EXIT_MODES",
    "MAX_POLL_STEPS",
    "POLL_PERIOD",
    "exit_flag",
    "exit_mode",
    "get_exit_flag",
    "graceful_exit",
    "install",
    "installed",
    "loader_workers_starting",
    "poll_stop",
    "reset",
    "set_checkpoint_interval",
    "set_exit_mode",
    "shield_loader_worker",
    "uninstall",
]

logger = logging.getLogger(__name__)

#: Target seconds between two polls (the stop allreduce); faster steps poll every few steps.
POLL_PERIOD = 0.05
#: Most steps between two polls.
MAX_POLL_STEPS = 64

_signum = 0  # first signal received by this process, 0 if none
_previous: dict[int, Any] = {}
# The poll in flight: (int64 tensor [signal, -proposed steps], its all-reduce work or None in a
# single process).
_pending: tuple[torch.Tensor, Any] | None = None
_skip = 0  # calls left before the next poll (agreed by every replica)
_since = 0  # calls since the last poll
_last_poll: float | None = None  # perf_counter() of the last poll
_group: Any = None  # the gloo group of the stop polls, and the default group it was made for
_group_of: Any = None

# Periodic checkpoints: the interval in seconds (None: from the environment at the next poll; 0:
# off) and rank 0's clock (perf_counter() of the start of training or of the last one).
_ckpt_interval: float | None = None
_ckpt_clock: float | None = None

EXIT_MODES = ("fast", "full", "immediate")
_exit_mode = "fast"
_armed_code: int | None = None  # exit code of an armed fast exit (mode "fast"), else None


def _handler(signum: int, frame: Any) -> None:
    global _signum
    if _signum:
        # Second signal: give up on the graceful path.
        logger.warning("got %s again, forcing exit", signal.Signals(signum).name)
        signal.signal(signum, _forcing(_previous.get(signum)))
        signal.raise_signal(signum)
        return
    _signum = signum
    logger.info(
        "got %s, exiting gracefully after the current step... send the signal again to force exit",
        signal.Signals(signum).name,
    )


def _forcing(previous: Any) -> Any:
    """The handler a second signal re-raises into: the one :func:`install` replaced, unless
    that would not end the process (ignored, ours, or not installed from Python)."""
    if previous is None or previous is signal.SIG_IGN or previous is _handler:
        return signal.SIG_DFL
    return previous


def install() -> bool:
    """Install the SIGINT/SIGTERM handlers (idempotent); False off the main thread.

    Each signal is checked on its own: another library that replaced one of them since (a
    SIGTERM handler of a job runner, say) gets it taken back, and the handler it had set is
    what a second signal falls back to.
    """
    if installed():
        return True
    if threading.current_thread() is not threading.main_thread():
        return False
    for sig in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(sig) is not _handler:
            _previous[sig] = signal.signal(sig, _handler)
    return True


def installed() -> bool:
    """True when this module's handlers are the current SIGINT and SIGTERM handlers."""
    return all(signal.getsignal(s) is _handler for s in (signal.SIGINT, signal.SIGTERM))


def exit_flag() -> int:
    """The signal number received by this process (0 if none)."""
    return _signum


def get_exit_flag() -> bool:
    """Whether this process received SIGINT or SIGTERM (``adaptdl._signal`` name)."""
    return bool(_signum)


def poll_stop() -> int:
    """Collective, once per step on every replica: the agreed signal number, or 0 to go on.

    Every call counts a step; a call that polls returns what the previous poll's asynchronous
    allreduce (max over replicas) found and starts the next one unless a stop was agreed.
    Between polls (agreed step counts, see the module docstring) calls return 0 at once.
    """
    global _pending, _skip, _since, _last_poll, _ckpt_clock
    _disarm()  # still training: a caught SystemExit must not end the process later
    _since += 1
    if _skip > 0:  # only ever set with a poll in flight
        _skip -= 1
        return 0
    agreed, steps, save = 0, 1, 0
    if _pending is not None:
        flag, work = _pending
        if work is not None:
            work.wait()
        agreed, steps, save = int(flag[0]), max(-int(flag[1]), 1), int(flag[2])
    _pending = None
    now = time.perf_counter()
    if not agreed:
        if save:  # the same step on every replica; a stop checkpoints anyway
            _periodic_checkpoint()
            _ckpt_clock = time.perf_counter()
        distributed = collective.is_distributed()
        proposal = 1
        if distributed and _last_poll is not None:
            per_step = (now - _last_poll) / max(_since, 1)
            proposal = int(POLL_PERIOD / per_step) if per_step > 0 else MAX_POLL_STEPS
            proposal = min(max(proposal, 1), MAX_POLL_STEPS)
        flag = torch.tensor([_signum, -proposal, _checkpoint_due(now)], dtype=torch.int64)
        work = None
        if distributed:
            work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=_stop_group(), async_op=True)
        _pending = (flag, work)
        _skip = steps - 1
    _since, _last_poll = 0, now
    return agreed


def set_checkpoint_interval(seconds: float | None) -> float | None:
    """Seconds of training between two periodic checkpoints (0: off; None: from
    ``ADAPTRAIN_CHECKPOINT_INTERVAL`` at the next poll, the default); returns the old value.

    Only rank 0's value counts (its clock decides for every replica). Periodic checkpoints
    need ``ADAPTRAIN_CHECKPOINT_PATH`` as well.

    Raises:
        ValueError: a negative or non-finite number.
    """
    global _ckpt_interval
    if seconds is not None and not 0 <= float(seconds) < float("inf"):
        raise ValueError(f"checkpoint interval {seconds!r} must be a finite number of seconds ≥ 0")
    previous, _ckpt_interval = _ckpt_interval, None if seconds is None else float(seconds)
    return previous


def _checkpoint_due(now: float) -> int:
    """1 when rank 0's periodic-checkpoint interval has passed (its clock starts at the first
    poll), else 0; other ranks never propose one."""
    global _ckpt_interval, _ckpt_clock
    if _ckpt_interval is None:
        _ckpt_interval = env.checkpoint_interval() if env.checkpoint_path() is not None else 0.0
    if _ckpt_interval <= 0:
        return 0
    if _ckpt_clock is None:
        _ckpt_clock = now
        return 0
    if now - _ckpt_clock < _ckpt_interval:
        return 0
    return int(not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0)


def _periodic_checkpoint() -> None:
    """Every replica at the same step: save every State, written in the background."""
    t0 = time.perf_counter()
    if checkpoint.save_all_states(background=True):
        logger.debug(
            "periodic checkpoint started in %.1f ms (written in the background)",
            1e3 * (time.perf_counter() - t0),
        )


_SIGWAITINFO = hasattr(signal, "sigwaitinfo")  # Linux and most Unixes; not macOS, Windows
_forkserver_warned = False


@contextlib.contextmanager
def loader_workers_starting(start_method: str | None = None) -> Iterator[None]:
    """Around the start of DataLoader worker processes: SIGTERM blocked in the calling thread.

    A worker inherits the signal mask of the thread that started it, through ``fork`` and
    through ``spawn``'s ``exec`` alike: it starts with SIGTERM blocked, in its main thread and
    in every thread that one starts (numpy's BLAS threads), so no SIGTERM can reach torch's
    handler before :func:`shield_loader_worker` runs. A signal that reaches this process
    meanwhile waits until the block is lifted (or another thread takes it; Python runs its
    handler in the main thread either way). A no-op without ``sigwaitinfo``.

    ``start_method`` is the workers' (``multiprocessing``'s default if None). For ``spawn`` and
    ``forkserver`` the helper processes ``multiprocessing`` starts on first use are started
    *before* the block: the resource tracker's start unblocks SIGINT and SIGTERM in the calling
    thread when it is done (so a block set before it would be lost), and a fork server started
    inside the block would hand it to every process it forks later, the user's own included.
    Forkserver workers therefore start unblocked, and are not shielded: a warning says so,
    once per process.
    """
    global _forkserver_warned
    if not _SIGWAITINFO:
        yield
        return
    if start_method is None:
        start_method = multiprocessing.get_start_method()
    if start_method in ("spawn", "forkserver"):
        resource_tracker.ensure_running()
    if start_method == "forkserver":
        forkserver.ensure_running()
        if not _forkserver_warned:
            _forkserver_warned = True
            logger.warning(
                "data loader workers started with 'forkserver' (Python 3.14's default on Linux) "
                "cannot be shielded from a SIGTERM sent to the whole process group (Slurm's "
                "scancel and preemption): it kills them, and the job then ends without a "
                "checkpoint. Pass multiprocessing_context='spawn' or 'fork' to the loader to "
                "keep them alive until the job has checkpointed."
            )
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        if signal.SIGTERM not in previous:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def shield_loader_worker(enable: bool = True) -> bool:
    """In a DataLoader worker process: let SIGTERM end it only when its parent sends it.

    A SIGTERM sent to the whole process group (Slurm's ``scancel`` and its preemption signal
    every process of a job step; ``kill -TERM -- -PGID`` does the same) reaches the loader's
    workers too. Torch's worker handler lets it kill them, and the main process then fails on
    the lost workers ("DataLoader worker ... is killed by signal: Terminated") in the steps
    before the replicas agree to stop: the job ends with no checkpoint. Shielded, the worker
    keeps SIGTERM blocked and a daemon thread takes each one with ``sigwaitinfo``: one from the
    parent (the loader's own shutdown, ``multiprocessing``'s at exit) ends the worker at once,
    as torch's handler does; any other is ignored, and the worker serves on until the main
    process, which got the same signal, has checkpointed and shuts it down. Once the parent
    has died, any SIGTERM ends the worker (and torch's watchdog ends it within seconds anyway).

    Call it from the worker's main thread (``worker_init_fn``; the ``AdaptiveDataLoader``'s
    does), in a worker started inside :func:`loader_workers_starting`. The shield needs every
    thread of the worker to block SIGTERM, and it checks (Linux's ``/proc``). A worker forked
    by a fork server started before that block already runs a thread that does not (started
    while it set up, before any code of ours), which could take the signal: there nothing is
    changed and a group SIGTERM still kills the workers. ``enable=False`` undoes the block
    instead (the worker's own SIGTERM handler, if it installed one, then works as usual).

    Returns:
        Whether the worker is shielded: True in a ``fork`` or ``spawn`` worker on Linux; False
        where ``sigwaitinfo`` or ``/proc`` is missing (macOS, Windows), off the main thread, or
        with a thread that does not block SIGTERM (``forkserver`` workers).
    """
    if not _SIGWAITINFO or threading.current_thread() is not threading.main_thread():
        return False
    if not enable:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        return False
    parent = os.getppid()
    # Blocked before the thread starts: threads inherit the mask, and a SIGTERM delivered to
    # a thread that does not block it runs torch's handler.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    if not _all_threads_block_sigterm():
        # A thread started before the block (in a forkserver's worker, while it set up) could
        # take the signal: leave torch's handling as it was.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        return False
    threading.Thread(
        target=_watch_sigterm, args=(parent,), name="adaptrain-worker-sigterm", daemon=True
    ).start()
    return True


def _all_threads_block_sigterm() -> bool:
    """Whether every thread of this process blocks SIGTERM (Linux's ``/proc``; else False)."""
    bit = 1 << (signal.SIGTERM - 1)
    try:
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/status") as f:
                blocked = next(int(line.split()[1], 16) for line in f if line.startswith("SigBlk:"))
            if not blocked & bit:
                return False
    except (OSError, StopIteration, ValueError):  # a thread that ended meanwhile, or no /proc
        return False
    return True


def _watch_sigterm(parent: int) -> None:
    while True:
        info = signal.sigwaitinfo({signal.SIGTERM})
        if info.si_pid == parent or os.getppid() != parent:
            os._exit(0)  # what torch's worker handler does with its parent's SIGTERM
        logger.debug("loader worker: SIGTERM from pid %d ignored (parent %d)", info.si_pid, parent)


def _forget_group() -> None:
    global _group, _group_of
    _group = _group_of = None


def _stop_group() -> Any:
    """The gloo group of the stop polls (created collectively at the first poll).

    Its own group: the object collectives run on a background thread, and two threads sharing
    one group could order their collectives differently on different replicas.
    """
    global _group, _group_of
    default = dist.group.WORLD
    if _group is None or _group_of is not default:
        _group = collective.new_gloo_group()
        _group_of = default
    return _group


def exit_mode() -> str:
    """How :func:`graceful_exit` leaves the process: one of :data:`EXIT_MODES`."""
    return _exit_mode


def set_exit_mode(mode: str) -> str:
    """Choose how :func:`graceful_exit` leaves (see the module docstring); returns the old mode.

    Raises:
        ValueError: ``mode`` is not one of ``"fast"``, ``"full"``, ``"immediate"``.
    """
    global _exit_mode
    if mode not in EXIT_MODES:
        raise ValueError(f"exit mode {mode!r} is not one of {EXIT_MODES}; pick one of those")
    previous, _exit_mode = _exit_mode, mode
    return previous


def _flush_everything() -> None:
    """Flush logging handlers, stdio and every open buffered file, as finalisation would."""
    for handler in list(getattr(logging, "_handlerList", [])):
        h = handler() if callable(handler) else None
        if h is not None:
            try:
                h.flush()
            except Exception:  # noqa: BLE001 - best effort at exit
                pass
    kinds = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom)
    # Text wrappers first: flushing one pushes its text into the binary buffer below it.
    files = sorted(
        (f for f in gc.get_objects() if type(f) in kinds),
        key=lambda f: type(f) is not io.TextIOWrapper,
    )
    for f in (sys.stdout, sys.stderr, *files):
        try:
            if f is not None and not f.closed:
                f.flush()
        except Exception:  # noqa: BLE001 - a closed pipe, a full disk: nothing left to do
            pass


def _fast_exit_hook() -> None:
    """Atexit hook armed by a "fast" :func:`graceful_exit`: run the other hooks, then leave.

    Registered last, so it runs first; it runs the remaining hooks itself (same order) and ends
    the process with the armed code before the interpreter's finalisation starts.
    """
    global _armed_code
    code = _armed_code
    _armed_code = None
    atexit.unregister(_fast_exit_hook)
    run_others = getattr(atexit, "_run_exitfuncs", None)
    if code is None or run_others is None:
        return
    run_others()
    _flush_everything()
    os._exit(code)


def _disarm() -> None:
    global _armed_code
    if _armed_code is not None:
        _armed_code = None
        atexit.unregister(_fast_exit_hook)


def graceful_exit(signum: int, mode: str | None = None) -> None:
    """Checkpoint once (rank 0 writes), wait for everybody, and exit with ``128 + signum``.

    Args:
        signum: the agreed signal number (from :func:`poll_stop`).
        mode: ``"fast"``, ``"full"`` or ``"immediate"`` (module docstring); None uses
            :func:`exit_mode` (default ``"fast"``).

    Raises:
        SystemExit: ``128 + signum`` (modes "fast" and "full"; "immediate" never returns).
        ValueError: unknown ``mode``.
    """
    mode = _exit_mode if mode is None else mode
    if mode not in EXIT_MODES:
        raise ValueError(f"exit mode {mode!r} is not one of {EXIT_MODES}; pick one of those")
    saved = checkpoint.save_all_states()
    name = signal.Signals(signum).name if signum in signal.Signals._value2member_map_ else signum
    logger.info("stopping on %s: %s", name, "checkpoint saved" if saved else "checkpointing is off")
    collective.teardown()
    _forget_group()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    code = 128 + signum
    if mode == "immediate":
        _flush_everything()
        os._exit(code)
    if mode == "fast":
        global _armed_code
        _disarm()
        _armed_code = code
        atexit.register(_fast_exit_hook)
    raise SystemExit(code)


def uninstall() -> None:
    """Put back the SIGINT/SIGTERM handlers that :func:`install` replaced (main thread only)."""
    if threading.current_thread() is threading.main_thread():
        for sig, previous in _previous.items():
            if signal.getsignal(sig) is _handler:  # not one another library set since
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        _previous.clear()


def reset(keep_handlers: bool = False) -> None:
    """Forget a received signal and any pending poll, and uninstall (tests, in-process restarts).

    With ``keep_handlers`` the handlers stay (what the exit of a finished run wants: a SIGTERM
    that comes while the process tears down is recorded, not fatal, so a run that did all its
    work still exits 0 instead of 143, which a scheduler would take for a stop to resume from
    the last checkpoint, repeating what followed it)."""
    global _signum, _pending, _group, _group_of, _skip, _since, _last_poll
    global _ckpt_interval, _ckpt_clock
    if _pending is not None and _pending[1] is not None:
        try:
            _pending[1].wait()
        except Exception:  # noqa: BLE001 - the group may be gone already
            pass
    _signum = 0
    _pending = None
    _skip = _since = 0
    _last_poll = None
    _ckpt_interval = _ckpt_clock = None
    _group = _group_of = None
    _disarm()
    if not keep_handlers:
        uninstall()


checkpoint.register_reset_hook(reset)
