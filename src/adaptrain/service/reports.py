"""From a job's posted hints to the :class:`~adaptrain.sched.jobs.JobReport` the policy reads.

A job that has posted no hints yet has no goodput model: the policy sees it as never run (its
speedup unknown). Once rank 0 posts its fitted step-time model (``perfParams``) and gradient
statistics (``gradParams``), the job's speedup is its goodput model's, with the batch limits it
posted, exactly as the simulator's adaptive jobs are valued.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from adaptrain.core.goodput import GoodputFunction
from adaptrain.sched.jobs import JobReport
from adaptrain.sched.speedup import SpeedupFunction

logger = logging.getLogger(__name__)

__all__ = ["job_report", "speedup_from_hints"]


def speedup_from_hints(
    hints: dict[str, Any], max_nodes: int, max_replicas: int
) -> SpeedupFunction | None:
    """The job's speedup from its posted goodput model, or ``None`` without one."""
    perf, grad = hints.get("perfParams"), hints.get("gradParams")
    if not perf or not grad:
        return None
    params = [perf[k] for k in ("alpha_c", "beta_c", "alpha_n", "beta_n", "alpha_r", "beta_r")]
    params.append(perf["gamma"])
    bounds = hints.get("localBszBounds")
    try:
        goodput = GoodputFunction(params, (grad["norm"], grad["var"]), hints["initBatchSize"])
        return SpeedupFunction(
            goodput,
            max_batch_size=hints.get("maxBatchSize"),
            atomic_bsz_range=tuple(bounds) if bounds else None,
            accumulation=bool(hints.get("gradientAccumulation")),
            max_nodes=max(1, max_nodes),
            max_replicas=max(1, max_replicas),
        )
    except (RuntimeError, ValueError, ZeroDivisionError) as exc:
        logger.warning("hints give no usable goodput model (%s): the job counts as unmeasured", exc)
        return None


def job_report(
    *,
    submitted: float,
    attained_service: float,
    spec: dict[str, Any],
    group: int,
    hints: dict[str, Any] | None,
    running: bool,
    cooldown: bool,
    max_nodes: int,
    max_replicas: int,
) -> JobReport:
    """What a service job reports: its spec's bounds, its restarts, and from its hints its
    profile, goodput model, batch limits and epoch. A running job that is not preemptible, or
    that was rescaled in the last rounds (``cooldown``), is pinned to its allocation."""
    hints = hints or {}
    profile = {
        (p["numNodes"], p["numReplicas"], p["atomicBsz"]): (p["stepTime"], p["syncTime"])
        for p in hints.get("profile", ())
    }
    bounds = hints.get("localBszBounds")
    min_local = int(bounds[0]) if bounds else None
    max_batch = hints.get("maxBatchSize")
    progress = hints.get("progress") or {}
    speedup = speedup_from_hints(hints, max_nodes, max_replicas) if profile else None
    return JobReport(
        submitted=submitted,
        attained_service=attained_service if math.isfinite(attained_service) else 0.0,
        min_replicas=int(spec.get("min_replicas", 0)),
        max_replicas=int(spec.get("max_replicas", 1)),
        preemptible=not (running and (cooldown or not spec.get("preemptible", True))),
        num_restarts=max(group, 0),
        epoch=progress.get("epoch"),
        profile=profile or None,
        speedup_fn=speedup,
        max_batch_size=int(max_batch) if max_batch and min_local else None,
        min_local_bsz=min_local if max_batch else None,
    )
