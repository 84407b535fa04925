"""``adaptrain simulate``'s progress: a bar on a terminal, plain lines in a log.

Real processes replaying the Pollux artifact's traces (skipped where ``../shared/data/pollux``
is absent).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from _cli_cases import env as _env
from _cli_cases import finish as _finish
from _cli_cases import simulate_cmd as _simulate_cmd
from _cli_cases import traces as _traces


def _two_jobs(tmp_path: Path) -> Path:
    wl = tmp_path / "two.csv"
    wl.write_text(
        "name,time,application,num_replicas,batch_size\n"
        "cifar10-0,0,cifar10,2,256\n"
        "ncf-1,10,ncf,1,256\n"
    )
    return wl


@pytest.mark.timeout(120)
def test_simulate_off_a_terminal_writes_lines_not_a_bar(tmp_path, real_data):
    res = subprocess.run(
        _simulate_cmd(_traces(real_data), _two_jobs(tmp_path), "--policy", "waterfill"),
        env=_env(),
        capture_output=True,  # stderr a pipe, as in a log file; bytes: text mode reads \r as \n
        timeout=100,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert b"\r" not in res.stderr  # no bar redrawn into the log
    assert b"waterfill: finished 2/2 jobs" in res.stderr  # a plain line instead
    assert b"avg JCT" in res.stdout


@pytest.mark.timeout(120)
@pytest.mark.skipif(sys.platform == "win32", reason="needs a pseudo-terminal")
def test_simulate_on_a_terminal_still_draws_its_bar(tmp_path, real_data):
    import fcntl
    import pty
    import struct
    import termios

    primary, secondary = pty.openpty()
    # 24 x 100 characters (a new pseudo-terminal has 0 columns: tqdm would draw nothing)
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    proc = subprocess.Popen(
        _simulate_cmd(_traces(real_data), _two_jobs(tmp_path), "--policy", "waterfill"),
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=secondary,
    )
    os.close(secondary)
    err = b""
    try:
        while True:
            try:
                chunk = os.read(primary, 4096)
            except OSError:  # EIO: the terminal's last writer closed it
                break
            if not chunk:
                break
            err += chunk
        stdout, _ = proc.communicate(timeout=60)
    finally:
        os.close(primary)
        _finish(proc)
    assert proc.returncode == 0, err[-3000:]
    assert b"\r" in err and b"sim-s" in err  # tqdm's bar
    assert b"finished 2/2 jobs" not in err and b"avg JCT" in stdout
