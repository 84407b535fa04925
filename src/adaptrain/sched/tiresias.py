"""Tiresias (2D-LAS) baseline as run in the Pollux paper's simulator.

Gu et al., "Tiresias: A GPU Cluster Manager for Distributed Deep Learning", NSDI'19. Two
priority queues ordered by arrival; a running job is demoted from queue 0 to queue 1 once its
executed time x requested GPUs reaches ``queue_threshold`` (16 GPU-hours). Each round, jobs are
admitted in queue order (queue 0 first) whenever their fixed replica count (``max_replicas``)
still fits in the cluster, skipping those that don't; admitted jobs keep their placement, new ones
are packed onto the nodes with the most free GPUs. No starvation handling (as in the artifact).
A non-preemptible job (``JobInfo.preemptible``) that runs keeps its allocation, ahead of both
queues.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping

from .policy_base import Allocation, JobInfo, NodeInfo, NodeKey, pack_replicas

__all__ = ["TiresiasPolicy"]


class TiresiasPolicy:
    """Discretised 2D-LAS with a fixed number of GPUs per job."""

    name = "tiresias"

    def __init__(self, queue_threshold: float = 3600 * 16) -> None:
        self.queue_threshold = queue_threshold
        self._queue0: list[str] = []
        self._queue1: list[str] = []
        self._status: dict[str, str] = {}
        self._last_check: collections.Counter = collections.Counter()
        self._executed: collections.Counter = collections.Counter()

    def optimize(
        self,
        jobs: Mapping[str, JobInfo],
        nodes: Mapping[NodeKey, NodeInfo],
        base_allocations: Mapping[str, list[NodeKey]],
        time: float,
    ) -> Allocation:
        now = int(time)
        self._queue0 = [k for k in self._queue0 if k in jobs]
        self._queue1 = [k for k in self._queue1 if k in jobs]
        self._status = {k: v for k, v in self._status.items() if k in jobs}
        allocations = {k: list(v) for k, v in base_allocations.items() if k in jobs}
        for key in jobs:
            if key not in self._status:
                self._status[key] = "PENDING"
                self._queue0.append(key)
        for key, job in jobs.items():
            elapsed = int(now - self._last_check[key])
            self._last_check[key] = now
            if self._status[key] == "RUNNING":
                self._executed[key] = int(self._executed[key] + elapsed)
                gpu_time = int(self._executed[key] * job.max_replicas)
                if key in self._queue0 and gpu_time >= self.queue_threshold:
                    self._queue0.remove(key)
                    self._queue1.append(key)
        total = {k: int(n.gpus) for k, n in nodes.items()}
        free_total = sum(total.values())
        pinned = {  # non-preemptible jobs keep the allocation they run on, whatever their queue
            k for k, job in jobs.items() if not job.preemptible and base_allocations.get(k)
        }
        for key in pinned:
            self._status[key] = "RUNNING"
            free_total -= len(allocations[key])
        for queue in (self._queue0, self._queue1):
            for key in queue:
                if key in pinned:
                    continue
                if jobs[key].max_replicas <= free_total:
                    self._status[key] = "RUNNING"
                    free_total -= jobs[key].max_replicas
                else:
                    self._status[key] = "PENDING"
                    allocations.pop(key, None)
        free = collections.Counter(total) - collections.Counter(
            n for alloc in allocations.values() for n in alloc
        )
        for queue in (self._queue0, self._queue1):
            for key in queue:
                if self._status[key] == "RUNNING" and not allocations.get(key):
                    allocations[key] = pack_replicas(jobs[key].max_replicas, free)
        return allocations

    def state_dict(self) -> dict:
        return {
            "queue0": list(self._queue0),
            "queue1": list(self._queue1),
            "status": dict(self._status),
            "last_check": dict(self._last_check),
            "executed": dict(self._executed),
        }

    def load_state_dict(self, state: dict) -> None:
        self._queue0 = list(state["queue0"])
        self._queue1 = list(state["queue1"])
        self._status = dict(state["status"])
        self._last_check = collections.Counter(state["last_check"])
        self._executed = collections.Counter(state["executed"])
