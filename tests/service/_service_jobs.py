"""Helpers of the service's reliability and security tests: a job that counts steps (and
checkpoints each one), waiting on a job's status over HTTP, and the per-step records' checks."""

from __future__ import annotations

import os
import time
from collections import Counter

import httpx
import psutil

#: ``python count.py N DELAY``: counts to N, one step each DELAY seconds, each rank on its own.
#: Every step's begin and end (with the pid) go to ``steps-RANK.log`` in the share folder; the
#: step reached goes to a step file in the checkpoint folder (the emulated checkpoint), from
#: which a restart resumes. SIGTERM: finish the step, checkpoint, exit 143.
COUNT = """
import os, signal, sys, time
n, delay = int(sys.argv[1]), float(sys.argv[2])
rank = os.environ["ADAPTRAIN_REPLICA_RANK"]
ckpt = os.path.join(os.environ["ADAPTRAIN_CHECKPOINT_PATH"], "step-" + rank)
stop = []
signal.signal(signal.SIGTERM, lambda signum, frame: stop.append(signum))
step = 0
if os.path.exists(ckpt):
    with open(ckpt) as f:
        step = int(f.read())
print("start rank", rank, "at step", step, "group", os.environ["ADAPTRAIN_NUM_RESTARTS"],
      flush=True)
rec = open(os.path.join(os.environ["ADAPTRAIN_SHARE_PATH"], "steps-" + rank + ".log"), "a",
           buffering=1)
while step < n:
    rec.write(f"begin {step} {os.getpid()} {time.time()!r}\\n")
    time.sleep(delay)
    rec.write(f"end {step} {os.getpid()} {time.time()!r}\\n")
    step += 1
    with open(ckpt + ".tmp", "w") as f:
        f.write(str(step))
    os.replace(ckpt + ".tmp", ckpt)
    print("step", step, flush=True)
    if stop:
        print("checkpointed at step", step, flush=True)
        sys.exit(143)
print("done rank", rank, flush=True)
"""


def http(srv, token: str | None = None, timeout: float = 30.0) -> httpx.Client:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=srv.url, headers=headers, timeout=timeout)


def job(srv, name: str, token: str | None = None) -> dict:
    with http(srv, token) as c:
        resp = c.get(f"/jobs/{name}")
    resp.raise_for_status()
    return resp.json()


def wait_job(
    srv, name: str, statuses: tuple[str, ...], timeout: float = 60.0, token: str | None = None
) -> dict:
    """Job ``name``'s detail once its status is one of ``statuses``."""
    deadline = time.monotonic() + timeout
    last: dict = {}
    while time.monotonic() < deadline:
        last = job(srv, name, token)
        if last["status"] in statuses:
            return last
        time.sleep(0.3)
    raise AssertionError(f"{name} not in {statuses} after {timeout:g} s: {last}\n{srv.text()}")


def wait_for(predicate, timeout: float, what: str, step: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


def share(state_dir: str, name: str) -> str:
    return os.path.join(state_dir, "jobs", name, "share")


def records(state_dir: str, name: str, rank: int) -> list[tuple[str, int, int, float]]:
    """``(kind, step, pid, time)`` of every step record of one rank, in file order."""
    path = os.path.join(share(state_dir, name), f"steps-{rank}.log")
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            parts = line.split()
            if len(parts) == 4:  # a line cut by a kill -9 is not a record
                out.append((parts[0], int(parts[1]), int(parts[2]), float(parts[3])))
    return out


def steps_done(state_dir: str, name: str, rank: int) -> int:
    return sum(kind == "end" for kind, *_ in records(state_dir, name, rank))


def check_steps(state_dir: str, name: str, ranks: int, n: int, exactly_once: bool) -> None:
    """Every step of every rank ended (none lost); no two processes of a rank ever ran at the
    same time (no step run twice concurrently); with ``exactly_once``, none ran twice."""
    for rank in range(ranks):
        recs = records(state_dir, name, rank)
        ends = Counter(step for kind, step, _, _ in recs if kind == "end")
        assert sorted(ends) == list(range(n)), f"{name} rank {rank}: steps ended {sorted(ends)}"
        if exactly_once:
            twice = {s: k for s, k in ends.items() if k > 1}
            assert not twice, f"{name} rank {rank}: steps ended more than once: {twice}"
        spans: dict[int, list[float]] = {}
        for _, _, pid, t in recs:
            lo, hi = spans.setdefault(pid, [t, t])
            spans[pid] = [min(lo, t), max(hi, t)]
        ordered = sorted(spans.items(), key=lambda kv: kv[1][0])
        for (pid_a, (_, end_a)), (pid_b, (start_b, _)) in zip(ordered, ordered[1:]):
            assert start_b >= end_a, (
                f"{name} rank {rank}: pid {pid_b} stepped at {start_b} while pid {pid_a} still "
                f"stepped (until {end_a})"
            )


def replica_procs(state_dir: str, name: str, group: int | None = None) -> dict[int, psutil.Process]:
    """rank -> the launcher of job ``name``'s replica (of ``group``, else any) still alive."""
    out = {}
    runs = os.path.join(state_dir, "runs", name) + os.sep
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info.get("cmdline") or []
        if "adaptrain.service.launcher" not in cmd:
            continue
        for arg in cmd:
            if arg.startswith(runs) and arg.endswith(".status"):
                g, r = os.path.basename(arg)[1:-7].split("-r")
                if group is None or int(g) == group:
                    try:
                        if proc.status() != psutil.STATUS_ZOMBIE:
                            out[int(r)] = proc
                    except psutil.Error:
                        pass
    return out


def live_replicas(state_dir: str) -> list[int]:
    """The pids of every launcher of this state directory still alive."""
    runs = os.path.join(state_dir, "runs") + os.sep
    out = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info.get("cmdline") or []
        if "adaptrain.service.launcher" in cmd and any(a.startswith(runs) for a in cmd):
            try:
                if proc.status() != psutil.STATUS_ZOMBIE:
                    out.append(proc.pid)
            except psutil.Error:
                pass
    return out


def gone(procs) -> bool:
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.Error:
            pass
    return True


def events(detail: dict) -> list[str]:
    return [e["kind"] for e in detail["events"]]
