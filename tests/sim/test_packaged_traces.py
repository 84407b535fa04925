"""The Pollux artifact's per-model traces ship inside the package: ``adaptrain simulate`` needs no
``--traces`` outside a checkout, and a built wheel holds them."""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import adaptrain.sim
from adaptrain.sim.traces import PACKAGED_TRACES, default_traces_dir, load_applications

MODELS = ("bert", "cifar10", "deepspeech2", "imagenet", "ncf", "yolov3")
REPO = Path(__file__).resolve().parents[2]
SHARED_TRACES = REPO.parent / "shared" / "data" / "pollux" / "traces"


def _csvs(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.glob("*/*.csv"))


def test_default_traces_dir_is_the_packaged_folder():
    traces = default_traces_dir()
    assert traces == PACKAGED_TRACES
    assert Path(traces).parent.parent == Path(adaptrain.sim.__file__).parent  # in the package
    assert sorted(p.name for p in Path(traces).iterdir() if p.is_dir()) == list(MODELS)
    notice = (Path(traces) / "NOTICE").read_text()
    assert "c793c7089bd307462686339d29707925c461f9a9" in notice and "Apache" in notice
    assert "Apache License" in (Path(traces) / "LICENSE").read_text()


def test_packaged_traces_load():
    apps = load_applications(default_traces_dir())
    assert sorted(apps) == list(MODELS)
    assert apps["yolov3"].max_local_bsz == 8  # the artifact's override applies
    step, sync = apps["cifar10"].get_throughput((1,), 128)
    assert step > 0 and sync >= 0


def test_packaged_traces_equal_the_artifact_copy():
    if not SHARED_TRACES.is_dir():
        pytest.skip("artifact traces not present beside the checkout")
    packaged = Path(default_traces_dir())
    assert _csvs(packaged) == [c for c in _csvs(SHARED_TRACES) if c.split("/")[0] in MODELS]
    for rel in _csvs(packaged):
        assert filecmp.cmp(packaged / rel, SHARED_TRACES / rel, shallow=False), rel
    assert not (packaged / "philly.csv").exists()  # the simulator reads no job trace


def _simulate_two_jobs(folder: Path, env: dict[str, str] | None = None) -> dict:
    """``python -m adaptrain simulate`` without ``--traces``, run in ``folder`` on a workload of
    two jobs written there: its JSON summary."""
    workload = folder / "workload.csv"
    workload.write_text(
        "name,time,application,num_replicas,batch_size\n"
        "ncf-0,0,ncf,1,256\n"
        "cifar10-1,30,cifar10,2,128\n"
    )
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "adaptrain",
            "simulate",
            str(workload),
            "--policy",
            "tiresias",
            "--json",
            "--nodes",
            "2",
            "--fit-workers",
            "0",
        ],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_simulate_without_traces_from_any_folder(tmp_path):
    """Run from a folder outside the checkout: the default traces are the packaged ones."""
    out = _simulate_two_jobs(tmp_path)
    assert out["num_jobs"] == 2 and out["avg_jct"] > 0


def test_wheel_holds_the_traces(tmp_path):
    """A non-editable wheel, built offline from a copy of the project, carries every CSV and
    the licence files."""
    src = tmp_path / "project"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(
        REPO / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
    )
    out = tmp_path / "wheels"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-q",
            "-w",
            str(out),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    if res.returncode != 0 and "setuptools" in res.stderr and "No module named" in res.stderr:
        pytest.skip("setuptools is not installed: no wheel can be built offline")
    assert res.returncode == 0, res.stderr
    (wheel,) = out.glob("adaptrain-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    prefix = "adaptrain/sim/data/traces/"
    packaged = {prefix + c for c in _csvs(Path(PACKAGED_TRACES))}
    assert len(packaged) >= len(MODELS) * 3
    assert packaged <= names
    assert {prefix + "NOTICE", prefix + "LICENSE"} <= names

    # the wheel's files alone, first on the path: the simulator runs on its traces
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    env = dict(os.environ, PYTHONPATH=str(site))
    where = subprocess.run(
        [sys.executable, "-c", "import adaptrain.sim.traces as t; print(t.default_traces_dir())"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert where.stdout.strip() == str(site / "adaptrain" / "sim" / "data" / "traces")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    installed, checkout = _simulate_two_jobs(run_dir, env), _simulate_two_jobs(tmp_path)
    for out in (installed, checkout):
        out.pop("policy_s_per_round")  # a timing
    assert installed == checkout
