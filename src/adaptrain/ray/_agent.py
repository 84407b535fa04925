"""The node agent of the Ray backend: one small Ray actor per node that starts the node's
replicas as real processes and watches them.

The user's code never runs inside a Ray task or actor: the agent starts each replica under
:mod:`adaptrain.service.launcher` (its output appended to the replica's log file, its exit
status written to a status file, SIGTERM and SIGINT passed on to the command), in a process
session of its own, through a short-lived helper process so that the replica is not the
agent's child: Ray kills a worker's children when the worker exits, and a replica must end
through its launcher (a checkpoint on SIGTERM), not be killed under it. The launcher watches
the agent (``--server-pid``): when the agent goes (its node drained or lost, or the agent
killed) the replica gets SIGTERM within about a second, checkpoints and exits 143.

The agent is a detached actor: a server killed with ``kill -9`` leaves it and its replicas
running, and the server restarted on the same state directory finds it again by name and
re-adopts them. Each call from the server counts as its heartbeat; once the server has been
silent for the orphan timeout the agent stops its replicas (SIGTERM: they checkpoint), and once
nothing runs any more it exits, so nothing runs for ever unwatched.

This module is imported on every node of the cluster (the actor's class); it needs nothing of
Ray itself beyond the actor's runtime context, asked for lazily.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import psutil

from adaptrain.service.backend import LOST

logger = logging.getLogger(__name__)

__all__ = ["Agent", "Key"]

#: a replica: (job, restart group, rank)
Key = tuple[str, int, int]

#: the helper that starts the launcher and exits at once, so that the launcher is not a child of
#: the agent's Ray worker process (it writes the launcher's pid to the pipe named in argv[1])
_DETACH = (
    "import os, subprocess, sys\n"
    "p = subprocess.Popen(sys.argv[2:])\n"
    "os.write(int(sys.argv[1]), str(p.pid).encode())\n"
)

#: seconds a launcher waits after its agent is gone before it passes SIGTERM to its replica
LAUNCHER_ORPHAN_TIMEOUT = 0.5


class Agent:
    """Starts, signals and watches the replicas of one node (see the module docstring).

    ``orphan_timeout``: seconds without a call from the server after which the replicas are
    stopped; ``kill_after``: seconds after that SIGTERM before the replicas left are killed."""

    def __init__(self, orphan_timeout: float = 600.0, kill_after: float = 60.0) -> None:
        self.orphan_timeout = orphan_timeout
        self.kill_after = kill_after
        self._procs: dict[Key, dict[str, Any]] = {}
        self._final: dict[Key, int] = {}
        self._lock = threading.Lock()
        self._contact = time.monotonic()
        me = psutil.Process()
        self._me = (me.pid, me.create_time())
        threading.Thread(target=self._watch_server, daemon=True, name="agent-watch").start()

    # ---- identity ---------------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        """This node's Ray ID and address, and the agent's process."""
        import ray

        self._contact = time.monotonic()
        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "pid": self._me[0],
            "hostname": socket.gethostname(),
        }

    def address(self) -> tuple[str, int]:
        """Where rank 0 of a job starting here listens: this node's IP and a free port."""
        import ray

        self._contact = time.monotonic()
        ip = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET) as s:
            s.bind((ip, 0))
            return ip, s.getsockname()[1]

    # ---- replicas ---------------------------------------------------------------------------
    def launch(self, specs: list[dict[str, Any]]) -> list[tuple[int, float | None]]:
        """Start one replica per spec (``key``, ``command``, ``env``, ``cwd``, ``log``,
        ``status``), all at once; each one's launcher pid and start time. On an error, the
        replicas started by this call are killed and the error raised."""
        self._contact = time.monotonic()
        spawned: list[tuple[Key, dict, subprocess.Popen, int]] = []
        out: list[tuple[int, float | None]] = []
        try:
            for spec in specs:
                spawned.append((tuple(spec["key"]), spec, *self._spawn(spec)))  # type: ignore[misc]
            for key, spec, helper, read in spawned:
                out.append(self._started(key, spec, helper, read))
        except BaseException:
            for key, *_ in spawned:
                self.signal(key, signal.SIGKILL)
            raise
        finally:
            for *_, read in spawned:
                with contextlib.suppress(OSError):
                    os.close(read)
        return out

    def _spawn(self, spec: dict[str, Any]) -> tuple[subprocess.Popen, int]:
        """Start the helper that starts the replica's launcher; it and the pipe it answers on."""
        os.makedirs(os.path.dirname(spec["status"]), exist_ok=True)
        if os.path.exists(spec["status"]):
            os.remove(spec["status"])
        env = dict(os.environ)
        for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(var, None)  # torchrun's, should the node's environment hold them
        env.update(spec["env"])
        argv = [
            sys.executable, "-m", "adaptrain.service.launcher",
            "--status", spec["status"],
            "--server-pid", str(self._me[0]),
            "--server-create-time", repr(self._me[1]),
            "--orphan-timeout", repr(LAUNCHER_ORPHAN_TIMEOUT),
            "--", *spec["command"],
        ]  # fmt: skip
        read, write = os.pipe()
        try:
            with open(spec["log"], "ab") as log:
                helper = subprocess.Popen(
                    [sys.executable, "-c", _DETACH, str(write), *argv],
                    cwd=spec["cwd"],
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    pass_fds=(write,),
                )
        except BaseException:
            os.close(read)
            raise
        finally:
            os.close(write)
        return helper, read

    def _started(
        self, key: Key, spec: dict[str, Any], helper: subprocess.Popen, read: int
    ) -> tuple[int, float | None]:
        """Wait for the helper's answer (the launcher's pid) and record the replica."""
        raw = b""
        while chunk := os.read(read, 64):
            raw += chunk
        helper.wait()
        if not raw:
            raise RuntimeError(f"replica {key}: its launcher did not start (see {spec['log']})")
        pid = int(raw)
        try:
            created: float | None = psutil.Process(pid).create_time()
        except psutil.Error:
            created = None
        with self._lock:
            # the session (and process group) is the helper's: the launcher and the command
            # live in it after the helper has gone
            self._procs[key] = {
                "pid": pid,
                "created": created,
                "session": helper.pid,
                "status": spec["status"],
            }
            self._final.pop(key, None)
        return pid, created

    def _alive(self, proc: dict[str, Any]) -> bool:
        try:
            p = psutil.Process(proc["pid"])
            if proc["created"] is not None and abs(p.create_time() - proc["created"]) > 1.0:
                return False
            if p.status() == psutil.STATUS_ZOMBIE:
                try:  # a zombie is ours to reap only if this process became its parent
                    os.waitpid(proc["pid"], os.WNOHANG)
                except ChildProcessError:
                    pass
                return False
            return True
        except psutil.Error:
            return False

    def _code(self, key: Key, proc: dict[str, Any]) -> int | None:
        if key in self._final:
            return self._final[key]
        if self._alive(proc):
            return None
        self._kill_session(proc)
        try:
            with open(proc["status"]) as f:
                code = int(json.load(f)["exit_code"])
        except (OSError, ValueError, KeyError):
            code = LOST
        self._final[key] = code
        return code

    def _kill_session(self, proc: dict[str, Any]) -> None:
        """SIGKILL what is left of a replica's session once its launcher is gone (its command
        would otherwise run on unwatched); only processes started after the launcher."""
        for p in psutil.process_iter():
            try:
                if p.pid == os.getpid() or os.getpgid(p.pid) != proc["session"]:
                    continue
                if proc["created"] is not None and p.create_time() < proc["created"] - 1.0:
                    continue
                p.kill()
            except (psutil.Error, ProcessLookupError, PermissionError):
                pass

    def poll(self) -> dict[Key, int | None]:
        """Every replica this agent knows: its exit status, ``None`` while it runs (the
        server's heartbeat)."""
        self._contact = time.monotonic()
        with self._lock:
            return {key: self._code(key, proc) for key, proc in self._procs.items()}

    def signal(self, key: Key, sig: int) -> None:
        """``sig`` to a live replica's launcher (it passes SIGTERM/SIGINT on); SIGKILL to its
        whole session."""
        self._contact = time.monotonic()
        with self._lock:
            proc = self._procs.get(tuple(key))  # type: ignore[arg-type]
            if proc is None or not self._alive(proc):
                return
            try:
                if sig == signal.SIGKILL:
                    os.killpg(proc["session"], signal.SIGKILL)
                else:
                    os.kill(proc["pid"], sig)
            except (ProcessLookupError, PermissionError):
                pass

    def forget(self, keys: list[Key]) -> None:
        """Drop ended replicas the server has recorded."""
        with self._lock:
            for key in keys:
                key = tuple(key)  # type: ignore[assignment]
                if key in self._final:
                    self._procs.pop(key, None)
                    self._final.pop(key, None)

    def stop_all(self) -> int:
        """SIGTERM to every live replica (the server is going away for good); how many."""
        with self._lock:
            live = [p for k, p in self._procs.items() if self._code(k, p) is None]
        for proc in live:
            try:
                os.kill(proc["pid"], signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
        return len(live)

    # ---- the server's absence -----------------------------------------------------------------
    def _watch_server(self) -> None:
        stopped_at: float | None = None
        while True:
            time.sleep(1.0)
            silent = time.monotonic() - self._contact
            if silent <= self.orphan_timeout:
                stopped_at = None
                continue
            with self._lock:
                live = [p for k, p in self._procs.items() if self._code(k, p) is None]
            if not live:
                logger.warning("adaptrain agent: no server for %.0f s and nothing runs: exiting",
                               silent)  # fmt: skip
                os._exit(0)
            if stopped_at is None:
                stopped_at = time.monotonic()
                logger.warning("adaptrain agent: no server for %.0f s: stopping %d replicas",
                               silent, len(live))  # fmt: skip
                for proc in live:
                    try:
                        os.kill(proc["pid"], signal.SIGTERM)
                    except (ProcessLookupError, PermissionError):
                        pass
            elif time.monotonic() - stopped_at > self.kill_after:
                for proc in live:
                    try:
                        os.killpg(proc["session"], signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
