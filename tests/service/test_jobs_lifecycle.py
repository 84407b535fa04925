"""Jobs through a real server: submit, run on emulated nodes, succeed, fail after their
restart budget, get cancelled; ls, describe, logs and cp through the real CLI."""

from __future__ import annotations

import json
import time

import pytest

HELLO = """
import os, sys, time
rank = os.environ["ADAPTRAIN_REPLICA_RANK"]
print("hello from", rank, "of", os.environ["ADAPTRAIN_NUM_REPLICAS"], flush=True)
if rank == "0":
    with open(os.path.join(os.environ["ADAPTRAIN_SHARE_PATH"], "out.txt"), "w") as f:
        f.write("written by " + os.environ["ADAPTRAIN_JOB_ID"])
time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 1.0)
"""

CRASH = """
import os
print("restart", os.environ["ADAPTRAIN_NUM_RESTARTS"], flush=True)
raise SystemExit(3)
"""


def _wait(srv, name: str, statuses: tuple[str, ...], timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        jobs = {j["name"]: j for j in json.loads(srv.cli("ls", "--json").stdout)}
        if jobs.get(name, {}).get("status") in statuses:
            return jobs[name]
        time.sleep(0.5)
    raise AssertionError(f"{name} not in {statuses}: {srv.cli('describe', name).stdout}")


@pytest.fixture
def workdir(tmp_path):
    d = tmp_path / "work"
    d.mkdir()
    (d / "hello.py").write_text(HELLO)
    (d / "crash.py").write_text(CRASH)
    (d / ".gitignore").write_text("data/\n")
    (d / "data").mkdir()
    (d / "data" / "big.bin").write_bytes(b"0" * 1000)
    return d


def test_a_job_runs_succeeds_and_keeps_its_logs_and_files(server, workdir, tmp_path):
    srv = server("--nodes", "2", "--slots-per-node", "2", "--interval", "2")
    out = srv.cli("submit", "--name", "hello", "--max-replicas", "2", "--", "python", "hello.py",
                  cwd=str(workdir))  # fmt: skip
    assert out.stdout.strip().splitlines()[-1] == "hello"
    job = _wait(srv, "hello", ("Succeeded",))
    assert job["restarts"] == 0
    logs = srv.cli("logs", "hello").stdout
    assert "hello from 0 of" in logs and "=== group 0 rank 0" in logs
    srv.cli("cp", "hello:out.txt", str(tmp_path / "got.txt"))
    assert (tmp_path / "got.txt").read_text() == "written by hello"
    # the working copy left .gitignore'd files out
    assert not (tmp_path / "state" / "jobs" / "hello" / "workdir" / "data").exists()
    table = srv.cli("ls").stdout
    assert "hello" in table and "Succeeded" in table
    desc = srv.cli("describe", "hello").stdout
    assert "Submitted" in desc and "Started" in desc and "Succeeded" in desc


def test_a_crashing_job_restarts_then_fails_with_the_reason(server, workdir):
    srv = server("--slots", "2", "--interval", "2")
    srv.cli("submit", "--name", "crash", "--max-restarts", "2", "--", "python", "crash.py",
            cwd=str(workdir))  # fmt: skip
    job = _wait(srv, "crash", ("Failed",))
    assert "exited 3" in job["reason"] and "budget 2" in job["reason"]
    logs = srv.cli("logs", "crash").stdout
    assert [f"restart {i}" in logs for i in range(3)] == [True] * 3  # the first run + 2 restarts


def test_delete_cancels_a_running_job(server, workdir):
    srv = server("--slots", "2", "--interval", "2", "--grace", "5")
    srv.cli("submit", "--name", "long", "--", "python", "hello.py", "60", cwd=str(workdir))
    _wait(srv, "long", ("Running",))
    assert srv.cli("delete", "long").stdout.startswith("long: ")
    job = _wait(srv, "long", ("Cancelled",))
    assert job["replicas"] == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--name", "Bad_Name", "--", "true"], "DNS label"),
        (["--min-replicas", "3", "--max-replicas", "2", "--", "true"], "min_replicas=3"),
        (["--min-replicas", "9", "--max-replicas", "9", "--", "true"], "exceeds the cluster"),
        (["--max-replicas", "0", "--", "true"], "max_replicas"),
        (["--env", "ADAPTRAIN_X=1", "--", "true"], "set by the server"),
    ],
)
def test_bad_submissions_get_a_clear_error(server, workdir, args, message):
    srv = server("--slots", "2", "--interval", "5")
    proc = srv.cli("submit", *args, check=False, cwd=str(workdir))
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_a_name_taken_twice_is_refused(server, workdir):
    srv = server("--slots", "2", "--interval", "5")
    srv.cli("submit", "--name", "twice", "--", "python", "hello.py", cwd=str(workdir))
    proc = srv.cli("submit", "--name", "twice", "--", "true", check=False, cwd=str(workdir))
    assert proc.returncode == 2 and "exists" in proc.stderr
