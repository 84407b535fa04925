"""Ctrl-C in ``adaptrain simulate``: exit status 130, one line, no traceback, nothing written.

Real processes replaying the Pollux artifact's traces (skipped where ``../shared/data/pollux``
is absent).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _cli_cases import env as _env
from _cli_cases import finish as _finish
from _cli_cases import sigint_default as _sigint_default
from _cli_cases import simulate_cmd as _simulate_cmd
from _cli_cases import traces as _traces
from _cli_cases import wait_for as _wait_for


@pytest.mark.timeout(120)
def test_simulate_ctrl_c_exits_130_with_one_line_and_no_traceback(tmp_path, real_data):
    err = tmp_path / "stderr.txt"
    with open(err, "w") as f:
        proc = subprocess.Popen(
            # 160 jobs: minutes of simulation on two cores
            _simulate_cmd(
                _traces(real_data),
                Path(real_data) / "workloads" / "workload-6.csv",
                "--policy",
                "waterfill",
            ),
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=f,
            text=True,
            preexec_fn=_sigint_default,
        )
    try:
        _wait_for(proc, err, r"waterfill")  # simulating
        # in the simulation's first rounds; interrupts at exact points (in the fit workers'
        # start, in an import that runs source text, in the claims' lock) have tests of their own
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        stdout, _ = proc.communicate(timeout=30)
    finally:
        _finish(proc)
    text = err.read_text()
    assert proc.returncode == 130, text[-3000:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text
    last = text.strip().splitlines()[-1]
    assert re.fullmatch(
        r"adaptrain simulate: interrupted while simulating waterfill \(policy 1 of 1\) at "
        r"\d+ s simulated time, \d+ of 160 jobs finished; nothing was written",
        last,
    ), last
    assert stdout == ""  # no partial results


_EXEC_INTERRUPTED = """
import sys
from adaptrain.cli import main, simulate

def interrupted_in_source_text(args, where, check):
    # as a Ctrl-C that lands in an import which runs source text (scipy's, numpy's)
    exec("raise KeyboardInterrupt")

simulate._run = interrupted_in_source_text
sys.exit(main(["simulate", "w.csv", "--traces", "."]))
"""


@pytest.mark.timeout(60)
def test_simulate_ctrl_c_in_source_text_still_exits_130_under_python_m(tmp_path):
    # CPython notes a KeyboardInterrupt that ends code run from a string, even one caught
    # later, and `python -m` then exits by SIGINT whatever status the program chose (after the
    # message): an interrupt early in a run, in an import that runs source text, can end so.
    (tmp_path / "interrupted_cli.py").write_text(_EXEC_INTERRUPTED)
    env = _env()
    src = str(Path(__file__).resolve().parents[2] / "src")
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "interrupted_cli"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert proc.returncode == 130, (proc.returncode, proc.stderr[-3000:])
    assert proc.stderr.strip() == (
        "adaptrain simulate: interrupted before the simulation started; nothing was written"
    )
