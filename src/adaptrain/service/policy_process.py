"""The scheduling policy's rounds in a process of their own.

A round with a thousand jobs keeps a CPU busy for a fraction of a second, mostly in Python.
Run in the server's process, it holds the interpreter lock that the HTTP API needs, and every
request that arrives during a round waits for it. :class:`PolicyProcess` runs the policy's
:meth:`optimize` in one worker process (a :class:`~concurrent.futures.ProcessPoolExecutor` of
one, started with ``spawn``), so the API answers on the other core meanwhile.

The worker keeps the policy object between rounds (its genetic population, arrival rate and
fits warm-start the next round) and returns its ``state_dict`` with each allocation, which is
therefore always at hand for the store. A worker that dies (killed, out of memory) is started
again from that state and the round is asked again once; if that fails too, the round runs in
this process, on a policy restored from the same state, and so do the later ones. The worker
ends with the process (``prctl(PR_SET_PDEATHSIG)``, :func:`adaptrain.procs.die_with_parent`)
or at :meth:`close`.

The arrival fast path (``allocate_job``, a few comparisons) stays in this process, on a local
instance of the same policy that loads the worker's state after each round.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
from collections.abc import Mapping
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from adaptrain.procs import die_with_parent
from adaptrain.sched import ClusterSpec, FifoPolicy, PolluxPolicy, WaterfillPolicy

logger = logging.getLogger(__name__)

__all__ = ["PolicyProcess", "make_policy"]

POLICIES = ("waterfill", "pollux", "fifo")


def make_policy(name: str, cluster: ClusterSpec, seed: int = 0):
    """The service's policy ``name`` (one of :data:`POLICIES`) for ``cluster``."""
    if name == "pollux":
        return PolluxPolicy(cluster=cluster, seed=seed)
    if name == "fifo":  # a baseline: each job at its --max-replicas, in submission order
        return FifoPolicy()
    if name == "waterfill":
        return WaterfillPolicy(cluster=cluster, seed=seed)
    raise ValueError(f"policy {name!r} must be one of {', '.join(POLICIES)}")


def _restored(name: str, cluster: ClusterSpec, seed: int, state: dict | None):
    policy = make_policy(name, cluster, seed)
    if state is not None:
        try:
            policy.load_state_dict(state)
        except Exception as exc:  # noqa: BLE001 - a stale state only costs a warm start
            logger.warning("the policy's saved state does not load (%s); starting afresh", exc)
    return policy


# ---- the worker process ---------------------------------------------------------------------
_POLICY: Any = None


def _start_worker(parent: int, name: str, cluster: ClusterSpec, seed: int, state) -> None:
    global _POLICY
    die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the server's to handle
    _POLICY = _restored(name, cluster, seed, state)


def _optimize(jobs, nodes, base, now) -> tuple[dict, dict]:
    alloc = _POLICY.optimize(jobs, nodes, base, now)
    return dict(alloc), _POLICY.state_dict()


def _ping() -> int:
    return os.getpid()


# ---- the server's side --------------------------------------------------------------------------
class PolicyProcess:
    """The policy ``name`` for ``cluster``, restored from ``state`` (a ``state_dict``), with
    its rounds run in a worker process (``in_process=True``: in this one, as a fallback and
    for comparison). The policy's interface: :meth:`optimize`, :meth:`allocate_job`,
    :meth:`state_dict`, :meth:`load_state_dict`; and :meth:`close`."""

    def __init__(
        self,
        name: str,
        cluster: ClusterSpec,
        state: dict | None = None,
        *,
        seed: int = 0,
        in_process: bool = False,
    ) -> None:
        self.name, self.cluster, self.seed = name, cluster, seed
        # arrivals, and the rounds when in-process
        self._local = _restored(name, cluster, seed, state)
        self._state = state
        self._pool: ProcessPoolExecutor | None = None
        self._in_process = in_process

    @property
    def in_process(self) -> bool:
        """Whether the rounds run in this process (asked for, or the worker failed twice)."""
        return self._in_process

    def start(self) -> None:
        """Start the worker now rather than at the first round (it takes a second or two to
        import the policy); returns at once."""
        if not self._in_process:
            self._executor().submit(_ping)

    def worker_pid(self) -> int | None:
        """The worker's process id (started if it was not), or None when in-process."""
        if self._in_process:
            return None
        return self._executor().submit(_ping).result()

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(
                max_workers=1,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_start_worker,
                initargs=(os.getpid(), self.name, self.cluster, self.seed, self._state),
            )
        return self._pool

    def optimize(
        self, jobs: Mapping[str, Any], nodes: Mapping[str, Any], base: Mapping, now: float
    ) -> dict:
        """The policy's allocation for this round (see ``Policy.optimize``)."""
        if not self._in_process:
            for attempt in (1, 2):
                try:
                    alloc, self._state = (
                        self._executor().submit(_optimize, jobs, nodes, base, now).result()
                    )
                    self._sync_local()
                    return alloc
                except BrokenProcessPool:
                    self.close(wait=False)
                    logger.warning(
                        "the policy's worker process died (try %d of 2): %s",
                        attempt,
                        "starting another from the last round's state"
                        if attempt == 1
                        else "the rounds run in the server's process from now on",
                    )
            self._in_process = True
            self._local = _restored(self.name, self.cluster, self.seed, self._state)
        alloc = dict(self._local.optimize(jobs, nodes, base, now))
        self._state = self._local.state_dict()
        return alloc

    def _sync_local(self) -> None:
        """The local instance learns what the worker did (``allocate_job`` may read it, e.g.
        the applications' shared profiles)."""
        try:
            self._local.load_state_dict(self._state)
        except Exception as exc:  # noqa: BLE001 - arrivals then use a fresh policy's view
            logger.warning("the policy's state does not load in the server (%s)", exc)

    def allocate_job(self, job: Any, nodes: Mapping[str, Any]) -> list:
        """A place for a job that arrives between rounds (the policy's ``allocate_job``; ``[]``
        for a policy without one)."""
        allocate = getattr(self._local, "allocate_job", None)
        return list(allocate(job, nodes) or []) if allocate else []

    def state_dict(self) -> dict:
        """The policy's state after the last round (or as loaded; a fresh policy's)."""
        return self._state if self._state is not None else self._local.state_dict()

    def load_state_dict(self, state: dict | None) -> None:
        """Resume from ``state``: the next round's worker (or this process) starts from it."""
        self._state = state
        self._local = _restored(self.name, self.cluster, self.seed, state)
        if not self._in_process:
            self.close(wait=False)

    def close(self, wait: bool = True) -> None:
        """Stop the worker process (``wait``: for a round in progress to end)."""
        if self._pool is not None:
            self._pool.shutdown(wait=wait, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> PolicyProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
