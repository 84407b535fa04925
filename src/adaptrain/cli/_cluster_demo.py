"""``adaptrain demo --cluster``: the scheduler service at work, in one command.

An embedded server (the same :class:`~adaptrain.service.server.Server` as ``adaptrain
server``) on emulated nodes of this machine, its dashboard on a loopback port, and three small
real training jobs (:mod:`adaptrain.cli._cluster_job`) submitted a few seconds apart through
its HTTP API. Each trains until a deadline within ``--minutes``, the first ending first, so
the policy re-divides the slots as jobs arrive and again as they leave. A progress bar follows
the allocation; at the end, a summary (how each job was rescaled, how full the cluster was)
and ``allocations.png`` (the slots each job held at each round, and its batch size).

The state directory (``OUT/state``) is kept: ``adaptrain server --state-dir OUT/state`` with
the same nodes shows the run again in the dashboard. Ctrl-C (or SIGTERM) stops the server,
whose jobs checkpoint and stop, then writes the summary of what ran; a second Ctrl-C kills
every process left at once. The replicas also stop by themselves shortly after this process
is killed outright (their launchers' orphan timeout).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from adaptrain.procs import raise_if_interrupted, recorded_interrupts, sigterm_as_interrupt

#: (seconds after the start it arrives, name, workload, share of the budget it trains until)
JOBS = (
    (0.0, "digits-a", "digits", 0.50),
    (6.0, "charlm", "charlm", 0.90),
    (12.0, "digits-b", "digits", 0.72),
)
#: seconds the demo waits past its budget for the last job to end before stopping the server
SLACK = 30.0
#: a replica whose server (this process) is gone that long stops by itself
ORPHAN_TIMEOUT = 20.0


def check_arguments(args: argparse.Namespace) -> str | None:
    if not (math.isfinite(args.minutes) and args.minutes > 0):
        return f"--minutes={args.minutes}: give a positive, finite time budget (e.g. --minutes 3)"
    if args.nodes < 1 or args.slots_per_node < 1:
        return f"--nodes {args.nodes} --slots-per-node {args.slots_per_node}: give at least 1"
    if not 0 <= args.port <= 65535:
        return f"--port {args.port}: give 0 (any free port) or a port in 1..65535"
    return None


def interval_for(minutes: float) -> float:
    """Seconds between policy rounds: about 18 rounds over the budget, 5 to 30 s apart."""
    return min(30.0, max(5.0, minutes * 60.0 / 18.0))


def run(args: argparse.Namespace, out: Path) -> int:
    """The demo with its output folder ``out`` (locked by the caller); the exit status."""
    from adaptrain.service.client import Client, ServiceError
    from adaptrain.service.config import ServerConfig
    from adaptrain.service.local import make_nodes
    from adaptrain.service.server import Server

    state_dir = out / "state"
    if state_dir.exists():  # the previous demo's run: its jobs' names are taken there
        shutil.rmtree(state_dir)
    budget = args.minutes * 60.0
    config = ServerConfig(
        host="127.0.0.1",
        port=args.port,
        state_dir=str(state_dir),
        interval=interval_for(args.minutes),
        rescale_rounds=1,
        grace=20.0,
        restart_delay=3.0,
        max_restarts=2,
        checkpoint_interval=5.0,
        hints_interval=2.0,
        orphan_timeout=ORPHAN_TIMEOUT,
    )
    try:
        server = Server(config, make_nodes(nodes=args.nodes, slots_per_node=args.slots_per_node))
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"adaptrain demo: {exc}", file=sys.stderr)
        return 2
    ready = threading.Event()
    thread = threading.Thread(target=server.serve, kwargs={"ready": ready}, daemon=True)
    interrupted: list[int] = []
    failed = False
    report: dict[str, Any] | None = None
    started = time.time()
    with sigterm_as_interrupt() as sigterms, recorded_interrupts() as interrupts:
        try:
            thread.start()
            if not ready.wait(60):
                print("adaptrain demo: the embedded server did not start", file=sys.stderr)
                return 1
            print(
                f"adaptrain demo --cluster: dashboard at {server.url}/ (Ctrl-C stops the demo)\n"
                f"  {args.nodes} emulated nodes x {args.slots_per_node} slots, "
                f"{config.policy} policy every {config.interval:g} s; 3 jobs over "
                f"{args.minutes:g} min",
                flush=True,
            )
            with Client(server.url) as client:
                try:
                    _follow(
                        client,
                        args,
                        started,
                        budget,
                        lambda: raise_if_interrupted(sigterms, interrupts),
                    )
                finally:
                    try:
                        report = _collect(client, started)
                    except ServiceError as exc:
                        print(f"adaptrain demo: could not read the run's history: {exc}")
        except ServiceError as exc:  # the embedded server refused or stopped answering
            print(f"adaptrain demo: {exc}", file=sys.stderr, flush=True)
            failed = True
        except KeyboardInterrupt:
            interrupted.append(sigterms[0] if sigterms else signal.SIGINT)
            print(
                "\nadaptrain demo: interrupted; the jobs checkpoint and stop... "
                "(Ctrl-C again to kill them)",
                file=sys.stderr,
                flush=True,
            )
        finally:
            _stop(server, thread)
    if report is not None:
        _report(report, args, config, out, state_dir, bool(interrupted))
    if interrupted:
        return 128 + interrupted[0]
    return 1 if failed else 0


def _job_spec(name: str, workload: str, until: float) -> dict[str, Any]:
    return {
        "name": name,
        "command": [
            sys.executable,
            "-m",
            "adaptrain.cli._cluster_job",
            workload,
            "--until",
            repr(until),
        ],
        "min_replicas": 0,
        "max_replicas": 16,
        "env": {"OMP_NUM_THREADS": "1"},
    }


def _follow(
    client: Any,
    args: argparse.Namespace,
    started: float,
    budget: float,
    check: Callable[[], None],
) -> None:
    """Submit the jobs on their schedule and show the allocation until every job has ended
    (or the budget and its slack are spent). ``check()`` raises again a SIGINT or SIGTERM Python
    dropped (:func:`adaptrain.procs.recorded_interrupts`)."""
    bar = None
    if not args.no_bar and sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=round(budget), unit="s", desc="cluster", dynamic_ncols=True)
    pending = list(JOBS)
    last_line = 0.0
    try:
        while True:
            check()
            now = time.time()
            elapsed = now - started
            while pending and elapsed >= pending[0][0]:
                _, name, workload, share = pending.pop(0)
                job = client.submit(_job_spec(name, workload, started + share * budget))
                _say(bar, f"[{elapsed:5.0f} s] submitted {job['name']} ({workload})")
            jobs = client.jobs()
            held = " ".join(f"{j['name']}:{j['replicas']}" for j in jobs)
            if bar is not None:
                bar.n = min(round(elapsed), bar.total)
                bar.set_postfix_str(held, refresh=False)
                bar.refresh()
            elif now - last_line >= 10:
                last_line = now
                print(f"[{elapsed:5.0f} s] replicas {held}", flush=True)
            done = all(j["status"] in ("Succeeded", "Failed", "Cancelled") for j in jobs)
            if not pending and jobs and done:
                return
            if elapsed > budget + SLACK:
                _say(bar, f"[{elapsed:5.0f} s] budget spent: stopping the jobs left")
                return
            time.sleep(1.0)
    finally:
        if bar is not None:
            bar.close()


def _say(bar: Any, message: str) -> None:
    if bar is not None:
        bar.write(message)
    else:
        print(message, flush=True)


def _collect(client: Any, started: float) -> dict[str, Any]:
    """What the summary and the plot need, read through the API while the server runs."""
    import httpx

    from adaptrain.service.client import ServiceError

    jobs = client.jobs()
    details = {j["name"]: client.job(j["name"]) for j in jobs}
    try:
        with httpx.Client(base_url=client.url, timeout=30) as http:
            samples = {
                j["name"]: http.get(f"/jobs/{j['name']}/history")
                .raise_for_status()
                .json()["samples"]
                for j in jobs
            }
            reply = http.get("/cluster/history", params={"limit": 10_000}).raise_for_status()
            rounds = reply.json()["rounds"]
    except httpx.HTTPError as exc:
        raise ServiceError(str(exc)) from None
    return {"started": started, "jobs": jobs, "details": details, "samples": samples,
            "rounds": rounds}  # fmt: skip


def _stop(server: Any, thread: threading.Thread) -> None:
    """Stop the server (its jobs checkpoint and stop); a Ctrl-C meanwhile kills every process
    this one started, at once."""
    server.stop()
    while thread.is_alive():
        try:
            thread.join(0.2)
        except KeyboardInterrupt:
            print("adaptrain demo: killing the jobs", file=sys.stderr, flush=True)
            _kill_children()


def _kill_children() -> None:
    """SIGKILL every process below this one (each replica's launcher heads a session of its
    own: the whole session goes)."""
    for child in psutil.Process().children(recursive=True):
        try:
            if os.getpgid(child.pid) == child.pid:
                os.killpg(child.pid, signal.SIGKILL)
            else:
                child.kill()
        except (psutil.Error, ProcessLookupError, PermissionError):
            pass


# ---- the summary and the plot ---------------------------------------------------------------
def _changes(values: list[int]) -> list[int]:
    out: list[int] = []
    for v in values:
        if not out or out[-1] != v:
            out.append(v)
    return out


def summarise(report: dict[str, Any]) -> dict[str, Any]:
    """Per job: status, runtime, rescales, restarts, the replicas it held round by round (each
    change once) and its first and last batch size; the cluster's mean utilisation."""
    rounds = report["rounds"]
    jobs = []
    for job in report["jobs"]:
        name = job["name"]
        detail = report["details"][name]
        rescales = sum(
            e["kind"] == "Stopping" and e["message"].startswith("rescale") for e in detail["events"]
        )
        held = [r["jobs"].get(name, 0) for r in rounds]
        first = next((i for i, v in enumerate(held) if v), None)
        last = max((i for i, v in enumerate(held) if v), default=None)
        path = _changes(held[first : last + 1]) if first is not None else []
        sizes = [s["batch_size"] for s in report["samples"][name] if s["batch_size"]]
        jobs.append(
            {
                "name": name,
                "status": job["status"],
                "runtime_s": round(job["runtime"], 1),
                "rescales": rescales,
                "restarts": job["restarts"],
                "replicas": path,
                "batch_size": [sizes[0], sizes[-1]] if sizes else [],
            }
        )
    used = [r["used"] / r["total"] for r in rounds if r["total"]]
    return {
        "jobs": jobs,
        "rounds": len(rounds),
        "utilisation": sum(used) / len(used) if used else 0.0,
        "elapsed_s": round(time.time() - report["started"], 1),
    }


def summary_lines(summary: dict[str, Any], args: argparse.Namespace, interval: float) -> list[str]:
    lines = [
        f"adaptrain demo --cluster: {len(summary['jobs'])} jobs on {args.nodes} nodes x "
        f"{args.slots_per_node} slots, a policy round every {interval:g} s, "
        f"{summary['elapsed_s'] / 60:.1f} min",
        f"  {'job':<10} {'status':<10} {'runtime':>8} {'rescales':>8} {'restarts':>8}  "
        f"{'replicas, round by round':<26} batch size",
    ]
    for job in summary["jobs"]:
        path = " -> ".join(map(str, job["replicas"])) or "-"
        bsz = " -> ".join(map(str, job["batch_size"])) or "-"
        lines.append(
            f"  {job['name']:<10} {job['status']:<10} {job['runtime_s']:>7.0f}s "
            f"{job['rescales']:>8} {job['restarts']:>8}  {path:<26} {bsz}"
        )
    lines.append(
        f"  cluster: {summary['rounds']} rounds, {100 * summary['utilisation']:.0f}% of the "
        "slots held on average"
    )
    return lines


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def plot(report: dict[str, Any], path: Path) -> None:
    """``path``: the slots each job held at each round (stacked) and each job's batch size."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = report["started"]
    rounds = report["rounds"]
    names = [j["name"] for j in report["jobs"]]
    colours = {n: plt.get_cmap("tab10")(i % 10) for i, n in enumerate(names)}
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    if rounds:
        times = [(r["time"] - t0) / 60 for r in rounds]
        layers = [[r["jobs"].get(n, 0) for r in rounds] for n in names]
        top.stackplot(times, layers, labels=names, colors=[colours[n] for n in names], step="post")
        total = max(r["total"] for r in rounds)
        top.axhline(total, color="black", linestyle="--", linewidth=1, label="slots")
        top.set_ylim(0, total + 0.5)
    top.set_ylabel("slots held")
    top.set_title("How the policy divided the cluster, round by round")
    if rounds:
        top.legend(loc="upper right", fontsize=8)
    for name in names:
        pts = [(s["time"], s["batch_size"]) for s in report["samples"][name] if s["batch_size"]]
        if pts:
            bottom.step([(t - t0) / 60 for t, _ in pts], [b for _, b in pts], where="post",
                        color=colours[name], label=name)  # fmt: skip
    bottom.set_ylabel("batch size")
    bottom.set_xlabel("minutes since the start")
    if bottom.get_lines():
        bottom.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    _write_atomic(path, buf.getvalue())


def _report(
    report: dict[str, Any],
    args: argparse.Namespace,
    config: Any,
    out: Path,
    state_dir: Path,
    interrupted: bool,
) -> None:
    summary = summarise(report)
    summary["interrupted"] = interrupted
    lines = summary_lines(summary, args, config.interval)
    if interrupted:
        lines.append(
            "  interrupted: the jobs still running (their status above is as of the Ctrl-C) "
            "checkpointed and stopped with the server"
        )
    outputs = [out / "summary.json", out / "summary.txt"]
    if not args.no_plot:
        try:
            plot(report, out / "allocations.png")
            outputs.insert(0, out / "allocations.png")
        except ImportError:
            lines.append("  (no plot: matplotlib is not installed; pip install adaptrain[demo])")
    lines.append(f"  outputs: {', '.join(map(str, outputs))}")
    lines.append(
        f"  the dashboard again: adaptrain server --state-dir {state_dir} --nodes {args.nodes} "
        f"--slots-per-node {args.slots_per_node}"
    )
    text = "\n".join(lines) + "\n"
    _write_atomic(out / "summary.json", json.dumps(summary, indent=1).encode())
    _write_atomic(out / "summary.txt", text.encode())
    print(text, end="", flush=True)
