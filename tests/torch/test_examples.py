"""The examples run end to end for a few steps: one process, and the tutorial under torchrun.

The tutorial's steps run as ``__main__`` in processes forked from a server with torch
imported (:func:`adaptrain.dist.spawn.spawn`); the other examples run as commands.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from adaptrain.dist.spawn import free_port, spawn

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
TIMEOUT = 240


_RENDEZVOUS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")


def _launcher_set(key: str) -> bool:
    """Whether ``key`` is a variable a launcher sets (a script run from a shell sees none)."""
    return key in _RENDEZVOUS or key.startswith("ADAPTRAIN_")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not _launcher_set(k)}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _run(cmd: list[str]) -> str:
    p = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=TIMEOUT, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout


def _run_script(rank: int, world_size: int, path: str, argv: list[str]) -> str:
    """Run ``path`` as ``__main__`` with ``argv`` in a standalone environment (no rendezvous
    or ``ADAPTRAIN_*`` variables, as ``python path ...`` from a shell, except that the script's
    folder is not put first on ``sys.path``: the tutorial's steps import nothing from it); its
    stdout."""
    import contextlib
    import io
    import runpy

    for key in [k for k in os.environ if _launcher_set(k)]:
        del os.environ[key]
    sys.argv = [path, *argv]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        runpy.run_path(path, run_name="__main__")
    return buf.getvalue()


@pytest.mark.parametrize("step", range(6))
def test_digits_tutorial_step(step: int) -> None:
    # Each step in a fresh process forked from the test run's fork server, which has torch
    # imported: the script itself runs as from a shell, without 5 s of imports per step (the
    # command line and torchrun paths are the other tests' here).
    path = str(EXAMPLES / "digits" / f"step_{step}.py")
    (out,) = spawn(
        _run_script,
        1,
        args=(path, ["--epochs", "1", "--max-steps", "3"]),
        init=False,
        env={"OMP_NUM_THREADS": "1"},
        preload=["sklearn.datasets"],
        timeout=TIMEOUT,
    )
    assert "Test set: Average loss" in out
    if step == 5:
        assert "[evaluated 359 samples]" in out  # exact count from the Accumulator


def test_digits_step_5_under_torchrun() -> None:
    out = _run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node=2",
            "--master-addr=127.0.0.1",
            f"--master-port={free_port()}",
            str(EXAMPLES / "digits" / "step_5.py"),
            "--epochs",
            "1",
            "--max-steps",
            "3",
        ]
    )
    # Printed once (rank 0), summed over both replicas: every test sample exactly once.
    assert out.count("[evaluated 359 samples]") == 1


def _charlm_args(tmp_path: Path, epochs: int, max_steps: int, *extra: str) -> list[str]:
    """A tiny char LM run of examples/charlm.py (20k characters, GRU 16)."""
    small = ["--max-chars", "20000", "--hidden", "16", "--seq-len", "32"]
    return [
        str(EXAMPLES / "charlm.py"),
        "--epochs",
        str(epochs),
        "--max-steps",
        str(max_steps),
        *small,
        "--cache-dir",
        str(tmp_path),
        *extra,
    ]


def test_charlm_example(tmp_path: Path) -> None:
    out = _run([sys.executable, *_charlm_args(tmp_path, 1, 4, "--log-interval", "1")])
    assert "epoch 0 step 3" in out and "bits/char" in out


_COUNTING = """
import os, runpy, signal, sys
import adaptrain.torch as adl
import adaptrain.workloads as w
orig, seen = w.charlm_loss, [0]
def loss(model, batch):  # count the training steps per epoch; SIGTERM ourselves at KILL_AT
    if model.training:
        seen[0] += 1
        print(f"TRAINSTEP epoch={adl.current_epoch()}", flush=True)
        if seen[0] == int(os.environ.get("KILL_AT", "0")):
            os.kill(os.getpid(), signal.SIGTERM)
    return orig(model, batch)
w.charlm_loss = loss
sys.argv = ["charlm.py", *sys.argv[1:]]
runpy.run_path(sys.argv.pop(1), run_name="__main__")
"""


def test_charlm_max_steps_hold_across_a_restart(tmp_path: Path) -> None:
    wrapper = tmp_path / "count.py"
    wrapper.write_text(_COUNTING)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    cmd = [
        sys.executable,
        str(wrapper),
        *_charlm_args(tmp_path, 2, 6, "--batch-size", "8", "--log-interval", "1000"),
    ]
    logs = []
    for kill_at in ("3", "0"):  # the first run stops in epoch 0 after 3 steps, the rerun ends
        env = dict(_env(), ADAPTRAIN_CHECKPOINT_PATH=str(ckpt), KILL_AT=kill_at)
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT, cwd=ROOT)
        logs.append(p.stdout)
        assert p.returncode == (143 if kill_at == "3" else 0), p.stdout[-2000:] + p.stderr[-2000:]
    per_epoch = [sum(log.count(f"TRAINSTEP epoch={e}") for log in logs) for e in (0, 1)]
    assert per_epoch == [6, 6]  # epoch 0 split over the two runs (the old count gave 4 + 6)
