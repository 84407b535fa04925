"""Review (session 21) of the two commands: Ctrl-C in ``adaptrain simulate``, a simulation's
progress in a log, and a demo interrupted in (or rerun into) its final validation. (The budget
a finished demo reports is checked by ``tests/test_demo.py::test_demo_end_to_end``'s rerun.)

Real processes throughout. The simulations replay the Pollux artifact's traces (skipped where
``../shared/data/pollux`` is absent); the demos run one replica with budgets of about a second.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

POLLUX = Path(__file__).resolve().parents[2] / "shared" / "data" / "pollux"
needs_traces = pytest.mark.skipif(
    not (POLLUX / "traces").is_dir(), reason="the Pollux artifact's traces are not present"
)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    return env


def _sigint_default() -> None:
    # As in a terminal: a test run started as a background job inherits SIGINT ignored, and
    # Python then installs no Ctrl-C handler.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _wait_for(proc: subprocess.Popen, log: Path, pattern: str, timeout: float = 90) -> str:
    """The text of ``log`` once it matches ``pattern`` (the process still running)."""
    deadline = time.monotonic() + timeout
    while True:
        text = log.read_text()
        if re.search(pattern, text):
            return text
        assert proc.poll() is None, f"ended ({proc.returncode}) before {pattern!r}: {text[-3000:]}"
        assert time.monotonic() < deadline, f"no {pattern!r} in {timeout} s: {text[-3000:]}"
        time.sleep(0.05)


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


def _finish(proc: subprocess.Popen) -> None:
    """Make sure ``proc`` (and, for a demo, its torchrun tree) is gone."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)  # the demo's second Ctrl-C kills its tree
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


# ----- adaptrain simulate ----------------------------------------------------------------------


def _simulate_cmd(workload: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "adaptrain",
        "simulate",
        str(workload),
        "--traces",
        str(POLLUX / "traces"),
        *extra,
    ]


def _two_jobs(tmp_path: Path) -> Path:
    wl = tmp_path / "two.csv"
    wl.write_text(
        "name,time,application,num_replicas,batch_size\n"
        "cifar10-0,0,cifar10,2,256\n"
        "ncf-1,10,ncf,1,256\n"
    )
    return wl


@needs_traces
@pytest.mark.timeout(120)
def test_simulate_off_a_terminal_writes_lines_not_a_bar(tmp_path):
    res = subprocess.run(
        _simulate_cmd(_two_jobs(tmp_path), "--policy", "waterfill"),
        env=_env(),
        capture_output=True,  # stderr a pipe, as in a log file; bytes: text mode reads \r as \n
        timeout=100,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert b"\r" not in res.stderr  # no bar redrawn into the log
    assert b"waterfill: finished 2/2 jobs" in res.stderr  # a plain line instead
    assert b"avg JCT" in res.stdout


@needs_traces
@pytest.mark.timeout(120)
@pytest.mark.skipif(sys.platform == "win32", reason="needs a pseudo-terminal")
def test_simulate_on_a_terminal_still_draws_its_bar(tmp_path):
    import fcntl
    import pty
    import struct
    import termios

    primary, secondary = pty.openpty()
    # 24 x 100 characters (a new pseudo-terminal has 0 columns: tqdm would draw nothing)
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    proc = subprocess.Popen(
        _simulate_cmd(_two_jobs(tmp_path), "--policy", "waterfill"),
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


@needs_traces
@pytest.mark.timeout(120)
def test_simulate_ctrl_c_exits_130_with_one_line_and_no_traceback(tmp_path):
    err = tmp_path / "stderr.txt"
    with open(err, "w") as f:
        proc = subprocess.Popen(
            # 160 jobs: minutes of simulation on two cores
            _simulate_cmd(POLLUX / "workloads" / "workload-6.csv", "--policy", "waterfill"),
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=f,
            text=True,
            preexec_fn=_sigint_default,
        )
    try:
        _wait_for(proc, err, r"waterfill")  # simulating
        # in the simulation's first rounds; the interrupts that once ended otherwise here (in
        # the fit worker's start, in an import that runs source text, in the claims' lock)
        # have tests of their own, each at its exact point (session 59)
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

def interrupted_in_source_text(args, where):
    # as a Ctrl-C that lands in an import which runs source text (scipy's, numpy's)
    exec("raise KeyboardInterrupt")

simulate._run = interrupted_in_source_text
sys.exit(main(["simulate", "w.csv", "--traces", "."]))
"""


@pytest.mark.timeout(60)
def test_simulate_ctrl_c_in_source_text_still_exits_130_under_python_m(tmp_path):
    # CPython notes a KeyboardInterrupt that ends code run from a string, even one caught
    # later, and `python -m` then exits by SIGINT whatever status the program chose: 2 of
    # session 58's 170 interrupts early in a run ended so, after the message (session 59).
    (tmp_path / "interrupted_cli.py").write_text(_EXEC_INTERRUPTED)
    env = _env()
    src = str(Path(__file__).resolve().parents[1] / "src")
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


# ----- adaptrain demo --------------------------------------------------------------------------


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
