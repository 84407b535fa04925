"""``adaptrain ray submit`` as a command: its arguments, SIGTERM (the replicas checkpoint,
status 143) and a rerun that resumes from ``--checkpoint-dir``."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from _launcher_jobs import COUNT, kill_leftovers, leftover_processes, records, write_job
from _ray_cluster import local_ray_cluster  # before ray


def submit(*args: str, **kw) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen(
        [sys.executable, "-m", "adaptrain", "ray", "submit", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        **kw,
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "args, message",
    [
        (["-m", "2"], "required: -f"),
        (["-f", "missing.py", "-m", "2"], "is not a file inside the working directory"),
        (["-f", "{code}", "-m", "0"], "max_workers=0 must be at least 1"),
        (["-f", "{code}", "-m", "1", "--cpus", "0"], "a replica needs some CPUs or GPUs"),
        (["-f", "{code}", "-m", "1", "-e", "NOEQUALS"], "expected KEY=VALUE"),
    ],
)
def test_bad_arguments_exit_2_with_the_reason(tmp_path, args, message):
    code = write_job(str(tmp_path), "count.py", COUNT)
    proc = submit(*[a.format(code=code) for a in args])
    out, _ = proc.communicate(timeout=50)
    assert proc.returncode == 2, out
    assert message in out


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sigterm_checkpoints_and_a_rerun_resumes_from_the_checkpoint_dir(tmp_path):
    code = write_job(str(tmp_path / "wd"), "count.py", COUNT)
    log = str(tmp_path / "events.jsonl")
    ckpts = str(tmp_path / "ckpt")
    common = ["-f", code, "-m", "1", "--spot", "off", "--checkpoint-dir", ckpts]
    common += ["-e", f"LAUNCHER_TEST_LOG={log}"]
    procs = []
    try:
        with local_ray_cluster(workers=[{"num_cpus": 1}], connect=False) as cluster:
            first = submit("-u", cluster.address, *common, "--", "--steps", "10000",
                           "--delay", "0.1", "--tag", str(tmp_path))  # fmt: skip
            procs.append(first)
            deadline = time.monotonic() + 120
            while len(records(log, "step")) < 10:
                assert first.poll() is None, first.communicate()[0][-3000:]
                assert time.monotonic() < deadline, "no steps"
                time.sleep(0.2)
            first.send_signal(signal.SIGTERM)
            out, _ = first.communicate(timeout=90)
            assert first.returncode == 143, out[-3000:]
            saved = [c for c in records(log, "checkpoint")]
            assert len(saved) == 1 and saved[0]["step"] >= 10
            assert os.listdir(ckpts) == [f"checkpoint-{saved[0]['seq']:06d}.tar"]
            assert "interrupted" in out
            # the rerun restores the kept checkpoint and runs five more steps
            resume_at = saved[0]["step"]
            second = submit("-u", cluster.address, *common, "--", "--steps", str(resume_at + 5),
                            "--delay", "0.1", "--tag", str(tmp_path))  # fmt: skip
            procs.append(second)
            out, _ = second.communicate(timeout=120)
            assert second.returncode == 0, out[-3000:]
            assert "job finished" in out and "restoring from checkpoint-" in out
            assert f"rank 0 of 1 starts at step {resume_at}" in out  # the replica's output
            starts = records(log, "start")
            assert [s["step"] for s in starts] == [0, resume_at]
            assert max(r["step"] for r in records(log, "step")) == resume_at + 5
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        kill_leftovers(str(tmp_path))
    assert not leftover_processes(str(tmp_path))


@pytest.fixture(scope="module")
def client_url():
    """A head (0 CPUs) with a Ray Client server and one 1-CPU worker; its ``ray://`` URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with local_ray_cluster(
        [{"num_cpus": 1}], connect=False, head_args={"ray_client_server_port": port}
    ):
        yield f"ray://127.0.0.1:{port}"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_submit_through_ray_client(tmp_path, client_url):
    """``-u ray://HOST:PORT``: the driver has no GCS connection of its own; the autoscaler
    request and the drain poll go through tasks on the cluster."""
    code = write_job(str(tmp_path / "wd"), "count.py", COUNT)
    log = str(tmp_path / "events.jsonl")
    proc = None
    try:
        proc = submit("-u", client_url, "-f", code, "-m", "1", "--spot", "off",
                      "-e", f"LAUNCHER_TEST_LOG={log}", "--",
                      "--steps", "8", "--delay", "0.1", "--tag", str(tmp_path))  # fmt: skip
        out, _ = proc.communicate(timeout=150)
        assert proc.returncode == 0, out[-3000:]
        assert "asked the autoscaler for 1 x {'CPU': 1.0}" in out
        assert "job finished" in out
        assert max(r["step"] for r in records(log, "step")) == 8
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        kill_leftovers(str(tmp_path))
    assert not leftover_processes(str(tmp_path))


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_client_server_that_cannot_start_the_driver_is_asked_again_then_reported(
    client_url, monkeypatch, caplog
):
    """The cluster's client server answers but fails to start this driver's server process
    (here because the driver's runtime env names a conda env that does not exist): the
    command's connect warns and tries again, 3 times in all, then raises the server's error."""
    import ray

    from adaptrain.cli import ray as cli_ray

    monkeypatch.setattr(cli_ray, "CLIENT_RETRY_DELAY", 0.1)
    # the server holds a failed session open for the client's reconnect grace (30 s): none here
    monkeypatch.setenv("RAY_CLIENT_RECONNECT_GRACE_PERIOD", "0")
    bad = {"conda": "no-such-env-xyz"}
    with caplog.at_level(logging.WARNING, logger="adaptrain.ray"):
        # (the server's reply, or, where it closed the session's stream before the reply was
        # read, "Ray client has already been disconnected")
        with pytest.raises(ConnectionError, match="|".join(cli_ray.CLIENT_TRANSIENT)):
            cli_ray._connect(ray, client_url, runtime_env=bad)
    tries = [r.getMessage() for r in caplog.records if "failed to start" in r.getMessage()]
    assert [t[t.index("(try") :] for t in tries] == [
        "(try 1 of 3): trying again in 0.1 s",
        "(try 2 of 3): trying again in 0.1 s",
    ], tries
    assert not ray.is_initialized()
    monkeypatch.delenv("RAY_CLIENT_RECONNECT_GRACE_PERIOD")
    cli_ray._connect(ray, client_url)  # the same cluster, a driver it can start: connects
    try:
        assert ray.get(ray.remote(lambda: 6 * 7).remote()) == 42
    finally:
        ray.shutdown()
