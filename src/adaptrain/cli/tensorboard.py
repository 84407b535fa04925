"""``adaptrain tensorboard [--port P]``: TensorBoard over every job's log directory."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

NAME = "tensorboard"
HELP = "TensorBoard over every job's ADAPTRAIN_TENSORBOARD_LOGDIR"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--state-dir", default="adaptrain-state", help="the server's state dir")
    parser.add_argument("--port", type=int, default=6006)
    parser.add_argument("--host", default="127.0.0.1")


def logdir_spec(state_dir: str) -> str:
    """TensorBoard's ``--logdir_spec``: ``job:path`` for every job's folder."""
    jobs = os.path.join(state_dir, "jobs")
    names = sorted(os.listdir(jobs)) if os.path.isdir(jobs) else []
    return ",".join(f"{n}:{os.path.join(jobs, n, 'tensorboard')}" for n in names)


def run(args: argparse.Namespace) -> int:
    if not os.path.isdir(args.state_dir):
        print(f"adaptrain tensorboard: no state directory {args.state_dir!r}", file=sys.stderr)
        return 2
    spec = logdir_spec(args.state_dir) or f"none:{args.state_dir}"
    print(f"adaptrain tensorboard: http://{args.host}:{args.port}/", flush=True)
    cmd = [sys.executable, "-m", "tensorboard.main", "--logdir_spec", spec]
    cmd += ["--port", str(args.port), "--host", args.host]
    try:
        return subprocess.call(cmd)
    except KeyboardInterrupt:
        return 130
