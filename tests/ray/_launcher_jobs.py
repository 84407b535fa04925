"""Training scripts for the ``adaptrain ray submit`` tests (written to a test's working
directory and run as replicas; never imported by pytest), and reading what they record.

Both append one JSON line per event to ``$LAUNCHER_TEST_LOG`` (the test machine runs every
node, so one file serves all of them): ``group`` (``ADAPTRAIN_NUM_RESTARTS``), ``rank``,
``replicas`` and the event's fields.
"""

from __future__ import annotations

import json
import os
import sys
import time

#: ``python count.py --steps N --delay S [--hints scales|slow] [--hang-group G]``: the light
#: job (no torch). Every replica counts steps; rank 0 keeps the step in adaptrain's checkpoint
#: layout (``checkpoint-<seq>/state``, renamed into place whole) when SIGTERM stops it (exit
#: 143) and at the end, and resumes from the newest one. With ``--hints`` rank 0 first puts a
#: goodput model to ``$ADAPTRAIN_SUPERVISOR_URL`` that scales (``scales``) or whose network
#: makes a second node slower than one (``slow``). In group ``--hang-group`` every replica
#: ignores SIGTERM and rank 0 leaves a half-written checkpoint, as a job stuck in a collective.
#: ``--save-every K``: rank 0 also checkpoints every K steps (periodic checkpoints; not in the
#: hang group). ``--fail-group G --fail-step S``: in group G rank 0 exits 1 at step S.
COUNT = r"""
import argparse, json, os, signal, sys, time, urllib.request

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, required=True)
p.add_argument("--delay", type=float, default=0.2)
p.add_argument("--hints", choices=["scales", "slow"], default=None)
p.add_argument("--hang-group", type=int, default=-1)
p.add_argument("--save-every", type=int, default=0)
p.add_argument("--fail-group", type=int, default=-1)
p.add_argument("--fail-step", type=int, default=0)
p.add_argument("--tag", default="")  # the test's folder: how its processes are found
args = p.parse_args()
rank = int(os.environ["ADAPTRAIN_REPLICA_RANK"])
replicas = int(os.environ["ADAPTRAIN_NUM_REPLICAS"])
group = int(os.environ["ADAPTRAIN_NUM_RESTARTS"])
root = os.environ["ADAPTRAIN_CHECKPOINT_PATH"]
log = open(os.environ["LAUNCHER_TEST_LOG"], "a")


def record(event, **kw):
    log.write(json.dumps(dict(event=event, group=group, rank=rank, replicas=replicas,
                              time=time.time(), pid=os.getpid(), **kw)) + "\n")
    log.flush()


def newest():
    seqs = [int(d.split("-")[1]) for d in os.listdir(root) if d.startswith("checkpoint-")]
    return max(seqs) if seqs else None


def save(step):
    seq = (newest() if newest() is not None else -1) + 1
    tmp = os.path.join(root, ".tmp-checkpoint-%06d-%d" % (seq, os.getpid()))
    os.makedirs(tmp)
    with open(os.path.join(tmp, "state"), "w") as f:
        json.dump({"step": step}, f)
    os.rename(tmp, os.path.join(root, "checkpoint-%06d" % seq))
    record("checkpoint", seq=seq, step=step)


step = 0
restored = newest()
if restored is not None:
    with open(os.path.join(root, "checkpoint-%06d" % restored, "state")) as f:
        step = json.load(f)["step"]
hang = group == args.hang_group
stop = []
if hang:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
else:
    signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
record("start", step=step, restored=restored)
print(f"rank {rank} of {replicas} starts at step {step}", flush=True)
if rank == 0 and args.hints:
    net, var = (0.001, 100.0) if args.hints == "scales" else (0.5, 100.0)
    body = {
        "initBatchSize": 32, "maxBatchSize": 4096, "localBszBounds": [16, 256],
        "maxProfiledReplicas": replicas, "gradientAccumulation": False,
        "perfParams": {"alpha_c": 0.01, "beta_c": 0.001, "alpha_n": net, "beta_n": net / 10,
                       "alpha_r": net / 2, "beta_r": net / 20, "gamma": 1.5},
        "gradParams": {"norm": 1.0, "var": var},
    }
    req = urllib.request.Request(
        os.environ["ADAPTRAIN_SUPERVISOR_URL"] + "/hints/" + os.environ["ADAPTRAIN_JOB_ID"],
        data=json.dumps(body).encode(), method="PUT",
        headers={"Authorization": "Bearer " + os.environ["ADAPTRAIN_JOB_TOKEN"],
                 "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        record("hints", status=resp.status)
if hang and rank == 0:
    os.makedirs(os.path.join(root, ".tmp-checkpoint-%06d-%d" % ((newest() or 0) + 1, os.getpid())))
while step < args.steps:
    time.sleep(args.delay)
    step += 1
    record("step", step=step)
    if rank == 0 and args.save_every and step % args.save_every == 0 and not hang:
        save(step)
    if rank == 0 and group == args.fail_group and step == args.fail_step:
        record("exit", code=1)
        sys.exit(1)
    if stop:
        if rank == 0:
            save(step)
        record("exit", code=143)
        sys.exit(143)
if rank == 0:
    save(step)
record("exit", code=0)
"""

#: ``python train.py --epochs E --step-sleep S``: a real adaptrain.torch job (a linear model
#: on 96 synthetic samples, batch 8, gloo): SIGTERM makes the library checkpoint and exit 143.
#: Every replica records each micro-batch's sample ids and epoch.
TRAIN = r"""
import argparse, json, os, time

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import adaptrain.torch as at

p = argparse.ArgumentParser()
p.add_argument("--epochs", type=int, default=4)
p.add_argument("--step-sleep", type=float, default=0.2)
p.add_argument("--tag", default="")  # the test's folder: how its processes are found
args = p.parse_args()
torch.set_num_threads(1)
torch.manual_seed(0)
at.init_process_group("gloo")
rank = torch.distributed.get_rank()
replicas = torch.distributed.get_world_size()
group = int(os.environ["ADAPTRAIN_NUM_RESTARTS"])
log = open(os.environ["LAUNCHER_TEST_LOG"], "a")
x = torch.randn(96, 8)
y = (x.sum(1) > 0).long()
data = TensorDataset(x, y, torch.arange(96))
model = torch.nn.Linear(8, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model = at.AdaptiveDataParallel(model, optimizer)
loader = at.AdaptiveDataLoader(data, batch_size=8, shuffle=True)
log.write(json.dumps(dict(event="start", group=group, rank=rank, replicas=replicas,
                          time=time.time())) + "\n")
log.flush()
for epoch in at.remaining_epochs_until(args.epochs):
    for xb, yb, ib in loader:
        loss = F.cross_entropy(model(xb), yb)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        time.sleep(args.step_sleep)
        log.write(json.dumps(dict(event="step", group=group, rank=rank, replicas=replicas,
                                  epoch=epoch, ids=ib.tolist(), time=time.time())) + "\n")
        log.flush()
log.write(json.dumps(dict(event="exit", group=group, rank=rank, replicas=replicas, code=0,
                          time=time.time())) + "\n")
log.flush()
"""


def write_job(folder: str, name: str, text: str) -> str:
    """Write the script ``text`` as ``folder/name``; its path."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name)
    with open(path, "w") as f:
        f.write(text)
    return path


def records(path: str, event: str | None = None) -> list[dict]:
    """The recorded events (of kind ``event``), in file order."""
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:  # a line cut by a kill
                continue
            if event is None or rec["event"] == event:
                out.append(rec)
    return out


def wait_for(predicate, timeout: float, what: str, thread=None, step: float = 0.2):
    """``predicate()``'s value once true; fails after ``timeout`` s, or if ``thread`` ended."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if thread is not None and not thread.is_alive():
            raise AssertionError(f"the launcher ended while waiting for {what}")
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


def leftover_processes(marker: str) -> list:
    """Processes whose command line mentions ``marker`` (a test's unique folder)."""
    import psutil

    out = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if any(marker in part for part in proc.info["cmdline"] or ()):
                out.append(proc)
        except (psutil.Error, TypeError):
            continue
    return out


def kill_leftovers(marker: str) -> list[int]:
    """Kill (by pid) what :func:`leftover_processes` finds; their pids."""
    pids = []
    for proc in leftover_processes(marker):
        if proc.pid == os.getpid():
            continue
        pids.append(proc.pid)
        try:
            proc.kill()
        except Exception:  # noqa: BLE001 - gone meanwhile
            pass
    return pids


PYTHON = sys.executable
