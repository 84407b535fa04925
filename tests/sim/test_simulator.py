"""Simulator accounting on tiny hand-computed traces, and fidelity on the artifact's traces."""

from __future__ import annotations

import json
import logging
import os
from types import MappingProxyType

import pytest

from adaptrain.sched import (
    ClusterSpec,
    OptimusPolicy,
    PolluxPolicy,
    Search,
    TiresiasPolicy,
    WaterfillPolicy,
)
from adaptrain.sim import (
    SimulationStalled,
    Simulator,
    WorkloadJob,
    load_applications,
    load_workload,
)
from adaptrain.sim.simulator import _placement


def test_placement_runs():
    assert _placement([3, 3, 3, 5]) == [3, 1]
    assert _placement([]) == []
    assert _placement([1, 2, 2, 1]) == [1, 2, 1]


def test_single_job_hand_computed(tiny_traces):
    # Submitted at 0, first scheduled at t=60, 30 s restart, 1 progress/s, epochs end at 60 and
    # 120 progress: finishes at 60 + 30 + 120 = 210 s.
    apps = load_applications(tiny_traces)
    w = [WorkloadJob("a", 0.0, "toy", 1, 8)]
    sim = Simulator(w, apps, TiresiasPolicy(), cluster=ClusterSpec(gpus_per_node=4), num_nodes=1)
    res = sim.run()
    assert res.jcts == {"a": 210.0}
    job = sim.jobs[0]
    assert job.epoch == 2 and job.num_restarts == 0
    assert job.attained_service == pytest.approx(150.0)  # 30 s restart + 120 s training, 1 GPU
    assert res.makespan == 210.0


def test_late_submission_and_queueing(tiny_traces):
    # Two 4-GPU jobs on one 4-GPU node: b waits for a. b is first scheduled at t=240 (a ends at
    # 210 inside the round ending at 240), restarts for 30 s and trains 120 s: ends at 390.
    apps = load_applications(tiny_traces)
    w = [WorkloadJob("a", 0.0, "toy", 4, 16), WorkloadJob("b", 53.0, "toy", 4, 16)]
    res = Simulator(
        w, apps, TiresiasPolicy(), cluster=ClusterSpec(gpus_per_node=4), num_nodes=1
    ).run()
    assert res.jcts == {"a": 210.0, "b": 390.0 - 53.0}
    assert res.policy_s_per_round >= 0.0


def test_slower_steps_and_bigger_batches(tmp_path, tiny_app_writer):
    tiny_app_writer(tmp_path, step=2.0)
    apps = load_applications(str(tmp_path))
    # 2 s per step at batch 8 -> 0.5 progress/s: 240 s of training after the 30 s restart.
    w = [WorkloadJob("a", 0.0, "toy", 1, 8)]
    res = Simulator(
        w, apps, TiresiasPolicy(), cluster=ClusterSpec(gpus_per_node=4), num_nodes=1
    ).run()
    assert res.jcts == {"a": 60.0 + 30.0 + 240.0}


def test_adaptive_policies_finish_tiny(tiny_traces):
    apps = load_applications(tiny_traces)
    w = [WorkloadJob(f"j{i}", 20.0 * i, "toy", 1, 8) for i in range(4)]
    spec = ClusterSpec(gpus_per_node=2)
    policies = (
        WaterfillPolicy(cluster=spec),
        PolluxPolicy(pop_size=10, generations=5, cluster=spec),
        OptimusPolicy(),
    )
    for policy in policies:
        sim = Simulator(w, apps, policy, cluster=spec, num_nodes=2)
        res = sim.run(max_time=20000)
        assert len(res.jcts) == 4, policy.name
        # can never beat the restart + one GPU's worth of work at gain 1 and 1 s/step by more
        # than the replica count allows (4 GPUs at most here)
        assert all(v >= 60 for v in res.jcts.values())


def test_unknown_application_is_rejected(tiny_traces):
    apps = load_applications(tiny_traces)
    with pytest.raises(ValueError, match="unknown|known"):
        Simulator([WorkloadJob("x", 0, "nope", 1, 8)], apps, TiresiasPolicy())


def _stored(real: str, policy: str, workload: str) -> float:
    path = os.path.join(real, "results-jobload", f"{policy}-1.0", "summary.json")
    with open(path) as f:
        return json.load(f)["avgs"][workload]


@pytest.mark.parametrize("policy_cls", [TiresiasPolicy, OptimusPolicy])
def test_baselines_reproduce_artifact_workload6(policy_cls, real_data):
    apps = load_applications(os.path.join(real_data, "traces"))
    w = load_workload(os.path.join(real_data, "workloads", "workload-6.csv"))
    policy = policy_cls()
    res = Simulator(w, apps, policy).run()
    stored = _stored(real_data, policy.name, "workload-6")
    assert len(res.jcts) == 160
    assert res.avg_jct == pytest.approx(stored, rel=0.02)


# ---- limits, stalls, duplicate names, fractional intervals, validation -------------------


def test_fixed_job_larger_than_cluster_is_capped_and_the_run_ends(tiny_traces, caplog):
    # "big" asks for 8 GPUs on a 4-GPU cluster: capped at 4 (batch 16 on 4 replicas, gain 1,
    # 1 progress/s), it runs first: 60 + 30 + 120 = 210 s. "small" waits for it, is placed at
    # the round ending at 240 and finishes at 240 + 30 + 120 = 390 s.
    apps = load_applications(tiny_traces)
    w = [WorkloadJob("big", 0.0, "toy", 8, 16), WorkloadJob("small", 0.0, "toy", 1, 8)]
    with caplog.at_level(logging.WARNING, logger="adaptrain.sim.simulator"):
        sim = Simulator(
            w, apps, TiresiasPolicy(), cluster=ClusterSpec(gpus_per_node=4), num_nodes=1
        )
    assert "big (8 -> 4)" in caplog.text
    assert [j.target_num_replicas for j in sim.jobs] == [4, 1]
    res = sim.run(max_time=10_000)
    assert res.jcts == {"big": 210.0, "small": 390.0}


class _NeverPolicy:
    """A policy that never places anything (the remaining jobs can never run)."""

    name = "never"

    def optimize(self, jobs, nodes, base_allocations, time):
        return {}


def test_run_raises_when_no_remaining_job_is_ever_scheduled(tiny_traces):
    apps = load_applications(tiny_traces)
    w = [WorkloadJob("a", 0.0, "toy", 1, 8), WorkloadJob("late", 1000.0, "toy", 1, 8)]
    sim = Simulator(w, apps, _NeverPolicy(), cluster=ClusterSpec(gpus_per_node=4), num_nodes=1)
    with pytest.raises(SimulationStalled, match=r"stalled.*'late'"):
        sim.run(stall_rounds=5)
    # idle rounds count only once every job is submitted: rounds ending 1020, ..., 1260
    assert sim.current_time == 1260.0
    assert isinstance(SimulationStalled("x"), RuntimeError)
    with pytest.raises(ValueError, match="stall_rounds"):
        sim.run(stall_rounds=0)


def test_duplicate_job_names_are_rejected(tiny_traces, tmp_path):
    apps = load_applications(tiny_traces)
    w = [WorkloadJob("a", 0.0, "toy", 1, 8), WorkloadJob("a", 5.0, "toy", 1, 8)]
    with pytest.raises(ValueError, match=r"duplicate job names.*\['a'\]"):
        Simulator(w, apps, TiresiasPolicy(), num_nodes=1)
    path = tmp_path / "w.csv"
    path.write_text(
        "name,time,application,num_replicas,batch_size\n"
        "a,0,toy,1,8\nb,1,toy,1,8\na,2,toy,1,8\nb,3,toy,1,8\nc,4,toy,1,8\n"
    )
    with pytest.raises(ValueError, match=r"duplicate job names \['a', 'b'\]"):
        load_workload(str(path))


class _PlacedPolicy(TiresiasPolicy):
    """Fixed-batch jobs (Tiresias's kind) on the placements given, every round."""

    def __init__(self, placements):
        super().__init__()
        self.placements = placements

    def optimize(self, jobs, nodes, base_allocations, time):
        return {k: list(v) for k, v in self.placements.items() if k in jobs}


@pytest.mark.parametrize(
    ("placements", "interference", "jct"),
    [
        # two multi-node jobs share both nodes: each trains at (1 - 0.5) progress/s, so its
        # 120 progress take 240 s after the round at 60 and the 30 s restart: 330 s
        ({"a": [0, 1], "b": [0, 1]}, 0.5, 330.0),
        ({"a": [0, 1], "b": [0, 1]}, 0.25, 60.0 + 30.0 + 160.0),
        ({"a": [0, 1], "b": [0, 1]}, 0.0, 210.0),  # the setting off: no slowdown
        # one multi-node job beside a single-node one: nobody is slowed
        ({"a": [0, 1], "b": [0, 0]}, 0.5, 210.0),
    ],
)
def test_interference_slows_multi_node_jobs_sharing_a_node(
    tiny_traces, placements, interference, jct
):
    apps = load_applications(tiny_traces)
    w = [WorkloadJob("a", 0.0, "toy", 2, 16), WorkloadJob("b", 0.0, "toy", 2, 16)]
    sim = Simulator(
        w,
        apps,
        _PlacedPolicy(placements),
        cluster=ClusterSpec(gpus_per_node=3),
        num_nodes=2,
        interference=interference,
    )
    res = sim.run(max_time=10_000)
    assert res.jcts == {"a": jct, "b": jct}


@pytest.mark.parametrize(
    ("interval", "jct"),
    [(60, 210.0), (1, 151.0), (200, 350.0), (45.5, 195.5), (0.5, 150.5), (7.3, 157.3)],
)
def test_completion_time_for_any_interval(tiny_traces, interval, jct):
    # One 1-GPU job submitted at 0, placed at the first round's end, 30 s restart, then 120 s
    # of training at 1 progress/s (epoch ends at 60 and 120): JCT = interval + 150 s exactly.
    apps = load_applications(tiny_traces)
    w = [WorkloadJob("a", 0.0, "toy", 1, 8)]
    sim = Simulator(
        w,
        apps,
        TiresiasPolicy(),
        cluster=ClusterSpec(gpus_per_node=4, round_seconds=interval),
        num_nodes=1,
    )
    res = sim.run(max_time=10_000)
    assert res.jcts["a"] == pytest.approx(jct, abs=1e-9)
    assert sim.jobs[0].attained_service == pytest.approx(150.0, abs=1e-9)
    if float(interval).is_integer():  # the artifact's whole-second arithmetic, exactly
        assert res.jcts["a"] == jct


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_nodes": 0}, "num_nodes"),
        ({"cluster": {"gpus_per_node": 4}}, "ClusterSpec"),
        ({"interference": 1.0}, "interference"),
        ({"interference": -0.1}, "interference"),
    ],
)
def test_bad_simulator_settings_are_rejected(tiny_traces, kwargs, match):
    apps = load_applications(tiny_traces)
    with pytest.raises(ValueError, match=match):
        Simulator([WorkloadJob("a", 0.0, "toy", 1, 8)], apps, TiresiasPolicy(), **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"round_seconds": 0}, "round_seconds"),
        ({"round_seconds": float("nan")}, "round_seconds"),
        ({"gpus_per_node": 0}, "gpus_per_node"),
        ({"restart_delay": -5.0}, "restart_delay"),
    ],
)
def test_bad_cluster_facts_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ClusterSpec(**kwargs)


def test_a_policy_priced_for_another_cluster_is_refused(tiny_traces):
    apps = load_applications(tiny_traces)
    work = [WorkloadJob("a", 0.0, "toy", 1, 8)]
    policy = WaterfillPolicy(cluster=ClusterSpec(gpus_per_node=2))
    with pytest.raises(ValueError, match="gpus_per_node=2.*differs.*gpus_per_node=4"):
        Simulator(work, apps, policy, cluster=ClusterSpec(gpus_per_node=4))
    # without a cluster of its own, the simulator takes the policy's
    assert Simulator(work, apps, policy).cluster == ClusterSpec(gpus_per_node=2)
    assert Simulator(work, apps, TiresiasPolicy()).cluster == ClusterSpec()


def test_jobs_never_get_more_replicas_than_the_traces_measure(real_data):
    # 17 nodes x 4 = 68 GPUs; the traces measure at most 64 replicas.
    apps = load_applications(os.path.join(real_data, "traces"), ["imagenet"])
    w = [WorkloadJob("j", 0.0, "imagenet", 68, 6400)]
    sim = Simulator(w, apps, TiresiasPolicy(), cluster=ClusterSpec(gpus_per_node=4), num_nodes=17)
    assert sim.jobs[0].target_num_replicas == 64
    sim.run(max_time=300)  # used to fail at t=60: no throughput for 68 replicas
    assert len(sim.allocations["j"]) == 64
    adaptive = Simulator(w, apps, WaterfillPolicy(search=Search(method="local")), num_nodes=17)
    assert adaptive.job_info(adaptive.jobs[0]).replica_limit == 64
    assert apps["imagenet"].max_measured_replicas == 64


def test_speedup_table_covers_clusters_above_256_gpus(real_data):
    # 80 nodes x 4 = 320 GPUs: the speedup memo table must cover the whole cluster
    apps = load_applications(os.path.join(real_data, "traces"), ["imagenet"])
    w = [WorkloadJob("j", 0.0, "imagenet", 1, apps["imagenet"].init_batch_size)]
    sim = Simulator(w, apps, WaterfillPolicy(search=Search(method="local")), num_nodes=80)
    sim.run(max_time=180)
    fn = sim.jobs[0].speedup_fn()
    assert sim.jobs[0].perf_params is not None
    assert float(fn(80, 320)) > 0 and float(fn(70, 300)) > 0


def test_optimus_step_time_model_packs_onto_the_cluster_s_node_size(real_data):
    # Optimus predicts a step on r replicas packed onto full nodes: of the cluster's size,
    # not always 4 GPUs (a cluster of 2-GPU nodes puts 4 replicas on two nodes).
    apps = load_applications(os.path.join(real_data, "traces"), ["cifar10"])
    w = [WorkloadJob("j", 0.0, "cifar10", 4, 512)]
    job = Simulator(
        w, apps, OptimusPolicy(), cluster=ClusterSpec(gpus_per_node=2), num_nodes=8
    ).jobs[0]
    app = apps["cifar10"]
    assert job.step_time_fn(2)(4) == pytest.approx(app.get_throughput((2, 2), 128)[0])
    assert job.step_time_fn(4)(4) == pytest.approx(app.get_throughput((4,), 128)[0])
    assert job.step_time_fn(2)(4) != pytest.approx(job.step_time_fn(4)(4))
    with pytest.raises(ValueError, match="gpus_per_node=0"):
        job.step_time_fn(0)


def test_model_memos_shared_across_jobs_and_simulations_change_nothing(real_data):
    # Jobs of one model share the batch size they pick and their speedup table through memos
    # kept across simulations (pure functions of the model, its batch limits and the table's
    # size). A run gives the same JCTs and restarts with the memos empty and after another
    # simulation, on another cluster, filled them.
    from adaptrain.sim import GoodputMemos

    apps = load_applications(os.path.join(real_data, "traces"))
    w = load_workload(os.path.join(real_data, "workloads", "workload-6.csv"))[:16]

    def run(workload, num_nodes, memos):
        policy = WaterfillPolicy(search=Search(method="local"))
        sim = Simulator(workload, apps, policy, num_nodes=num_nodes, memos=memos)
        return sim.run(max_time=5400)

    first_memos = GoodputMemos()
    first = run(w, 4, first_memos)
    used = [set(m.keys()) for m in (first_memos.batch_sizes, first_memos.speedups)]
    memos = GoodputMemos()
    run(w[::2], 2, memos)
    # entries the replay looks up (as the first run did) and finds filled by the other run
    shared = [used[i] & set(m.keys()) for i, m in enumerate((memos.batch_sizes, memos.speedups))]
    assert all(shared), [len(s) for s in shared]
    again = run(w, 4, memos)
    assert again.jcts == first.jcts and again.restarts == first.restarts
    assert len(first.jcts) >= 4


def test_the_simulator_reports_each_job_s_measured_profile_read_only(tiny_traces):
    apps = load_applications(tiny_traces)
    sim = Simulator([WorkloadJob("j", 0.0, "toy", 1, 8)], apps, WaterfillPolicy(seed=0))
    for _ in range(3):
        sim.step()
    job = sim.jobs[0]
    info = sim.job_info(job)
    assert isinstance(info.profile, MappingProxyType)
    assert dict(info.profile) == job.profile and job.profile
    for (n, r, b), (step, sync) in info.profile.items():
        assert 1 <= n <= r and b >= 1 and step > 0 and sync >= 0


def test_fifo_runs_each_job_at_its_workload_size_in_order(tiny_traces):
    from adaptrain.sched import FifoPolicy

    apps = load_applications(tiny_traces)
    work = [WorkloadJob("a", 0.0, "toy", 2, 8), WorkloadJob("b", 1.0, "toy", 2, 16)]
    sim = Simulator(work, apps, FifoPolicy(), cluster=ClusterSpec(gpus_per_node=2), num_nodes=1)
    sim.step()
    assert sim.allocations == {"a": [0, 0]}  # b waits: it does not fit beside a
    result = sim.run(max_time=20000)
    assert set(result.jcts) == {"a", "b"} and result.jcts["b"] > result.jcts["a"]
