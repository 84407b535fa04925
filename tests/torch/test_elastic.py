"""Exactly-once across real interrupt/resume cycles with changing replica counts (1→2→3→1).

Every run is a group of real processes running ``_elastic_train.py`` (ADAPTRAIN_* variables, one
run under torchrun), interrupted mid-epoch by a real SIGTERM that one rank sends itself; the
next run resumes from the checkpoint on another number of replicas. The sample ids recorded
by every rank of every run must cover each epoch's training and evaluation sets exactly once.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from adaptrain.dist.spawn import free_port

SCRIPT = str(Path(__file__).with_name("_elastic_train.py"))
N_TRAIN, N_EVAL, EPOCHS = 157, 100, 3
TIMEOUT = 150
# Stop polls at every step (poll period 0), so that each stop lands in the phase it is planned
# for; the default period (fast steps poll every few steps) is tested in test_signals.py.
STOP_AT = ("--poll-period", "0", "--stop-after")

_STRIP = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
)


def _base_env(ckpt: Path) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k not in _STRIP and not k.startswith("ADAPTRAIN_")
    }
    env.update(ADAPTRAIN_CHECKPOINT_PATH=str(ckpt), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def run_group(n: int, ckpt: Path, out: Path, tag: str, *args: str) -> list[int]:
    """Run n replicas with ADAPTRAIN_* variables; return their exit codes (rank order)."""
    port = free_port()
    procs = []
    for r in range(n):
        env = _base_env(ckpt)
        env.update(
            ADAPTRAIN_MASTER_ADDR="127.0.0.1",
            ADAPTRAIN_MASTER_PORT=str(port),
            ADAPTRAIN_NUM_REPLICAS=str(n),
            ADAPTRAIN_REPLICA_RANK=str(r),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, SCRIPT, "--out", str(out), "--tag", tag, *args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    codes, logs = [], []
    try:
        for p in procs:
            stdout, _ = p.communicate(timeout=TIMEOUT)
            codes.append(p.returncode)
            logs.append(stdout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(c not in (0, 143, 130) for c in codes):
        pytest.fail(f"run {tag}: exit codes {codes}\n" + "\n".join(x[-3000:] for x in logs))
    return codes


def run_torchrun(n: int, ckpt: Path, out: Path, tag: str, *args: str) -> int:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={n}",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        SCRIPT,
        "--out",
        str(out),
        "--tag",
        tag,
        *args,
    ]
    p = subprocess.run(cmd, env=_base_env(ckpt), capture_output=True, text=True, timeout=TIMEOUT)
    return p.returncode


def _records(out: Path) -> list[dict]:
    rows = []
    for f in sorted(out.glob("*.jsonl")):
        rows += [json.loads(line) for line in f.read_text().splitlines()]
    return rows


def _assert_exactly_once(rows: list[dict]) -> None:
    for epoch in range(EPOCHS):
        for phase, ids in (("train", range(N_TRAIN)), ("eval", range(N_TRAIN, N_TRAIN + N_EVAL))):
            seen = collections.Counter(
                i for r in rows if r["phase"] == phase and r["epoch"] == epoch for i in r["ids"]
            )
            dup = {i: c for i, c in seen.items() if c > 1}
            missing = set(ids) - set(seen)
            assert not dup, f"epoch {epoch} {phase}: duplicated ids {dup}"
            assert not missing, f"epoch {epoch} {phase}: missing ids {sorted(missing)}"
            assert set(seen) == set(ids)
        acc = [r for r in rows if r["phase"] == "acc" and r["epoch"] == epoch]
        # The Accumulator over the (non-padded) evaluation loop is exact, across restarts.
        assert [a["n"] for a in acc] == [N_EVAL], acc


@pytest.mark.timeout(600)
def test_exactly_once_1_2_3_1_with_signals(tmp_path: Path) -> None:
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    ckpt.mkdir()
    out.mkdir()
    # 1 replica, SIGTERM after 5 micro-batches: stops inside epoch 0's training loop.
    assert run_group(1, ckpt, out, "r1", *STOP_AT, "5") == [143]
    # 2 replicas under torchrun, rank 1 signals itself: stops inside epoch 0's evaluation.
    rc = run_torchrun(2, ckpt, out, "r2", *STOP_AT, "9", "--stop-rank", "1")
    assert rc != 0  # torchrun reports the (deliberately) interrupted workers
    # 3 replicas, rank 2 signals itself: stops inside epoch 1's training loop.
    assert run_group(3, ckpt, out, "r3", *STOP_AT, "8", "--stop-rank", "2") == [143] * 3
    # 1 replica runs to the end.
    assert run_group(1, ckpt, out, "r4") == [0]

    rows = _records(out)
    by_run = collections.defaultdict(set)
    for f in out.glob("*.jsonl"):
        tag = f.name.split("-")[0]
        by_run[tag] |= {
            (r["phase"], r.get("epoch")) for r in map(json.loads, f.read_text().split("\n")[:-1])
        }
    # Each run did some work and the interrupted ones stopped where planned.
    assert ("train", 0) in by_run["r1"] and ("eval", 0) not in by_run["r1"]
    assert ("eval", 0) in by_run["r2"] and ("train", 1) not in by_run["r2"]
    assert ("train", 1) in by_run["r3"] and ("eval", 1) not in by_run["r3"]
    assert ("done", None) in by_run["r4"]
    assert len(list(out.glob("r2-rank*.jsonl"))) == 2 and len(list(out.glob("r3-rank*"))) == 3
    _assert_exactly_once(rows)
    # Only the newest complete checkpoint is kept; no temporary directory is left.
    assert [p.name for p in ckpt.iterdir()] == ["checkpoint-000002"]


@pytest.mark.timeout(400)
def test_exactly_once_with_autoscale_and_accumulation(tmp_path: Path) -> None:
    """Gradient accumulation: a stop never cuts an accumulation cycle; 2 → 1 replicas."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    ckpt.mkdir()
    out.mkdir()
    common = ["--autoscale", "48", "--local-max", "4", "--grad-accum", "--epochs", "2"]
    # 2 replicas: local 3 × 2 micro-batches (global 12); rank 0 is signalled after 4.
    assert run_group(2, ckpt, out, "a2", *common, *STOP_AT, "4") == [143, 143]
    assert run_group(1, ckpt, out, "a1", *common) == [0]
    rows = _records(out)
    for f in out.glob("a2-rank*.jsonl"):
        train = [json.loads(x) for x in f.read_text().splitlines()]
        train = [r for r in train if r["phase"] == "train"]
        assert train[-1]["optim"], f"{f.name}: stopped inside an accumulation cycle"
        assert any(not r["optim"] for r in train)  # accumulation did happen
        assert {r["bsz"] for r in train} == {12}
    for epoch in range(2):
        seen = collections.Counter(
            i for r in rows if r["phase"] == "train" and r["epoch"] == epoch for i in r["ids"]
        )
        assert seen == collections.Counter(range(N_TRAIN)), f"epoch {epoch}"
        ev = collections.Counter(
            i for r in rows if r["phase"] == "eval" and r["epoch"] == epoch for i in r["ids"]
        )
        assert ev == collections.Counter(range(N_TRAIN, N_TRAIN + N_EVAL))
