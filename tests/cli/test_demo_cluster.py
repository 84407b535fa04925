"""``adaptrain demo --cluster``: the real command in a process of its own, an embedded server
with emulated nodes and three real training jobs. Its printed URL serves the dashboard and the
API its jobs went through; a Ctrl-C stops every process it started (none survives) and still
writes the summary and the plot of what ran; a short run ends by itself with every job done."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from _cli_cases import env, finish, sigint_default, wait_for

psutil = pytest.importorskip("psutil")

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the process trees are checked on Linux"
)

NAMES = {"digits-a", "charlm", "digits-b"}


def _start(out: Path, log: Path, minutes: float) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "adaptrain", "demo", "--cluster", "--minutes", str(minutes),
           "--out", str(out), "--no-bar"]  # fmt: skip
    with open(log, "w") as f:
        return subprocess.Popen(
            cmd, env=env(), stdout=f, stderr=subprocess.STDOUT, preexec_fn=sigint_default
        )


def _alive(procs: list) -> list[str]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{p.pid}: {' '.join(p.cmdline())[:200]}")
        except psutil.Error:
            pass
    return out


def _mentioning(text: str) -> list[str]:
    """Processes whose command line names ``text`` (the demo's output folder)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info.get("cmdline") or [])
        if text in cmd:
            found.append(f"{p.pid}: {cmd[:200]}")
    return found


def _kill_all(proc: subprocess.Popen, tree: list) -> None:
    finish(proc)
    for p in tree:
        try:
            p.kill()
        except psutil.Error:
            pass


def _png(path: Path) -> bool:
    return path.exists() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_demo_serves_its_dashboard_and_ctrl_c_leaves_no_process(tmp_path):
    out, log = tmp_path / "demo", tmp_path / "demo.log"
    proc = _start(out, log, minutes=3)
    tree: list = []
    try:
        text = wait_for(proc, log, r"dashboard at http://\S+/", 90)
        url = re.search(r"dashboard at (http://\S+)/", text).group(1)
        assert url.startswith("http://127.0.0.1:")  # loopback only
        page = httpx.get(url + "/", timeout=10)
        assert page.status_code == 200 and "static/dashboard.js" in page.text
        assert httpx.get(url + "/static/dashboard.js", timeout=10).status_code == 200

        def running() -> list[dict] | None:
            jobs = httpx.get(url + "/jobs", timeout=10).json()
            live = [j for j in jobs if j["replicas"] > 0]
            return jobs if {j["name"] for j in jobs} == NAMES and len(live) >= 2 else None

        deadline = time.monotonic() + 120
        jobs = None
        while jobs is None:  # the three jobs arrive a few seconds apart, two of them run
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, (
                log.read_text()[-3000:],
                httpx.get(url + "/jobs").text,
            )
            jobs = running()
            time.sleep(0.5)
        tree = psutil.Process(proc.pid).children(recursive=True)
        launchers = [p for p in tree if "adaptrain.service.launcher" in " ".join(p.cmdline())]
        replicas = [p for p in tree if "adaptrain.cli._cluster_job" in p.cmdline()]
        assert len(launchers) >= 2 and len(replicas) >= 2, [p.cmdline() for p in tree]

        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=90)
        text = log.read_text()
        assert rc == 130, text[-3000:]
        assert "interrupted; the jobs checkpoint and stop" in text
        assert "Traceback" not in text, text[-3000:]
        deadline = time.monotonic() + 10
        while _alive(tree) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _alive(tree) == [], f"alive 10 s after the demo ended: {_alive(tree)}"
        assert _mentioning(str(out)) == []
        # what ran until then: the summary and the plot
        summary = json.loads((out / "summary.json").read_text())
        assert {j["name"] for j in summary["jobs"]} == NAMES
        assert _png(out / "allocations.png")
        assert "digits-a" in text and "allocations.png" in text
        with pytest.raises(httpx.HTTPError):  # the server went with it
            httpx.get(url + "/jobs", timeout=5)
    finally:
        _kill_all(proc, tree)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_short_demo_ends_by_itself_with_a_summary_and_a_plot(tmp_path):
    out, log = tmp_path / "demo", tmp_path / "demo.log"
    proc = _start(out, log, minutes=0.5)
    try:
        rc = proc.wait(timeout=240)
        text = log.read_text()
        assert rc == 0, text[-3000:]
    finally:
        finish(proc)
    assert "Traceback" not in text, text[-3000:]
    assert re.search(r"\[\s*\d+ s\] submitted digits-b", text), text
    summary = json.loads((out / "summary.json").read_text())
    jobs = {j["name"]: j for j in summary["jobs"]}
    assert set(jobs) == NAMES
    assert {j["status"] for j in jobs.values()} == {"Succeeded"}, jobs
    assert summary["rounds"] >= 3 and 0 < summary["utilisation"] <= 1
    assert any(j["replicas"] for j in jobs.values())  # held slots in the rounds recorded
    assert _png(out / "allocations.png")
    txt = (out / "summary.txt").read_text()
    assert txt in text and "rounds" in txt and "--state-dir" in txt
    assert _mentioning(str(out)) == []


def test_bad_cluster_arguments_are_refused_before_anything_starts(tmp_path):
    for bad, flag in ((["--minutes", "0"], "--minutes"), (["--nodes", "0"], "--nodes")):
        res = subprocess.run(
            [sys.executable, "-m", "adaptrain", "demo", "--cluster", "--out", str(tmp_path / "o"),
             *bad],
            env=env(), capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert res.returncode == 2 and flag in res.stderr, res.stderr
        assert not (tmp_path / "o" / "state").exists()
