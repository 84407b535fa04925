"""From what a job has reported to what a policy sees: one rule for the simulator and a service.

A running job reports its state: when it was submitted, the GPU-seconds it has had, how often it
restarted, the step times it measured on each configuration, its goodput model and its batch
limits. :func:`job_info` turns that report into the :class:`~adaptrain.sched.policy_base.JobInfo`
a policy decides on. The rules are AdaptDL's allocator's:

- a job never gets more replicas than the cluster has slots, its own ``max_replicas`` (the
  job spec's bound) or its batch limits allow (``max_batch_size // min_local_bsz``: every replica
  needs at least its smallest local batch); that is its ``replica_limit``;
- an adaptive job is offered at most twice the largest replica count it has run on (the
  exploration cap: its goodput model has seen nothing larger); a policy with its own exploration
  rule may widen this up to ``replica_limit``;
- a job with a fixed replica count (``replicas``) gets exactly that count, and a job with a
  fixed batch size but no fixed count (``batch_size``) at most one replica per smallest local
  batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .policy_base import JobInfo

__all__ = ["JobReport", "job_info"]


@dataclass(frozen=True)
class JobReport:
    """What a job has reported, as the simulator or a service knows it.

    ``submitted`` is the submission time (seconds, the clock the caller passes as ``now``);
    ``attained_service`` the GPU-seconds it has had; ``max_replicas`` the job's own bound
    (``None``: none beyond the cluster and its batch limits). ``profile`` maps each measured
    ``(num_nodes, num_replicas, atomic_bsz)`` to ``(step_time, sync_time)`` seconds.
    ``speedup_fn`` and ``remaining_work`` come from the job's goodput model (``None`` before it
    has one); ``max_batch_size`` and ``min_local_bsz`` are its batch limits (``None``: unknown).
    ``replicas`` fixes the replica count (a job that does not scale), ``batch_size`` fixes the
    batch size (a job whose replica count a policy chooses from its step time,
    ``step_time_fn(replicas)``, and ``remaining_steps``).
    """

    submitted: float
    attained_service: float = 0.0
    min_replicas: int = 0
    max_replicas: int | None = None
    preemptible: bool = True
    num_restarts: int = 0
    application: str | None = None
    epoch: int | None = None
    profile: Mapping[tuple[int, int, int], tuple[float, float]] | None = None
    speedup_fn: Callable[..., Any] | None = None
    remaining_work: float | None = None
    max_batch_size: int | None = None
    min_local_bsz: int | None = None
    replicas: int | None = None
    batch_size: int | None = None
    step_time_fn: Callable[[int], float] | None = None
    remaining_steps: float = 1.0

    def __post_init__(self) -> None:
        if not math.isfinite(self.submitted):
            raise ValueError(f"submitted={self.submitted} must be a finite time in seconds")
        for name in ("max_replicas", "max_batch_size", "min_local_bsz", "replicas", "batch_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}={value} must be >= 1, or None (unknown)")
        if self.min_replicas < 0:
            raise ValueError(f"min_replicas={self.min_replicas} must be >= 0")

    @property
    def max_profiled_replicas(self) -> int:
        """The largest replica count the job has measured a step on (0: none)."""
        return max((int(k[1]) for k in self.profile or ()), default=0)


def job_info(report: JobReport, *, cluster_replicas: int, now: float) -> JobInfo:
    """The :class:`JobInfo` a policy sees of ``report`` at time ``now`` on a cluster of
    ``cluster_replicas`` slots (GPUs), by the rules of the module docstring."""
    if cluster_replicas < 1:
        raise ValueError(f"cluster_replicas={cluster_replicas} must be >= 1")
    limit = cluster_replicas
    if report.max_replicas is not None:
        limit = min(limit, report.max_replicas)
    common: dict[str, Any] = {
        "creation_timestamp": report.submitted,
        "attained_service": report.attained_service,
        "preemptible": report.preemptible,
        "num_restarts": report.num_restarts,
        "age": now - report.submitted,
        "application": report.application,
        "epoch": report.epoch,
    }
    if report.replicas is not None:  # a fixed size
        return JobInfo(max_replicas=min(report.replicas, limit), **common)
    if report.batch_size is not None:  # a fixed batch size, spread over the replicas
        per_batch = max(1, report.batch_size // (report.min_local_bsz or 1))
        return JobInfo(
            max_replicas=min(per_batch, limit),
            step_time_fn=report.step_time_fn,
            remaining_steps=report.remaining_steps,
            **common,
        )
    if report.max_batch_size is not None and report.min_local_bsz is not None:
        limit = min(limit, max(1, report.max_batch_size // report.min_local_bsz))
    largest = report.max_profiled_replicas
    least = min(report.min_replicas, limit)
    return JobInfo(
        min_replicas=least,
        max_replicas=min(max(2 * largest, 1, least), limit),
        speedup_fn=report.speedup_fn,
        remaining_work=report.remaining_work,
        max_profiled_replicas=largest,
        replica_limit=limit,
        profile=report.profile,
        **common,
    )
