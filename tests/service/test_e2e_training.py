"""End to end: real training jobs under a real server, rescaled by its policy.

A server with 2 emulated nodes x 2 CPU slots runs three jobs submitted a few seconds apart:
AdaptDL's digits tutorial (autoscale_batch_size) twice and a tiny character LM, each with
``--max-replicas 4``. Short policy rounds, hints every second and periodic checkpoints make
the policy rescale them within the test: the first job starts on a whole node and shrinks as
the others arrive, and a job grows onto the slots the char LM leaves. Every job succeeds; from
the sample ids every replica logged, each training sample was seen exactly once per epoch
across the rescales; ``adaptrain cp`` fetches the file a job wrote and ``adaptrain logs`` holds
its output from before and after a restart. A few minutes on 2 CPU cores.
"""

from __future__ import annotations

import glob
import json
import os
import re
import time
from collections import Counter, defaultdict

import pytest
from _e2e_jobs import SCRIPT
from _service_jobs import wait_job

pytestmark = pytest.mark.slow

JOBS = {  # name -> the training script's arguments
    "digits": ["digits", "--epochs", "10", "--step-sleep", "0.1"],
    "charlm": ["charlm", "--epochs", "6", "--step-sleep", "0.1"],
    "digits-b": ["digits", "--epochs", "8", "--step-sleep", "0.1"],
}


def _events(detail: dict, kind: str, pattern: str) -> list[tuple[int, int]]:
    """The two numbers ``pattern`` captures in each of a job's events of ``kind``."""
    out = []
    for event in detail["events"]:
        m = re.match(pattern, event["message"])
        if event["kind"] == kind and m:
            out.append((int(m.group(1)), int(m.group(2))))
    return out


def _rescales(detail: dict) -> list[tuple[int, int]]:
    """The ``(old, new)`` replica counts of every rescale of a job, from its events."""
    return _events(detail, "Stopping", r"rescale: (\d+) -> (\d+) replicas")


def _started(detail: dict) -> dict[int, int]:
    """The replica count each restart group of a job was started with, from its events."""
    return dict(_events(detail, "Started", r"group (\d+): (\d+) on"))


def _seen(share: str) -> tuple[dict[int, Counter], dict[int, set[int]]]:
    """Per epoch, how often each training sample was seen (over every replica and restart
    group), and per restart group the replica counts it trained on."""
    seen: dict[int, Counter] = defaultdict(Counter)
    sizes: dict[int, set[int]] = defaultdict(set)
    for path in glob.glob(os.path.join(share, "ids-g*-r*.jsonl")):
        group = int(re.search(r"ids-g(\d+)-r", path).group(1))
        with open(path) as f:
            for line in f:
                record = json.loads(line)
                seen[record["epoch"]].update(record["ids"])
                sizes[group].add(record["replicas"])
    return seen, sizes


def test_jobs_rescale_succeed_and_see_every_sample_once_per_epoch(server, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "train.py").write_text(SCRIPT)
    srv = server(
        "--nodes", "2", "--slots-per-node", "2", "--interval", "4", "--restart-delay", "3",
        "--checkpoint-interval", "2", "--hints-interval", "1", "--rescale-rounds", "1",
        "--grace", "30",
    )  # fmt: skip
    for i, (name, args) in enumerate(JOBS.items()):
        if i:
            time.sleep(4)
        srv.cli("submit", "--name", name, "--max-replicas", "4", "--", "python", "train.py",
                *args, cwd=str(work))  # fmt: skip
    details = {name: wait_job(srv, name, ("Succeeded", "Failed"), timeout=240) for name in JOBS}
    for name, detail in details.items():
        assert detail["status"] == "Succeeded", (name, detail, srv.cli("logs", name).stdout)

    rescales = {name: _rescales(d) for name, d in details.items()}
    assert any(new > old for r in rescales.values() for old, new in r), rescales
    assert any(new < old for r in rescales.values() for old, new in r), rescales

    state = srv.state_dir
    trained_on = {}
    for name in JOBS:
        share = os.path.join(state, "jobs", name, "share")
        with open(os.path.join(share, "final.json")) as f:
            final = json.load(f)
        epochs, samples = final["epochs"], final["samples"]
        seen, sizes = _seen(share)
        assert sorted(seen) == list(range(epochs)), (name, sorted(seen))
        for epoch, counts in seen.items():
            missing = set(range(samples)) - set(counts)
            twice = {i: k for i, k in counts.items() if k > 1}
            assert not missing and not twice and len(counts) == samples, (
                f"{name} epoch {epoch}: {len(missing)} samples missing, {len(twice)} seen more "
                f"than once (replica counts {dict(sizes)}, rescales {rescales[name]})"
            )
        # every group that trained did so on the replicas it was started with (a rescale's
        # target may change before its group starts, so the events of the start are the truth)
        started = _started(details[name])
        assert sizes and set(sizes) <= set(started), (name, dict(sizes), started)
        for group, trained in sizes.items():
            assert trained == {started[group]}, (name, group, trained, started)
        trained_on[name] = {started[group] for group in sizes}
    assert any(len(n) > 1 for n in trained_on.values()), (trained_on, rescales)

    moved = next(name for name in JOBS if rescales[name])
    srv.cli("cp", f"{moved}:final.json", str(tmp_path / "final.json"))
    got = json.loads((tmp_path / "final.json").read_text())
    assert got["workload"] == JOBS[moved][0]
    logs = srv.cli("logs", moved).stdout
    last = details[moved]["restarts"]
    assert last >= 1
    for group in (0, last):
        assert f"=== group {group} rank 0" in logs, logs[-3000:]
        assert f"group {group} rank 0 of" in logs, logs[-3000:]
    assert f"{JOBS[moved][0]} done" in logs
