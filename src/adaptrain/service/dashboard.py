"""The web dashboard: a page at ``/`` (its scripts, styles and charts under ``/static``, written
for this package: no CDN, nothing fetched from elsewhere) and the JSON history it charts.

The page itself holds no data, so it is served without a token; everything it shows comes from
the API under the same rule as every other call (``Authorization: Bearer``, the server's token
where it has one). On a server with a token the page asks for it, keeps it in the tab's
``sessionStorage`` and sends it with each request. It polls the API (every 2 s, or every half
round where rounds are shorter), so a rescale shows within one scheduling round, without a
reload.

The history endpoints read what the controller records: a sample of a job's hints each time
rank 0 posts them, and one of its replica count each time its replicas start or have all ended
(:meth:`~adaptrain.service.store.Store.add_sample`), and the slots each job held at each policy
round (:meth:`~adaptrain.service.store.Store.add_round`), both bounded.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated

from fastapi import Depends, FastAPI, HTTPException, Query
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, Field

from .models import check_name
from .store import ROUNDS_KEPT, SAMPLES_PER_JOB

if TYPE_CHECKING:
    from .controller import Controller

__all__ = [
    "STATIC_DIR",
    "ClusterHistory",
    "ClusterSlots",
    "JobHistory",
    "JobSample",
    "NodeSlots",
    "RoundSample",
    "add_dashboard",
]

#: the page's files, shipped as package data
STATIC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")

#: what the page may load: its own files and the API, nothing from elsewhere, and no framing
_PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}

Since = Annotated[
    float | None,
    Query(description="only what was recorded after this time (Unix seconds)", allow_inf_nan=False),
]


class JobSample(BaseModel):
    """A job's hints at ``time`` (Unix seconds), with the replicas it held then; or, its other
    fields null, a change of its allocation (its replicas started, or all ended: 0)."""

    time: float
    replicas: int
    batch_size: int | None = None
    gain: float | None = None
    goodput: float | None = None
    throughput: float | None = None


class JobHistory(BaseModel):
    """A job's samples, oldest first, and where its TensorBoard events are written."""

    name: str
    samples: list[JobSample] = Field(default_factory=list)
    tensorboard_logdir: str


class RoundSample(BaseModel):
    """The cluster at the start of a policy round: ``used`` of ``total`` slots, per job."""

    time: float
    round: int
    used: int
    total: int
    jobs: dict[str, int] = Field(default_factory=dict)


class ClusterHistory(BaseModel):
    rounds: list[RoundSample] = Field(default_factory=list)
    interval: float


class NodeSlots(BaseModel):
    """A node's slots in order, each the name of the job whose replica holds it, or null;
    ``reserved``: slots promised to pending jobs, waiting for others to free them."""

    name: str
    slots: list[str | None]
    reserved: int = 0


class ClusterSlots(BaseModel):
    nodes: list[NodeSlots]
    round: int
    interval: float
    policy: str


def add_dashboard(app: FastAPI, controller: Controller, admin: Callable[..., None]) -> None:
    """Serve the page at ``/`` and its files under ``/static`` on ``app``, and add the history
    endpoints, each behind ``admin`` (the API's token check)."""
    store = controller.store
    config = controller.config
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    @app.get("/", include_in_schema=False)
    def page() -> FileResponse:
        return FileResponse(
            os.path.join(STATIC_DIR, "index.html"), media_type="text/html", headers=_PAGE_HEADERS
        )

    @app.get("/jobs/{name}/history", dependencies=[Depends(admin)])
    def job_history(
        name: str,
        since: Since = None,
        limit: Annotated[int, Query(ge=1, le=SAMPLES_PER_JOB)] = SAMPLES_PER_JOB,
    ) -> JobHistory:
        job = controller._get(_checked(name))
        return JobHistory(
            name=job.name,
            samples=[JobSample(**vars(s)) for s in store.samples(job.name, since, limit)],
            tensorboard_logdir=os.path.abspath(controller.job_dir(job.name, "tensorboard")),
        )

    @app.get("/cluster/history", dependencies=[Depends(admin)])
    def cluster_history(
        since: Since = None,
        limit: Annotated[int, Query(ge=1, le=ROUNDS_KEPT)] = 1000,
    ) -> ClusterHistory:
        rounds = [
            RoundSample(time=r.time, round=r.round, used=r.used, total=r.total, jobs=r.held)
            for r in store.rounds(since, limit)
        ]
        return ClusterHistory(rounds=rounds, interval=config.interval)

    @app.get("/cluster/slots", dependencies=[Depends(admin)])
    def cluster_slots() -> ClusterSlots:
        nodes = dict(controller.backend.nodes)
        holders = {name: [None] * len(node.slots) for name, node in nodes.items()}
        reserved = dict.fromkeys(nodes, 0)
        for job in store.jobs(("Pending", "Starting", "Running", "Stopping")):
            if job.phase == "Pending":
                for node in job.target or ():
                    if node in reserved:
                        reserved[node] += 1
                continue
            for rec in store.replicas(job.name, job.group):
                slots = holders.get(rec.node)
                if rec.exit_code is None and slots is not None and 0 <= rec.slot < len(slots):
                    slots[rec.slot] = job.name
        return ClusterSlots(
            nodes=[
                NodeSlots(name=n, slots=holders[n], reserved=reserved[n]) for n in sorted(nodes)
            ],
            round=controller.round,
            interval=config.interval,
            policy=config.policy,
        )


def _checked(name: str) -> str:
    try:
        return check_name(name)
    except ValueError as exc:
        raise HTTPException(400, str(exc)) from None
