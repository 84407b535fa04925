"""``adaptrain demo``'s options and its ``--out``: bad values refused before torchrun starts, a
second demo on a held ``--out`` refused, plain log lines off a terminal, ``--no-plot``, and a
``--fresh`` run that leaves no TensorBoard events of the earlier one.

Real processes (launcher → torchrun → replicas); one replica and a short budget keep each run to
a few seconds of training.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    return env


def _demo(out: Path, *extra: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``adaptrain demo`` on one replica, stdout and stderr captured (pipes: not a terminal)."""
    cmd = [
        sys.executable,
        "-m",  # what the `adaptrain` script runs
        "adaptrain",
        "demo",
        "--out",
        str(out),
        "--replicas",
        "1",
        "--max-chars",
        "60000",
        "--no-plot",
        *extra,
    ]
    # bytes, decoded below: text mode would turn a bar's "\r" into "\n" and hide it
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the launcher stops its torchrun (own session) too
        try:
            stdout, stderr = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)  # a second signal kills the tree
            stdout, stderr = proc.communicate(timeout=30)
        pytest.fail(
            f"adaptrain demo {extra} still ran after {timeout} s: "
            f"{stdout.decode(errors='replace')[-2000:]}"
        )
    stdout, stderr = stdout.decode(errors="replace"), stderr.decode(errors="replace")
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--minutes", "nan"),  # trained forever: `elapsed >= nan` is never true
        ("--minutes", "inf"),
        ("--batch-size", "0"),  # these three ended in a traceback from every replica
        ("--max-batch-size", "16"),  # below the initial --batch-size 32
        ("--max-chars", "1000"),  # no validation window
    ],
)
@pytest.mark.timeout(180)
def test_demo_rejects_bad_values_before_starting_torchrun(tmp_path, flag, value):
    res = _demo(tmp_path / "out", "--minutes", "0.02", "--no-bar", flag, value, timeout=60)
    assert res.returncode == 2, (res.stdout + res.stderr)[-3000:]
    assert res.stderr.startswith("adaptrain demo: ") and f"{flag}={value}" in res.stderr
    assert "Traceback" not in res.stdout + res.stderr
    assert not (tmp_path / "out" / "summary.json").exists()


@pytest.mark.timeout(300)
@pytest.mark.skipif(sys.platform == "win32", reason="POSIX file locks")
def test_a_held_out_is_refused_then_a_logged_run_and_a_fresh_run(tmp_path):
    """One ``--out`` through three launches (each costs seconds of process start-up, so the
    three checks share them): a second demo on a held ``--out`` is refused; once the lock is
    released a run logs plain lines when its output is not a terminal; a ``--fresh`` run
    hides the first run's TensorBoard events."""
    import fcntl

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # an --out with a space in its path
    out = tmp_path / "with space" / "demo"
    out.mkdir(parents=True)
    # 1. What a running demo holds: the launcher's lock on out/.lock.
    with open(out / ".lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        res = _demo(out, "--minutes", "0.03", "--no-bar", timeout=90)
    assert res.returncode == 2, (res.stdout + res.stderr)[-3000:]
    assert "another adaptrain demo is running" in res.stderr and str(out) in res.stderr
    assert not list((out / "checkpoint").glob("checkpoint-*"))
    assert not (out / "summary.json").exists()

    # 2. Once the lock is released the demo runs (and releases the lock itself at the end).
    # One replica, --no-plot, stderr a pipe and no --no-bar: log lines, not a bar.
    first = _demo(out, "--minutes", "0.03")
    both = first.stdout + first.stderr
    assert first.returncode == 0, both[-3000:]
    with open(out / ".lock", "w") as again:
        fcntl.flock(again, fcntl.LOCK_EX | fcntl.LOCK_NB)
    assert "\r" not in both  # no bar redrawn into a log
    assert "] epoch 0 step " in first.stdout  # the plain progress lines instead
    summary_txt = (out / "summary.txt").read_text()
    assert summary_txt in first.stdout
    assert "demo.png" not in summary_txt and not (out / "demo.png").exists()  # --no-plot
    assert f"{out / 'summary.json'}, {out / 'tensorboard'}" in summary_txt
    assert json.loads((out / "summary.json").read_text())["replicas"] == 1

    # 3. A fresh run on the same --out: only its own TensorBoard records are left.
    second = _demo(out, "--minutes", "0.03", "--no-bar", "--fresh")
    assert second.returncode == 0, (second.stdout + second.stderr)[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["restarts"] == 0 and len(summary["history"]) >= 1
    ea = EventAccumulator(str(out / "tensorboard"))
    ea.Reload()
    steps = [e.step for e in ea.Scalars("demo/loss")]
    # only the second run's records: the first run's, at the same steps, were purged
    assert steps == [int(row[1]) for row in summary["history"]]
