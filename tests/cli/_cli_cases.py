"""Helpers shared by the CLI's process tests (a helper module, not a test module): the child's
environment, a terminal's Ctrl-C, waiting on a log, and making sure a process is gone."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path


def env() -> dict[str, str]:
    out = dict(os.environ)
    out["OMP_NUM_THREADS"] = "1"
    return out


def sigint_default() -> None:
    # As in a terminal: a test run started as a background job inherits SIGINT ignored, and
    # Python then installs no Ctrl-C handler.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def wait_for(proc: subprocess.Popen, log: Path, pattern: str, timeout: float = 90) -> str:
    """The text of ``log`` once it matches ``pattern`` (the process still running)."""
    deadline = time.monotonic() + timeout
    while True:
        text = log.read_text()
        if re.search(pattern, text):
            return text
        assert proc.poll() is None, f"ended ({proc.returncode}) before {pattern!r}: {text[-3000:]}"
        assert time.monotonic() < deadline, f"no {pattern!r} in {timeout} s: {text[-3000:]}"
        time.sleep(0.05)


def finish(proc: subprocess.Popen) -> None:
    """Make sure ``proc`` is gone: a Ctrl-C, a second one (the demo's kills its torchrun
    tree), then SIGKILL."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def traces(real_data: str) -> str:
    """The folder of the artifact's traces."""
    return os.path.join(real_data, "traces")


def simulate_cmd(traces_dir: str, workload: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "adaptrain", "simulate", str(workload), "--traces", traces_dir,
            *extra]  # fmt: skip
