"""The process that runs one replica of a job for the service: ``python -m
adaptrain.service.launcher --status FILE --server-pid PID [--server-file FILE]
[--orphan-timeout S] -- COMMAND...``.

It starts the job's command as its child, passes SIGTERM and SIGINT on to it (the library
checkpoints and exits 143), and when the command ends writes its exit status to ``FILE``
(atomically) and exits with it. The status file is how a server that restarted after a crash
learns how a replica it did not start ended: the replicas outlive a ``kill -9`` of the server,
which re-adopts them (:mod:`adaptrain.service.local`). A replica whose server stays gone for
``--orphan-timeout`` seconds is stopped the same way, so nothing runs for ever unwatched; a
server restarted on the same state directory (named in ``--server-file``) counts as its server.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time

import psutil

__all__ = ["main", "write_status"]


def write_status(path: str, exit_code: int) -> None:
    """Write ``{"exit_code": N}`` to ``path`` atomically (a temporary file, then a rename)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"exit_code": int(exit_code), "time": time.time()}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _server_alive(pid: int, create_time: float | None) -> bool:
    try:
        proc = psutil.Process(pid)
        return create_time is None or abs(proc.create_time() - create_time) < 1.0
    except psutil.Error:
        return False


def _server_in(path: str | None) -> tuple[int, float | None] | None:
    """The server that ``path`` (the state directory's ``server.json``) names, if it is alive:
    a server restarted on the state directory re-adopts this replica and watches it from then
    on, so the replica must watch that server, not the one that started it."""
    if not path:
        return None
    try:
        with open(path) as f:
            info = json.load(f)
        pid, created = int(info["pid"]), info.get("create_time")
        created = None if created is None else float(created)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return (pid, created) if _server_alive(pid, created) else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m adaptrain.service.launcher")
    parser.add_argument("--status", required=True)
    parser.add_argument("--server-pid", type=int, required=True)
    parser.add_argument("--server-create-time", type=float, default=None)
    parser.add_argument("--server-file", default=None)
    parser.add_argument("--orphan-timeout", type=float, default=600.0)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command after --")
    try:
        child = subprocess.Popen(command, stdin=subprocess.DEVNULL)
    except OSError as exc:
        print(f"adaptrain: cannot start {command[0]!r}: {exc}", file=sys.stderr, flush=True)
        write_status(args.status, 127)
        return 127
    stopping = threading.Event()

    def forward(signum: int, frame: object) -> None:
        stopping.set()
        try:
            child.send_signal(signal.SIGTERM if signum == signal.SIGTERM else signum)
        except ProcessLookupError:
            pass

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)

    def watch_server() -> None:
        gone_since: float | None = None
        server = (args.server_pid, args.server_create_time)
        while child.poll() is None:
            if not _server_alive(*server):
                server = _server_in(args.server_file) or server
            if _server_alive(*server):
                gone_since = None
            elif gone_since is None:
                gone_since = time.monotonic()
            elif time.monotonic() - gone_since > args.orphan_timeout and not stopping.is_set():
                print(
                    f"adaptrain: the server (pid {server[0]}) has been gone for "
                    f"{args.orphan_timeout:g} s; stopping this replica",
                    file=sys.stderr,
                    flush=True,
                )
                forward(signal.SIGTERM, None)
            time.sleep(1.0)

    threading.Thread(target=watch_server, daemon=True).start()
    code = child.wait()
    if code < 0:  # killed by a signal: the shell's convention
        code = 128 - code
    write_status(args.status, code)
    return code


if __name__ == "__main__":  # pragma: no cover - run as a process by the local backend
    sys.exit(main())
