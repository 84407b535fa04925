"""What a scheduling policy sees and returns.

A policy maps (jobs' state, cluster, time) to an allocation: ``{job_key: [node_key, ...]}``
with one node key per replica (a job with 3 replicas on node 2 and 1 on node 5 gets
``[2, 2, 2, 5]``). A node key is any sortable, hashable name: the simulator numbers its nodes,
a service names them (a hostname, a Ray node ID). Policies order nodes by their keys, so keys
of one cluster must be of one type. Policies never touch the simulator; the simulator and the
service build :class:`JobInfo` (:func:`adaptrain.sched.jobs.job_info`) and :class:`NodeInfo`
and call :meth:`Policy.optimize`.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = [
    "Allocation",
    "JobInfo",
    "NodeKey",
    "NodeInfo",
    "Policy",
    "check_allocations",
    "replica_bound",
    "pack_replicas",
]

#: A node's key: an index in the simulator, a name (hostname, Ray node ID) in a service.
NodeKey = Hashable
Allocation = dict[str, list[NodeKey]]


@dataclass
class JobInfo:
    """A job as a policy sees it (one GPU per replica).

    ``speedup_fn(num_nodes, num_replicas)`` (numpy-vectorised) is the job's goodput relative to
    one GPU; ``step_time_fn(num_replicas)`` (Optimus) predicts seconds per step at the job's
    fixed batch size and ``remaining_steps`` how many steps it still needs.
    ``remaining_work`` is the job's own estimate of the seconds it still needs on one GPU
    (remaining epochs x examples, over its modelled one-GPU goodput), ``None`` if unknown.
    ``max_profiled_replicas`` is the largest replica count the job has run on (0 if unknown):
    its speedup beyond that size is an extrapolation of its goodput model.
    ``replica_limit`` is the most replicas the job may ever get (its own and the cluster's
    limit), ``None`` if that is ``max_replicas``. A ``max_replicas`` below it is the allocator's
    default exploration cap (AdaptDL's rule: at most twice the largest size the job has run on),
    which lifts as the job grows. It bounds how far a job goes beyond the sizes its model has
    seen. The cap is a scheduling choice, not a property of the job: a policy with its own
    exploration rule may widen it up to ``replica_limit``, and says so through a
    ``replica_bound(job)`` method (:func:`replica_bound`). Policies without one keep to
    ``max_replicas``.
    ``application`` names what the job trains, e.g. its model on this cluster's hardware
    (``None``: unknown): jobs of one application have the same throughput, so a policy may
    share what one has measured with the others (``WaterfillPolicy(share_profiles=True)``).
    ``epoch`` is the job's current epoch (``None``: unknown).
    ``profile`` holds the step times the job has measured, as AdaptDL's job keeps them:
    ``(num_nodes, num_replicas, atomic_bsz) -> (step_time, sync_time)`` in seconds, an
    optimizer step and its all-reduce (``None``: not reported). A policy may correct its
    goodput model where the model and the measurements disagree
    (``WaterfillPolicy(calibrate=True)``).
    """

    creation_timestamp: float
    attained_service: float = 0.0
    min_replicas: int = 0
    max_replicas: int = 1
    speedup_fn: Callable[..., Any] | None = None
    preemptible: bool = True
    num_restarts: int = 0
    age: float = 0.0
    step_time_fn: Callable[[int], float] | None = None
    remaining_steps: float = 1.0
    remaining_work: float | None = None
    max_profiled_replicas: int = 0
    replica_limit: int | None = None
    application: str | None = None
    epoch: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    profile: Mapping[tuple[int, int, int], tuple[float, float]] | None = None

    def __post_init__(self) -> None:
        if self.max_replicas < 1:
            raise ValueError(f"max_replicas={self.max_replicas} must be >= 1")
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError(
                f"min_replicas={self.min_replicas} must lie in [0, max_replicas={self.max_replicas}]"
            )
        if self.max_profiled_replicas < 0:
            raise ValueError(
                f"max_profiled_replicas={self.max_profiled_replicas} must be >= 0 (0: unknown)"
            )
        if self.replica_limit is not None and self.replica_limit < self.max_replicas:
            raise ValueError(
                f"replica_limit={self.replica_limit} must be >= max_replicas={self.max_replicas} "
                "(or None: max_replicas is the limit)"
            )


@dataclass
class NodeInfo:
    """A node with ``gpus`` free GPUs (slots); ``preemptible``: it may be taken away at short
    notice (a spot instance), so a policy places jobs there last."""

    gpus: int
    preemptible: bool = False


class Policy(Protocol):
    """``optimize(jobs, nodes, base_allocations, time) -> allocations``.

    A policy may also define ``allocate_job(job, free_nodes) -> list[int]``: a place for one job
    that arrives between two rounds, on the GPUs free at that moment (``free_nodes[n].gpus`` is
    node ``n``'s free GPUs; ``[]``: the job waits for the next round). AdaptDL's allocator calls
    it on every new job (``PolluxPolicy.allocate_job``: one replica on the first node with room)
    so that a job does not wait a whole round; the simulator does the same unless told not to
    (``Simulator(arrival_allocation=False)``, the artifact simulator's behaviour).
    """

    name: str

    def optimize(
        self,
        jobs: Mapping[str, JobInfo],
        nodes: Mapping[NodeKey, NodeInfo],
        base_allocations: Mapping[str, list[NodeKey]],
        time: float,
    ) -> Allocation: ...


def pack_replicas(
    num_replicas: int, free_gpus: collections.Counter, node_order: list[NodeKey] | None = None
) -> list[NodeKey]:
    """Place replicas greedily on the node with most free GPUs (ties: lowest key first).

    This is the placement of the artifact's Tiresias and Optimus (``Counter.most_common``);
    ``free_gpus`` is updated in place.
    """
    alloc: list[NodeKey] = []
    while len(alloc) < num_replicas:
        node, count = max(free_gpus.items(), key=lambda kv: kv[1])  # first max in order
        if count <= 0:
            raise RuntimeError(f"no free GPU left to place {num_replicas} replicas")
        num = min(count, num_replicas - len(alloc))
        alloc.extend([node] * num)
        free_gpus[node] -= num
    return alloc


def replica_bound(policy: object, job: JobInfo) -> int:
    """The most replicas ``policy`` may give ``job`` now: ``policy.replica_bound(job)`` for a
    policy with its own exploration rule, else ``job.max_replicas``.

    A policy's own bound must lie in ``[max_replicas, replica_limit]``: it may widen the
    allocator's exploration cap, never the job's limit. ``RuntimeError`` otherwise.
    """
    fn = getattr(policy, "replica_bound", None)
    if fn is None:
        return job.max_replicas
    bound = int(fn(job))
    limit = job.max_replicas if job.replica_limit is None else job.replica_limit
    if not job.max_replicas <= bound <= limit:
        raise RuntimeError(
            f"{type(policy).__name__}.replica_bound gave {bound}, outside [max_replicas="
            f"{job.max_replicas}, replica_limit={limit}]"
        )
    return bound


def check_allocations(
    allocations: Mapping[str, list[NodeKey]],
    jobs: Mapping[str, JobInfo],
    nodes: Mapping[NodeKey, NodeInfo],
    *,
    interference: bool = False,
    policy: object | None = None,
) -> None:
    """Raise ``RuntimeError`` if allocations break capacity, replica bounds or (optionally)
    interference avoidance (at most one multi-node job per node).

    A job's upper bound is its ``max_replicas``, or with ``policy`` :func:`replica_bound`
    (the policy's own exploration rule, within the job's ``replica_limit``)."""
    used: collections.Counter = collections.Counter()
    multi: collections.Counter = collections.Counter()
    for key, alloc in allocations.items():
        if key not in jobs:
            raise RuntimeError(f"allocation for unknown job {key!r}")
        n = len(alloc)
        job = jobs[key]
        hi = job.max_replicas if policy is None else replica_bound(policy, job)
        if n and not job.min_replicas <= n <= hi:
            raise RuntimeError(f"job {key!r} got {n} replicas outside [{job.min_replicas}, {hi}]")
        used.update(alloc)
        if len(set(alloc)) > 1:
            multi.update(set(alloc))
    for node, count in used.items():
        if node not in nodes:
            raise RuntimeError(f"allocation on unknown node {node!r}")
        if count > nodes[node].gpus:
            raise RuntimeError(f"node {node} over capacity: {count} > {nodes[node].gpus}")
    if interference:
        bad = [n for n, c in multi.items() if c > 1]
        if bad:
            raise RuntimeError(f"nodes {bad} host more than one multi-node job")
