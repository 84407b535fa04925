"""The per-node actor of ``adaptrain ray submit``: it runs the job's replicas on its node.

The user's code never runs inside a Ray task. One :class:`ReplicaHost` actor per node of the
job, holding the CPUs and GPUs of that node's replicas, starts each replica as an ordinary
process (``python -u code.py ARGS`` in a private copy of the working directory) wrapped by
:mod:`adaptrain.service.launcher`, which passes SIGTERM on and stops the replica should the
actor die without cleaning up. The replicas get the ``ADAPTRAIN_*`` environment of an elastic
job: rendezvous, ranks, their node's checkpoint folder and, for rank 0, a supervisor URL.

The host also

* unpacks the working directory and the checkpoint to restore from, both sent by the launcher
  through Ray's object store (no shared filesystem is assumed), and packs the newest complete
  checkpoint of its folder when asked (rank 0's host: only rank 0 writes checkpoints);
* on rank 0's node, receives rank 0's scheduling hints on 127.0.0.1 (``PUT /hints/JOB``,
  the service's contract, validated by its :class:`~adaptrain.service.models.Hints`), which
  the launcher reads at each poll: no port is opened to the network;
* watches its node's cloud metadata server for a spot interruption (:mod:`._spot`).
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from adaptrain import env
from adaptrain.ray._spot import AwsSpotWatcher, GcpSpotWatcher, SpotMonitor

__all__ = ["HintsReceiver", "ReplicaHost", "newest_checkpoint", "pack_checkpoint", "unpack"]

logger = logging.getLogger(__name__)

_CKPT_RE = re.compile(r"^checkpoint-(\d+)$")
_MAX_HINTS_BYTES = 1 << 20


# ----- files ------------------------------------------------------------------------------------
def newest_checkpoint(root: str) -> tuple[int, str] | None:
    """``(seq, path)`` of the newest complete ``checkpoint-<seq>`` folder under ``root`` (the
    library renames a checkpoint into place only once it is whole), or None."""
    best = None
    try:
        entries = os.listdir(root)
    except OSError:
        return None
    for name in entries:
        m = _CKPT_RE.match(name)
        path = os.path.join(root, name)
        if m and os.path.isdir(path) and (best is None or int(m.group(1)) > best[0]):
            best = (int(m.group(1)), path)
    return best


def pack_checkpoint(path: str) -> bytes:
    """The checkpoint folder ``path`` as an uncompressed tar (weights do not compress)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(path, arcname=os.path.basename(path))
    return buf.getvalue()


def unpack(data: bytes, dest: str) -> None:
    """Extract the tar (gzip'd or not) ``data`` into ``dest``, refusing paths that leave it."""
    os.makedirs(dest, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
        tar.extractall(dest, filter="data")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


# ----- hints ------------------------------------------------------------------------------------
class HintsReceiver:
    """A tiny HTTP server on 127.0.0.1 that keeps the newest hints rank 0 puts.

    It answers ``PUT /hints/<job>`` with ``Authorization: Bearer <token>``: 204 when the body
    is a valid :class:`~adaptrain.service.models.Hints`, 401 without the token, 422 for an
    invalid body, 413 beyond 1 MiB, 404 elsewhere.
    """

    def __init__(self, job: str, token: str) -> None:
        from adaptrain.service.models import Hints  # pydantic: only on rank 0's node

        self._lock = threading.Lock()
        self.seq = 0
        self.body: dict | None = None
        receiver = self
        path = f"/hints/{urllib.parse.quote(job, safe='')}"
        expected = f"Bearer {token}"

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, code: int, text: str = "") -> None:
                data = text.encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                if data:
                    self.send_header("Content-Type", "text/plain; charset=utf-8")
                self.end_headers()
                if data:
                    self.wfile.write(data)

            def do_PUT(self) -> None:  # noqa: N802 - http.server's naming
                if self.path.split("?", 1)[0] != path:
                    return self._answer(404, "not found")
                if self.headers.get("Authorization") != expected:
                    return self._answer(401, "missing or wrong token")
                try:
                    length = int(self.headers.get("Content-Length") or 0)
                except ValueError:
                    length = -1
                if not 0 <= length <= _MAX_HINTS_BYTES:
                    return self._answer(413, "body too large")
                try:
                    body = Hints.model_validate(json.loads(self.rfile.read(length))).model_dump()
                except ValueError as exc:  # bad JSON, or pydantic's ValidationError
                    return self._answer(422, str(exc)[:500])
                with receiver._lock:
                    receiver.seq += 1
                    receiver.body = body
                return self._answer(204)

            def do_GET(self) -> None:  # noqa: N802
                self._answer(404, "not found")

            do_POST = do_GET  # noqa: N815

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                logger.debug("hints: " + format, *args)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="adaptrain-hints-receiver", daemon=True
        )
        self._thread.start()

    def latest(self) -> tuple[int, dict | None]:
        with self._lock:
            return self.seq, self.body

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


# ----- the actor --------------------------------------------------------------------------------
class ReplicaHost:
    """The replicas of one job on one node (a Ray actor: see the module docstring).

    Args:
        job: the job's name (``ADAPTRAIN_JOB_ID``).
        token: the secret rank 0 sends with its hints.
        spot: which metadata servers to watch: ``"auto"`` (AWS and GCP, each dropped after a
            few unanswered polls), ``"aws"``, ``"gcp"`` or ``"off"``.
        aws_url: AWS metadata base URL (default: the node's ``ADAPTRAIN_AWS_METADATA_URL``).
        gcp_url: GCP metadata base URL (default: the node's ``ADAPTRAIN_GCP_METADATA_URL``).
        spot_interval: seconds between two metadata polls.
    """

    def __init__(
        self,
        job: str,
        token: str,
        spot: str = "auto",
        aws_url: str | None = None,
        gcp_url: str | None = None,
        spot_interval: float = 5.0,
    ) -> None:
        self.job = job
        self.token = token
        self.root = tempfile.mkdtemp(prefix="adaptrain-ray-")
        self.ckpt_dir = os.path.join(self.root, "checkpoint")
        self.code_dir = os.path.join(self.root, "code")
        os.makedirs(self.ckpt_dir)
        self._lock = threading.Lock()
        self._procs: dict[int, subprocess.Popen] = {}
        self._hints: HintsReceiver | None = None
        watchers: list = []
        if spot in ("auto", "aws"):
            watchers.append(AwsSpotWatcher(aws_url or env.aws_metadata_url()))
        if spot in ("auto", "gcp"):
            watchers.append(GcpSpotWatcher(gcp_url or env.gcp_metadata_url()))
        # a cloud named explicitly is never given up on
        self._spot = SpotMonitor(watchers, spot_interval, give_up=3 if spot == "auto" else 1 << 30)
        self._spot.start()

    # ----- set-up ------------------------------------------------------------------------------
    def node(self) -> dict[str, Any]:
        """Where this host runs: its Ray node ID, the node's IP, its pid and GPU IDs."""
        import ray

        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
            "gpus": [str(g) for g in ray.get_gpu_ids()],
        }

    def setup(self, code: bytes, checkpoint: bytes | None, rank0: bool) -> dict[str, Any]:
        """Unpack the working directory and the checkpoint to restore; on rank 0's host, pick
        the rendezvous port and start the hints receiver."""
        unpack(code, self.code_dir)
        if checkpoint is not None:
            unpack(checkpoint, self.ckpt_dir)
        out: dict[str, Any] = {"ip": self.node()["ip"]}
        if rank0:
            out["port"] = _free_port()
            self._hints = HintsReceiver(self.job, self.token)
        return out

    def start(self, script: str, args: list[str], replicas: list[dict[str, str]]) -> list[int]:
        """Start one replica per entry of ``replicas`` (each its rank's environment); their
        wrappers' pids."""
        import psutil
        import ray

        me = psutil.Process()
        gpus = [str(g) for g in ray.get_gpu_ids()]
        per = len(gpus) // max(1, len(replicas))
        status_dir = os.path.join(self.root, "status")
        os.makedirs(status_dir, exist_ok=True)
        pids = []
        for i, delta in enumerate(replicas):
            rank = int(delta["ADAPTRAIN_REPLICA_RANK"])
            child_env = dict(os.environ)
            child_env.update(delta)
            child_env["ADAPTRAIN_CHECKPOINT_PATH"] = self.ckpt_dir
            if self._hints is not None:
                child_env["ADAPTRAIN_SUPERVISOR_URL"] = self._hints.url
            if gpus:  # each replica sees its own GPUs, as in a pod of its own; fractions share
                mine = gpus[i * per : (i + 1) * per] if per else gpus
                child_env["CUDA_VISIBLE_DEVICES"] = ",".join(mine)
            command = [sys.executable, "-u", os.path.join(self.code_dir, script), *args]
            wrapper = [
                sys.executable,
                "-m",
                "adaptrain.service.launcher",
                "--status",
                os.path.join(status_dir, f"rank-{rank}.json"),
                "--server-pid",
                str(me.pid),
                "--server-create-time",
                repr(me.create_time()),
                "--orphan-timeout",
                "10",
                "--",
                *command,
            ]
            proc = subprocess.Popen(
                wrapper,
                cwd=self.code_dir,
                env=child_env,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own process group: killed as one
            )
            with self._lock:
                self._procs[rank] = proc
            pids.append(proc.pid)
        return pids

    # ----- watching ----------------------------------------------------------------------------
    def poll(self, hints_seen: int = 0) -> dict[str, Any]:
        """The replicas' exit codes (None: running), a spot notice, and hints newer than
        ``hints_seen`` (``(seq, body)``)."""
        with self._lock:
            procs = dict(self._procs)
        exits = {}
        for rank, proc in procs.items():
            code = proc.poll()
            exits[rank] = None if code is None else (128 - code if code < 0 else code)
        notice = self._spot.notice
        out: dict[str, Any] = {"exits": exits, "notice": notice.as_dict() if notice else None}
        if self._hints is not None:
            seq, body = self._hints.latest()
            if seq > hints_seen:
                out["hints"] = (seq, body)
        return out

    def checkpoint(self, after: int) -> tuple[int, bytes] | None:
        """``(seq, tar)`` of the newest complete checkpoint here if newer than ``after``."""
        for _ in range(5):  # the library may delete it as a newer one lands: take that one
            newest = newest_checkpoint(self.ckpt_dir)
            if newest is None or newest[0] <= after:
                return None
            try:
                return newest[0], pack_checkpoint(newest[1])
            except (OSError, tarfile.TarError):
                time.sleep(0.1)
        return None

    # ----- stopping ----------------------------------------------------------------------------
    def terminate(self) -> None:
        """SIGTERM every replica (the library checkpoints and exits 143)."""
        with self._lock:
            procs = list(self._procs.values())
        for proc in procs:
            if proc.poll() is None:
                try:
                    proc.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass

    def kill(self) -> None:
        """SIGKILL every replica's process group, and reap them."""
        with self._lock:
            procs = list(self._procs.values())
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                logger.warning("replica wrapper %d did not die of SIGKILL", proc.pid)

    def close(self) -> None:
        """Kill the replicas, stop watching, delete this host's files."""
        self.kill()
        self._spot.stop()
        if self._hints is not None:
            self._hints.close()
        shutil.rmtree(self.root, ignore_errors=True)
