"""``adaptrain demo`` interrupted in, or rerun into, its final validation.

Real processes (launcher -> torchrun -> one replica) with budgets of about a second.
(The budget a finished demo reports is checked by ``test_demo.py::test_demo_end_to_end``'s
rerun.)
"""

from __future__ import annotations

import json
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
from _cli_cases import wait_for as _wait_for


def _interrupt_demo_at(
    proc: subprocess.Popen, log: Path, pattern: str, delay: float = 0.0
) -> tuple[int, str]:
    """Ctrl-C the demo ``delay`` s after ``log`` matches ``pattern``; its exit status and log."""
    try:
        _wait_for(proc, log, pattern, 120)
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=60)
    finally:
        _finish(proc)
    return rc, log.read_text()


def _demo_cmd(out: Path, minutes: float, *extra: str, max_chars: int = 60_000) -> list[str]:
    return [
        sys.executable,
        "-m",
        "adaptrain",
        "demo",
        "--out",
        str(out),
        "--replicas",
        "1",
        "--minutes",
        str(minutes),
        "--max-chars",
        str(max_chars),
        "--no-plot",
        "--no-bar",
        *extra,
    ]


def _demo(out: Path, minutes: float, **kw) -> subprocess.CompletedProcess:
    """A demo run to its end, stdout and stderr captured."""
    return subprocess.run(
        _demo_cmd(out, minutes, **kw), env=_env(), capture_output=True, text=True, timeout=150
    )


def _start_demo(out: Path, log: Path, minutes: float, **kw) -> subprocess.Popen:
    with open(log, "w") as f:
        return subprocess.Popen(
            _demo_cmd(out, minutes, **kw),
            env=_env(),
            stdout=f,
            stderr=subprocess.STDOUT,
            preexec_fn=_sigint_default,
        )


def _summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


@pytest.mark.timeout(240)
def test_ctrl_c_in_the_final_validation_is_resumed_by_the_rerun(tmp_path, monkeypatch):
    out, log = tmp_path / "demo", tmp_path / "first.log"
    # 5% of 12M characters: a final validation of a few seconds, the window for the Ctrl-C
    big = 12_000_000
    proc = _start_demo(out, log, 0.02, max_chars=big)
    rc, first = _interrupt_demo_at(
        proc, log, r"training budget spent after \d+ steps: final validation"
    )
    assert rc == 130, first[-3000:]
    assert "bits/char" not in first  # interrupted in the validation, before its result
    assert "run the same command again to resume" in first
    assert not (out / "summary.json").exists()
    steps = int(re.search(r"training budget spent after (\d+) steps", first).group(1))

    res = _demo(out, 0.02, max_chars=big)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    summary = _summary(out)
    assert summary["steps"] == steps  # no further training
    assert len(summary["valid"]) == 1 and summary["valid"][0][1] == steps
    bpc = summary["valid"][0][2]
    assert f"validation {bpc:.3f} bits/char after {steps} steps" in res.stdout
    assert "validation " in (out / "summary.txt").read_text()
    # The resumed pass kept the sums of the part done before the Ctrl-C: the same value as one
    # uninterrupted pass of the checkpointed model over the whole split.
    assert bpc == pytest.approx(_validation_bpc(out, big, monkeypatch), rel=1e-9)


def _validation_bpc(out: Path, max_chars: int, monkeypatch) -> float:
    """Bits/char of the model in ``out``'s checkpoint on the demo's whole validation split."""
    import math

    import torch

    from adaptrain import checkpoint
    from adaptrain.workloads import CharLM, charlm_datasets, charlm_loss

    class Weights(checkpoint.State):
        def __init__(self) -> None:
            super().__init__("adaptdl-dataparallel")  # AdaptiveDataParallel's state
            self.model = None

        def save(self, fileobj) -> None:
            raise AssertionError("read only")

        def load(self, fileobj) -> None:
            self.model = torch.load(fileobj, weights_only=True, map_location="cpu")["model"]

    monkeypatch.setenv("ADAPTRAIN_CHECKPOINT_PATH", str(out / "checkpoint"))
    checkpoint.reset()
    try:
        weights = Weights()
        assert checkpoint.load_state(weights)
    finally:
        checkpoint.reset()
    model = CharLM(hidden=128, seed=0)  # the worker's model
    model.load_state_dict(weights.model)
    model.eval()
    _, valid = charlm_datasets(64, max_chars, valid_fraction=0.05, cache_dir=out / "cache")
    loss_sum = chars = 0.0
    with torch.no_grad():  # the worker's batches (256 windows) and order of summation
        for batch in torch.utils.data.DataLoader(valid, batch_size=256):
            loss_sum += charlm_loss(model, batch).item() * batch[1].numel()
            chars += batch[1].numel()
    return loss_sum / chars / math.log(2)


@pytest.mark.timeout(240)
def test_a_rerun_with_the_budget_spent_validates_before_it_finishes(tmp_path):
    # A checkpoint whose budget is spent without a final validation (here: Ctrl-C in the
    # first epoch, rerun with a budget below the time trained) used to end as a finished job
    # with no validation at all.
    out, log = tmp_path / "demo", tmp_path / "first.log"
    proc = _start_demo(out, log, 0.3, max_chars=2_000_000)  # epochs of tens of seconds
    rc, first = _interrupt_demo_at(proc, log, r"\] epoch 0 step ", delay=1.0)
    assert rc == 130, first[-3000:]
    assert "bits/char" not in first  # still in the first epoch: no validation yet

    res = _demo(out, 0.001, max_chars=2_000_000)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    steps = int(re.search(r"resuming after \S+ of training \((\d+) steps", res.stdout).group(1))
    summary = _summary(out)
    assert summary["steps"] == steps  # trained no further
    assert [int(v[1]) for v in summary["valid"]] == [steps]  # but validated the final model
    assert "validation " in (out / "summary.txt").read_text()
