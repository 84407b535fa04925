"""``adaptrain demo``'s last act: a kill while the plot and the summaries are written leaves each
output complete or absent, never truncated (the launcher reads a present ``summary.json`` as "the
job finished")."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from adaptrain.cli._demo_worker import HISTORY_FIELDS, plot, write_atomic


def test_write_atomic_replaces_the_file_whole(tmp_path):
    path = tmp_path / "summary.json"
    path.write_text("old")
    write_atomic(path, lambda tmp: tmp.write_text("new content"))
    assert path.read_text() == "new content"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]  # no temporary left


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "summary.txt"
    path.write_text("old")

    def half_then_fail(tmp: Path) -> None:
        with open(tmp, "w") as f:
            f.write("half of the new")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomic(path, half_then_fail)
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.txt"]


@pytest.mark.timeout(120)
def test_a_process_killed_while_writing_leaves_the_old_file(tmp_path):
    # A real process SIGKILLed half-way through an output (the demo's second Ctrl-C kills its
    # tree): the file readers see is the old one, whole, not the half written.
    path, ready = tmp_path / "summary.json", tmp_path / "ready"
    path.write_text('{"old": true}')
    code = textwrap.dedent(
        f"""
        import pathlib, time
        from adaptrain.cli._demo_worker import write_atomic

        def slow(tmp):
            with open(tmp, "w") as f:
                f.write('{{"new": ')
                f.flush()
                pathlib.Path({str(ready)!r}).write_text("")
                time.sleep(60)
                f.write("true}}")

        write_atomic(pathlib.Path({str(path)!r}), slow)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 90
        while not ready.exists():
            assert proc.poll() is None, f"the writer ended early ({proc.returncode})"
            assert time.monotonic() < deadline, "the writer never started writing"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert json.loads(path.read_text()) == {"old": True}


def test_the_plot_is_written_whole_and_replaces_the_old_one(tmp_path):
    # plot() reads the state's history and validations only (a DemoState would register a
    # checkpoint State in this process)
    state = SimpleNamespace(
        history=[tuple(float(i + j) for j in range(len(HISTORY_FIELDS))) for i in range(1, 6)],
        valid=[(3.0, 3, 2.5)],
    )
    path = tmp_path / "demo.png"
    path.write_bytes(b"not a png")
    plot(state, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo.png"]
