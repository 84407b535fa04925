"""A non-preemptible running job keeps its allocation under every policy: it is neither shrunk
nor moved, on one node or several, and Tiresias never preempts it."""

from __future__ import annotations

import dataclasses

import pytest
from _sched_cases import cluster_and_jobs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adaptrain.sched import (
    ClusterSpec,
    JobInfo,
    LinearSpeedup,
    NodeInfo,
    OptimusPolicy,
    PolluxPolicy,
    Search,
    TiresiasPolicy,
    WaterfillPolicy,
    check_allocations,
)


def _policy(kind: str, seed: int = 0):
    if kind == "pollux":
        return PolluxPolicy(pop_size=16, generations=10, seed=seed)
    if kind == "waterfill-local":
        return WaterfillPolicy(search=Search(method="local"))
    if kind == "waterfill-genetic":
        return WaterfillPolicy(search=Search(pop_size=16, generations=10), seed=seed)
    return {"tiresias": TiresiasPolicy, "optimus": OptimusPolicy}[kind]()


ALL_KINDS = ["pollux", "waterfill-local", "waterfill-genetic", "tiresias", "optimus"]


def _crowded_node():
    """One 4-GPU node fully held by a non-preemptible job; three more jobs wait."""
    fast = lambda r: 1.0 / r  # noqa: E731
    jobs = {
        "np": JobInfo(
            0.0,
            attained_service=1e6,
            max_replicas=4,
            speedup_fn=LinearSpeedup(),
            preemptible=False,
            age=3600.0,
            remaining_work=1e6,
            step_time_fn=fast,
        ),
    }
    for i in range(3):
        jobs[f"w{i}"] = JobInfo(
            10.0 + i, max_replicas=4, speedup_fn=LinearSpeedup(), age=60.0, step_time_fn=fast
        )
    return jobs, {0: NodeInfo(4)}, {"np": [0, 0, 0, 0]}


@pytest.mark.parametrize("kind", ["pollux", "waterfill-local", "waterfill-genetic", "optimus"])
def test_a_non_preemptible_running_job_is_neither_shrunk_nor_moved(kind):
    jobs, nodes, base = _crowded_node()
    for seed in range(3):
        alloc = _policy(kind, seed).optimize(jobs, nodes, base, 60.0)
        assert alloc["np"] == [0, 0, 0, 0], (seed, alloc)
        assert not any(alloc.get(k) for k in jobs if k != "np"), alloc


@pytest.mark.parametrize("kind", ["pollux", "waterfill-local", "waterfill-genetic"])
def test_a_non_preemptible_multi_node_job_keeps_its_nodes(kind):
    # "pm" runs on two nodes in its own order of nodes; scalable jobs would like its GPUs, and
    # no other multi-node job may share its nodes (interference avoidance)
    nodes = {i: NodeInfo(4) for i in range(3)}
    jobs = {
        "pm": JobInfo(
            0.0,
            attained_service=1e6,
            max_replicas=8,
            speedup_fn=LinearSpeedup(),
            preemptible=False,
            age=3600.0,
            remaining_work=1e7,
        ),
    }
    for i in range(4):
        jobs[f"w{i}"] = JobInfo(1.0 + i, max_replicas=8, speedup_fn=LinearSpeedup(), age=600.0)
    base = {"pm": [2, 2, 0, 0, 0]}
    for seed in range(3):
        alloc = _policy(kind, seed).optimize(jobs, nodes, base, 60.0)
        assert alloc["pm"] == [2, 2, 0, 0, 0], (seed, alloc)
        check_allocations({k: v for k, v in alloc.items() if v}, jobs, nodes, interference=True)


def test_tiresias_never_preempts_a_non_preemptible_job():
    # "np" runs, is demoted to queue 1 (threshold 1 GPU-second), then a queue-0 job arrives
    # that needs the whole node: a preemptible job would be preempted, "np" keeps running.
    policy = TiresiasPolicy(queue_threshold=1.0)
    nodes = {0: NodeInfo(4)}
    np_job = JobInfo(0.0, max_replicas=4, preemptible=False)
    first = policy.optimize({"np": np_job}, nodes, {}, 0.0)
    assert first == {"np": [0, 0, 0, 0]}
    jobs = {"np": np_job, "new": JobInfo(60.0, max_replicas=4)}
    alloc = policy.optimize(jobs, nodes, first, 60.0)
    assert alloc.get("np") == [0, 0, 0, 0], alloc
    assert not alloc.get("new")
    # the same job, preemptible, is preempted (the queue order is unchanged)
    policy = TiresiasPolicy(queue_threshold=1.0)
    pre = dataclasses.replace(np_job, preemptible=True)
    first = policy.optimize({"np": pre}, nodes, {}, 0.0)
    alloc = policy.optimize({"np": pre, "new": jobs["new"]}, nodes, first, 60.0)
    assert not alloc.get("np") and alloc["new"] == [0, 0, 0, 0]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cluster_and_jobs(), st.data())
def test_policies_keep_every_non_preemptible_allocation(case, data):
    jobs, nodes, base = case
    running = sorted(k for k, v in base.items() if v)
    pinned = data.draw(st.sets(st.sampled_from(running)) if running else st.just(set()))
    jobs = {k: dataclasses.replace(j, preemptible=k not in pinned) for k, j in jobs.items()}
    gpn = max(n.gpus for n in nodes.values())
    for kind in ALL_KINDS:
        if kind.startswith("waterfill"):
            policy = WaterfillPolicy(
                search=Search(
                    method="local" if kind.endswith("local") else "genetic",
                    pop_size=12,
                    generations=4,
                ),
                cluster=ClusterSpec(gpus_per_node=gpn),
            )
        elif kind == "pollux":
            policy = PolluxPolicy(pop_size=12, generations=4, seed=1)
        else:
            policy = _policy(kind)
        alloc = policy.optimize(jobs, nodes, base, 60.0)
        for k in pinned:
            assert alloc.get(k) == base[k], (kind, k, alloc)
        alloc = {k: v for k, v in alloc.items() if v}
        if kind in ("tiresias", "optimus"):  # no minimum-replica guarantees
            check_allocations(
                alloc, {k: dataclasses.replace(j, min_replicas=0) for k, j in jobs.items()}, nodes
            )
        else:  # waterfill within its own bound (explore_growth), the others the allocator's
            check_allocations(alloc, jobs, nodes, interference=True, policy=policy)
