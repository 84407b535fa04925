"""``adaptrain submit [options] -- COMMAND [ARGS...]``: submit a job; prints its name."""

from __future__ import annotations

import argparse
import os

from ._client import add_server_arguments, client, fail

NAME = "submit"
HELP = "submit a training job (the current directory is its working copy)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--name", help="job name (a DNS label; default: from the command)")
    parser.add_argument("--min-replicas", type=int, default=0)
    parser.add_argument("--max-replicas", type=int, default=1)
    parser.add_argument(
        "--no-preemptible", action="store_true", help="never rescale it once running"
    )
    parser.add_argument("--max-restarts", type=int, default=3, help="restarts after crashes")
    parser.add_argument("--workdir", default=".", help="directory to snapshot (default: .)")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
    add_server_arguments(parser)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")


def run(args: argparse.Namespace) -> int:
    from adaptrain.service.client import ServiceError
    from adaptrain.service.snapshot import pack

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        return fail(NAME, "no command: adaptrain submit [options] -- python train.py", 2)
    env = {}
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep:
            return fail(NAME, f"--env {item!r}: expected KEY=VALUE", 2)
        env[key] = value
    if not os.path.isdir(args.workdir):
        return fail(NAME, f"--workdir {args.workdir!r} is not a directory", 2)
    try:
        workdir = pack(args.workdir)
    except ValueError as exc:
        return fail(NAME, str(exc), 2)
    spec = {
        "name": args.name,
        "command": command,
        "min_replicas": args.min_replicas,
        "max_replicas": args.max_replicas,
        "preemptible": not args.no_preemptible,
        "max_restarts": args.max_restarts,
        "env": env,
    }
    try:
        with client(args) as c:
            job = c.submit(spec, workdir)
    except (ServiceError, ValueError) as exc:
        return fail(NAME, str(exc), 2 if getattr(exc, "status", 0) and exc.status < 500 else 1)
    print(job["name"])
    return 0
