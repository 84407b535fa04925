"""The embedded backend: replicas are processes on this machine, its GPUs (or CPU slots) the
cluster, optionally split into emulated nodes.

Each replica runs under :mod:`adaptrain.service.launcher` in a process session of its own, its
output appended to a log file under the state directory, its exit status written to a file
there. Replicas outlive a ``kill -9`` of the server: the server records each launcher's pid and
start time, and a server restarted on the same state directory re-adopts the replicas still
alive (the pid alive with the same start time) and reads how the others ended from their status
files.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence

import psutil

from .backend import LOST, Node, replica_file
from .store import ReplicaRecord

logger = logging.getLogger(__name__)

__all__ = ["LOST", "LocalBackend", "Node", "detect_gpus", "free_port", "make_nodes"]


def detect_gpus() -> list[int]:
    """This machine's GPU indices (``nvidia-smi -L``), or ``[]``."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return list(range(sum(line.startswith("GPU ") for line in out.splitlines())))


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def make_nodes(
    slots: int | None = None, nodes: int | None = None, slots_per_node: int | None = None
) -> list[Node]:
    """The cluster: ``nodes`` emulated nodes of ``slots_per_node`` slots, or one node of
    ``slots`` slots; GPUs where this machine has them (one per slot, round robin), else CPU
    slots (default: one per core)."""
    gpus = detect_gpus()
    if nodes is not None or slots_per_node is not None:
        if nodes is None or slots_per_node is None:
            raise ValueError(
                "--nodes and --slots-per-node go together (e.g. --nodes 2 --slots-per-node 2)"
            )
        if nodes < 1 or slots_per_node < 1:
            raise ValueError(f"--nodes {nodes} and --slots-per-node {slots_per_node} must be >= 1")
        if slots is not None:
            raise ValueError("give --slots or --nodes with --slots-per-node, not both")
        counts = [slots_per_node] * nodes
    else:
        total = slots if slots is not None else (len(gpus) or os.cpu_count() or 1)
        if total < 1:
            raise ValueError(f"--slots {total} must be >= 1")
        counts = [total]
    out, k = [], 0
    for i, count in enumerate(counts):
        ids = []
        for _ in range(count):
            ids.append(gpus[k % len(gpus)] if gpus else None)
            k += 1
        out.append(Node("localhost" if len(counts) == 1 else f"node-{i}", tuple(ids)))
    return out


class LocalBackend:
    """Starts, signals and watches replicas on this machine (see the module docstring)."""

    name = "local"

    def __init__(
        self,
        nodes: Sequence[Node],
        run_dir: str,
        orphan_timeout: float = 600.0,
        server_file: str | None = None,
    ) -> None:
        if not nodes:
            raise ValueError("a cluster needs at least one node")
        self.nodes = {n.name: n for n in nodes}
        self.run_dir = run_dir
        self.orphan_timeout = orphan_timeout
        #: where the server names itself (pid, start time): a replica re-adopted by a restarted
        #: server watches that one (see :mod:`adaptrain.service.launcher`)
        self.server_file = server_file
        self._procs: dict[tuple[str, int, int], subprocess.Popen] = {}
        self._ended: set[tuple[str, int, int]] = set()
        me = psutil.Process()
        self._me = (me.pid, me.create_time())
        os.makedirs(run_dir, exist_ok=True)

    # ---- paths ----------------------------------------------------------------------------
    def status_path(self, job: str, group: int, rank: int) -> str:
        return replica_file(self.run_dir, job, group, rank, ".status")

    def log_path(self, job: str, group: int, rank: int) -> str:
        return replica_file(self.run_dir, job, group, rank, ".log")

    # ---- launching ------------------------------------------------------------------------
    def launch(
        self,
        job: str,
        group: int,
        allocation: Sequence[str],
        command: Sequence[str],
        env: Mapping[str, str],
        cwd: str,
        busy: Mapping[str, set[int]],
    ) -> list[ReplicaRecord]:
        """Start one replica per entry of ``allocation`` (node names, rank order) on slots of
        those nodes not in ``busy`` (node -> slot indices in use); their records."""
        os.makedirs(os.path.join(self.run_dir, job), exist_ok=True)
        nodes = list(dict.fromkeys(allocation))
        port = free_port()
        used = {n: set(busy.get(n, ())) for n in self.nodes}
        records: list[ReplicaRecord] = []
        local_rank: dict[str, int] = {}
        try:
            for rank, node_name in enumerate(allocation):
                node = self.nodes[node_name]
                slot = next(i for i in range(len(node.slots)) if i not in used[node_name])
                used[node_name].add(slot)
                renv = dict(os.environ)
                renv.update(env)
                renv.update(
                    {
                        "ADAPTRAIN_MASTER_ADDR": "127.0.0.1",
                        "ADAPTRAIN_MASTER_PORT": str(port),
                        "ADAPTRAIN_NUM_NODES": str(len(nodes)),
                        "ADAPTRAIN_NUM_REPLICAS": str(len(allocation)),
                        "ADAPTRAIN_REPLICA_RANK": str(rank),
                        "ADAPTRAIN_LOCAL_RANK": str(local_rank.get(node_name, 0)),
                        "ADAPTRAIN_NUM_RESTARTS": str(group),
                        "PYTHONUNBUFFERED": "1",
                    }
                )
                for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
                    renv.pop(var, None)  # torchrun's, if the server itself runs under it
                local_rank[node_name] = local_rank.get(node_name, 0) + 1
                gpu = node.slots[slot]
                if gpu is not None:
                    renv["CUDA_VISIBLE_DEVICES"] = str(gpu)
                status = self.status_path(job, group, rank)
                if os.path.exists(status):
                    os.remove(status)
                log = open(self.log_path(job, group, rank), "ab")  # noqa: SIM115 - the child owns it
                try:
                    proc = subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "adaptrain.service.launcher",
                            "--status",
                            status,
                            "--server-pid",
                            str(self._me[0]),
                            "--server-create-time",
                            repr(self._me[1]),
                            "--orphan-timeout",
                            repr(self.orphan_timeout),
                            *(["--server-file", self.server_file] if self.server_file else []),
                            "--",
                            *command,
                        ],
                        cwd=cwd,
                        env=renv,
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                finally:
                    log.close()
                self._procs[job, group, rank] = proc
                try:
                    created = psutil.Process(proc.pid).create_time()
                except psutil.Error:
                    created = None
                records.append(
                    ReplicaRecord(job, group, rank, node_name, slot, proc.pid, created, None)
                )
        except BaseException:
            for rec in records:
                self.signal(rec, signal.SIGKILL)
            raise
        return records

    # ---- watching -------------------------------------------------------------------------
    def _alive(self, rec: ReplicaRecord) -> bool:
        if rec.pid is None:
            return False
        try:
            proc = psutil.Process(rec.pid)
            if rec.create_time is not None and abs(proc.create_time() - rec.create_time) > 1.0:
                return False  # the pid was reused
            return proc.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def exit_code(self, rec: ReplicaRecord) -> int | None:
        """How the replica ended (its command's exit status, :data:`LOST` if it vanished
        without one), or ``None`` while it runs."""
        key = (rec.job, rec.group, rec.rank)
        proc = self._procs.get(key)
        if proc is not None:
            code = proc.poll()
            if code is None:
                return None
            self._procs.pop(key, None)
        elif self._alive(rec):
            return None
        if key not in self._ended:
            self._ended.add(key)
            self._kill_leftovers(rec)
        try:
            with open(self.status_path(rec.job, rec.group, rec.rank)) as f:
                return int(json.load(f)["exit_code"])
        except (OSError, ValueError, KeyError):
            return LOST

    def _kill_leftovers(self, rec: ReplicaRecord) -> None:
        """SIGKILL what is left of a replica's session once its launcher is gone: the command
        of a launcher that was killed (or its children) would otherwise run on unwatched,
        beside the replica that replaces it. The session's process group is the launcher's
        pid; only processes started after the launcher belong to it (a reused pid never
        matches)."""
        if rec.pid is None:
            return
        for proc in psutil.process_iter():
            try:
                if os.getpgid(proc.pid) != rec.pid or proc.pid == os.getpid():
                    continue
                if rec.create_time is not None and proc.create_time() < rec.create_time - 1.0:
                    continue
                logger.warning(
                    "job %s replica %d: its launcher is gone; killing pid %d left in its session",
                    rec.job,
                    rec.rank,
                    proc.pid,
                )
                proc.kill()
            except (psutil.Error, ProcessLookupError, PermissionError):
                pass

    def signal(self, rec: ReplicaRecord, sig: int) -> None:
        """Send ``sig`` to a live replica's launcher (which passes SIGTERM/SIGINT on); SIGKILL
        goes to the whole session (the launcher and the command)."""
        if not self._alive(rec):
            return
        try:
            if sig == signal.SIGKILL:
                os.killpg(os.getpgid(rec.pid), signal.SIGKILL)
            else:
                os.kill(rec.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def adopt(self, records: Sequence[ReplicaRecord]) -> list[ReplicaRecord]:
        """The records of replicas still alive (a restarted server takes them over)."""
        return [r for r in records if self._alive(r)]
