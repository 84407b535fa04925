"""Behaviour of our default policy ``waterfill`` beyond the constraint checks of test_policies:
warm-start stability, restart penalty, packing, weighting and argument validation."""

from __future__ import annotations

import numpy as np
import pytest

from adaptrain.sched import JobInfo, LinearSpeedup, NodeInfo, WaterfillPolicy, check_allocations


def _concave(a: float):
    def fn(n, r):
        r = np.asarray(r, dtype=float)
        n = np.asarray(n, dtype=float)
        return np.where(r > 0, r**a / (1.0 + 0.1 * np.maximum(n - 1, 0)), 0.0)

    return fn


def _cluster(num_nodes: int = 4, gpus: int = 4) -> dict[int, NodeInfo]:
    return {i: NodeInfo(gpus) for i in range(num_nodes)}


def _jobs(n: int, seed: int = 0, age: float = 3600.0) -> dict[str, JobInfo]:
    rng = np.random.default_rng(seed)
    return {
        f"j{i}": JobInfo(
            float(i),
            max_replicas=int(rng.integers(1, 17)),
            speedup_fn=_concave(float(rng.uniform(0.4, 0.95))),
            remaining_work=float(rng.uniform(600, 1e5)),
            age=age,
            num_restarts=1,
        )
        for i in range(n)
    }


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_second_round_keeps_allocation(seed):
    """Warm start: with nothing changed, a second round reproduces the first (no restarts)."""
    nodes = _cluster()
    jobs = _jobs(9, seed)
    policy = WaterfillPolicy()
    first = policy.optimize(jobs, nodes, {}, 0.0)
    first = {k: v for k, v in first.items() if v}
    second = policy.optimize(jobs, nodes, first, 60.0)
    second = {k: v for k, v in second.items() if v}
    assert second == first


def test_restart_penalty_blocks_small_gains_for_young_jobs():
    """A job that just restarted keeps its size when growing gains little; an old one grows."""
    nodes = _cluster(1, 4)
    fn = _concave(0.15)  # growing 2 -> 4 gains 11%: less than the young job's restart cost
    base = {"a": [0, 0]}
    young = {"a": JobInfo(0.0, max_replicas=4, speedup_fn=fn, age=60.0, num_restarts=1)}
    old = {"a": JobInfo(0.0, max_replicas=4, speedup_fn=fn, age=1e5, num_restarts=1)}
    assert WaterfillPolicy().optimize(young, nodes, base, 60.0)["a"] == [0, 0]
    assert len(WaterfillPolicy().optimize(old, nodes, base, 60.0)["a"]) == 4


def test_single_node_jobs_are_packed_and_multi_node_jobs_get_whole_nodes():
    nodes = _cluster(4, 4)
    jobs = {
        "big": JobInfo(0.0, max_replicas=8, min_replicas=8, speedup_fn=LinearSpeedup()),
        "s1": JobInfo(1.0, max_replicas=2, speedup_fn=LinearSpeedup()),
        "s2": JobInfo(2.0, max_replicas=2, speedup_fn=LinearSpeedup()),
        "s3": JobInfo(3.0, max_replicas=3, speedup_fn=LinearSpeedup()),
    }
    alloc = WaterfillPolicy().optimize(jobs, nodes, {}, 0.0)
    check_allocations({k: v for k, v in alloc.items() if v}, jobs, nodes, interference=True)
    assert len(alloc["big"]) == 8 and len(set(alloc["big"])) == 2  # two full nodes
    for k in ("s1", "s2", "s3"):
        assert len(alloc[k]) == jobs[k].max_replicas and len(set(alloc[k])) == 1


def test_waiting_job_is_admitted_by_taking_a_gpu_from_the_cheapest_donor():
    """A new short job gets a GPU from a full cluster; the job losing least gives it up."""
    nodes = _cluster(1, 4)
    jobs = {
        "long": JobInfo(
            0.0,
            max_replicas=4,
            speedup_fn=_concave(0.5),
            remaining_work=1e6,
            age=1e4,
            num_restarts=1,
        ),
        "new": JobInfo(1.0, max_replicas=1, speedup_fn=LinearSpeedup(), remaining_work=100.0),
    }
    alloc = WaterfillPolicy().optimize(jobs, nodes, {"long": [0, 0, 0, 0]}, 60.0)
    assert len(alloc["new"]) == 1 and len(alloc["long"]) == 3


def test_las_weighting_prefers_less_attained_service():
    nodes = _cluster(1, 1)
    jobs = {
        "served": JobInfo(0.0, attained_service=1e5, speedup_fn=LinearSpeedup()),
        "fresh": JobInfo(1.0, attained_service=0.0, speedup_fn=LinearSpeedup()),
    }
    alloc = WaterfillPolicy(weighting="las").optimize(jobs, nodes, {}, 0.0)
    assert alloc.get("fresh") == [0] and not alloc.get("served")


@pytest.mark.parametrize(
    "kwargs",
    [{"theta": 0.0}, {"alpha": -1.0}, {"weighting": "fifo"}, {"gpus_per_node": 0}],
)
def test_bad_arguments_raise(kwargs):
    with pytest.raises(ValueError):
        WaterfillPolicy(**kwargs)


def test_empty_job_set():
    assert WaterfillPolicy().optimize({}, _cluster(), {}, 0.0) == {}
