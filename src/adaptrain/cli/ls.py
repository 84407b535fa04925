"""``adaptrain ls [--json]``: the jobs, as AdaptDL's table plus batch size and speedup."""

from __future__ import annotations

import argparse
import json
import time

from ._client import add_server_arguments, client, fail

NAME = "ls"
HELP = "list the jobs"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="a JSON list of objects")
    add_server_arguments(parser)


def _duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 3600:
        return f"{seconds // 60} min"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def run(args: argparse.Namespace) -> int:
    from adaptrain.service.client import ServiceError

    try:
        with client(args) as c:
            jobs = c.jobs()
    except (ServiceError, ValueError) as exc:
        return fail(NAME, str(exc))
    if args.json:
        print(json.dumps(jobs, indent=1))
        return 0
    header = f"{'Name':<32} {'Status':<10} {'Start(UTC)':<13} {'Runtime':>9} {'Rplc':>4} {'Rtrt':>4} {'Bsz':>6} {'Speedup':>7}"
    print(header)
    for job in jobs:
        start = job.get("started")
        when = time.strftime("%b-%d %H:%M", time.gmtime(start)) if start else "-"
        bsz = job.get("batch_size")
        speedup = job.get("speedup")
        print(
            f"{job['name']:<32} {job['status']:<10} {when:<13} {_duration(job.get('runtime') or 0):>9} "
            f"{job.get('replicas', 0):>4} {job.get('restarts', 0):>4} "
            f"{bsz if bsz is not None else '-':>6} {f'{speedup:.2f}' if speedup is not None else '-':>7}"
        )
    return 0
