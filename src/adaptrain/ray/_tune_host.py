"""The replica host of an adaptive Tune trial: a Ray actor in one bundle of the trial's
placement group that runs one replica as a process of its own and stops it.

It imports Ray but neither Tune nor torch (a host starts in a fresh Ray worker process at every
trial start and resize; ``ray.tune`` and torch would each add seconds there). A replica's
checkpoints are adaptrain's (:mod:`adaptrain.dist.checkpoint`): complete ones are folders
``checkpoint-<number>`` under its ``ADAPTRAIN_CHECKPOINT_PATH``, the newest the highest number.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile

import ray

__all__ = ["ReplicaHost", "ReplicaHostActor", "pack_newest_checkpoint", "unpack_checkpoint"]

_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")  # adaptrain.dist.checkpoint's complete ones


def _newest_checkpoint(folder: str) -> str | None:
    found = [
        (int(m.group(1)), entry)
        for entry in os.listdir(folder)
        if (m := _CHECKPOINT.match(entry)) and os.path.isdir(os.path.join(folder, entry))
    ]
    return os.path.join(folder, max(found)[1]) if found else None


def pack_newest_checkpoint(folder: str) -> bytes | None:
    """A tar of the newest adaptrain checkpoint under ``folder`` (None if it holds none)."""
    newest = _newest_checkpoint(folder) if os.path.isdir(folder) else None
    if newest is None:
        return None
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        tar.add(newest, arcname=os.path.basename(newest))
    return buffer.getvalue()


def unpack_checkpoint(blob: bytes, folder: str) -> None:
    """Put the checkpoint of :func:`pack_newest_checkpoint` under ``folder``."""
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r") as tar:
        tar.extractall(folder, filter="data")


class ReplicaHost:
    """Runs one replica process of a trial in its placement-group bundle, and stops it."""

    def __init__(self, trial_id: str, rank: int) -> None:
        self.rank = rank
        self.folder = tempfile.mkdtemp(prefix=f"adaptrain-tune-{trial_id}-{rank}-")
        self.checkpoints = os.path.join(self.folder, "checkpoints")
        os.makedirs(self.checkpoints)
        self.proc: subprocess.Popen | None = None

    def where(self) -> tuple[str, str]:
        """(node id, node IP) of this host."""
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def free_port(self) -> int:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def start(self, variables: dict[str, str], payload: bytes, checkpoint: bytes | None) -> int:
        """Start the replica with ``variables`` on top of this process's environment, after
        putting ``checkpoint`` (if any) in its checkpoint folder; its process id."""
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"replica {self.rank} is still running")
        shutil.rmtree(self.checkpoints, ignore_errors=True)
        os.makedirs(self.checkpoints)
        if checkpoint is not None:
            unpack_checkpoint(checkpoint, self.checkpoints)
        fd, path = tempfile.mkstemp(prefix="payload-", dir=self.folder)
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
        child = dict(os.environ)
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            child.pop(name, None)
        child.update(variables)
        child["ADAPTRAIN_CHECKPOINT_PATH"] = self.checkpoints
        # what this actor can import (the driver's modules included), the replica can too
        child["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "adaptrain.ray._tune_replica", path, str(os.getpid())],
            env=child,
            stdin=subprocess.DEVNULL,
            cwd=self.folder,
        )
        return self.proc.pid

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def wait(self, timeout: float) -> int | None:
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def signal(self, signum: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signum)

    def checkpoint(self) -> bytes | None:
        """The newest checkpoint the replicas wrote here (rank 0's host writes them)."""
        return pack_newest_checkpoint(self.checkpoints)

    def shutdown(self, grace: float = 5.0) -> int | None:
        """Stop the replica (SIGTERM, SIGKILL after ``grace`` seconds) and remove the folder."""
        code = None
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(grace)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            code = self.proc.returncode
            self.proc = None  # reaped: nothing left for the actor's own exit to clean up
        shutil.rmtree(self.folder, ignore_errors=True)
        return code


#: the actor class (``ReplicaHostActor.options(...).remote(trial_id, rank)``)
ReplicaHostActor = ray.remote(ReplicaHost)
