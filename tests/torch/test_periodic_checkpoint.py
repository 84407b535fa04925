"""Periodic checkpoints (``ADAPTRAIN_CHECKPOINT_INTERVAL``) survive a ``kill -9``.

A real 2-replica gloo job (``_supervised_train.py``: the digits MLP with adaptive batch size)
checkpoints every second; rank 0, the replica that writes, is killed with SIGKILL at a moment
that does not line up with the checkpoints (possibly in the middle of a background write). The
other replica must end by itself within seconds (its peer vanished: gloo's next collective
fails), the checkpoint folder must hold a complete checkpoint, and a restarted job must resume
from the newest one, at a step boundary of the killed run, having lost at most about one
interval of training.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from _supervised_train import replica_env

from adaptrain.dist.checkpoint import latest_checkpoint

pytestmark = pytest.mark.slow

SCRIPT = str(Path(__file__).with_name("_supervised_train.py"))
INTERVAL = 1.0


def _launch(
    out: Path, ckpt: Path, tag: str, replicas: int, seconds: float, interval: float | None
) -> list[subprocess.Popen]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(replicas):
        e = replica_env(
            port,
            replicas,
            rank,
            ADAPTRAIN_CHECKPOINT_PATH=str(ckpt),
        )
        if interval is not None:
            e["ADAPTRAIN_CHECKPOINT_INTERVAL"] = str(interval)
        cmd = [sys.executable, SCRIPT, "--out", str(out), "--tag", tag, "--seconds", str(seconds)]
        with open(out / f"{tag}-{rank}.err", "w") as err:
            procs.append(subprocess.Popen(cmd, env=e, stderr=err, stdout=subprocess.DEVNULL))
    return procs


def _records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    with open(path) as f:
        lines = [line for line in f if line.endswith("\n")]  # a torn last line is no record
    return [r for r in map(json.loads, lines) if "pos" in r]


def _kill_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_a_job_killed_with_sigkill_resumes_from_its_last_periodic_checkpoint(
    tmp_path: Path,
) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    first = _launch(tmp_path, ckpt, "a", 2, seconds=120.0, interval=INTERVAL)
    try:
        deadline = time.monotonic() + 120
        while True:  # 3.7 s of training: three periodic checkpoints, 0.7 s into the next
            steps = _records(tmp_path / "a-rank0.jsonl")
            if steps and steps[-1]["t"] - steps[0]["t"] >= 3 * INTERVAL + 0.7:
                break
            assert time.monotonic() < deadline and all(p.poll() is None for p in first)
            time.sleep(0.02)
        os.kill(first[0].pid, signal.SIGKILL)
        killed = time.monotonic()
        assert first[0].wait(10) == -signal.SIGKILL
        code = first[1].wait(30)  # its peer vanished: the next collective fails
        took = time.monotonic() - killed
    finally:
        _kill_all(first)
    assert code != 0 and took < 10.0, (code, took)
    latest = latest_checkpoint(str(ckpt))
    assert latest is not None and (Path(latest) / "MANIFEST.json").exists()
    assert int(latest.rsplit("-", 1)[1]) >= 1  # several periodic checkpoints were published

    second = _launch(tmp_path, ckpt, "b", 2, seconds=1.0, interval=INTERVAL)
    try:
        codes = [p.wait(120) for p in second]
    finally:
        _kill_all(second)
    assert codes == [0, 0], (tmp_path / "b-0.err").read_text()[-3000:]

    before = _records(tmp_path / "a-rank0.jsonl")
    after = _records(tmp_path / "b-rank0.jsonl")
    resume = after[0]["pos"]
    assert resume > 0  # from a checkpoint, not from scratch
    # At a step boundary of the killed run: the samples before it are not trained again.
    reached = [r for r in before if r["pos"] == resume]
    assert reached, resume
    lost_seconds = before[-1]["t"] - reached[0]["t"]
    lost_samples = before[-1]["pos"] + before[-1]["n"] * 2 - resume  # two replicas
    trained = before[-1]["pos"] + before[-1]["n"] * 2
    # At most one interval, plus a poll period, a step and the write before the rename.
    assert 0 <= lost_seconds <= INTERVAL + 0.5, (lost_seconds, lost_samples, trained)
    print(
        f"kill -9 at {before[-1]['t'] - before[0]['t']:.2f} s of training: resumed from sample "
        f"{resume}, lost {lost_samples} of {trained} samples ({lost_seconds:.2f} s); the peer "
        f"ended {took:.2f} s after the kill"
    )


def test_no_periodic_checkpoint_without_an_interval(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    procs = _launch(tmp_path, ckpt, "a", 1, seconds=2.5, interval=None)
    try:
        assert procs[0].wait(120) == 0, (tmp_path / "a-0.err").read_text()[-3000:]
    finally:
        _kill_all(procs)
    assert len(_records(tmp_path / "a-rank0.jsonl")) > 100
    assert latest_checkpoint(str(ckpt)) is None  # standalone: only a stop checkpoints
