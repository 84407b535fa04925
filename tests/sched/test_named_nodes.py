"""Nodes named by strings (a hostname, a Ray node ID), as a service names them: every policy
decides exactly as with integer keys of the same order, and the checks work on names."""

from __future__ import annotations

import pytest

from adaptrain.sched import (
    ClusterSpec,
    JobInfo,
    NodeInfo,
    OptimusPolicy,
    PolluxPolicy,
    PowerSpeedup,
    Search,
    TiresiasPolicy,
    WaterfillPolicy,
    check_allocations,
)

NAMES = [f"host-{i:02d}" for i in range(6)]  # sorted as the integers 0..5


def _jobs() -> dict[str, JobInfo]:
    jobs = {}
    for i in range(7):
        jobs[f"job{i}"] = JobInfo(
            creation_timestamp=10.0 * i,
            attained_service=100.0 * i,
            max_replicas=8,
            replica_limit=12,
            max_profiled_replicas=4,
            speedup_fn=PowerSpeedup(0.6 + 0.05 * i),
            remaining_work=3000.0 * (i + 1),
            age=600.0,
            step_time_fn=lambda r: 1.0 / r**0.7,
            remaining_steps=1000.0,
        )
    return jobs


def _policies():
    spec = ClusterSpec(gpus_per_node=4)
    return {
        "waterfill": lambda: WaterfillPolicy(cluster=spec, seed=1),
        "waterfill-local": lambda: WaterfillPolicy(cluster=spec, search=Search(method="local")),
        "pollux": lambda: PolluxPolicy(pop_size=20, generations=10, seed=1, cluster=spec),
        "tiresias": TiresiasPolicy,
        "optimus": OptimusPolicy,
    }


@pytest.mark.parametrize("kind", list(_policies()))
def test_named_nodes_get_the_allocation_of_integer_nodes(kind):
    make = _policies()[kind]
    jobs = _jobs()
    if kind == "tiresias":  # fixed sizes: each job asks for its own count
        jobs = {k: JobInfo(j.creation_timestamp, max_replicas=1 + i % 4) for i, (k, j) in
                enumerate(jobs.items())}  # fmt: skip
    int_nodes = {i: NodeInfo(4, preemptible=i >= 4) for i in range(len(NAMES))}
    named = {NAMES[i]: info for i, info in int_nodes.items()}
    by_int, by_name = make(), make()
    base_int: dict = {}
    base_named: dict = {}
    for rnd in range(3):  # a few rounds, each warm-started from the last
        a = by_int.optimize(jobs, int_nodes, base_int, 60.0 * rnd)
        b = by_name.optimize(jobs, named, base_named, 60.0 * rnd)
        assert {k: [NAMES[n] for n in v] for k, v in a.items() if v} == {
            k: list(v) for k, v in b.items() if v
        }
        check_allocations({k: v for k, v in b.items() if v}, jobs, named, interference=True)
        base_int = {k: v for k, v in a.items() if v}
        base_named = {k: v for k, v in b.items() if v}


def test_arrivals_are_placed_on_named_nodes():
    free = {"gpu-b": NodeInfo(2), "gpu-a": NodeInfo(4)}
    job = _jobs()["job0"]
    alloc = WaterfillPolicy().allocate_job(job, free)
    assert alloc and set(alloc) <= set(free)
    assert PolluxPolicy().allocate_job(job, free) == ["gpu-a"]


def test_checks_name_the_node_over_capacity():
    nodes = {"gpu-a": NodeInfo(2)}
    jobs = {"j": JobInfo(0.0, max_replicas=4)}
    with pytest.raises(RuntimeError, match="gpu-a"):
        check_allocations({"j": ["gpu-a"] * 3}, jobs, nodes)
    with pytest.raises(RuntimeError, match="unknown node 'gpu-z'"):
        check_allocations({"j": ["gpu-z"]}, jobs, nodes)
