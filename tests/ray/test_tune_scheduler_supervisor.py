"""A trial's supervisor: rank 0's hints and results reach the trainable over real HTTP, and a
result's poster waits until Tune asks for the next one (no Ray cluster needed)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from adaptrain.ray._tune_supervisor import TrialSupervisor
from adaptrain.ray.tune import report
from adaptrain.torch._hints import HintsReporter

TOKEN = "s3cret"


@pytest.fixture
def supervisor(monkeypatch):
    sup = TrialSupervisor("trial_0001", TOKEN)
    monkeypatch.setenv("ADAPTRAIN_SUPERVISOR_URL", sup.url)
    monkeypatch.setenv("ADAPTRAIN_JOB_ID", "trial_0001")
    monkeypatch.setenv("ADAPTRAIN_JOB_TOKEN", TOKEN)
    monkeypatch.setenv("ADAPTRAIN_REPLICA_RANK", "0")
    yield sup
    sup.close()


def _report_in_thread(**metrics) -> threading.Thread:
    thread = threading.Thread(target=report, kwargs=metrics, daemon=True)
    thread.start()
    return thread


@pytest.mark.timeout(60)
def test_a_result_waits_for_tune_to_ask_for_the_next(supervisor):
    poster = _report_in_thread(mean_accuracy=0.5, epoch=0)
    assert supervisor.next_result(timeout=10) == {"mean_accuracy": 0.5, "epoch": 0}
    poster.join(0.5)
    assert poster.is_alive(), "report() returned before Tune asked for the next result"
    supervisor.release()
    poster.join(10)
    assert not poster.is_alive()
    assert supervisor.next_result(timeout=0.1) is None


@pytest.mark.timeout(60)
def test_results_posted_while_stopping_are_kept_in_order(supervisor):
    first = _report_in_thread(epoch=0)
    assert supervisor.next_result(timeout=10) == {"epoch": 0}
    second = _report_in_thread(epoch=1)  # posted, not handed over yet
    deadline = time.monotonic() + 10
    while supervisor._results.qsize() == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert supervisor.stop() == [{"epoch": 1}]
    first.join(10)
    second.join(10)
    assert not first.is_alive() and not second.is_alive()
    report(epoch=2)  # while stopping: answered at once, kept for after the restart
    assert supervisor.late_results() == [{"epoch": 1}, {"epoch": 2}]
    supervisor.reopen()
    assert supervisor.late_results() == []


@pytest.mark.timeout(60)
def test_rank0_hints_reporter_posts_to_the_supervisor(supervisor):
    reporter = HintsReporter(supervisor.url, "trial_0001", TOKEN, interval=1.0)
    try:
        reporter.offer({"initBatchSize": 32, "perfParams": None, "profile": []})
        deadline = time.monotonic() + 20
        while reporter.posted < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        reporter.close(timeout=5)
    assert reporter.posted == 1, reporter.last_error
    assert supervisor.hints == {"initBatchSize": 32, "perfParams": None, "profile": []}
    # another job's secret is refused
    wrong = HintsReporter(supervisor.url, "trial_0001", "not-it", interval=1.0, backoff=0.1)
    try:
        wrong.offer({"initBatchSize": 1})
        deadline = time.monotonic() + 20
        while wrong.failures < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        wrong.close(timeout=5)
    assert wrong.failures >= 1 and "401" in (wrong.last_error or ""), wrong.last_error
    assert supervisor.hints["initBatchSize"] == 32


@pytest.mark.timeout(60)
def test_a_request_for_another_trial_or_without_the_token_is_refused(supervisor):
    def post(path: str, token: str | None) -> int:
        request = urllib.request.Request(
            supervisor.url + path, data=json.dumps({"metrics": {}}).encode(), method="POST"
        )
        if token:
            request.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status
        except urllib.error.HTTPError as exc:
            return exc.code

    assert post("/report/trial_0001", None) == 401
    assert post("/report/trial_0002", TOKEN) == 404
    assert post("/report/trial_0001/x", TOKEN) == 404


def test_report_outside_a_trial_warns_once_and_does_nothing(monkeypatch, caplog):
    import adaptrain.ray.tune as tune_module

    monkeypatch.delenv("ADAPTRAIN_SUPERVISOR_URL", raising=False)
    monkeypatch.setattr(tune_module, "_warned_outside", False)
    with caplog.at_level("WARNING", logger="adaptrain.ray.tune"):
        report({"mean_accuracy": 1.0})  # no supervisor: a warning, no error
        report(mean_accuracy=1.0)
    warnings = [r for r in caplog.records if "outside an adaptive Tune trial" in r.getMessage()]
    assert len(warnings) == 1


@pytest.mark.timeout(120)
def test_a_replica_imports_neither_tune_nor_the_scheduler():
    """The replica processes only need ``report``: importing ``adaptrain.ray.tune`` must not
    pull in ``ray.tune`` (seconds of start-up on every replica of every restart)."""
    code = (
        "import sys, adaptrain.ray.tune, adaptrain.ray._tune_replica; "
        "print(sorted(m for m in sys.modules if m.startswith(('ray.tune', 'adaptrain.sched'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=100, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout
