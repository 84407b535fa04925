"""``adaptrain demo`` end to end: launcher → torchrun → 2 replicas, outputs, Ctrl-C and resume."""

from __future__ import annotations

import io
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from adaptrain import checkpoint
from adaptrain.cli import _demo_worker

SMALL = ["--max-chars", "60000", "--no-bar"]


def _demo_cmd(out: Path, minutes: float, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "adaptrain",
        "demo",
        "--minutes",
        str(minutes),
        "--out",
        str(out),
        *SMALL,
        *extra,
    ]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    return env


def _stop(proc: subprocess.Popen) -> None:
    """Make sure the launcher and its torchrun tree are gone (two Ctrl-C, then kill)."""
    if proc.poll() is None:
        for _ in range(2):
            proc.send_signal(signal.SIGINT)
            time.sleep(1.0)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(
        cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        _stop(proc)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def test_demo_state_roundtrip():
    checkpoint.reset()
    try:
        s = _demo_worker.DemoState()
        s.elapsed_before, s.steps, s.samples = 12.5, 40, 1280
        s.history = [(1.0, 1, 4.6, 32, 1, 1.0, 0.5, 0.1, math.nan, 300.0)]
        s.valid = [(5.0, 30, 2.9)]
        buf = io.BytesIO()
        s.save(buf)
        checkpoint.reset()
        t = _demo_worker.DemoState()
        t.load(io.BytesIO(buf.getvalue()))
        assert (t.elapsed(), t.steps, t.samples, t.restarts) == (12.5, 40, 1280, 1)
        s.done = True  # a finished job's state: loading it is no restart
        buf_done = io.BytesIO()
        s.save(buf_done)
        checkpoint.reset()
        f = _demo_worker.DemoState()
        f.load(io.BytesIO(buf_done.getvalue()))
        assert f.done and f.restarts == 0
        checkpoint.reset()
        assert t.valid == s.valid and len(t.history) == 1
        assert t.history[0][:8] == s.history[0][:8] and math.isnan(t.history[0][8])
        t.start_clock()
        time.sleep(0.05)
        t.stop_clock()
        assert 12.55 <= t.elapsed() < 13.5  # the clock adds to the restored time
        buf2 = io.BytesIO()
        t.save(buf2)
        checkpoint.reset()
        u = _demo_worker.DemoState()
        u.load(io.BytesIO(buf2.getvalue()))
        assert u.restarts == 2 and u.elapsed() == t.elapsed()  # replay: same again
    finally:
        checkpoint.reset()


def test_demo_rejects_bad_arguments(tmp_path):
    for bad in (["--replicas", "0"], ["--minutes", "0"]):
        res = subprocess.run(
            [sys.executable, "-m", "adaptrain", "demo", "--out", str(tmp_path), *bad],
            env=_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert res.returncode != 0 and bad[0] in res.stderr


@pytest.mark.timeout(240)
def test_demo_end_to_end(tmp_path):
    out = tmp_path / "demo"
    budget_min = 0.15
    res = _run(_demo_cmd(out, budget_min), timeout=200)
    assert res.returncode == 0, res.stdout[-3000:]
    assert "adaptrain demo — character LM" in res.stdout
    assert (out / "demo.png").stat().st_size > 10_000
    summary = json.loads((out / "summary.json").read_text())
    assert summary["replicas"] == 2 and summary["restarts"] == 0
    assert summary["steps"] > 0 and len(summary["history"]) > 0
    # Every replica stopped after the agreed step once the budget was spent.
    assert budget_min * 60 <= summary["elapsed_s"] < budget_min * 60 + 30
    # The training loss went down.
    losses = [row[2] for row in summary["history"]]
    assert losses[-1] < losses[0]
    # TensorBoard scalars.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(out / "tensorboard"))
    ea.Reload()
    tags = set(ea.Tags()["scalars"])
    for name in ("loss", "batch_size", "accum_steps", "gain", "sqr", "var", "throughput"):
        assert f"demo/{name}" in tags, tags
    assert "adaptdl/Total_Batch_Size" in tags and "adaptdl/Gain" in tags
    assert (out / "checkpoint").is_dir()
    assert f"of {budget_min} min budget" in res.stdout
    # A rerun of a finished job does not train again, whatever budget it is given: it reports
    # the budget the job ran under, and how to start a new job.
    again = _run(_demo_cmd(out, 5, "--no-plot"), timeout=200)
    assert again.returncode == 0, again.stdout[-3000:]
    summary2 = json.loads((out / "summary.json").read_text())
    assert summary2["steps"] == summary["steps"] and summary2["budget_min"] == budget_min
    assert summary2["restarts"] == 0 and "is finished" in again.stdout  # no restart counted
    assert len(list((out / "checkpoint").glob("checkpoint-*"))) == 1  # nothing saved again
    assert f"of {budget_min} min budget" in again.stdout and "of 5 min budget" not in again.stdout
    assert f"of {budget_min} min budget" in (out / "summary.txt").read_text()
    assert (
        f"already finished under a {budget_min} min budget; --minutes 5 applies to a new job"
        in again.stdout
    )
    assert "another --out" in again.stdout and "--fresh" in again.stdout


def _start_and_signal(out: Path, log: Path, sig: int) -> int:
    """Start the demo, send ``sig`` to the launcher 2 s into training, return its exit code."""
    with open(log, "w") as f:
        proc = subprocess.Popen(
            _demo_cmd(out, 0.3),
            env=_env(),
            stdout=f,
            stderr=subprocess.STDOUT,
            # as in a terminal: a test run started as a background job (`cmd &` without job
            # control) inherits SIGINT ignored, and Python then installs no Ctrl-C handler
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
    try:
        deadline = time.monotonic() + 150
        while "step " not in log.read_text():  # training has started
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "no training step logged in 150 s"
            time.sleep(0.5)
        time.sleep(2.0)
        proc.send_signal(sig)
        return proc.wait(timeout=90)
    finally:
        _stop(proc)


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if text.encode() in f.read():
                        found.append(int(entry))
            except OSError:
                continue
    return found


@pytest.mark.timeout(200)
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc to find leftover workers")
def test_demo_sigterm_to_the_launcher_stops_torchrun_too(tmp_path):
    # torchrun runs in a session of its own: a SIGTERM to the launcher (kill, timeout, a CI
    # runner) used to leave it and its workers training unseen.
    out = tmp_path / "demo"
    log = tmp_path / "first.log"
    rc = _start_and_signal(out, log, signal.SIGTERM)
    assert rc == 128 + signal.SIGTERM, log.read_text()[-3000:]
    assert len(sorted((out / "checkpoint").glob("checkpoint-*"))) == 1
    assert not (out / "summary.json").exists()
    assert _processes_mentioning(str(out)) == []


@pytest.mark.timeout(300)
def test_demo_ctrl_c_checkpoints_and_resumes(tmp_path):
    out = tmp_path / "demo"
    log = tmp_path / "first.log"
    rc = _start_and_signal(out, log, signal.SIGINT)
    first = log.read_text()
    assert rc == 130, first[-3000:]
    assert "run the same command again to resume" in first
    ckpts = sorted((out / "checkpoint").glob("checkpoint-*"))
    assert len(ckpts) == 1
    assert not (out / "summary.json").exists()  # it did not finish

    res = _run(_demo_cmd(out, 0.3, "--no-plot"), timeout=200)
    assert res.returncode == 0, res.stdout[-3000:]
    assert "resuming after" in res.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["restarts"] == 1
    elapsed = [row[0] for row in summary["history"]]
    steps = [row[1] for row in summary["history"]]
    assert elapsed == sorted(elapsed) and steps == sorted(steps)  # continued, not restarted
    assert 18 <= summary["elapsed_s"] < 18 + 30  # one budget over both runs


def test_a_signal_after_the_job_finished_is_not_an_interruption(tmp_path, monkeypatch, capsys):
    # The launcher's logic alone, around a stand-in for torchrun that finishes (writes the
    # summary) and then lingers: a Ctrl-C in that window must not read as an interruption.
    import argparse
    import threading

    from adaptrain.cli import demo

    out = tmp_path / "demo"
    ready = tmp_path / "ready"
    worker = (
        "import pathlib, signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))\n"
        f"pathlib.Path({str(out / 'summary.json')!r}).write_text('{{}}')\n"
        f"pathlib.Path({str(ready)!r}).write_text('')\n"
        "time.sleep(30)\n"
    )
    monkeypatch.setattr(demo, "_worker_command", lambda args: [sys.executable, "-c", worker])

    def interrupt():
        deadline = time.monotonic() + 30
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)

    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    args = parser.parse_args(["--out", str(out), "--minutes", "0.1"])
    threading.Thread(target=interrupt, daemon=True).start()
    assert demo.run(args) == 0
    assert "the job had finished" in capsys.readouterr().err
