"""``adaptrain server``: the scheduler service in the foreground until SIGINT or SIGTERM.

The HTTP API runs in uvicorn on a thread, the scheduling loop on another; the main thread waits
for a signal, then has every running job checkpoint and stop (they resume when a server starts
again on the same state directory) and exits. One server per state directory (a lock file).
"""

from __future__ import annotations

import fcntl
import gc
import json
import logging
import os
import signal
import socket
import threading
import time

import psutil
import uvicorn

from .api import create_app
from .backend import Backend, Node
from .config import ServerConfig
from .controller import Controller
from .local import LocalBackend

logger = logging.getLogger(__name__)

__all__ = ["Server"]


class Server:
    """The service with ``config`` on ``nodes`` of this machine (a
    :class:`~adaptrain.service.local.LocalBackend`) or on ``backend`` (a
    :class:`~adaptrain.service.backend.Backend` built on the state directory's ``runs``
    folder, see :meth:`runs_dir`); :meth:`serve` blocks until :meth:`stop`."""

    def __init__(
        self,
        config: ServerConfig,
        nodes: list[Node] | None = None,
        backend: Backend | None = None,
    ) -> None:
        if (nodes is None) == (backend is None):
            raise ValueError("give the server either nodes (the local backend) or a backend")
        self.config = config
        os.makedirs(config.state_dir, exist_ok=True)
        self._lock_file = open(os.path.join(config.state_dir, "server.lock"), "a+")  # noqa: SIM115
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock_file.close()
            raise RuntimeError(
                f"another adaptrain server runs on state directory {config.state_dir!r}"
            ) from None
        family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((config.host, config.port))
        self.port = self.sock.getsockname()[1]
        host = f"[{config.host}]" if family == socket.AF_INET6 else config.host
        client_host = "127.0.0.1" if config.host in ("0.0.0.0", "::") else host
        self.url = f"http://{client_host}:{self.port}"
        if backend is None:
            backend = LocalBackend(
                nodes,
                self.runs_dir(config),
                orphan_timeout=config.orphan_timeout,
                server_file=os.path.abspath(os.path.join(config.state_dir, "server.json")),
            )
        self.controller = Controller(config, backend, self.url)
        self.app = create_app(self.controller)
        self._stop = threading.Event()
        self._uvicorn: uvicorn.Server | None = None

    @staticmethod
    def runs_dir(config: ServerConfig) -> str:
        """Where replicas' logs and exit statuses go under the state directory."""
        return os.path.join(config.state_dir, "runs")

    def serve(self, ready: threading.Event | None = None) -> None:
        self.controller.recover()
        # what exists now (modules, the app, the policy) lives as long as the server: out of
        # the garbage collector's scans, whose full passes over it paused every request for
        # 60-70 ms (a thousand-job listing's allocations trigger one every second or so)
        gc.collect()
        gc.freeze()
        loop = threading.Thread(target=self.controller.run, args=(self._stop,), daemon=True)
        loop.start()
        self.sock.listen(2048)
        cfg = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off")
        self._uvicorn = uvicorn.Server(cfg)
        http = threading.Thread(
            target=self._uvicorn.run, kwargs={"sockets": [self.sock]}, daemon=True
        )
        http.start()
        while not self._uvicorn.started and http.is_alive():
            time.sleep(0.02)
        # the replicas re-adopted from a previous server watch this one from now on
        me = psutil.Process()
        info = {"url": self.url, "pid": me.pid, "create_time": me.create_time()}
        path = os.path.join(self.config.state_dir, "server.json")
        with open(f"{path}.tmp", "w") as f:
            json.dump(info, f)
        os.replace(f"{path}.tmp", path)
        print(f"adaptrain server: listening on {self.url}", flush=True)
        if ready is not None:
            ready.set()
        self._stop.wait()
        loop.join(timeout=30)
        self.controller.shutdown()
        self._uvicorn.should_exit = True
        http.join(timeout=10)
        self.sock.close()
        self.controller.store.close()
        self._lock_file.close()

    def stop(self) -> None:
        self._stop.set()

    def run_until_signalled(self) -> int:
        """Serve until SIGINT or SIGTERM; 0."""
        got: list[int] = []

        def handler(signum: int, frame: object) -> None:
            if not got:
                print(
                    "adaptrain server: stopping; running jobs checkpoint and resume on restart",
                    flush=True,
                )
            got.append(signum)
            self.stop()

        signal.signal(signal.SIGINT, handler)
        signal.signal(signal.SIGTERM, handler)
        self.serve()
        return 0
