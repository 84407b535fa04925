"""A real ``adaptrain server`` on 127.0.0.1 for the service's tests: started in a process of
its own on a free port, with a temporary state directory, stopped (and every replica it
started checked gone) by the test that asked for it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "src")


class ServerProcess:
    def __init__(self, state_dir: str, args: list[str], env: dict | None = None) -> None:
        self.state_dir = state_dir
        self.args = args
        self.env = {**os.environ, "PYTHONPATH": SRC, **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.starts = 0
        self.log = ""

    def start(self, timeout: float = 30.0) -> ServerProcess:
        """Start (or start again, on the same state directory) and wait for its URL."""
        self.starts += 1
        self.log = f"{self.state_dir}-server-{self.starts}.log"
        out = open(self.log, "w")  # noqa: SIM115 - the child writes it
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "adaptrain", "server", "--port", "0", "--state-dir",
             self.state_dir, *self.args],
            stdout=out, stderr=subprocess.STDOUT, env=self.env, start_new_session=True,
        )  # fmt: skip
        out.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with open(self.log) as f:
                found = re.findall(r"listening on (http://\S+)", f.read())
            if found:
                self.url = found[-1]
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}: {self.text()}")
            time.sleep(0.1)
        raise RuntimeError(f"server did not start: {self.text()}")

    def text(self) -> str:
        with open(self.log) as f:
            return f.read()[-5000:]

    def cli(self, *args: str, timeout: float = 60.0, check: bool = True, cwd: str | None = None):
        env = {**self.env, "ADAPTRAIN_SERVER": self.url}
        proc = subprocess.run(
            [sys.executable, "-m", "adaptrain", *args], capture_output=True, text=True,
            env=env, timeout=timeout, cwd=cwd,
        )  # fmt: skip
        if check and proc.returncode != 0:
            raise AssertionError(f"adaptrain {' '.join(args)}: {proc.returncode}\n{proc.stderr}")
        return proc

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=120)


def replica_pids(state_dir: str) -> list[int]:
    """Launchers of this state directory's replicas still alive."""
    out = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info.get("cmdline") or []
        if "adaptrain.service.launcher" in cmd and any(state_dir in c for c in cmd):
            out.append(proc.pid)
    return out


@pytest.fixture
def server(tmp_path):
    started: list[ServerProcess] = []

    def make(*args: str, env: dict | None = None, state_dir: str | None = None) -> ServerProcess:
        srv = ServerProcess(state_dir or str(tmp_path / "state"), list(args), env)
        started.append(srv)
        return srv.start()

    yield make
    for srv in started:
        srv.kill(signal.SIGTERM)
    for srv in started:
        for pid in replica_pids(srv.state_dir):
            try:
                os.killpg(os.getpgid(pid), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
