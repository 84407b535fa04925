"""Jobs placed as they arrive, between rounds (``allocate_job``), as AdaptDL's allocator does."""

from __future__ import annotations

import pytest

from adaptrain.sched import (
    ClusterSpec,
    Exploration,
    JobInfo,
    NodeInfo,
    PolluxPolicy,
    TiresiasPolicy,
    WaterfillPolicy,
)
from adaptrain.sim import Simulator, WorkloadJob, load_applications


class _FirstFitTiresias(TiresiasPolicy):
    """Tiresias (fixed-size jobs, whole-second hand arithmetic) that also places a job on
    arrival: all its replicas on the first node with room."""

    def __init__(self) -> None:
        super().__init__()
        self.offers: list[tuple[float, dict[int, int]]] = []

    def allocate_job(self, job, nodes):
        self.offers.append((job.age, {n: info.gpus for n, info in nodes.items()}))
        for n in sorted(nodes):
            if nodes[n].gpus >= job.max_replicas:
                return [n] * job.max_replicas
        return []


class _Greedy(_FirstFitTiresias):
    """Asks for more GPUs than are free (the simulator must refuse)."""

    def allocate_job(self, job, nodes):
        return [min(nodes)] * 5


# ---- the simulator's accounting, by hand ---------------------------------------------------


def test_a_job_starts_when_it_arrives(tiny_traces):
    # Submitted at 53: placed then, 30 s restart, 120 s of training at 1 progress/s -> ends at
    # 203, JCT 150. Waiting for the round at 60 instead (the artifact's rule): 60+150-53 = 157.
    apps = load_applications(tiny_traces)
    w = [WorkloadJob("a", 53.0, "toy", 1, 8)]
    policy = _FirstFitTiresias()
    sim = Simulator(w, apps, policy, cluster=ClusterSpec(gpus_per_node=4), num_nodes=1)
    res = sim.run()
    assert res.jcts == {"a": 150.0}
    assert sim.arrivals_placed == 1 and res.summary()["arrivals_placed"] == 1
    assert sim.jobs[0].num_restarts == 0  # the rounds at 60-180 kept its place
    assert sim.jobs[0].attained_service == pytest.approx(150.0)
    assert policy.offers == [(0.0, {0: 4})]  # offered at its submission: age 0, node free
    assert len(sim.policy_seconds_arrivals) == 1
    off = Simulator(w, apps, _FirstFitTiresias(), num_nodes=1, arrival_allocation=False).run()
    assert off.jcts == {"a": 157.0}


def test_a_job_at_time_zero_starts_at_zero(tiny_traces):
    # no round has run at t = 0: the job is an arrival there (before: placed at 60, JCT 210)
    apps = load_applications(tiny_traces)
    res = Simulator(
        [WorkloadJob("a", 0.0, "toy", 1, 8)], apps, _FirstFitTiresias(), num_nodes=1
    ).run()
    assert res.jcts == {"a": 150.0}


@pytest.mark.parametrize(
    ("b_time", "b_end"),
    [
        # a (4 GPUs from 0) ends at 150: at 130 no GPU is free, b waits for the round at 180
        (130.0, 180.0 + 150.0),
        # at 155 a has ended and freed its GPUs within the round: b starts at once
        (155.0, 155.0 + 150.0),
        # exactly at a's end: a's GPUs are free
        (150.0, 150.0 + 150.0),
    ],
)
def test_arrivals_get_only_free_gpus(tiny_traces, b_time, b_end):
    apps = load_applications(tiny_traces)
    w = [WorkloadJob("a", 0.0, "toy", 4, 16), WorkloadJob("b", b_time, "toy", 4, 16)]
    sim = Simulator(w, apps, _FirstFitTiresias(), cluster=ClusterSpec(gpus_per_node=4), num_nodes=1)
    res = sim.run()
    assert res.jcts == {"a": 150.0, "b": b_end - b_time}
    assert sim.arrivals_placed == (2 if b_end - b_time == 150.0 else 1)


def test_two_arrivals_in_one_round_share_the_free_gpus(tiny_traces):
    # one 4-GPU node: a (2 GPUs) at 10, b (2 GPUs) at 20, c (1 GPU) at 30 -> a and b fill the
    # node on arrival, c finds no room and waits for the round at 60 ... and for a GPU.
    apps = load_applications(tiny_traces)
    w = [
        WorkloadJob("a", 10.0, "toy", 2, 16),
        WorkloadJob("b", 20.0, "toy", 2, 16),
        WorkloadJob("c", 30.0, "toy", 1, 8),
    ]
    policy = _FirstFitTiresias()
    sim = Simulator(w, apps, policy, cluster=ClusterSpec(gpus_per_node=4), num_nodes=1)
    sim.step()
    assert sim.allocations == {"a": [0, 0], "b": [0, 0]}
    # c found no free GPU: the policy was not even asked
    assert [free for _, free in policy.offers] == [{0: 4}, {0: 2}]
    assert sim.arrivals_placed == 2
    res = sim.run()
    assert res.jcts["a"] == 150.0 and res.jcts["b"] == 150.0
    assert res.jcts["c"] > 150.0


def test_arrival_allocations_are_checked(tiny_traces):
    apps = load_applications(tiny_traces)
    sim = Simulator([WorkloadJob("a", 5.0, "toy", 1, 8)], apps, _Greedy(), num_nodes=1)
    with pytest.raises(RuntimeError, match="replicas|capacity"):
        sim.step()


def test_policies_without_allocate_job_wait_for_the_round(tiny_traces):
    apps = load_applications(tiny_traces)
    sim = Simulator([WorkloadJob("a", 53.0, "toy", 1, 8)], apps, TiresiasPolicy(), num_nodes=1)
    assert sim.run().jcts == {"a": 157.0}
    assert sim.arrivals_placed == 0


def test_waterfill_places_a_new_job_on_arrival(tiny_traces):
    # adaptive job, never run: waterfill's first size (4 GPUs) on arrival, at its submission
    apps = load_applications(tiny_traces)
    w = [WorkloadJob("a", 7.0, "toy", 1, 8)]
    sim = Simulator(w, apps, WaterfillPolicy(), cluster=ClusterSpec(gpus_per_node=4), num_nodes=2)
    sim.step()
    assert sim.allocations == {"a": [0, 0, 0, 0]} and sim.arrivals_placed == 1
    assert sim.jobs[0].num_restarts == 0
    sim = Simulator(
        w,
        apps,
        WaterfillPolicy(exploration=Exploration(first_replicas=None)),
        cluster=ClusterSpec(gpus_per_node=4),
        num_nodes=2,
    )
    sim.step()
    assert sim.arrivals_placed == 1 and sim.jobs[0].placement == (1,)


# ---- the policies' choices ---------------------------------------------------------------


def _job(**kw) -> JobInfo:
    base = dict(creation_timestamp=0.0, max_replicas=1, replica_limit=16)
    base.update(kw)
    return JobInfo(**base)


def test_waterfill_allocate_job_best_fit_then_most_free():
    policy = WaterfillPolicy()  # a new job: up to 4 GPUs
    new = _job()
    nodes = {0: NodeInfo(1), 1: NodeInfo(4), 2: NodeInfo(4), 3: NodeInfo(3)}
    assert policy.allocate_job(new, nodes) == [1, 1, 1, 1]  # fullest node holding all 4
    nodes = {0: NodeInfo(6), 1: NodeInfo(5), 2: NodeInfo(2)}
    assert policy.allocate_job(new, nodes) == [1] * 4  # best fit: 5 free, not 6
    nodes = {0: NodeInfo(2), 1: NodeInfo(3), 2: NodeInfo(3)}
    assert policy.allocate_job(new, nodes) == [1, 1, 1]  # none holds 4: most free, lowest key
    assert policy.allocate_job(new, {}) == []
    # the allocator's 1 GPU without the first-size rule
    assert WaterfillPolicy(exploration=Exploration(first_replicas=None)).allocate_job(
        new, {5: NodeInfo(4)}
    ) == [5]
    # a measured job: up to 4x its largest tried size (2 -> 8), on one node
    tried = _job(max_replicas=4, max_profiled_replicas=2, speedup_fn=lambda n, r: r)
    assert policy.allocate_job(tried, {0: NodeInfo(8), 1: NodeInfo(3)}) == [0] * 8
    # min replicas: no node with 3 free -> wait
    needy = _job(min_replicas=3, max_replicas=3)
    assert policy.allocate_job(needy, {0: NodeInfo(2), 1: NodeInfo(2)}) == []
    assert policy.allocate_job(needy, {0: NodeInfo(2), 1: NodeInfo(3)}) == [1, 1, 1]


def test_pollux_allocate_job_is_adaptdl_first_fit():
    policy = PolluxPolicy()
    nodes = {3: NodeInfo(4), 1: NodeInfo(0), 2: NodeInfo(2, preemptible=True), 0: NodeInfo(1)}
    assert policy.allocate_job(_job(), nodes) == [0]  # one replica, lowest key with room
    assert policy.allocate_job(_job(min_replicas=2, max_replicas=2), nodes) == [3, 3]
    # preemptible nodes last
    assert policy.allocate_job(_job(), {0: NodeInfo(1, preemptible=True), 1: NodeInfo(1)}) == [1]
    assert policy.allocate_job(_job(min_replicas=5, max_replicas=5), nodes) == []
