"""The service's HTTP API (FastAPI; the OpenAPI schema is served at ``/openapi.json``).

Authorisation: with a server token (``--token-file``) every call needs ``Authorization: Bearer
<token>``. The supervisor's calls (``PUT /hints/{job}``, ``GET /discover/{job}/{group}``) take
the job's own token (``ADAPTRAIN_JOB_TOKEN``), given to its replicas only, so no other process
can steer the scheduling of a job, token or not. Every error is a 4xx with its reason in
``detail``; a body over the server's limit is refused with 413 before it is read.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import math
import os
import time
from typing import Annotated

from fastapi import Depends, FastAPI, Header, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response

from .controller import TERMINAL, Controller, JobError
from .dashboard import add_dashboard
from .metrics import Metrics
from .models import Hints, JobDetail, JobEvent, JobSpec, JobView, check_name

__all__ = ["create_app"]


def _bearer(authorization: str | None) -> str | None:
    if authorization and authorization.startswith("Bearer "):
        return authorization[7:].strip()
    return None


def _same(a: str | None, b: str | None) -> bool:
    return a is not None and b is not None and hmac.compare_digest(a.encode(), b.encode())


def create_app(controller: Controller) -> FastAPI:
    config = controller.config
    metrics = Metrics(controller)
    app = FastAPI(
        title="adaptrain scheduler",
        version=_version(),
        description="Elastic training jobs on a shared cluster, scheduled for goodput.",
    )

    app.add_middleware(_BodyLimit, limit=config.max_body)

    @app.exception_handler(JobError)
    async def job_error(request: Request, exc: JobError):
        return JSONResponse({"detail": str(exc)}, status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        # FastAPI's own handler echoes each offending input: a NaN there made the reply
        # unrenderable (a 500), a huge string made it as huge as the request
        return JSONResponse({"detail": [_error(e) for e in exc.errors()]}, status_code=422)

    def admin(authorization: Annotated[str | None, Header()] = None) -> None:
        if config.token is not None and not _same(_bearer(authorization), config.token):
            raise HTTPException(401, "missing or wrong token (ADAPTRAIN_TOKEN or --token-file)")

    def job_token(job: str, authorization: Annotated[str | None, Header()] = None) -> None:
        """A dependency: resolved before the body is validated, so a caller without the
        job's token learns nothing from the replies (not even which jobs exist, where the
        server has a token)."""
        check = _name(job)
        given = _bearer(authorization)
        if config.token is not None and _same(given, config.token):
            return
        expected = controller.store.token_of(check)
        if expected is None and config.token is None:
            raise HTTPException(404, f"no job named {check!r}")
        if not _same(given, expected):
            raise HTTPException(401, f"missing or wrong token for job {check!r}")

    def view(job, live: int | None = None) -> JobView:
        return JobView(**_view_fields(controller, job, live))

    @app.get("/healthz", include_in_schema=False)
    def healthz() -> dict:
        return {"ok": True, "round": controller.round}

    @app.post("/jobs", status_code=201, dependencies=[Depends(admin)])
    def submit(spec: JobSpec) -> JobView:
        return view(controller.submit(spec))

    @app.get("/jobs", dependencies=[Depends(admin)])
    def list_jobs() -> list[JobView]:
        live = controller.store.live_replicas()
        return [view(j, live.get(j.name, 0)) for j in controller.store.jobs()]

    @app.get("/jobs/{name}", dependencies=[Depends(admin)])
    def describe(name: str) -> JobDetail:
        job = controller._get(_name(name))
        spec = job.spec
        return JobDetail(
            **_view_fields(controller, job),
            command=spec["command"],
            min_replicas=spec["min_replicas"],
            max_replicas=spec["max_replicas"],
            preemptible=spec["preemptible"],
            max_restarts=spec["max_restarts"],
            allocation=job.allocation,
            pending_reason=controller.pending_reason.get(job.name)
            if job.phase == "Pending"
            else None,
            events=[
                JobEvent(time=t, kind=k, message=m) for t, k, m in controller.store.events(job.name)
            ],
            hints=job.hints,
        )

    @app.delete("/jobs/{name}", dependencies=[Depends(admin)])
    def delete(name: str) -> JobView:
        return view(controller.cancel(_name(name)))

    @app.get("/jobs/{name}/logs", dependencies=[Depends(admin)])
    def logs(
        name: str,
        rank: Annotated[int | None, Query(ge=0, le=4096)] = None,
        offset: Annotated[int, Query(ge=0)] = 0,
        limit: Annotated[int, Query(ge=1, le=16 * 1024 * 1024)] = 1024 * 1024,
        tail: Annotated[int | None, Query(ge=1, le=16 * 1024 * 1024)] = None,
    ) -> Response:
        job = controller._get(_name(name))
        data = _log_stream(controller, job, rank)
        if tail is not None:  # the last bytes (the dashboard's log pane); offset is ignored
            offset = max(0, len(data) - tail)
        chunk = data[offset : offset + limit]
        headers = {
            "X-Next-Offset": str(offset + len(chunk)),
            "X-Job-Status": job.phase,
            "X-Job-Done": "1" if job.phase in TERMINAL else "0",
        }
        return Response(chunk, media_type="text/plain; charset=utf-8", headers=headers)

    @app.get("/jobs/{name}/files/{path:path}", dependencies=[Depends(admin)])
    def get_file(name: str, path: str) -> Response:
        job = controller._get(_name(name))
        root = os.path.realpath(controller.job_dir(job.name, "share"))
        if "\x00" in path:
            raise HTTPException(400, "the path holds a NUL character")
        if os.path.isabs(path) or ".." in path.replace("\\", "/").split("/"):
            raise HTTPException(400, f"path {path!r} must be relative to the share folder, no '..'")
        full = os.path.realpath(os.path.join(root, path))
        if os.path.commonpath([root, full]) != root:
            raise HTTPException(400, f"path {path!r} resolves outside the job's share folder")
        if not os.path.isfile(full):
            raise HTTPException(404, f"no file {path!r} in job {job.name!r}'s share folder")
        if not os.access(full, os.R_OK):
            raise HTTPException(403, f"file {path!r} cannot be read")
        # streamed in chunks: a checkpoint-sized file is never held in memory whole
        return FileResponse(full, media_type="application/octet-stream")

    @app.put("/hints/{job}", status_code=204, dependencies=[Depends(job_token)])
    def put_hints(job: str, hints: Hints) -> Response:
        controller.put_hints(job, hints.model_dump())
        return Response(status_code=204)

    @app.get("/discover/{job}/{group}", dependencies=[Depends(job_token)])
    async def discover(
        job: str,
        group: int,
        timeout: Annotated[float, Query(ge=0, le=600)] = 30.0,
    ) -> list[str]:
        # a long poll on the event loop: a waiting caller holds no server thread
        deadline = time.monotonic() + timeout
        while True:
            record = controller.store.job(job)
            if record is not None and record.group == group:
                reps = controller.store.replicas(job, group)
                if reps:
                    return ["127.0.0.1"] * len(reps)
            if record is None or record.group > group or time.monotonic() >= deadline:
                raise HTTPException(408, f"group {group} of job {job!r} is not running")
            await asyncio.sleep(0.2)

    @app.get("/metrics", dependencies=[Depends(admin)], include_in_schema=False)
    def get_metrics() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/cluster", dependencies=[Depends(admin)])
    def cluster() -> dict:
        return {
            "nodes": {n: len(node.slots) for n, node in controller.backend.nodes.items()},
            "free": controller._free(),
            "round": controller.round,
            "policy": config.policy,
            "interval": config.interval,
        }

    add_dashboard(app, controller, admin)
    return app


class _TooLarge(HTTPException):
    pass


class _BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes gets 413, refused before it is read
    where its length is declared, cut off as it passes the limit where it is not (chunked)."""

    def __init__(self, app, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for key, value in scope.get("headers", ()):
            if key == b"content-length":
                try:
                    size = int(value)
                except ValueError:
                    size = -1
                if size < 0:
                    reply = JSONResponse({"detail": "Content-Length is not a number"}, 400)
                    await reply(scope, receive, send)
                    return
                if size > self.limit:
                    reply = JSONResponse(
                        {"detail": f"request body of {size} bytes exceeds {self.limit}"}, 413
                    )
                    await reply(scope, receive, send)
                    return
        received = 0

        async def limited():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise _TooLarge(413, f"request body exceeds {self.limit} bytes")
            return message

        await self.app(scope, limited, send)


def _short(value):
    """``value`` for a reply: JSON-safe (non-finite numbers as text) and short."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, int):
        return value if abs(value) < 1 << 63 else str(value)[:40] + "..."
    if isinstance(value, str):
        return value if len(value) <= 200 else value[:200] + "..."
    if isinstance(value, (dict, list, tuple)):
        try:
            text = json.dumps(value, allow_nan=False)
        except (TypeError, ValueError):
            text = None
        if text is not None and len(text) <= 1000:
            return value
    text = repr(value) if not isinstance(value, Exception) else str(value)
    return text if len(text) <= 200 else text[:200] + "..."


def _error(err: dict) -> dict:
    out = {k: err[k] for k in ("type", "loc", "msg") if k in err}
    if len(str(out.get("msg", ""))) > 1000:
        out["msg"] = str(out["msg"])[:1000] + "..."
    if "input" in err:
        out["input"] = _short(err["input"])
    if isinstance(err.get("ctx"), dict):
        out["ctx"] = {k: _short(v) for k, v in err["ctx"].items()}
    return out


def _name(name: str) -> str:
    try:
        return check_name(name)
    except ValueError as exc:
        raise HTTPException(400, str(exc)) from None


def _view_fields(controller: Controller, job, live: int | None = None) -> dict:
    hints = job.hints or {}
    now = time.time()
    runtime = 0.0
    if job.started is not None:
        runtime = (job.finished or now) - job.started
    if live is None:
        live = sum(1 for r in controller.store.replicas(job.name, job.group) if r.exit_code is None)
    speedup = controller.speedup(job)
    goodput = hints.get("goodput")
    return {
        "name": job.name,
        "status": job.phase,
        "reason": job.reason,
        "submitted": job.submitted,
        "started": job.started,
        "finished": job.finished,
        "runtime": runtime,
        "replicas": live if job.phase in ("Starting", "Running", "Stopping") else 0,
        "restarts": max(job.group, 0),
        "failures": job.failures,
        "batch_size": hints.get("batchSize"),
        "speedup": speedup,
        "goodput": goodput,
        "gain": hints.get("gain"),
    }


def _log_stream(controller: Controller, job, rank: int | None) -> bytes:
    """Every replica's output across the job's restart groups (one rank, or all, each group's
    part headed by a line naming it)."""
    parts = []
    for group in range(job.group + 1):
        for rec in controller.store.replicas(job.name, group):
            if rank is not None and rec.rank != rank:
                continue
            path = controller.backend.log_path(job.name, group, rec.rank)
            try:
                with open(path, "rb") as f:
                    body = f.read()
            except OSError:
                continue
            parts.append(f"=== group {group} rank {rec.rank} on {rec.node} ===\n".encode() + body)
    return b"".join(parts)


def _version() -> str:
    from adaptrain import __version__

    return __version__
