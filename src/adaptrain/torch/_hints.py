"""Scheduling hints posted by rank 0 to the scheduler's supervisor (``adaptdl``'s
``_report_sched_hints``).

When ``ADAPTRAIN_SUPERVISOR_URL`` is set, rank 0 PUTs the hints body of the service contract
(``{SUPERVISOR_URL}/hints/{job_id}``, header ``Authorization: Bearer $ADAPTRAIN_JOB_TOKEN``):
AdaptDL's fields (:func:`adaptrain.torch._metrics.sched_hints`), the profile of measured step
times, the batch size in force and the progress (epoch, samples of the epoch, statistical
progress). It posts at most every ``ADAPTRAIN_HINTS_INTERVAL`` seconds (default 30) and at the
first step boundary after each batch-size change.

A post never blocks a training step: at a step boundary that is due, the training loader builds
the body (a few dicts, tens of microseconds) and drops it into a one-slot mailbox, replacing
one not yet sent; a daemon thread sends the newest body with a timeout (5 s). A failing
supervisor (an error status, a timeout, a refused connection) is logged once, as a warning,
then retried with exponential backoff (1 s doubling up to 60 s, always with the newest body),
and logged again, once, when a post goes through. A server restarted on another port names
its new URL in ``ADAPTRAIN_SUPERVISOR_FILE`` (its ``server.json``); after a failed post the
reporter reads that file and posts to the URL it names, so a re-adopted replica's hints reach
the new server. A standalone run (no supervisor URL), and
every replica but rank 0, starts no thread and never imports ``httpx``.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import urllib.parse
from typing import Any

import torch.distributed as dist

from adaptrain import env
from adaptrain.dist.checkpoint import register_reset_hook
from adaptrain.torch import _metrics
from adaptrain.torch.epoch import current_epoch, finished_epochs

__all__ = ["HintsReporter", "active", "configure", "post_soon", "reporter", "snapshot", "tick"]

logger = logging.getLogger(__name__)

_STOP = object()


class HintsReporter:
    """Posts hints bodies to the supervisor from a daemon thread, the newest one first.

    Args:
        url: the supervisor's base URL (``http://host:port``).
        job_id: the job's name (the last part of the endpoint).
        token: the job's secret, sent as ``Authorization: Bearer <token>`` (None: no header).
        interval: seconds between two posts (:meth:`due`).
        timeout: seconds a post may take (connect, send, answer) before it counts as failed.
        backoff: seconds before the first retry after a failure; doubles at each failure.
        max_backoff: the longest wait between two retries.
        url_file: a JSON file whose ``"url"`` is the supervisor's current base URL, read again
            after each failed post (the server may have restarted on another port).
    """

    def __init__(
        self,
        url: str,
        job_id: str,
        token: str | None,
        interval: float = 30.0,
        *,
        timeout: float = 5.0,
        backoff: float = 1.0,
        max_backoff: float = 60.0,
        url_file: str | None = None,
    ) -> None:
        if not interval > 0 or not timeout > 0 or not 0 < backoff <= max_backoff:
            raise ValueError(
                f"interval={interval}, timeout={timeout} and backoff={backoff} must be > 0, "
                f"and backoff ≤ max_backoff={max_backoff}"
            )
        self._path = f"/hints/{urllib.parse.quote(job_id, safe='')}"
        self.endpoint = f"{url.rstrip('/')}{self._path}"
        self.url_file = url_file
        self.interval = float(interval)
        self.timeout = float(timeout)
        self.backoff = float(backoff)
        self.max_backoff = float(max_backoff)
        self._headers = {} if not token else {"Authorization": f"Bearer {token}"}
        self._slot: queue.Queue = queue.Queue(maxsize=1)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.next_due = 0.0  # time.monotonic() of the next post; 0: at the next step boundary
        self.offered = 0  # bodies handed over
        self.posted = 0  # bodies the supervisor accepted
        self.failures = 0  # failed posts
        self.failing = False  # the last post failed
        self.last_error: str | None = None

    # ----- training side (main thread) ---------------------------------------------------------
    def due(self, now: float | None = None) -> bool:
        """Whether the next body should be offered now."""
        return (time.monotonic() if now is None else now) >= self.next_due

    def post_soon(self) -> None:
        """Make the next :meth:`due` true (after a batch-size change)."""
        self.next_due = 0.0

    def offer(self, body: dict[str, Any]) -> None:
        """Hand ``body`` to the sending thread (replacing one not yet sent); never blocks."""
        self.next_due = time.monotonic() + self.interval
        self.offered += 1
        self._put(body)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="adaptrain-hints", daemon=True)
            self._thread.start()

    def close(self, timeout: float | None = None) -> None:
        """Stop the sending thread (a post in flight is abandoned after ``timeout``)."""
        self._stop.set()
        self._put(_STOP)
        if self._thread is not None:
            self._thread.join(timeout)

    def _put(self, item: Any) -> None:
        try:
            self._slot.get_nowait()
        except queue.Empty:
            pass
        try:
            self._slot.put_nowait(item)
        except queue.Full:  # the thread cannot take one meanwhile; only we put
            pass

    # ----- sending thread ----------------------------------------------------------------------
    def _run(self) -> None:
        import httpx  # only a replica that posts imports it

        delay = 0.0
        body: Any = None
        with httpx.Client(timeout=self.timeout, headers=self._headers) as client:
            while not self._stop.is_set():
                if body is None:
                    body = self._slot.get()
                else:  # retrying: wait, then send the newest body
                    if self._stop.wait(delay):
                        return
                    try:
                        body = self._slot.get_nowait()
                    except queue.Empty:
                        pass
                if body is _STOP:
                    return
                error = self._send(client, httpx, body)
                if error is None:
                    self.posted += 1
                    if self.failing:
                        logger.info("hints: the supervisor %s accepts posts again", self.endpoint)
                    self.failing, delay, body = False, 0.0, None
                    continue
                self.failures += 1
                self.last_error = error
                if not self.failing:
                    logger.warning(
                        "hints: cannot post to the supervisor %s (%s); retrying with backoff "
                        "(up to %.0f s) and logging again once it works",
                        self.endpoint,
                        error,
                        self.max_backoff,
                    )
                self.failing = True
                self._follow_url_file()
                delay = min(self.max_backoff, self.backoff if not delay else 2 * delay)

    def _follow_url_file(self) -> None:
        """Post to the URL the supervisor's file names now, if it names another one."""
        if self.url_file is None:
            return
        try:
            with open(self.url_file) as f:
                url = json.load(f)["url"]
        except (OSError, ValueError, KeyError, TypeError):
            return
        if isinstance(url, str) and url.startswith(("http://", "https://")):
            endpoint = f"{url.rstrip('/')}{self._path}"
            if endpoint != self.endpoint:
                logger.info("hints: the supervisor moved to %s", url)
                self.endpoint = endpoint

    def _send(self, client: Any, httpx: Any, body: dict[str, Any]) -> str | None:
        """PUT ``body``; None when accepted (2xx), else what went wrong."""
        try:
            response = client.put(self.endpoint, json=body)
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        except Exception as exc:  # noqa: BLE001 - never let the thread die
            return f"{type(exc).__name__}: {exc}"
        if 200 <= response.status_code < 300:
            return None
        detail = response.text[:200]
        return f"HTTP {response.status_code}" + (f": {detail}" if detail else "")

    # ----- checkpointable counters -------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The counters (offered, posted, failures) and the last error."""
        return {
            "offered": self.offered,
            "posted": self.posted,
            "failures": self.failures,
            "last_error": self.last_error,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.offered = int(state["offered"])
        self.posted = int(state["posted"])
        self.failures = int(state["failures"])
        self.last_error = state["last_error"]


#: True when this process posts hints (rank 0 with a supervisor): the loader's fast check.
active = False
_reporter: HintsReporter | None = None
_configured = False


def configure() -> HintsReporter | None:
    """Set up this process's reporter from the environment, once (the training loader calls
    it at the start of each loop); None when it posts nothing (no supervisor, or not rank 0).

    Raises:
        ValueError: a supervisor URL without ``ADAPTRAIN_JOB_ID``, or a bad
            ``ADAPTRAIN_HINTS_INTERVAL``.
    """
    global _reporter, _configured, active
    if _configured:
        return _reporter
    url = env.supervisor_url()
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else env.replica_rank()
    if url is not None and rank == 0:
        job = env.job_id()
        if job is None:
            raise ValueError(
                f"ADAPTRAIN_SUPERVISOR_URL={url} is set but ADAPTRAIN_JOB_ID is not: the hints "
                "endpoint needs the job's name"
            )
        _reporter = HintsReporter(
            url, job, env.job_token(), env.hints_interval(), url_file=env.supervisor_file()
        )
        active = True
    _configured = True
    return _reporter


def reporter() -> HintsReporter | None:
    """This process's reporter, if it posts hints."""
    return _reporter


def snapshot(helper: Any) -> dict[str, Any] | None:
    """The hints body of the training loader ``helper`` (an AdaptiveDataLoaderHelper), or
    None before its batch size is known."""
    state = helper._state
    hints = _metrics.sched_hints(state.local_bsz or None, state.accum_steps or None)
    if hints is None:
        return None
    epoch = current_epoch()
    hints["progress"] = {
        "epoch": int(finished_epochs() if epoch is None else epoch),
        "samples": int(state.current_index),
        "progress": max(float(_metrics.get_progress()), 0.0) * hints["initBatchSize"],
    }
    return hints


def tick(helper: Any) -> None:
    """At a step boundary of the training loader: offer a body if one is due."""
    r = _reporter
    if r is not None and r.due():
        body = snapshot(helper)
        if body is not None:
            r.offer(body)


def post_soon() -> None:
    """Post at the next step boundary (the batch size changed)."""
    if _reporter is not None:
        _reporter.post_soon()


def _reset() -> None:
    global _reporter, _configured, active
    if _reporter is not None:
        _reporter.close(timeout=0)
    _reporter, _configured, active = None, False, False


register_reset_hook(_reset)
