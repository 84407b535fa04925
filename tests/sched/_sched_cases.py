"""Scheduling cases shared by the tests of ``adaptrain.sched`` (a helper module, not a test
module): speedup and step-time shapes, small clusters, random jobs, and a hypothesis strategy
drawing a cluster, its jobs and a valid current allocation."""

from __future__ import annotations

import collections

import numpy as np
from hypothesis import strategies as st

from adaptrain.sched import JobInfo, LinearSpeedup, NodeInfo


def concave(a: float):
    """A speedup ``r**a`` damped by 10% per extra node."""

    def fn(n, r):
        r = np.asarray(r, dtype=float)
        n = np.asarray(n, dtype=float)
        return np.where(r > 0, r**a / (1.0 + 0.1 * np.maximum(n - 1, 0)), 0.0)

    return fn


def step_time(c: float):
    return lambda r: c / r + 0.01 * r


@st.composite
def cluster_and_jobs(draw):
    """``(jobs, nodes, base)``: a cluster, up to 9 jobs, and a valid current allocation."""
    num_nodes = draw(st.integers(1, 5))
    gpus = draw(st.integers(1, 4))
    nodes = {i: NodeInfo(gpus) for i in range(num_nodes)}
    jobs = {}
    for j in range(draw(st.integers(1, 9))):
        max_r = draw(st.integers(1, 12))
        min_r = draw(st.integers(0, min(max_r, 2)))
        kind = draw(st.sampled_from(["linear", "concave", "none"]))
        fn = {
            "linear": LinearSpeedup(),
            "concave": concave(draw(st.floats(0.3, 1.0))),
            "none": None,
        }[kind]
        jobs[f"j{j}"] = JobInfo(
            creation_timestamp=float(j),
            attained_service=draw(st.floats(0, 1e5)),
            min_replicas=min_r,
            max_replicas=max_r,
            speedup_fn=fn,
            num_restarts=draw(st.integers(0, 3)),
            age=draw(st.floats(0, 1e4)),
            step_time_fn=step_time(draw(st.floats(0.1, 2.0))),
            remaining_steps=draw(st.floats(1, 1e4)),
            # a known remaining work and a smaller tried size switch waterfill's exploration on
            remaining_work=draw(st.none() | st.floats(0, 1e6)),
            max_profiled_replicas=draw(st.integers(0, max_r)),
            # a limit above max_replicas makes max_replicas an exploration cap: ramp credit
            replica_limit=draw(st.none() | st.integers(max_r, 24)),
        )
    # a random (valid) current allocation: fill nodes in order
    base = {}
    free = collections.Counter({n: gpus for n in nodes})
    for key, job in jobs.items():
        want = draw(st.integers(0, job.max_replicas))
        alloc = []
        for n in nodes:
            take = min(free[n], want - len(alloc))
            alloc += [n] * take
            free[n] -= take
        if len(alloc) == want and (want == 0 or want >= job.min_replicas) and len(set(alloc)) <= 1:
            base[key] = alloc
    return jobs, nodes, base


def cluster(num_nodes: int = 4, gpus: int = 4) -> dict[int, NodeInfo]:
    """``num_nodes`` nodes of ``gpus`` GPUs each."""
    return {i: NodeInfo(gpus) for i in range(num_nodes)}


def random_jobs(n: int, seed: int = 0, age: float = 3600.0) -> dict[str, JobInfo]:
    """``n`` jobs of random size limits, concave speedups and remaining work."""
    rng = np.random.default_rng(seed)
    return {
        f"j{i}": JobInfo(
            float(i),
            max_replicas=int(rng.integers(1, 17)),
            speedup_fn=concave(float(rng.uniform(0.4, 0.95))),
            remaining_work=float(rng.uniform(600, 1e5)),
            age=age,
            num_restarts=1,
        )
        for i in range(n)
    }
