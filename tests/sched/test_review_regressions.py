"""Regressions of a code review: non-preemptible jobs, 0-GPU nodes, input validation."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_policies import cluster_and_jobs

from adaptrain.cli._main import main
from adaptrain.core.goodput import GoodputFunction, GradParams, PerfParams
from adaptrain.sched import (
    JobInfo,
    LinearSpeedup,
    NodeInfo,
    OptimusPolicy,
    PolluxPolicy,
    SpeedupFunction,
    TiresiasPolicy,
    WaterfillPolicy,
    check_allocations,
)
from adaptrain.sim import Application, Simulator, WorkloadJob, load_applications, load_workload


def _policy(kind: str, seed: int = 0):
    if kind == "pollux":
        return PolluxPolicy(pop_size=16, generations=10, seed=seed)
    if kind == "waterfill-local":
        return WaterfillPolicy(search="local")
    if kind == "waterfill-genetic":
        return WaterfillPolicy(pop_size=16, generations=10, seed=seed)
    return {"tiresias": TiresiasPolicy, "optimus": OptimusPolicy}[kind]()


ALL_KINDS = ["pollux", "waterfill-local", "waterfill-genetic", "tiresias", "optimus"]


# ---- 1. non-preemptible running jobs keep their allocation -----------------------------------
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
                gpus_per_node=gpn,
                search="local" if kind.endswith("local") else "genetic",
                pop_size=12,
                generations=4,
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


# ---- 2. clusters with 0-GPU nodes -----------------------------------------------------------
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


# ---- 3. more GPUs per node than the traces measure -------------------------------------------
def test_simulator_rejects_more_gpus_per_node_than_the_traces_measure(tiny_traces):
    apps = load_applications(tiny_traces)
    w = [WorkloadJob("a", 0.0, "toy", 8, 16)]
    with pytest.raises(ValueError, match=r"gpus_per_node=8.*\b4\b"):
        Simulator(w, apps, TiresiasPolicy(), num_nodes=1, gpus_per_node=8)
    # the limit itself is fine
    Simulator([WorkloadJob("a", 0.0, "toy", 4, 16)], apps, TiresiasPolicy(), gpus_per_node=4)


def test_cli_reports_too_many_gpus_per_node_cleanly(tiny_traces, tmp_path, capsys):
    wl = tmp_path / "w.csv"
    wl.write_text("name,time,application,num_replicas,batch_size\na,0,toy,8,16\n")
    args = ["simulate", str(wl), "--traces", tiny_traces, "--policy", "tiresias", "--json"]
    rc = main([*args, "--nodes", "1", "--gpus-per-node", "8"])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("adaptrain simulate: ") and "gpus_per_node=8" in err
    assert "Traceback" not in err


def test_a_placement_with_ten_or_more_replicas_on_a_node_never_aliases(tiny_app_writer, tmp_path):
    d = tiny_app_writer(tmp_path)
    with open(os.path.join(d, "placements.csv"), "a") as f:  # a distinctive 2-node measurement
        for b in (4, 8, 16):
            f.write(f"11,{b},5.0,0.5\n")
    app = Application(d)
    assert app.get_throughput((1, 1), 8) == (5.0, 0.5)
    # 11 replicas on one node is not "11" (1 + 1 replicas on two nodes): no trace measures it
    with pytest.raises(ValueError, match="no throughput"):
        app.get_throughput((11,), 8)
    assert app.max_gpus_per_node == 4


# ---- 4. fixed batch sizes outside the application's range -----------------------------------
@pytest.mark.parametrize(
    ("policy", "replicas", "batch_size"),
    [
        (TiresiasPolicy, 1, 0),
        (TiresiasPolicy, 1, 4),  # below the initial batch size 8
        (TiresiasPolicy, 1, 32),  # above the largest batch size 16
        (TiresiasPolicy, 4, 8),  # 2 per replica: below the smallest profiled local batch, 4
        (OptimusPolicy, 1, 0),
        (OptimusPolicy, 1, -8),
        (OptimusPolicy, 1, 4),
        (OptimusPolicy, 1, 32),
    ],
)
def test_a_bad_fixed_batch_size_is_rejected_up_front(tiny_traces, policy, replicas, batch_size):
    apps = load_applications(tiny_traces)
    w = [WorkloadJob("ok", 0.0, "toy", 1, 8), WorkloadJob("bad", 0.0, "toy", replicas, batch_size)]
    with pytest.raises(ValueError, match=rf"'bad'.*batch_size={batch_size}\b.*\[\d+, 16\]"):
        Simulator(w, apps, policy(), num_nodes=1)
    # adaptive policies choose the batch size themselves: the column is not used
    Simulator(w, apps, WaterfillPolicy(search="local"), num_nodes=1)


# ---- 5. malformed workload rows --------------------------------------------------------------
@pytest.mark.parametrize(
    ("row", "problem"),
    [
        ("b,5,toy", "3 fields"),
        ("b,5,toy,1,8,9", "6 fields"),
        ("b,inf,toy,1,8", "time"),
        ("b,nan,toy,1,8", "time"),
        ("b,-1,toy,1,8", "time"),
        ("b,later,toy,1,8", "time"),
        ("b,5,toy,two,8", "num_replicas"),
        ("b,5,toy,1,", "batch_size"),
    ],
)
def test_a_malformed_workload_row_names_the_file_row_and_problem(tmp_path, row, problem):
    path = tmp_path / "w.csv"
    path.write_text(f"name,time,application,num_replicas,batch_size\na,0,toy,1,8\n{row}\n")
    with pytest.raises(ValueError) as info:
        load_workload(str(path))
    msg = str(info.value)
    assert str(path) in msg and "row 2" in msg and problem in msg, msg


@pytest.mark.parametrize("time", [float("inf"), float("nan")])
def test_simulator_rejects_a_non_finite_submission_time(tiny_traces, time):
    # inf: the run never ended (the job is never submitted); nan: a misleading stall message
    apps = load_applications(tiny_traces)
    w = [WorkloadJob("a", 0.0, "toy", 1, 8), WorkloadJob("b", time, "toy", 1, 8)]
    with pytest.raises(ValueError, match=rf"'b'.*time={time}"):
        Simulator(w, apps, TiresiasPolicy(), num_nodes=1)


# ---- 6. more epochs than the validation files hold ------------------------------------------
@pytest.mark.parametrize("max_epochs", [3, 100, 0, -1])
def test_max_epochs_beyond_the_validation_files_is_rejected(tiny_app_writer, tmp_path, max_epochs):
    d = tiny_app_writer(tmp_path)  # two epochs
    with pytest.raises(ValueError, match=rf"max_epochs={max_epochs}\b.*\b2\b"):
        Application(d, max_epochs=max_epochs)
    app = Application(d, max_epochs=2)
    assert app.get_progress(app.max_epochs) == 120.0


# ---- 7. a negative seed ----------------------------------------------------------------------
def test_cli_rejects_a_negative_seed(tiny_traces, tmp_path, capsys):
    wl = tmp_path / "w.csv"
    wl.write_text("name,time,application,num_replicas,batch_size\na,0,toy,1,8\n")
    rc = main(["simulate", str(wl), "--traces", tiny_traces, "--seed", "-1", "--json"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "--seed must be >= 0, got -1" in err and "Traceback" not in err


def test_speedup_helper_is_sane():
    fn = _speedup()
    assert float(fn(1, 1)) == pytest.approx(1.0)
    assert np.all(np.diff(fn(np.ones(4, dtype=int), np.arange(1, 5))) > 0)
