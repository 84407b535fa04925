"""First-in, first-out at each job's requested size: the baseline of a cluster without
elasticity.

Jobs start in submission order (``JobInfo.creation_timestamp``, ties by key), each at exactly
its requested size, its replicas packed onto the nodes with the most free GPUs
(:func:`~adaptrain.sched.policy_base.pack_replicas`, as Tiresias and Optimus place theirs). A job
that runs keeps its allocation until it ends: it is never preempted, shrunk or grown. The first
job that does not fit on the free GPUs waits, and so does every job behind it (no backfill: a
small later job never overtakes a large earlier one, so a large job cannot starve).

The requested size is ``JobInfo.replica_limit`` where it is set, else ``JobInfo.max_replicas``:

- a service job (and an adaptive job of the simulator) reports the bound of its spec
  (``adaptrain submit --max-replicas``) as ``replica_limit`` (with the cluster's size and its
  batch limits), while its ``max_replicas`` is only the allocator's exploration cap (twice the
  largest size it has run on), which would start every job on one replica;
- a fixed-size job (``JobReport.replicas``, the simulator's Tiresias jobs) has no
  ``replica_limit``: its ``max_replicas`` is its size.

The policy widens the exploration cap to that size through :meth:`FifoPolicy.replica_bound`.
A job placed between rounds (:meth:`FifoPolicy.allocate_job`) starts at once if it fits and no
earlier job waited at the last decision; otherwise it waits for the next round.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping

from .policy_base import Allocation, JobInfo, NodeInfo, NodeKey, pack_replicas

__all__ = ["FifoPolicy", "requested_replicas"]


def requested_replicas(job: JobInfo) -> int:
    """The size a job asked for: its ``replica_limit`` if set, else its ``max_replicas``."""
    return job.max_replicas if job.replica_limit is None else job.replica_limit


class FifoPolicy:
    """Submission order, requested size, packed placement, no preemption, no backfill."""

    name = "fifo"

    def __init__(self) -> None:
        #: whether a job waited (did not fit) at the last decision: a new arrival queues behind it
        self._blocked = False

    def replica_bound(self, job: JobInfo) -> int:
        return requested_replicas(job)

    def optimize(
        self,
        jobs: Mapping[str, JobInfo],
        nodes: Mapping[NodeKey, NodeInfo],
        base_allocations: Mapping[str, list[NodeKey]],
        time: float,
    ) -> Allocation:
        order = sorted(jobs, key=lambda k: (jobs[k].creation_timestamp, str(k)))
        free: collections.Counter = collections.Counter({n: int(i.gpus) for n, i in nodes.items()})
        allocations: Allocation = {}
        for key in order:  # running jobs keep what they hold
            held = [n for n in base_allocations.get(key) or () if n in nodes]
            if held:
                allocations[key] = held
                free.subtract(held)
        blocked = False
        for key in order:
            if key in allocations:
                continue
            need = requested_replicas(jobs[key])
            if sum(max(0, c) for c in free.values()) < need:
                blocked = True
                break
            allocations[key] = pack_replicas(need, free)
        self._blocked = blocked
        return allocations

    def allocate_job(self, job: JobInfo, free_nodes: Mapping[NodeKey, NodeInfo]) -> list[NodeKey]:
        """Place a job that arrives between rounds if it fits and nothing waits before it."""
        need = requested_replicas(job)
        free = collections.Counter({n: int(i.gpus) for n, i in free_nodes.items()})
        if self._blocked or sum(max(0, c) for c in free.values()) < need:
            self._blocked = True
            return []
        return pack_replicas(need, free)

    def state_dict(self) -> dict:
        return {"blocked": self._blocked}

    def load_state_dict(self, state: dict) -> None:
        self._blocked = bool(state.get("blocked", False))
