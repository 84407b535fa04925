"""``/metrics`` for operators, in Prometheus' text format (prometheus-client): jobs by status,
slots allocated and free, rescales, restarts, round times, per-job goodput and batch size."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from .models import PHASES

if TYPE_CHECKING:
    from .controller import Controller

__all__ = ["Metrics"]


class _Collector:
    def __init__(self, controller: Controller) -> None:
        self.controller = controller

    def collect(self):
        c = self.controller
        jobs = c.store.jobs()
        by_phase = Counter(j.phase for j in jobs)
        g = GaugeMetricFamily("adaptrain_jobs", "Jobs by status", labels=["status"])
        for phase in PHASES:
            g.add_metric([phase], by_phase.get(phase, 0))
        yield g
        free = c._free()
        total = sum(c.capacity.values())
        yield GaugeMetricFamily("adaptrain_slots_total", "Slots of the cluster", value=total)
        yield GaugeMetricFamily(
            "adaptrain_slots_free",
            "Slots no replica holds",
            value=sum(max(0, v) for v in free.values()),
        )
        yield GaugeMetricFamily(
            "adaptrain_slots_allocated",
            "Slots held by replicas",
            value=total - sum(max(0, v) for v in free.values()),
        )
        for key, help_text in (
            ("rescales", "Jobs moved to another replica count by a policy round"),
            ("restarts", "Replica groups started after the first (rescales and failures)"),
            ("starts", "Jobs started for the first time"),
        ):
            yield CounterMetricFamily(
                f"adaptrain_{key}", help_text, value=float(c.counters.get(key, 0))
            )
        yield GaugeMetricFamily("adaptrain_rounds", "Policy rounds run", value=c.round)
        last = c.round_seconds[-1] if c.round_seconds else 0.0
        yield GaugeMetricFamily(
            "adaptrain_round_seconds", "Seconds the last policy round took", value=last
        )
        recent = c.round_seconds[-100:]
        yield GaugeMetricFamily(
            "adaptrain_round_seconds_max",
            "Longest of the last 100 policy rounds, seconds",
            value=max(recent) if recent else 0.0,
        )
        goodput = GaugeMetricFamily(
            "adaptrain_job_goodput", "Goodput a job reported", labels=["job"]
        )
        bsz = GaugeMetricFamily("adaptrain_job_batch_size", "A job's batch size", labels=["job"])
        replicas = GaugeMetricFamily("adaptrain_job_replicas", "A job's allocation", labels=["job"])
        for job in jobs:
            if job.phase not in ("Starting", "Running", "Stopping"):
                continue
            hints = job.hints or {}
            if hints.get("goodput") is not None:
                goodput.add_metric([job.name], float(hints["goodput"]))
            if hints.get("batchSize") is not None:
                bsz.add_metric([job.name], float(hints["batchSize"]))
            replicas.add_metric([job.name], float(len(job.allocation)))
        yield goodput
        yield bsz
        yield replicas


class Metrics:
    def __init__(self, controller: Controller) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(controller))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
