"""Policies respect capacity, replica bounds and interference avoidance (hypothesis)."""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import pytest
from _sched_cases import cluster_and_jobs
from _sched_cases import concave as _concave
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adaptrain.sched import (
    ClusterSpec,
    Exploration,
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
from adaptrain.sched.pollux import nondominated_ranks

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(
    cluster_and_jobs(),
    st.sampled_from([4.0, None]),
    st.sampled_from([4, None]),
    st.sampled_from([2, 3]),
)
def test_waterfill_respects_constraints(case, growth, first, min_nodes):
    """Within capacity, min replicas, interference rules and its own bound (explore_growth
    times the tried size, first_replicas for a job never run, within replica_limit); the
    allocator's cap without either rule. The node floor (``min_nodes``) changes none of it."""
    jobs, nodes, base = case
    policy = WaterfillPolicy(
        search=Search(min_nodes=min_nodes),
        cluster=ClusterSpec(gpus_per_node=max(n.gpus for n in nodes.values())),
        exploration=Exploration(growth=growth, first_replicas=first),
    )
    alloc = {k: v for k, v in policy.optimize(jobs, nodes, base, 0.0).items() if v}
    check_allocations(alloc, jobs, nodes, interference=True, policy=policy)
    for k, v in alloc.items():
        limit = jobs[k].replica_limit or jobs[k].max_replicas
        assert len(v) <= limit
    if growth is None and first is None:
        check_allocations(alloc, jobs, nodes, interference=True)


@SETTINGS
@given(cluster_and_jobs(), st.integers(0, 2**31 - 1))
def test_pollux_respects_constraints(case, seed):
    jobs, nodes, base = case
    alloc = PolluxPolicy(pop_size=12, generations=4, seed=seed).optimize(jobs, nodes, base, 0.0)
    check_allocations({k: v for k, v in alloc.items() if v}, jobs, nodes, interference=True)


@SETTINGS
@given(cluster_and_jobs())
def test_baselines_respect_capacity(case):
    jobs, nodes, base = case
    # the baselines as the paper ran them have no minimum-replica guarantees
    jobs = {k: dataclasses.replace(j, min_replicas=0) for k, j in jobs.items()}
    for policy in (TiresiasPolicy(), OptimusPolicy()):
        alloc = policy.optimize(jobs, nodes, {}, 60.0)
        check_allocations(alloc, jobs, nodes)
        if policy.name == "tiresias":  # gang scheduling: all requested replicas or none
            assert all(len(v) == jobs[k].max_replicas for k, v in alloc.items())


def test_waterfill_uses_idle_gpus_and_prefers_scalable_jobs():
    nodes = {i: NodeInfo(4) for i in range(4)}
    jobs = {
        "lin": JobInfo(0.0, max_replicas=16, speedup_fn=LinearSpeedup()),
        "flat": JobInfo(1.0, max_replicas=16, speedup_fn=_concave(0.05)),
    }
    alloc = WaterfillPolicy().optimize(jobs, nodes, {}, 0.0)
    assert len(alloc["lin"]) > len(alloc["flat"]) >= 1
    assert sum(map(len, alloc.values())) == 16


def test_pollux_gives_every_job_a_gpu_when_possible():
    nodes = {i: NodeInfo(4) for i in range(2)}
    jobs = {
        f"j{i}": JobInfo(float(i), max_replicas=8, speedup_fn=_concave(0.8), age=600.0)
        for i in range(6)
    }
    alloc = PolluxPolicy(pop_size=30, generations=40, seed=1).optimize(jobs, nodes, {}, 0.0)
    assert all(len(alloc[k]) >= 1 for k in jobs)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 4)), min_size=1, max_size=25))
def test_nondominated_ranks_match_bruteforce(points):
    F = np.array(points, dtype=float)
    le = np.all(F[:, None] <= F[None], -1)
    lt = np.any(F[:, None] < F[None], -1)
    dom = le & lt
    rank = nondominated_ranks(F)
    for i in range(len(F)):
        dominators = np.flatnonzero(dom[:, i])
        expect = 0 if dominators.size == 0 else 1 + rank[dominators].max()
        assert rank[i] == expect


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), min_size=1, max_size=40))
def test_nondominated_ranks_match_pymoo(points):
    # pymoo's non-dominated sorting (the reference NSGA-II implementation) as the oracle.
    from pymoo.util.nds.non_dominated_sorting import NonDominatedSorting

    F = np.array(points, dtype=float)
    expected = np.empty(len(F), dtype=int)
    for k, front in enumerate(NonDominatedSorting().do(F)):
        expected[front] = k
    assert np.array_equal(nondominated_ranks(F), expected)


@settings(max_examples=50, deadline=None)
@given(st.integers(3, 30), st.integers(0, 10_000))
def test_crowding_matches_pymoo_on_a_front(n, seed):
    # pymoo averages the objectives' normalised gaps, this sums them: a factor of 2 for two
    # objectives, the same order (which is all the survival uses).
    from pymoo.operators.survival.rank_and_crowding.metrics import calc_crowding_distance

    from adaptrain.sched.pollux import _crowding

    x = np.sort(np.random.default_rng(seed).random(n))
    F = np.stack([x, 1.0 - x**2], axis=1)[np.random.default_rng(seed + 1).permutation(n)]
    ours = _crowding(F, np.zeros(n, dtype=int))
    ref = calc_crowding_distance(F)
    assert np.array_equal(np.isinf(ours), np.isinf(ref)) and np.isinf(ours).sum() == 2
    finite = ~np.isinf(ours)
    np.testing.assert_allclose(ours[finite], 2.0 * ref[finite], rtol=1e-12)


def test_tiresias_state_roundtrip():
    nodes = {0: NodeInfo(4)}
    jobs = {"a": JobInfo(0.0, max_replicas=2), "b": JobInfo(1.0, max_replicas=4)}
    p1 = TiresiasPolicy(queue_threshold=100)
    a1 = p1.optimize(jobs, nodes, {}, 60.0)
    p2 = TiresiasPolicy(queue_threshold=100)
    p2.load_state_dict(p1.state_dict())
    a2 = a1
    for t in (120.0, 180.0, 240.0):
        a1 = p1.optimize(jobs, nodes, a1, t)
        a2 = p2.optimize(jobs, nodes, a2, t)
        assert a1 == a2


def test_check_allocations_catches_violations():
    nodes = {0: NodeInfo(2), 1: NodeInfo(2)}
    jobs = {"a": JobInfo(0.0, max_replicas=2), "b": JobInfo(0.0, max_replicas=4)}
    with pytest.raises(RuntimeError, match="capacity"):
        check_allocations({"a": [0, 0], "b": [0]}, jobs, nodes)
    with pytest.raises(RuntimeError, match="replicas"):
        check_allocations({"a": [0, 0, 1]}, jobs, nodes)
    with pytest.raises(RuntimeError, match="multi-node"):
        check_allocations({"a": [0, 1], "b": [0, 1]}, jobs, nodes, interference=True)
    with pytest.raises(RuntimeError, match="unknown job 'c'"):
        check_allocations({"c": [0]}, jobs, nodes)
    with pytest.raises(RuntimeError, match="unknown node 7"):
        check_allocations({"a": [7]}, jobs, nodes)
    check_allocations({"a": [0, 1], "b": [0, 1]}, jobs, nodes)  # sharing allowed unless asked


def test_job_info_rejects_impossible_replica_bounds():
    with pytest.raises(ValueError, match="max_replicas=0"):
        JobInfo(0.0, max_replicas=0)
    with pytest.raises(ValueError, match="min_replicas=3"):
        JobInfo(0.0, min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match="min_replicas=-1"):
        JobInfo(0.0, min_replicas=-1, max_replicas=2)


def test_waterfill_fast_on_160_jobs_64_gpus():
    import time

    rng = np.random.default_rng(0)
    nodes = {i: NodeInfo(4) for i in range(16)}
    jobs = {
        f"j{i}": JobInfo(
            float(i),
            attained_service=float(rng.uniform(0, 1e5)),
            max_replicas=int(rng.integers(1, 65)),
            speedup_fn=_concave(float(rng.uniform(0.3, 0.95))),
            remaining_work=float(rng.uniform(60, 1e5)),
            age=float(rng.uniform(0, 1e4)),
        )
        for i in range(160)
    }
    policy = WaterfillPolicy()
    alloc = policy.optimize(jobs, nodes, {}, 0.0)
    t0 = time.perf_counter()
    for _ in range(3):
        alloc = policy.optimize(jobs, nodes, alloc, 60.0)
    per_round = (time.perf_counter() - t0) / 3
    check_allocations({k: v for k, v in alloc.items() if v}, jobs, nodes, interference=True)
    assert sum(map(len, alloc.values())) == 64  # more jobs than GPUs: all GPUs in use
    assert per_round < 1.0


def test_waterfill_prefers_short_jobs_when_congested():
    nodes = {0: NodeInfo(2)}
    jobs = {
        "long": JobInfo(0.0, max_replicas=2, speedup_fn=LinearSpeedup(), remaining_work=1e5),
        "short": JobInfo(1.0, max_replicas=2, speedup_fn=LinearSpeedup(), remaining_work=60.0),
        "mid": JobInfo(2.0, max_replicas=2, speedup_fn=LinearSpeedup(), remaining_work=600.0),
    }
    alloc = WaterfillPolicy().optimize(jobs, nodes, {}, 0.0)
    assert len(alloc.get("short", [])) == 1 and len(alloc.get("mid", [])) == 1
    assert not alloc.get("long")


def test_pollux_state_roundtrip_replays_identically():
    nodes = {i: NodeInfo(4) for i in range(3)}
    jobs = {
        f"j{i}": JobInfo(float(i), max_replicas=6, speedup_fn=_concave(0.7), age=300.0)
        for i in range(5)
    }
    p1 = PolluxPolicy(pop_size=16, generations=5, seed=3)
    a = p1.optimize(jobs, nodes, {}, 60.0)
    p2 = PolluxPolicy(pop_size=16, generations=5, seed=99)
    p2.load_state_dict(p1.state_dict())
    b1 = p1.optimize(jobs, nodes, a, 120.0)
    b2 = p2.optimize(jobs, nodes, a, 120.0)
    assert b1 == b2


@pytest.mark.parametrize("kind", ["pollux", "waterfill"])
def test_free_restarts_and_a_job_of_age_zero(kind):
    # restart_delay=0 (free restarts) with a job submitted at the round boundary (age 0): the
    # restart factor was 0/0 (NaN fitness: arbitrary allocations, idle GPUs) and waterfill's
    # restart cost divided by zero.
    from adaptrain.sched.speedup import LinearSpeedup

    nodes = {0: NodeInfo(4), 1: NodeInfo(4)}
    for seed in range(3):
        jobs = {
            "old": JobInfo(0.0, max_replicas=8, speedup_fn=LinearSpeedup(), age=600.0),
            "new": JobInfo(600.0, max_replicas=8, speedup_fn=LinearSpeedup(), age=0.0),
        }
        base = {"old": [0, 0, 0, 0, 1, 1, 1, 1]}
        if kind == "pollux":
            policy = PolluxPolicy(
                cluster=ClusterSpec(restart_delay=0.0), pop_size=50, generations=50, seed=seed
            )
        else:
            policy = WaterfillPolicy(cluster=ClusterSpec(restart_delay=0.0), seed=seed)
        alloc = policy.optimize(jobs, nodes, base, 600.0)
        assert sum(len(v) for v in alloc.values()) == 8, (seed, alloc)  # no GPU left idle


@pytest.mark.parametrize("kind", ["pollux", "waterfill"])
def test_a_cluster_without_gpus_gets_no_allocation(kind):
    policy = PolluxPolicy(pop_size=10, generations=5) if kind == "pollux" else WaterfillPolicy()
    jobs = {"a": JobInfo(0.0, max_replicas=2)}
    assert policy.optimize(jobs, {0: NodeInfo(0)}, {}, 0.0) == {}


def test_optimus_respects_min_replicas_and_pins_non_preemptible_jobs():
    def step(r):
        return 1.0 / r

    jobs = {
        "a": JobInfo(0.0, min_replicas=6, max_replicas=8, step_time_fn=step),
        "b": JobInfo(1.0, max_replicas=2, step_time_fn=step),
        "np": JobInfo(2.0, max_replicas=4, preemptible=False, step_time_fn=step),
    }
    nodes = {0: NodeInfo(2), 1: NodeInfo(4)}
    alloc = OptimusPolicy().optimize(jobs, nodes, {"np": [1]}, 60.0)
    assert alloc["np"] == [1]  # kept where it runs
    assert not alloc.get("a")  # 6 replicas do not fit beside the others: none
    check_allocations({k: v for k, v in alloc.items() if v}, jobs, nodes)


@SETTINGS
@given(cluster_and_jobs(), st.sampled_from([4, None]), st.data())
def test_allocate_job_respects_free_gpus_and_bounds(case, first, data):
    """A job arriving between rounds (``allocate_job``) gets free GPUs on one node, within its
    bounds; nothing only when no node has room for its minimum."""
    jobs, nodes, base = case
    used = collections.Counter(n for alloc in base.values() for n in alloc)
    free = {n: NodeInfo(info.gpus - used[n]) for n, info in nodes.items() if used[n] < info.gpus}
    key = data.draw(st.sampled_from(sorted(jobs)))
    job = jobs[key]
    for policy in (WaterfillPolicy(exploration=Exploration(first_replicas=first)), PolluxPolicy()):
        alloc = policy.allocate_job(job, free)
        if alloc:
            check_allocations({key: alloc}, {key: job}, free, interference=True, policy=policy)
            assert len(set(alloc)) == 1  # one node
        else:  # only when no node has room for its minimum
            assert all(n.gpus < max(job.min_replicas, 1) for n in free.values())


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), min_size=1, max_size=40))
def test_crowding_matches_a_per_front_reference(points):
    # several fronts and tied values: per front and objective, a stable sort by value, the two
    # ends at infinity, inner points (next - previous) / (max - min), 0 on a flat front
    from adaptrain.sched.pollux import _crowding

    F = np.array(points, dtype=float)
    rank = nondominated_ranks(F)
    expected = np.zeros(len(F))
    for k in np.unique(rank):
        members = np.flatnonzero(rank == k)
        for m in range(F.shape[1]):
            idx = members[np.argsort(F[members, m], kind="stable")]
            f = F[idx, m]
            span = f[-1] - f[0]
            for i, j in enumerate(idx):
                if i == 0 or i == len(idx) - 1:
                    expected[j] += np.inf
                else:
                    expected[j] += (f[i + 1] - f[i - 1]) / span if span > 0 else 0.0
    np.testing.assert_array_equal(_crowding(F, rank), expected)
