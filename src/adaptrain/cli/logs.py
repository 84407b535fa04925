"""``adaptrain logs JOB [--follow] [--rank R]``: every replica's output across restarts."""

from __future__ import annotations

import argparse
import sys
import time

from ._client import add_server_arguments, client, fail

NAME = "logs"
HELP = "a job's output, all replicas and restarts (kept after it ends)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job")
    parser.add_argument("--follow", "-f", action="store_true", help="keep printing until it ends")
    parser.add_argument("--rank", type=int, help="one replica's output only")
    add_server_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from adaptrain.service.client import ServiceError

    offset = 0
    try:
        with client(args) as c:
            while True:
                data, offset, done = c.logs(args.job, args.rank, offset)
                if data:
                    sys.stdout.buffer.write(data)
                    sys.stdout.flush()
                if not args.follow or (done and not data):
                    return 0
                if not data:
                    time.sleep(1.0)
    except (ServiceError, ValueError) as exc:
        return fail(NAME, str(exc))
    except KeyboardInterrupt:
        return 130
