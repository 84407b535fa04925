"""``adaptrain cp JOB:PATH DEST``: a file from a job's share folder (``ADAPTRAIN_SHARE_PATH``)."""

from __future__ import annotations

import argparse
import os

from ._client import add_server_arguments, client, fail

NAME = "cp"
HELP = "copy a file out of a job's share folder"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", metavar="JOB:PATH", help="PATH relative to the share folder")
    parser.add_argument("dest", metavar="DEST")
    add_server_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from adaptrain.service.client import ServiceError

    job, sep, path = args.source.partition(":")
    if not sep or not job or not path:
        return fail(NAME, f"{args.source!r}: expected JOB:PATH, e.g. mnist-1:model.pt", 2)
    path = path.lstrip("/") if path.startswith("/adaptrain/share/") else path
    try:
        with client(args) as c:
            data = c.file(job, path)
    except (ServiceError, ValueError) as exc:
        return fail(NAME, str(exc))
    dest = args.dest
    if os.path.isdir(dest):
        dest = os.path.join(dest, os.path.basename(path))
    with open(dest, "wb") as f:
        f.write(data)
    return 0
