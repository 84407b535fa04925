"""Optimus baseline as run in the Pollux paper's simulator.

Peng et al., "Optimus: An Efficient Dynamic Resource Scheduler for Deep Learning Clusters",
EuroSys'18. Every job gets one GPU (``min_replicas`` if more; a non-preemptible job keeps the
allocation it runs on), then GPUs are handed out one at a time to the job with the
largest marginal reduction of remaining time, ``(t_step(r) - t_step(r + 1)) * remaining_steps``,
at the job's fixed batch size. Jobs whose replica count is unchanged keep their placement; the
others are packed (fewest replicas first) onto the nodes with the most free GPUs.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping

from .policy_base import Allocation, JobInfo, NodeInfo, NodeKey, pack_replicas

__all__ = ["OptimusPolicy"]


class OptimusPolicy:
    """Greedy marginal-gain allocation over predicted remaining time."""

    name = "optimus"

    def optimize(
        self,
        jobs: Mapping[str, JobInfo],
        nodes: Mapping[NodeKey, NodeInfo],
        base_allocations: Mapping[str, list[NodeKey]],
        time: float,
    ) -> Allocation:
        for key, job in jobs.items():
            if job.step_time_fn is None:
                raise ValueError(f"job {key!r}: OptimusPolicy needs JobInfo.step_time_fn")
        free_total = sum(int(n.gpus) for n in nodes.values())
        num_replicas: dict[str, int] = {}
        gain: dict[str, float] = {}

        def marginal(key: str) -> float:
            job, r = jobs[key], num_replicas[key]
            if r + 1 > job.max_replicas or free_total < 1:
                return 0.0
            return (job.step_time_fn(r) - job.step_time_fn(r + 1)) * job.remaining_steps

        pinned = {  # non-preemptible jobs keep the allocation they run on
            k for k, job in jobs.items() if not job.preemptible and base_allocations.get(k)
        }
        for key in pinned:
            num_replicas[key] = len(base_allocations[key])
            free_total -= num_replicas[key]
        for key in jobs:  # every other job asks for its first replicas (arrival order)
            if key in pinned:
                continue
            first = max(1, jobs[key].min_replicas)
            if free_total < first:
                num_replicas[key] = 0
                gain[key] = 0.0
                continue
            num_replicas[key] = first
            free_total -= first
            gain[key] = marginal(key)
        while free_total > 0 and gain and max(gain.values()) > 0:
            key = max(gain, key=lambda k: gain[k])
            num_replicas[key] += 1
            gain[key] = marginal(key)
            free_total -= 1
        allocations = {
            k: list(v)
            for k, v in base_allocations.items()
            if k in jobs and len(v) == num_replicas[k]
        }
        total = {k: int(n.gpus) for k, n in nodes.items()}
        free = collections.Counter(total) - collections.Counter(
            n for alloc in allocations.values() for n in alloc
        )
        for key in sorted(jobs, key=lambda k: num_replicas[k]):
            if num_replicas[key] > 0 and not allocations.get(key):
                allocations[key] = pack_replicas(num_replicas[key], free)
        return allocations
