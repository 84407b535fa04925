"""The service survives its own crash and its replicas' crashes, with real processes.

* ``kill -9`` of the server while jobs run, then a restart on the same state directory: live
  replicas are re-adopted, replicas that ended meanwhile are accounted for, a replica lost
  meanwhile restarts its job from its checkpoint; no step runs twice, none is lost, the logs
  from before the crash are kept.
* SIGTERM / SIGINT of the server: the running jobs checkpoint and stop; a restart resumes them.
* ``kill -9`` of one replica: the others stop within seconds and the job restarts from its
  checkpoint.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from _service_jobs import (
    COUNT,
    check_steps,
    events,
    gone,
    job,
    live_replicas,
    records,
    replica_procs,
    steps_done,
    wait_for,
    wait_job,
)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def workdir(tmp_path):
    d = tmp_path / "work"
    d.mkdir()
    (d / "count.py").write_text(COUNT)
    return str(d)


def _submit(srv, workdir: str, name: str, n: int, delay: float, replicas: int = 1) -> None:
    srv.cli("submit", "--name", name, "--min-replicas", str(replicas), "--max-replicas",
            str(replicas), "--max-restarts", "2", "--", "python", "count.py", str(n), str(delay),
            cwd=workdir)  # fmt: skip


def _all_procs(launchers) -> list:
    """The launchers and their children (the replicas' commands)."""
    out = list(launchers)
    for p in launchers:
        try:
            out += p.children(recursive=True)
        except Exception:  # noqa: BLE001 - gone already
            pass
    return out


def test_kill_9_of_the_server_recovers_every_job(server, workdir):
    # a short orphan timeout: re-adopted replicas must keep running past it under the new server
    srv = server("--slots", "4", "--interval", "2", "--grace", "10", "--orphan-timeout", "6")
    state = srv.state_dir
    _submit(srv, workdir, "short", 14, 0.25)
    _submit(srv, workdir, "adopt", 64, 0.25, replicas=2)
    _submit(srv, workdir, "lost", 40, 0.25)
    wait_for(
        lambda: (
            all(steps_done(state, "adopt", r) >= 2 for r in (0, 1))
            and steps_done(state, "lost", 0) >= 2
        ),
        30,
        "every job stepping",
    )
    assert steps_done(state, "short", 0) < 14, "'short' ended before the crash: retune it"
    adopt_before = replica_procs(state, "adopt")
    lost_before = replica_procs(state, "lost")
    assert sorted(adopt_before) == [0, 1] and sorted(lost_before) == [0]

    srv.kill(signal.SIGKILL)
    # while the server is down: 'short' ends, 'lost' loses its replica to a kill -9
    os.killpg(lost_before[0].pid, signal.SIGKILL)
    wait_for(lambda: not replica_procs(state, "short"), 15, "'short' ending unwatched")
    assert gone(lost_before.values())
    srv.start()

    adopt = wait_job(srv, "adopt", ("Succeeded",), timeout=60)
    short = wait_job(srv, "short", ("Succeeded",), timeout=10)
    lost = wait_job(srv, "lost", ("Succeeded",), timeout=60)

    # 'adopt': re-adopted, the same processes to the end, each step exactly once
    assert (adopt["restarts"], adopt["failures"]) == (0, 0), adopt["events"]
    recovered = [e["message"] for e in adopt["events"] if e["kind"] == "Recovered"]
    assert recovered and "2 of 2 replicas re-adopted" in recovered[0], adopt["events"]
    check_steps(state, "adopt", 2, 64, exactly_once=True)
    for rank in (0, 1):  # one process per rank ran every step: the one adopted
        assert len({pid for _, _, pid, _ in records(state, "adopt", rank)}) == 1
    # 'short': ended while the server was down; its exit status was read from its status file
    assert (short["restarts"], short["failures"]) == (0, 0), short["events"]
    check_steps(state, "short", 1, 14, exactly_once=True)
    # 'lost': restarted from its checkpoint, never two copies at once
    assert (lost["restarts"], lost["failures"]) == (1, 1), lost["events"]
    assert "ReplicaFailed" in events(lost), lost["events"]
    check_steps(state, "lost", 1, 40, exactly_once=False)

    # the logs from before the crash are kept
    logs = srv.cli("logs", "adopt").stdout
    assert "start rank 0 at step 0 group 0" in logs and "done rank 1" in logs, logs[-2000:]
    logs = srv.cli("logs", "lost").stdout
    assert "=== group 0 rank 0" in logs and "=== group 1 rank 0" in logs, logs[-2000:]
    assert "start rank 0 at step 0 group 0" in logs and "group 1\n" in logs
    resumed = [ln for ln in logs.splitlines() if ln.startswith("start rank 0 at step")][-1]
    assert int(resumed.split()[5]) >= 2, resumed
    assert not live_replicas(state)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signalled_server_stops_its_jobs_at_a_checkpoint_and_resumes_them(server, workdir, sig):
    srv = server("--slots", "2", "--interval", "2", "--grace", "20")
    state = srv.state_dir
    _submit(srv, workdir, "count", 40, 0.2, replicas=2)
    wait_for(lambda: all(steps_done(state, "count", r) >= 3 for r in (0, 1)), 30, "stepping")
    procs = _all_procs(replica_procs(state, "count").values())
    t0 = time.monotonic()
    srv.kill(sig)
    assert srv.proc.returncode == 0, srv.text()
    assert time.monotonic() - t0 < 15, "the replicas took the whole grace period"
    assert gone(procs), "a replica outlived the server's orderly stop"
    stopped = [steps_done(state, "count", r) for r in (0, 1)]
    assert all(0 < s < 40 for s in stopped), stopped

    srv.start()
    detail = wait_job(srv, "count", ("Succeeded",), timeout=60)
    assert (detail["restarts"], detail["failures"]) == (1, 0), detail["events"]
    assert "Suspended" in events(detail), detail["events"]
    check_steps(state, "count", 2, 40, exactly_once=True)
    logs = srv.cli("logs", "count").stdout
    for rank in (0, 1):
        assert f"=== group 0 rank {rank}" in logs and f"=== group 1 rank {rank}" in logs
    assert "checkpointed at step" in logs and "start rank 0 at step 0 group 0" in logs
    assert not live_replicas(state)


@pytest.mark.parametrize("victim", ["command", "launcher"])
def test_kill_9_of_one_replica_restarts_the_job_from_its_checkpoint(server, workdir, victim):
    srv = server("--slots", "2", "--interval", "2", "--grace", "20")
    state = srv.state_dir
    _submit(srv, workdir, "count", 40, 0.2, replicas=2)
    wait_for(lambda: all(steps_done(state, "count", r) >= 3 for r in (0, 1)), 30, "stepping")
    launchers = replica_procs(state, "count", group=0)
    procs = _all_procs(launchers.values())
    if victim == "command":
        launchers[1].children()[0].kill()
    else:  # the launcher alone: its command, orphaned, must not keep stepping
        launchers[1].kill()
    t0 = time.monotonic()
    wait_for(lambda: gone(procs), 10, "every process of the failed group gone")
    assert time.monotonic() - t0 < 10
    detail = wait_job(srv, "count", ("Succeeded",), timeout=60)
    assert (detail["restarts"], detail["failures"]) == (1, 1), detail["events"]
    assert "ReplicaFailed" in events(detail), detail["events"]
    check_steps(state, "count", 2, 40, exactly_once=False)
    assert job(srv, "count")["status"] == "Succeeded"
    assert not live_replicas(state)
