"""No orphans: every process that ``adaptrain simulate`` and ``adaptrain demo`` start ends with
them, whether they are stopped by SIGTERM, SIGINT or SIGKILL.

Each test starts the real command, waits until its whole tree is running (the simulator's fit
worker and multiprocessing's resource tracker; the demo's torchrun agent and replicas), records
that tree, sends the signal to the command's own process only, and asserts that no process of
the recorded tree is alive 10 s later.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

psutil = pytest.importorskip("psutil")

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the process trees are checked on Linux"
)

#: Seconds within which the whole tree must be gone after the signal.
GRACE = 10.0

SIGNALS = [
    pytest.param(signal.SIGTERM, id="SIGTERM"),
    pytest.param(signal.SIGINT, id="SIGINT"),
    pytest.param(signal.SIGKILL, id="SIGKILL"),
]


def _sigint_default() -> None:
    # As in a terminal: a test run started as a background job inherits SIGINT ignored, and
    # Python then installs no Ctrl-C handler.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    return env


def _cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return ""


def _tree(pid: int) -> list[psutil.Process]:
    """``pid`` and every process below it (empty once it has gone)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _wait_for_tree(
    proc: subprocess.Popen,
    ready: Callable[[list[psutil.Process]], bool],
    log: Path,
    timeout: float,
) -> list[psutil.Process]:
    """The tree of ``proc`` once ``ready(tree)`` holds (the command still running)."""
    deadline = time.monotonic() + timeout
    while True:
        tree = _tree(proc.pid)
        if tree and ready(tree):
            return tree
        if proc.poll() is not None:
            pytest.fail(f"ended ({proc.returncode}) too early: {log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            found = [_cmdline(p)[:160] for p in tree]
            pytest.fail(f"tree not ready in {timeout} s: {found}; {log.read_text()[-3000:]}")
        time.sleep(0.1)


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def _survivors(proc: subprocess.Popen, tree: list[psutil.Process], grace: float) -> list[str]:
    """Wait up to ``grace`` seconds for every process of ``tree`` to end (``proc`` reaped);
    the command lines of those still alive then."""
    deadline = time.monotonic() + grace
    while True:
        if proc.poll() is None:
            try:
                proc.wait(timeout=0.1)
            except subprocess.TimeoutExpired:
                pass
        left = _alive(tree)
        if not left or time.monotonic() > deadline:
            return [f"{p.pid}: {_cmdline(p)[:200]}" for p in left]
        time.sleep(0.1)


def _kill_all(proc: subprocess.Popen, tree: list[psutil.Process]) -> None:
    """Whatever the test started and is still alive: SIGKILL, and reap the command."""
    for p in [*_tree(proc.pid), *tree]:
        try:
            p.kill()
        except psutil.Error:
            pass
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


# ----- adaptrain simulate ----------------------------------------------------------------------


def _is_fit_worker(p: psutil.Process) -> bool:
    return "spawn_main" in _cmdline(p)


def _is_resource_tracker(p: psutil.Process) -> bool:
    return "resource_tracker" in _cmdline(p)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("sig", SIGNALS)
def test_simulate_leaves_no_process_behind(real_data, tmp_path, sig):
    log = tmp_path / "stderr.txt"
    cmd = [
        sys.executable,
        "-m",
        "adaptrain",
        "simulate",
        os.path.join(real_data, "workloads", "workload-6.csv"),  # 160 jobs: minutes to simulate
        "--fit-workers",
        "1",
        "--policy",
        "waterfill",
        "--no-progress",
    ]
    with open(log, "w") as err:
        proc = subprocess.Popen(
            cmd,
            env=_env(),
            cwd=tmp_path,
            stdout=subprocess.DEVNULL,
            stderr=err,
            preexec_fn=_sigint_default,
        )
    tree: list[psutil.Process] = []
    try:
        tree = _wait_for_tree(
            proc,
            lambda t: any(map(_is_fit_worker, t)) and any(map(_is_resource_tracker, t)),
            log,
            timeout=120,
        )
        time.sleep(1.0)  # the worker under way
        tree = _tree(proc.pid)  # with anything started meanwhile
        assert len(tree) >= 3, [_cmdline(p) for p in tree]
        proc.send_signal(sig)
        left = _survivors(proc, tree, GRACE)
        assert left == [], f"alive {GRACE} s after {sig.name}: {left}"
        if sig == signal.SIGKILL:
            assert proc.returncode == -signal.SIGKILL
        else:  # stopped cleanly, with its one-line message
            text = log.read_text()
            assert proc.returncode == 128 + sig, text[-3000:]
            assert "Traceback" not in text, text[-3000:]
            assert "leaked" not in text, text[-3000:]  # the resource tracker had nothing left
            assert "adaptrain simulate: interrupted" in text, text[-3000:]
    finally:
        _kill_all(proc, tree)


# ----- adaptrain demo --------------------------------------------------------------------------


def _is_replica(p: psutil.Process) -> bool:
    """A replica (``python -m adaptrain.cli._demo_worker``), not torchrun (``python -m
    adaptrain.cli.demo ... -m adaptrain.cli._demo_worker``)."""
    try:
        argv = p.cmdline()
    except psutil.Error:
        return False
    return "adaptrain.cli._demo_worker" in argv and "adaptrain.cli.demo" not in argv


def _is_agent(p: psutil.Process) -> bool:
    try:
        return "adaptrain.cli.demo" in p.cmdline()
    except psutil.Error:
        return False


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "target, sig",
    [("launcher", signal.SIGKILL), ("launcher", signal.SIGTERM), ("torchrun", signal.SIGKILL)],
    ids=["SIGKILL", "SIGTERM", "torchrun-SIGKILL"],
)
def test_demo_leaves_no_process_behind(tmp_path, target, sig):
    """The signal goes to the launcher (``adaptrain demo``), or torchrun: the replicas end
    with torchrun, and the launcher then reports the stop."""
    pytest.importorskip("torch")
    out = tmp_path / "demo"
    log = tmp_path / "demo.log"
    cmd = [
        sys.executable,
        "-m",
        "adaptrain",
        "demo",
        "--out",
        str(out),
        "--replicas",
        "2",
        "--minutes",
        "10",  # never finishes within the test
        "--max-chars",
        "60000",
        "--no-plot",
        "--no-bar",
    ]
    with open(log, "w") as f:
        proc = subprocess.Popen(
            cmd, env=_env(), stdout=f, stderr=subprocess.STDOUT, preexec_fn=_sigint_default
        )
    tree: list[psutil.Process] = []
    try:
        tree = _wait_for_tree(
            proc, lambda t: sum(map(_is_replica, t)) == 2, log, timeout=120
        )  # the agent and its two replicas
        deadline = time.monotonic() + 120
        while not re.search(r"epoch \d+ step \d+", log.read_text()):  # training
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        tree = _tree(proc.pid)
        assert len(tree) >= 4, [_cmdline(p) for p in tree]  # launcher, torchrun, 2 replicas
        if target == "launcher":
            proc.send_signal(sig)
        else:
            (agent,) = [p for p in tree if _is_agent(p)]
            agent.send_signal(sig)
        left = _survivors(proc, tree, GRACE)
        assert left == [], f"alive {GRACE} s after {sig.name}: {left}; {log.read_text()[-2000:]}"
        if target == "torchrun":
            assert proc.returncode == 128 + signal.SIGKILL, log.read_text()[-3000:]
        elif sig == signal.SIGKILL:
            assert proc.returncode == -signal.SIGKILL
        else:
            assert proc.returncode == 128 + sig, log.read_text()[-3000:]
    finally:
        _kill_all(proc, tree)
