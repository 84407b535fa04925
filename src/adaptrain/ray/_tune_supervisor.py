"""A trial's supervisor: the HTTP endpoint its rank 0 posts hints and results to.

It runs in the trial's Tune actor, one per trial, on a thread of its own:

- ``PUT /hints/<trial id>``: the hints body of :mod:`adaptrain.torch._hints` (the goodput model,
  the step-time profile, the batch limits), kept as the trial's latest;
- ``POST /report/<trial id>``: a result (``{"metrics": {...}}``) from
  :func:`adaptrain.ray.tune.report`. The request is answered when the trainable asks for the
  next result (:meth:`TrialSupervisor.release`), or at once while the trial stops, so training
  and Tune stay in step as with Tune's own function API: a pause checkpoints just after the
  last result Tune has seen.

Every request must carry ``Authorization: Bearer <token>`` (the trial's secret).
"""

from __future__ import annotations

import hmac
import json
import logging
import queue
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["TrialSupervisor"]

_MAX_BODY = 4 << 20


class _Report:
    """One posted result, answered when the trainable lets its poster go on."""

    __slots__ = ("metrics", "answered")

    def __init__(self, metrics: dict[str, Any]) -> None:
        self.metrics = metrics
        self.answered = threading.Event()


class TrialSupervisor:
    """The endpoint of one trial (``url``), on ``host`` at a free port.

    ``next_result`` hands over the posted results in order; ``release`` answers the result
    handed over last; ``stop`` answers every waiting poster and makes later posts return at
    once (their results are kept: ``late_results``), until ``reopen``.
    """

    def __init__(
        self,
        job_id: str,
        token: str,
        host: str = "127.0.0.1",
        hints: dict[str, Any] | None = None,
    ) -> None:
        self.job_id = job_id
        self._token = token
        self._lock = threading.Lock()
        self._results: queue.Queue[_Report] = queue.Queue()
        self._held: _Report | None = None
        self._stopping = False
        self._late: list[dict[str, Any]] = []
        self._hints = hints  # the last ones known (a restarted trial's, from its checkpoint)
        self.hints_posts = 0
        supervisor = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib name
                logger.debug("supervisor %s: " + format, supervisor.job_id, *args)

            def do_PUT(self) -> None:  # noqa: N802 - http.server's name
                supervisor._handle(self, "PUT")

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                supervisor._handle(self, "POST")

        self._server = ThreadingHTTPServer((host, 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.2},
            name=f"adaptrain-tune-supervisor-{job_id}",
            daemon=True,
        )
        self._thread.start()

    # ---- the HTTP side -------------------------------------------------------------------------
    def _handle(self, request: BaseHTTPRequestHandler, method: str) -> None:
        parts = urllib.parse.urlparse(request.path).path.strip("/").split("/")
        authorized = hmac.compare_digest(
            request.headers.get("Authorization", ""), f"Bearer {self._token}"
        )
        if not authorized:
            return self._answer(request, 401, {"error": "wrong or missing bearer token"})
        if len(parts) != 2 or urllib.parse.unquote(parts[1]) != self.job_id:
            return self._answer(request, 404, {"error": f"no such endpoint {request.path}"})
        kind = parts[0]
        length = int(request.headers.get("Content-Length") or 0)
        if length > _MAX_BODY:
            return self._answer(request, 413, {"error": "body too large"})
        try:
            body = json.loads(request.rfile.read(length) or b"null")
        except ValueError:
            return self._answer(request, 400, {"error": "the body is not JSON"})
        if kind == "hints" and method == "PUT" and isinstance(body, dict):
            with self._lock:
                self._hints = body
                self.hints_posts += 1
            return self._answer(request, 200, {"ok": True})
        if kind == "report" and method == "POST" and isinstance(body, dict):
            metrics = body.get("metrics")
            if not isinstance(metrics, dict):
                return self._answer(request, 400, {"error": "no 'metrics' object"})
            report = _Report(metrics)
            with self._lock:
                if self._stopping:  # the trial is being checkpointed: keep it for after
                    self._late.append(metrics)
                    report.answered.set()
                else:
                    self._results.put(report)
            report.answered.wait()
            return self._answer(request, 200, {"ok": True, "stopping": self._stopping})
        return self._answer(request, 405, {"error": f"{method} /{kind} is not served"})

    @staticmethod
    def _answer(request: BaseHTTPRequestHandler, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        try:
            request.send_response(status)
            request.send_header("Content-Type", "application/json")
            request.send_header("Content-Length", str(len(data)))
            request.end_headers()
            request.wfile.write(data)
        except OSError:  # the poster went away (its replica stopped)
            pass

    # ---- the trainable's side ------------------------------------------------------------------
    @property
    def hints(self) -> dict[str, Any] | None:
        """The hints rank 0 posted last (None before the first)."""
        with self._lock:
            return self._hints

    @hints.setter
    def hints(self, hints: dict[str, Any] | None) -> None:
        """Hints known from before (a restored trial's), until rank 0 posts its own."""
        with self._lock:
            self._hints = hints

    def next_result(self, timeout: float) -> dict[str, Any] | None:
        """The oldest result not handed over yet, waiting up to ``timeout`` seconds."""
        try:
            report = self._results.get(timeout=timeout)
        except queue.Empty:
            return None
        with self._lock:
            self._held = report
        return report.metrics

    def release(self) -> None:
        """Let the poster of the last handed-over result go on."""
        with self._lock:
            held, self._held = self._held, None
        if held is not None:
            held.answered.set()

    def stop(self) -> list[dict[str, Any]]:
        """Answer every waiting poster; later posts return at once and are kept. Returns the
        results posted but not handed over (in order), which Tune has not seen."""
        with self._lock:
            self._stopping = True
            held, self._held = self._held, None
            waiting: list[_Report] = []
            while True:
                try:
                    waiting.append(self._results.get_nowait())
                except queue.Empty:
                    break
            self._late.extend(r.metrics for r in waiting)
        for report in ([held] if held is not None else []) + waiting:
            report.answered.set()
        return list(self._late)

    def late_results(self) -> list[dict[str, Any]]:
        """The results posted since :meth:`stop` (and those it found waiting), in order."""
        with self._lock:
            return list(self._late)

    def reopen(self) -> None:
        """Serve results again (new replicas start) and forget the late ones. The hints stay
        until the new rank 0 posts its own (the goodput model is in the checkpoint)."""
        with self._lock:
            self._stopping = False
            self._late = []

    def close(self) -> None:
        """Stop serving; answer whoever still waits."""
        self.stop()
        self._server.shutdown()
        self._server.server_close()
