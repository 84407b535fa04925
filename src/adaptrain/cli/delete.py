"""``adaptrain delete JOB``: checkpoint, stop and mark the job Cancelled."""

from __future__ import annotations

import argparse

from ._client import add_server_arguments, client, fail

NAME = "delete"
HELP = "cancel a job (it checkpoints and stops)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job")
    add_server_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from adaptrain.service.client import ServiceError

    try:
        with client(args) as c:
            job = c.delete(args.job)
    except (ServiceError, ValueError) as exc:
        return fail(NAME, str(exc))
    print(f"{job['name']}: {job['status']}")
    return 0
