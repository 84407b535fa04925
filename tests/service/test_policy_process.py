"""The policy's rounds in a worker process: the same decisions as in the server's process, a
state that replays, a worker replaced after a crash, and no worker outliving its server."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
from _service_jobs import wait_for

from adaptrain.sched import ClusterSpec, NodeInfo, WaterfillPolicy, job_info
from adaptrain.service.policy_process import PolicyProcess
from adaptrain.service.reports import job_report

CLUSTER = ClusterSpec(gpus_per_node=4, round_seconds=30.0, restart_delay=10.0)
NODES = {f"node-{i}": NodeInfo(4) for i in range(4)}
PERF = {"alpha_c": 0.01, "beta_c": 0.001, "alpha_n": 0.02, "beta_n": 0.001, "alpha_r": 0.01,
        "beta_r": 0.0005, "gamma": 1.5}  # fmt: skip


def _jobs(now: float) -> dict:
    """Twelve jobs as the service builds them from posted hints; the even ones have a model."""
    jobs = {}
    for i in range(12):
        hints = None
        if i % 2 == 0:
            hints = {
                "initBatchSize": 64, "maxBatchSize": 2048, "localBszBounds": [16, 256],
                "gradientAccumulation": False, "gradParams": {"norm": 0.5 + i, "var": 2.0 * i + 1},
                "perfParams": PERF, "progress": {"epoch": i % 5},
                "profile": [{"numNodes": 1, "numReplicas": 1 + i % 3, "atomicBsz": 64,
                             "stepTime": 0.1, "syncTime": 0.01}],
            }  # fmt: skip
        report = job_report(
            submitted=10.0 * i, attained_service=5.0 * i, spec={"max_replicas": 8}, group=0,
            hints=hints, running=False, cooldown=False, max_nodes=4, max_replicas=16,
        )  # fmt: skip
        jobs[f"job-{i}"] = job_info(report, cluster_replicas=16, now=now)
    return jobs


def _rounds(policy, count: int, start: int = 0) -> list[dict]:
    out, base = [], {}
    for k in range(start, start + count):
        now = 1000.0 + 30.0 * k
        alloc = {j: sorted(a) for j, a in policy.optimize(_jobs(now), NODES, base, now).items()}
        out.append(alloc)
        base = {j: a for j, a in alloc.items() if a}
    return out


@pytest.mark.timeout(120)
def test_rounds_in_the_worker_decide_as_in_the_server_and_replay_from_the_state():
    reference = WaterfillPolicy(cluster=CLUSTER, seed=0)
    expected = _rounds(reference, 3)
    with PolicyProcess("waterfill", CLUSTER) as policy:
        assert policy.worker_pid() not in (None, os.getpid())
        assert _rounds(policy, 3) == expected
        assert not policy.in_process
        state = policy.state_dict()
    assert any(expected[0].values())
    # save -> load -> replay: a new worker from the state of round 2 decides round 3 alike
    reference = WaterfillPolicy(cluster=CLUSTER, seed=0)
    _rounds(reference, 2)
    after_two = reference.state_dict()
    third = _rounds(reference, 1, start=2)
    with PolicyProcess("waterfill", CLUSTER, after_two) as policy:
        base = {j: a for j, a in expected[1].items() if a}
        got = policy.optimize(_jobs(1060.0), NODES, base, 1060.0)
        assert {j: sorted(a) for j, a in got.items()} == third[0] == expected[2]
    assert set(state) == set(reference.state_dict())


@pytest.mark.timeout(120)
def test_a_killed_worker_is_replaced_and_resumes_from_the_last_round():
    reference = WaterfillPolicy(cluster=CLUSTER, seed=0)
    with PolicyProcess("waterfill", CLUSTER) as policy:
        for k in range(2):
            now = 1000.0 + 30.0 * k
            assert policy.optimize(_jobs(now), NODES, {}, now) == reference.optimize(
                _jobs(now), NODES, {}, now
            )
        first = policy.worker_pid()
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: not psutil.pid_exists(first), 10, "the worker's end")
        now = 1060.0
        assert policy.optimize(_jobs(now), NODES, {}, now) == reference.optimize(
            _jobs(now), NODES, {}, now
        )
        assert policy.worker_pid() != first and not policy.in_process


def _explode():
    raise RuntimeError("this cluster spec cannot be read in another process")


class _LocalOnlyCluster(ClusterSpec):
    """A cluster spec that a worker process fails to unpickle: its start fails."""

    def __reduce__(self):
        return (_explode, ())


@pytest.mark.timeout(120)
def test_a_worker_that_cannot_start_leaves_the_rounds_in_the_server(caplog):
    cluster = _LocalOnlyCluster(gpus_per_node=4, round_seconds=30.0, restart_delay=10.0)
    reference = WaterfillPolicy(cluster=cluster, seed=0)
    with PolicyProcess("waterfill", cluster) as policy:
        got = policy.optimize(_jobs(1000.0), NODES, {}, 1000.0)
        assert policy.in_process and policy.worker_pid() is None
        assert got == reference.optimize(_jobs(1000.0), NODES, {}, 1000.0)
    messages = [r.getMessage() for r in caplog.records]
    assert any("(try 1 of 2)" in m for m in messages), messages
    assert any("run in the server's process from now on" in m for m in messages), messages


def _policy_workers(server_pid: int) -> list[psutil.Process]:
    try:
        children = psutil.Process(server_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    return [c for c in children if "multiprocessing" in " ".join(c.cmdline())]


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["kill-9", "sigterm"])
def test_the_policy_worker_ends_with_its_server(server, sig):
    srv = server("--slots", "2", "--interval", "1")
    found: list[psutil.Process] = []
    wait_for(lambda: found.extend(_policy_workers(srv.proc.pid)) or found, 30, "the worker")
    srv.kill(sig)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(p.is_running() for p in found):
        time.sleep(0.1)
    alive = [p for p in found if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, [p.cmdline() for p in alive]
