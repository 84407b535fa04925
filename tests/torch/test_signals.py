"""SIGINT/SIGTERM: all replicas agree on the stop step, checkpoint once, exit 143/130."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from adaptrain.dist import signals
from adaptrain.dist.spawn import spawn

SCRIPT = str(Path(__file__).with_name("_elastic_train.py"))


def _agree(rank: int, world_size: int, signal_rank: int, signal_step: int) -> int:
    signals.reset()
    assert signals.install()
    period = signals.POLL_PERIOD
    signals.POLL_PERIOD = 0.0  # every step polls, as with steps slower than the period
    try:
        for step in range(50):
            if rank == signal_rank and step == signal_step:
                os.kill(os.getpid(), signal.SIGTERM)
            agreed = signals.poll_stop()
            if agreed:
                return step * 1000 + agreed
        return -1
    finally:
        signals.POLL_PERIOD = period
        signals.reset()


def test_all_replicas_stop_at_the_same_step() -> None:
    # Rank 2 alone gets SIGTERM at step 4 just before its poll; the flag travels in the
    # allreduce started by that poll and everybody reads it at the poll of step 5.
    assert spawn(_agree, 3, args=(2, 4), timeout=120) == [5000 + signal.SIGTERM] * 3


def _agree_fast(rank: int, world_size: int, signal_rank: int, signal_step: int) -> tuple:
    """2 ms steps: far faster than the poll period, so most steps skip the allreduce."""
    import time

    signals.reset()
    assert signals.install()
    reduces = 0
    all_reduce = signals.dist.all_reduce

    def counting(*args, **kwargs):
        nonlocal reduces
        reduces += 1
        return all_reduce(*args, **kwargs)

    signals.dist.all_reduce = counting
    try:
        for step in range(600):
            time.sleep(0.002 * (1 + rank))  # replicas of different speeds still agree
            if rank == signal_rank and step == signal_step:
                os.kill(os.getpid(), signal.SIGTERM)
            agreed = signals.poll_stop()
            if agreed:
                return step, agreed, reduces
        return -1, 0, reduces
    finally:
        signals.dist.all_reduce = all_reduce
        signals.reset()


def test_fast_steps_poll_every_few_steps_and_all_stop_at_the_same_step() -> None:
    out = spawn(_agree_fast, 2, args=(1, 100), timeout=120)
    steps = {step for step, _, _ in out}
    assert len(steps) == 1, out  # the same step on every replica
    (stop,) = steps
    assert all(agreed == signal.SIGTERM for _, agreed, _ in out)
    # Within two poll intervals (each at most MAX_POLL_STEPS steps) after the signal...
    assert 100 < stop <= 100 + 2 * signals.MAX_POLL_STEPS + 1, stop
    # ...and the allreduce ran on a fraction of the steps (every step before this change).
    assert all(reduces < stop / 3 for _, _, reduces in out), out


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ADAPTRAIN_", "RANK"))}
    env.pop("WORLD_SIZE", None)
    env.pop("MASTER_PORT", None)
    env["ADAPTRAIN_CHECKPOINT_PATH"] = str(tmp_path)
    return env


def test_sigint_checkpoints_once_and_exits_130(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    p = subprocess.run(
        [
            sys.executable,
            SCRIPT,
            "--out",
            str(out),
            "--tag",
            "s",
            "--stop-after",
            "3",
            "--signal",
            "SIGINT",
            "--epochs",
            "1",
        ],
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 130, p.stdout + p.stderr
    assert sorted(x.name for x in tmp_path.iterdir()) == ["checkpoint-000000", "out"]
    # Stopped two micro-batches later: 4 recorded steps.
    assert len((out / "s-rank0.jsonl").read_text().splitlines()) == 4


def test_second_signal_forces_exit(tmp_path: Path) -> None:
    code = textwrap.dedent(
        """
        import os, signal, time
        from adaptrain.dist import signals
        signals.install()
        os.kill(os.getpid(), signal.SIGTERM)   # graceful request: recorded only
        assert signals.exit_flag() == signal.SIGTERM
        print("still alive", flush=True)
        os.kill(os.getpid(), signal.SIGTERM)   # second one: default action
        time.sleep(30)
        print("not reached", flush=True)
        """
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "still alive" in p.stdout and "not reached" not in p.stdout
    assert p.returncode == -signal.SIGTERM
