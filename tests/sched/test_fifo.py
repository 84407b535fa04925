"""The FIFO baseline: submission order, requested size, packed, never preempted, no backfill."""

from __future__ import annotations

from adaptrain.sched import FifoPolicy, JobInfo, JobReport, NodeInfo, check_allocations, job_info


def _job(t: float, size: int) -> JobInfo:
    return job_info(JobReport(submitted=t, replicas=size), cluster_replicas=64, now=100.0)


def _nodes(count: int = 2, gpus: int = 4) -> dict:
    return {i: NodeInfo(gpus) for i in range(count)}


def test_jobs_start_in_submission_order_at_their_requested_size():
    jobs = {"late": _job(30, 4), "early": _job(10, 4), "mid": _job(20, 4)}
    policy = FifoPolicy()
    alloc = policy.optimize(jobs, _nodes(), {}, 100.0)
    assert set(alloc) == {"early", "mid"}
    assert alloc["early"] == [0, 0, 0, 0] and alloc["mid"] == [1, 1, 1, 1]
    check_allocations(alloc, jobs, _nodes(), policy=policy)


def test_a_running_job_is_never_preempted_by_an_earlier_one():
    jobs = {"old": _job(0, 8), "running": _job(50, 4)}
    alloc = FifoPolicy().optimize(jobs, _nodes(), {"running": [1, 1, 1, 1]}, 100.0)
    assert alloc == {"running": [1, 1, 1, 1]}  # "old" waits for all 8 GPUs


def test_a_job_that_does_not_fit_blocks_those_behind_it():
    jobs = {"a": _job(0, 6), "big": _job(1, 4), "small": _job(2, 1)}
    policy = FifoPolicy()
    alloc = policy.optimize(jobs, _nodes(), {}, 100.0)
    assert set(alloc) == {"a"} and len(alloc["a"]) == 6  # 2 GPUs free, but no backfill
    assert policy.allocate_job(_job(3, 1), {0: NodeInfo(2)}) == []  # queues behind "big"
    done = {k: v for k, v in jobs.items() if k != "a"}
    alloc = policy.optimize(done, _nodes(), {}, 200.0)
    assert sorted(alloc) == ["big", "small"]
    assert policy.allocate_job(_job(3, 2), {0: NodeInfo(1), 1: NodeInfo(2)}) == [1, 1]


def test_named_nodes_and_the_spec_bound_of_an_adaptive_job():
    # a service job: max_replicas is the exploration cap (1 before it ran), its spec's
    # bound is replica_limit, which FIFO takes as the requested size
    info = job_info(JobReport(submitted=0, max_replicas=3), cluster_replicas=8, now=1.0)
    assert info.max_replicas == 1 and info.replica_limit == 3
    nodes = {"node-a": NodeInfo(2), "node-b": NodeInfo(2)}
    policy = FifoPolicy()
    alloc = policy.optimize({"j": info}, nodes, {}, 1.0)
    assert sorted(alloc["j"]) == ["node-a", "node-a", "node-b"]
    check_allocations(alloc, {"j": info}, nodes, policy=policy)
    assert policy.allocate_job(info, {"node-b": NodeInfo(2)}) == []  # 3 do not fit on 2
    state = policy.state_dict()
    again = FifoPolicy()
    again.load_state_dict(state)
    assert again.allocate_job(info, nodes) == []  # still blocked behind the waiting job


def test_the_server_accepts_the_fifo_policy():
    from adaptrain.sched import ClusterSpec
    from adaptrain.service.config import ServerConfig
    from adaptrain.service.policy_process import make_policy

    assert ServerConfig(policy="fifo").policy == "fifo"
    assert isinstance(make_policy("fifo", ClusterSpec()), FifoPolicy)
