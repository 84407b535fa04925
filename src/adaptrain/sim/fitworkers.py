"""Goodput refits computed ahead in worker processes, while the policy decides a round.

A simulated adaptive job refits its goodput model (``fit_perf_params``, tens of milliseconds)
whenever it meets a new (nodes, replicas, local batch) configuration: after a restart, and
after an epoch whose gradient statistics change its batch size. The fits take 28% of the
heaviest artifact file's simulation and 47% of a 160-job one's, on the critical path: the
policy of the next round needs them. Yet most of them are predictable before the policy has decided. A job that keeps its
placement, as most do in most rounds, steps through the next interval exactly as it would on
its current placement, and that needs nothing the policy computes.

So while the policy runs, :class:`FitPrefetcher` hands a copy of every running adaptive job to a
worker process, which steps it through the next interval on its current placement and records
every fit and batch-size choice it makes. Before the jobs really step, the simulator takes
those into its memos. A job the policy leaves in place then finds its fits done. A job it moves
meets other configurations: the work spent on its copy is lost, and its new placement is queued
once the policy has decided, a task the main process and the workers share.

The memos hold pure functions of their keys, so a simulation reads the same, bit for bit, with
or without prefetching: the workers are processes of the same interpreter and libraries, and
a fit limits BLAS to one thread. A worker that fails only stops the prefetching (a warning);
the simulation goes on computing every fit itself.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from ..procs import die_with_parent
from .job import GoodputMemos, SimJob
from .traces import Application

logger = logging.getLogger(__name__)

# Task slots in the shared claim table, reused round-robin: at most half of them pending at
# once (a round submits at most two tasks per running job), so a slot is free when reused.
_SLOTS = 1 << 16
_FREE, _WORKER, _CALLER = 0, 1, 2  # who runs a task: nobody yet, a worker, the caller
_STOP = None  # the message that ends a worker
_ABANDONED: list[Any] = []  # task queues closed with a feeder thread maybe still writing


@contextmanager
def _sigint_held() -> Iterator[list[int]]:
    """Hold a SIGINT that arrives inside the block until the block ends, then deliver it.

    Starting or stopping worker processes is not safe to interrupt. A KeyboardInterrupt in the
    middle of starting one cuts the pickled arguments a spawned child is reading (it dies with
    "pickle data was truncated", or "No such file or directory" once the parent has unlinked
    the semaphores it was about to open). So the blocks that start or stop workers run with
    SIGINT recorded instead of handled, and the signal is raised again, under the handler it
    would have met, as the block ends: a Ctrl-C still interrupts, once the workers are in a
    state :meth:`FitPrefetcher.close` can clean up; a second SIGINT meanwhile is delivered at
    once. (Blocking the signal with ``pthread_sigmask`` would not do: the kernel hands a
    process-wide signal to another thread that does not block it, such as a BLAS worker, and
    the main thread then raises at once.) Outside the main thread, where no handler can be
    set, or under a handler set outside Python, which could not be put back, the block runs
    as it is. Yields the signals held so far (empty or ``[SIGINT]``).

    A SIGTERM that :func:`adaptrain.procs.sigterm_as_interrupt` hands to this SIGINT handler is
    held the same way, and raised again as SIGTERM: it then interrupts even where SIGINT is
    ignored (a background job).
    """
    held: list[int] = []
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous is None:
        yield held
        return

    def hold(signum: int, frame: object) -> None:
        if not held:
            held.append(signum)
            return
        # a second Ctrl-C: the user insists, so it is delivered at once
        held.clear()
        signal.signal(signal.SIGINT, previous)
        signal.raise_signal(signum)

    signal.signal(signal.SIGINT, hold)
    try:
        yield held
    finally:
        signal.signal(signal.SIGINT, previous)
        if held:
            signal.raise_signal(held[0])


def _speculate(
    apps: Mapping[str, Application], memos: GoodputMemos, state: bytes, seconds: float
) -> tuple[list[tuple[Any, Any]], list[tuple[Any, Any]]]:
    """Step a job's copy ``seconds`` on its placement (``state``: its pickled ``(name,
    submission time, state_dict, interference)``); the fit and batch-size memo entries made, in
    the order made."""
    name, submitted, job_state, interference = pickle.loads(state)
    job = SimJob(name, apps[job_state["app"]], submitted, memos=memos)
    job.load_state_dict(job_state)
    with memos.fits.recording() as fits, memos.batch_sizes.recording() as bszs:
        job.step(seconds, interference=interference)
    return fits, bszs


def _worker(
    tasks, results, claims, owners, lock, apps: dict[str, Application], parent: int | None = None
) -> None:
    """A worker process: claim each task still free, run it, send its memo entries back.

    It ends with the simulating process ``parent`` (its process id), however that one ends: a
    worker left behind would hold multiprocessing's resource tracker alive with it."""
    die_with_parent(parent)
    # Ctrl-C reaches the whole process group: the simulating process handles it and closes
    # its workers, which must not print a traceback of their own
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    memos = GoodputMemos()
    while True:
        task = tasks.get()
        if task is _STOP:
            return
        seq, state, seconds = task
        slot = seq % _SLOTS
        with lock:
            if owners[slot] != seq or claims[slot] != _FREE:
                continue  # dropped, or the caller runs it
            claims[slot] = _WORKER
        start = time.perf_counter()
        try:
            out, error = _speculate(apps, memos, state, seconds), None
        except Exception as exc:  # noqa: BLE001 - reported to the caller, which stops
            out, error = None, f"{type(exc).__name__}: {exc}"
        results.put((seq, out, error, time.perf_counter() - start))


class FitPrefetcher:
    """Steps copies of the running adaptive jobs ahead in ``workers`` processes (see module).

    Each round: :meth:`submit` the running jobs before the policy runs (one task per job),
    :meth:`discard` those the policy moved, :meth:`submit` those with ``late=True`` (their
    first fits on the new placement), and step the jobs in the :meth:`order` it yields them:
    each once its task's results are in the memos, or once the caller has claimed a task no
    worker had started (the caller then computes that job's fits itself). So the caller and
    the workers share a round's tasks, from the two ends of the queue. A shared table of
    claims, under a lock, makes sure each task runs once.

    Use as a context manager, or call :meth:`close`: it owns the worker processes. They are
    started with the ``spawn`` method (no fork of a process that may hold BLAS or torch
    threads: a script that simulates with workers must guard its entry point with
    ``if __name__ == "__main__":``) and receive ``applications`` once. They end with the
    process that created them, even one killed with SIGKILL
    (:func:`adaptrain.procs.die_with_parent`; on Linux, when the *thread* that created them
    ends, so create the prefetcher in the thread that uses it and closes it).
    """

    def __init__(
        self, applications: Mapping[str, Application], memos: GoodputMemos, workers: int = 1
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers={workers} must be >= 1 (0: do not create a prefetcher)")
        self.workers = workers
        self.memos = memos
        self._seq = 0
        self._pending: dict[str, int] = {}  # job name -> its task
        self._done: dict[int, tuple] = {}  # results received for pending tasks
        self.active = False
        #: fits and batch-size choices taken from the workers into the memos
        self.fits_taken = 0
        self.bszs_taken = 0
        #: tasks the workers ran and whose results were received, of them taken, and the
        #: seconds the workers spent on them
        self.tasks_run = 0
        self.tasks_taken = 0
        self.tasks_claimed = 0  # by the caller, in order(): it computed those fits itself
        self.worker_seconds = 0.0
        with _sigint_held() as held:
            self._start(applications)
            self.active = True
            if held:  # a Ctrl-C came while they started: stop them at once, then deliver it
                self._shut(graceful=False)

    def _start(self, applications: Mapping[str, Application]) -> None:
        """The queues, shared tables and worker processes."""
        ctx = multiprocessing.get_context("spawn")
        self._tasks = ctx.Queue()  # (its feeder thread writes: no put waits for a worker)
        self._results = ctx.Queue()
        self._claims = ctx.RawArray("b", _SLOTS)
        self._owners = ctx.RawArray("q", [-1] * _SLOTS)  # the task that holds each slot
        self._lock = ctx.Lock()
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(self._tasks, self._results, self._claims, self._owners, self._lock),
                kwargs={"apps": dict(applications), "parent": os.getpid()},
                daemon=True,
                name=f"adaptrain-fit-prefetch-{i}",
            )
            for i in range(self.workers)
        ]
        try:
            for proc in self._procs:
                proc.start()
        except BaseException:  # e.g. in a daemonic process, which may not have children
            for proc in self._procs:
                if proc.pid is not None:
                    proc.terminate()
                    proc.join()
            raise

    def submit(
        self,
        jobs: Iterable[SimJob],
        seconds: float,
        interference: Callable[[SimJob], float],
        *,
        late: bool = False,
    ) -> None:
        """Queue copies of ``jobs`` (those running and adaptive) to step ``seconds`` ahead;
        ``interference(job)`` is the goodput fraction a job loses on shared nodes.

        Before the policy (``late=False``) this drops the tasks of an earlier round not taken;
        after it (``late=True``) it adds the jobs the policy placed anew.
        """
        if not late:
            self.discard(list(self._pending))
        if not self.active:
            return
        for job in jobs:
            if not (job.adaptive and job.placement and job.completion_time is None):
                continue
            if len(self._pending) >= _SLOTS // 2:  # (more than 16 000 running jobs)
                break
            seq, slot = self._seq, self._seq % _SLOTS
            self._seq += 1
            with self._lock:
                self._owners[slot] = seq
                self._claims[slot] = _FREE
            state = pickle.dumps(
                (job.name, job.submission_time, job.state_dict(), interference(job)),
                pickle.HIGHEST_PROTOCOL,
            )
            self._tasks.put((seq, state, seconds))
            self._pending[job.name] = seq

    def discard(self, names: Iterable[str]) -> None:
        """Forget the tasks of jobs ``names`` (their copies stepped on a placement they no
        longer have): a task no worker has claimed is skipped."""
        for name in names:
            seq = self._pending.pop(name, None)
            if seq is not None:
                self._claim(seq)
                self._done.pop(seq, None)

    def _claim(self, seq: int) -> bool:
        """Claim task ``seq`` for the caller; False if a worker holds it."""
        slot = seq % _SLOTS
        with self._lock:
            if self._owners[slot] == seq and self._claims[slot] == _FREE:
                self._claims[slot] = _CALLER
                return True
            return False

    def order(self, jobs: Iterable[SimJob]) -> Iterator[SimJob]:
        """Yield ``jobs`` in the order to step them, each once its fits are in the memos or
        left to the caller (jobs step independently: the order changes no result).

        First the jobs without a task; then, of the others, any whose task has finished (its
        fit and batch-size entries put into the memos: entries already there are kept, both
        being the same pure function of the key); else one whose task no worker has claimed,
        which the caller claims (it computes that job's fits itself as it steps), from the back
        of the queue, away from the workers; and when the workers hold every task left, the
        first to finish.
        """
        waiting = []
        for job in jobs:
            if job.name in self._pending:
                waiting.append(job)
            else:
                yield job
        waiting.sort(key=lambda j: self._pending[j.name])  # the order the workers take them
        while waiting:
            if not self.active:  # stopped: the caller computes the rest
                yield from waiting
                return
            self._receive(block=False)
            ready = [j for j in waiting if self._pending[j.name] in self._done]
            if ready:
                for job in ready:
                    waiting.remove(job)
                    seq = self._pending.pop(job.name, None)
                    if seq is not None and self.active:  # (a failed task stops prefetching)
                        self._merge(seq)
                    yield job
                continue
            for job in reversed(waiting):
                if self._claim(self._pending[job.name]):
                    waiting.remove(job)
                    del self._pending[job.name]
                    self.tasks_claimed += 1
                    yield job
                    break
            else:
                self._receive(block=True)

    def _merge(self, seq: int) -> None:
        _, out, error, _ = self._done.pop(seq)
        if error is not None:
            self._stop(error)
            return
        self.tasks_taken += 1
        fits, bszs = out
        self.fits_taken += self.memos.fits.merge(fits)
        self.bszs_taken += self.memos.batch_sizes.merge(bszs)

    def _receive(self, block: bool) -> None:
        """Receive the results there are (``block``: at least one), keeping those of pending
        tasks; stop prefetching if a worker died."""
        wanted = set(self._pending.values())
        while True:
            try:
                item = self._results.get(timeout=1.0) if block else self._results.get_nowait()
            except queue.Empty:
                if not block:
                    return
                dead = [p.name for p in self._procs if not p.is_alive()]
                if dead:
                    self._stop(f"worker(s) {dead} exited")
                    return
                continue
            self.worker_seconds += item[3]
            self.tasks_run += 1
            if item[0] in wanted:
                self._done[item[0]] = item
            block = False

    def stats(self) -> dict[str, float]:
        """What the workers did: tasks submitted, run (results received), taken (results put
        into the memos), claimed by the caller instead, fits and batch sizes taken, and the
        workers' seconds on the tasks run."""
        return {
            "tasks_submitted": self._seq,
            "tasks_run": self.tasks_run,
            "tasks_taken": self.tasks_taken,
            "tasks_claimed": self.tasks_claimed,
            "fits_taken": self.fits_taken,
            "bszs_taken": self.bszs_taken,
            "worker_seconds": self.worker_seconds,
        }

    def _stop(self, reason: str) -> None:
        logger.warning(
            "goodput prefetching stopped (%s); the simulation computes every fit itself from "
            "here, with the same results",
            reason,
        )
        self.close()

    def close(self, wait: bool = True) -> None:
        """Stop the workers (tasks not taken are dropped). ``wait``: each worker ends after its
        task, within 10 s; else they are terminated at once (after an interrupt or an error,
        when nothing more will be taken from them). A Ctrl-C meanwhile is delivered once they
        have stopped (:func:`_sigint_held`)."""
        with _sigint_held():
            self._shut(graceful=wait)

    def _shut(self, graceful: bool) -> None:
        """Stop the workers: ``graceful`` ends each after its task (waiting up to 10 s), else
        they are terminated at once."""
        if not self.active:
            return
        self.active = False
        self._pending, self._done = {}, {}
        # The claims' lock within a second, or no graceful end: a KeyboardInterrupt that
        # landed just as this process took it (inside ``with``, before the block) leaves it
        # held for ever, and a worker killed while holding it would too.
        if graceful and self._lock.acquire(timeout=1.0):
            try:  # no worker starts another task
                for slot in range(_SLOTS):
                    if self._claims[slot] == _FREE:
                        self._claims[slot] = _CALLER
            finally:
                self._lock.release()
            for _ in self._procs:
                self._tasks.put(_STOP)
        else:
            graceful = False
        for proc in self._procs:
            if graceful:
                proc.join(timeout=10.0)
            if proc.is_alive():
                proc.terminate()
            proc.join()
        self._results.close()  # (this process never puts: no feeder thread to wait for)
        self._tasks.close()
        if graceful and all(proc.exitcode == 0 for proc in self._procs):
            # each worker read up to a _STOP, after every task: nothing is left to write
            self._tasks.join_thread()
        else:
            # Tasks may be left in the queue's feeder thread with no reader, so it may never
            # end: not waited for. But it must not be what frees the queue either: the last
            # holder of a semaphore unlinks it, then tells the resource tracker, and a daemon
            # thread doing so as the interpreter exits is stopped between the two, leaving the
            # tracker to warn of a "leaked" semaphore it cannot find. Kept here, the queue's
            # semaphores are freed by this process's exit handler, on its main thread.
            self._tasks.cancel_join_thread()
            _ABANDONED.append(self._tasks)

    def __enter__(self) -> FitPrefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
