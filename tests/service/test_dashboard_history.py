"""What the dashboard charts: a job's hints over time and the cluster's rounds, recorded by the
controller in the state database (a schema migration, bounded tables) and served by small JSON
endpoints under the API's token rule; and the speedup every job view carries, computed from the
job's goodput model once per hints and allocation."""

from __future__ import annotations

import json
import os
import sqlite3
import sys
import time

import httpx
import pytest
from _service_jobs import http, wait_for, wait_job

from adaptrain.service.reports import speedup_from_hints
from adaptrain.service.store import MIGRATIONS, SCHEMA_VERSION, JobRecord, SampleRecord, Store

TOKEN = "dashboard-token-0123456789"

#: hints as rank 0 of a small character LM posted them (a fitted goodput model)
HINTS = {
    "initBatchSize": 32,
    "maxBatchSize": 512,
    "localBszBounds": [16, 128],
    "maxProfiledReplicas": 2,
    "gradientAccumulation": False,
    "gradParams": {"norm": 0.0218, "var": 0.364},
    "perfParams": {
        "alpha_c": 0.0695,
        "beta_c": 6.82e-05,
        "alpha_n": 9.8e-07,
        "beta_n": 1.1e-08,
        "alpha_r": 8.9e-07,
        "beta_r": 1e-08,
        "gamma": 1.015,
    },
    "progress": {"epoch": 3, "samples": 0, "progress": 1000.0},
    "batchSize": 128,
    "atomicBsz": 128,
    "accumSteps": 1,
    "gain": 3.42,
    "goodput": 1399.7,
    "throughput": 1636.8,
}

#: rank 0 posts three hints (batch sizes 32, 64, 128) with the job's own token, then waits
POSTER = """
import json, os, sys, time, httpx
if os.environ["ADAPTRAIN_REPLICA_RANK"] == "0":
    url, job = os.environ["ADAPTRAIN_SUPERVISOR_URL"], os.environ["ADAPTRAIN_JOB_ID"]
    auth = {"Authorization": "Bearer " + os.environ["ADAPTRAIN_JOB_TOKEN"]}
    hints = json.loads(sys.argv[1])
    for i, bsz in enumerate((32, 64, 128)):
        body = dict(hints, batchSize=bsz, gain=1.0 + i, goodput=100.0 * (i + 1),
                    throughput=200.0 * (i + 1))
        httpx.put(url + "/hints/" + job, json=body, headers=auth, timeout=10).raise_for_status()
        time.sleep(0.3)
    print("posted", flush=True)
time.sleep(120)
"""


def test_a_version_1_database_gains_the_history_tables(tmp_path):
    path = str(tmp_path / "state.db")
    db = sqlite3.connect(path)
    db.executescript(MIGRATIONS[0])
    db.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT)")
    db.execute("INSERT INTO meta VALUES ('schema_version', '1')")
    db.execute(
        "INSERT INTO jobs (name, spec, token, phase, submitted) VALUES ('old', '{}', 't', "
        "'Succeeded', 1.0)"
    )
    db.commit()
    db.close()
    store = Store(path)
    try:
        assert SCHEMA_VERSION == 2
        assert store.job("old").phase == "Succeeded"  # kept
        store.add_sample("old", SampleRecord(5.0, 2, 64, 1.5, 10.0, 20.0))
        assert store.samples("old") == [SampleRecord(5.0, 2, 64, 1.5, 10.0, 20.0)]
        store.add_round(6.0, 1, 4, {"old": 2, "idle": 0})
        (r,) = store.rounds()
        assert (r.used, r.total, r.held) == (2, 4, {"old": 2})
    finally:
        store.close()
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT value FROM meta").fetchone()[0] == "2"


def test_samples_and_rounds_are_bounded_keeping_the_newest(tmp_path):
    store = Store(str(tmp_path / "state.db"))
    try:
        keep = 100  # above the pruning period: pruned in batches, never below keep
        for i in range(1000):
            for job in ("a", "b", "c"):  # interleaved: the row ids of one job are not regular
                store.add_sample(job, SampleRecord(float(i), 1, i + 1), keep=keep)
        for job in ("a", "b", "c"):
            kept = store.samples(job, limit=10_000)
            assert keep <= len(kept) < keep + 64, (job, len(kept))
            assert [s.batch_size for s in kept] == list(range(1001 - len(kept), 1001))
        assert [s.batch_size for s in store.samples("a", since=997.0)] == [999, 1000]
        assert [s.batch_size for s in store.samples("a", limit=2)] == [999, 1000]
        for i in range(500):
            store.add_round(float(i), i, 4, {"a": i % 3}, keep=keep)
        rounds = store.rounds(limit=10_000)
        assert keep <= len(rounds) < keep + 64
        assert rounds[-1].round == 499 and rounds[-1].held == ({"a": 1} if 499 % 3 else {})
        assert [r.round for r in store.rounds(since=497.0)] == [498, 499]
    finally:
        store.close()


def test_the_speedup_is_computed_once_per_hints_and_allocation(tmp_path, monkeypatch):
    """``GET /jobs`` of 1,000 jobs with goodput models: each job's speedup at its allocation
    is its model's, computed on the first listing only; new hints or a new allocation recompute
    that job's alone."""
    from fastapi.testclient import TestClient

    from adaptrain.service import controller as controller_module
    from adaptrain.service.api import create_app
    from adaptrain.service.config import ServerConfig
    from adaptrain.service.controller import Controller
    from adaptrain.service.local import LocalBackend, make_nodes
    from adaptrain.service.models import JobSpec

    calls: list[int] = []

    def counted(*args, **kwargs):
        calls.append(1)
        return speedup_from_hints(*args, **kwargs)

    monkeypatch.setattr(controller_module, "speedup_from_hints", counted)
    state = tmp_path / "state"
    config = ServerConfig(state_dir=str(state))
    backend = LocalBackend(make_nodes(nodes=4, slots_per_node=4), str(state / "runs"))
    controller = Controller(config, backend, "http://127.0.0.1:9")
    spec = JobSpec(command=["true"], max_replicas=4).model_dump(exclude={"workdir"})
    with controller.store.transaction():
        for i in range(1000):
            controller.store.add_job(
                JobRecord(
                    name=f"j{i}",
                    spec=spec,
                    token="t",
                    phase="Running",
                    submitted=float(i),
                    group=0,
                    allocation=[f"node-{i % 4}"] * (1 + i % 4),
                    hints=HINTS,
                    hints_time=1.0,
                )
            )
    model = speedup_from_hints(HINTS, 4, 16)
    try:
        client = TestClient(create_app(controller))
        t0 = time.perf_counter()
        first = client.get("/jobs").json()
        t_first = time.perf_counter() - t0
        assert len(first) == 1000 and len(calls) == 1000
        for job in first:
            replicas = 1 + int(job["name"][1:]) % 4
            assert job["speedup"] == pytest.approx(model(1, replicas)), job
        assert {round(j["speedup"], 6) for j in first} == {
            round(model(1, r), 6) for r in (1, 2, 3, 4)
        }
        assert model(1, 4) > model(1, 1) == 1.0

        calls.clear()
        t0 = time.perf_counter()
        second = client.get("/jobs").json()
        t_second = time.perf_counter() - t0
        assert calls == []
        assert [j["speedup"] for j in second] == [j["speedup"] for j in first]
        print(f"GET /jobs of 1000 jobs: {t_first:.2f} s computing, {t_second:.2f} s cached")
        assert t_second < 2.0, t_second

        controller.put_hints("j5", dict(HINTS, batchSize=64))  # new hints
        controller.store.update_job("j6", allocation=["node-0", "node-1"])  # a new allocation
        third = {j["name"]: j for j in client.get("/jobs").json()}
        assert len(calls) == 2
        assert third["j6"]["speedup"] == pytest.approx(model(2, 2))
        assert third["j5"]["speedup"] == pytest.approx(model(1, 2))
        controller.store.update_job("j7", allocation=[])  # no allocation, no speedup
        assert client.get("/jobs/j7").json()["speedup"] is None
    finally:
        controller.store.close()


@pytest.mark.timeout(120)
def test_history_endpoints_serve_a_jobs_hints_and_the_rounds(server, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    srv = server("--slots", "2", "--interval", "1", "--grace", "5", "--token-file",
                 str(token_file))  # fmt: skip
    spec = {"name": "poster", "command": [sys.executable, "-c", POSTER, json.dumps(HINTS)],
            "max_replicas": 1}  # fmt: skip
    with http(srv, TOKEN) as c:
        assert c.post("/jobs", json=spec).status_code == 201
        wait_job(srv, "poster", ("Running",), token=TOKEN)

        def history(**params) -> list[dict]:
            return c.get("/jobs/poster/history", params=params).json()["samples"]

        def three_hinted() -> list[dict] | None:
            got = history()
            return got if sum(s["batch_size"] is not None for s in got) == 3 else None

        samples = wait_for(three_hinted, 30, "three samples of hints")
        start, *hinted = samples  # its allocation's start, then each post of hints
        assert start["replicas"] == 1 and start["batch_size"] is None and start["gain"] is None
        assert [s["batch_size"] for s in hinted] == [32, 64, 128]
        assert [s["gain"] for s in hinted] == [1.0, 2.0, 3.0]
        assert [s["goodput"] for s in hinted] == [100.0, 200.0, 300.0]
        assert [s["throughput"] for s in hinted] == [200.0, 400.0, 600.0]
        assert {s["replicas"] for s in hinted} == {1}
        assert samples == sorted(samples, key=lambda s: s["time"])
        assert [s["batch_size"] for s in history(since=hinted[0]["time"])] == [64, 128]
        later = c.get("/jobs/poster/history", params={"limit": 1}).json()
        assert [s["batch_size"] for s in later["samples"]] == [128]
        assert later["tensorboard_logdir"] == os.path.join(
            os.path.abspath(srv.state_dir), "jobs", "poster", "tensorboard"
        )
        # the job's view: its speedup at 1 replica, from the model it posted
        (view,) = c.get("/jobs").json()
        assert view["speedup"] == pytest.approx(speedup_from_hints(HINTS, 1, 2)(1, 1))
        # the rounds: the job holds one of the two slots
        rounds = wait_for(
            lambda: [r for r in c.get("/cluster/history").json()["rounds"] if r["jobs"]],
            30,
            "a round with the job",
        )
        assert rounds[-1]["jobs"] == {"poster": 1} and rounds[-1]["total"] == 2
        assert rounds[-1]["used"] == 1
        slots = c.get("/cluster/slots").json()
        assert [n["slots"] for n in slots["nodes"]] == [["poster", None]]
        # the log pane's tail: the last bytes of the job's output
        wait_for(lambda: b"posted" in c.get("/jobs/poster/logs").content, 30, "the output")
        tail = c.get("/jobs/poster/logs", params={"tail": 7})
        assert tail.content == b"posted\n" and tail.headers["X-Next-Offset"] == str(
            len(c.get("/jobs/poster/logs").content)
        )
        assert c.get("/jobs/nobody/history").status_code == 404
        assert c.get("/jobs/Not_A_Name/history").status_code == 400
        assert c.get("/cluster/history", params={"since": "nan"}).status_code == 422
    for token in (None, "wrong-token-0123456789"):
        with http(srv, token) as c:
            for path in ("/jobs/poster/history", "/cluster/history", "/cluster/slots"):
                resp = c.get(path)
                assert resp.status_code == 401 and "token" in resp.json()["detail"], path
    # the page itself holds no data: served to anyone, with a policy that loads only its own
    page = httpx.get(srv.url + "/")
    assert page.status_code == 200 and "dashboard.js" in page.text
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert httpx.get(srv.url + "/static/dashboard.js").status_code == 200
