"""Clusters with nodes that have no GPUs: every policy still uses every GPU, one replica per
node."""

from __future__ import annotations

import numpy as np
import pytest

from adaptrain.core.goodput import GoodputFunction, GradParams, PerfParams
from adaptrain.sched import (
    JobInfo,
    NodeInfo,
    OptimusPolicy,
    PolluxPolicy,
    Search,
    SpeedupFunction,
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


def _speedup() -> SpeedupFunction:
    perf = PerfParams(0.02, 0.001, 0.05, 0.002, 0.01, 0.001, 1.5)
    goodput = GoodputFunction(perf, GradParams(1.0, 4.0), 32)
    return SpeedupFunction(goodput, max_batch_size=1024, atomic_bsz_range=(16, 128))


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_nodes_without_gpus_do_not_break_any_policy(kind):
    # 6 nodes, 4 GPUs: Pollux's fair share was ceil(6 / 4) = 2 nodes for 1 replica
    nodes = {0: NodeInfo(0), 1: NodeInfo(4), 2: NodeInfo(0), 3: NodeInfo(0), 4: NodeInfo(0)}
    nodes[5] = NodeInfo(0)
    fn = _speedup()
    jobs = {
        f"j{i}": JobInfo(
            float(i),
            max_replicas=4 if kind != "tiresias" else 1,
            speedup_fn=fn,
            age=600.0,
            remaining_work=1e4,
            max_profiled_replicas=4,  # no exploration: waterfill sees the model itself
            step_time_fn=lambda r: 1.0 / r,
        )
        for i in range(4)
    }
    alloc = _policy(kind).optimize(jobs, nodes, {"j0": [1]}, 60.0)
    alloc = {k: v for k, v in alloc.items() if v}
    check_allocations(alloc, jobs, nodes, interference=True)
    assert sum(map(len, alloc.values())) == 4  # every GPU used
    assert all(n == 1 for v in alloc.values() for n in v)


def test_speedup_helper_is_sane():
    fn = _speedup()
    assert float(fn(1, 1)) == pytest.approx(1.0)
    assert np.all(np.diff(fn(np.ones(4, dtype=int), np.arange(1, 5))) > 0)
