"""``adaptrain describe JOB``: spec, allocation, events and, when pending, why."""

from __future__ import annotations

import argparse
import time

from ._client import add_server_arguments, client, fail

NAME = "describe"
HELP = "a job's spec, allocation, event history and why it waits"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job")
    add_server_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from adaptrain.service.client import ServiceError

    try:
        with client(args) as c:
            job = c.job(args.job)
    except (ServiceError, ValueError) as exc:
        return fail(NAME, str(exc))
    print(f"Name:        {job['name']}")
    print(f"Status:      {job['status']}" + (f" ({job['reason']})" if job.get("reason") else ""))
    print(f"Command:     {' '.join(job['command'])}")
    print(
        f"Replicas:    {job['replicas']} (min {job['min_replicas']}, max {job['max_replicas']}, "
        f"{'preemptible' if job['preemptible'] else 'not preemptible'})"
    )
    print(
        f"Restarts:    {job['restarts']} ({job['failures']} after failures, budget {job['max_restarts']})"
    )
    print(f"Allocation:  {', '.join(job['allocation']) or '-'}")
    if job.get("batch_size"):
        print(f"Batch size:  {job['batch_size']}")
    if job.get("pending_reason"):
        print(f"Pending:     {job['pending_reason']}")
    print("Events:")
    for ev in job["events"]:
        when = time.strftime("%H:%M:%S", time.localtime(ev["time"]))
        print(f"  {when}  {ev['kind']:<14} {ev['message']}")
    return 0
