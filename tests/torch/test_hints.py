"""Scheduling hints from rank 0 to a real supervisor (``adaptrain.torch._hints``).

Every test runs real training processes (``_supervised_train.py``: the digits MLP with adaptive
batch size, one process per replica, gloo) against a real FastAPI app served by uvicorn on
127.0.0.1 from a thread of the test (stopped by the test, and after a time limit in any case).
The app records every PUT (time, path, Authorization header, body) and answers as its mode
says: 204, 500 for a while, or only after 10 s (past the reporter's 5 s timeout); a supervisor
that is down is a port nobody listens on. Bodies are checked against the service contract
(/work/notes/service_api.md), written here as strict pydantic models.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import pytest
import uvicorn
from _supervised_train import replica_env
from fastapi import FastAPI, Request, Response
from pydantic import BaseModel, ConfigDict, Field, model_validator

from adaptrain import env

pytestmark = pytest.mark.slow

SCRIPT = str(Path(__file__).with_name("_supervised_train.py"))
JOB = "digits-job"
WARNING = "cannot post to the supervisor"
RECOVERED = "accepts posts again"


# ----- the contract ---------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


NonNegInt = Annotated[int, Field(ge=0)]
PosInt = Annotated[int, Field(ge=1)]
NonNeg = Annotated[float, Field(ge=0)]


class _GradParams(_Strict):
    norm: NonNeg
    var: NonNeg


class _PerfParams(_Strict):
    alpha_c: float
    beta_c: float
    alpha_n: float
    beta_n: float
    alpha_r: float
    beta_r: float
    gamma: float


class _ProfileRow(_Strict):
    numNodes: int
    numReplicas: int
    atomicBsz: int
    stepTime: Annotated[float, Field(gt=0)]
    syncTime: NonNeg
    count: PosInt


class _Progress(_Strict):
    epoch: NonNegInt
    samples: NonNegInt
    progress: NonNeg


class Hints(_Strict):
    initBatchSize: PosInt
    maxBatchSize: int | None
    localBszBounds: tuple[PosInt, int] | None
    maxProfiledReplicas: NonNegInt
    gradientAccumulation: bool
    gradParams: _GradParams | None
    perfParams: _PerfParams | None
    profile: list[_ProfileRow]
    progress: _Progress
    batchSize: int | None
    atomicBsz: int | None
    accumSteps: int | None
    gain: float | None
    goodput: float | None
    throughput: float | None

    @model_validator(mode="after")
    def _limits(self) -> Hints:
        if self.maxBatchSize is not None and self.maxBatchSize < self.initBatchSize:
            raise ValueError("maxBatchSize < initBatchSize")
        return self


# ----- a real supervisor ----------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _app(record: list[dict[str, Any]], mode: str, fail_for: float) -> FastAPI:
    """The hints endpoint: records each PUT; ``mode`` "ok" (204), "error" (500 for the first
    ``fail_for`` seconds after the first request, then 204) or "hang" (answers after 10 s)."""
    app = FastAPI()
    first: list[float] = []

    @app.put("/hints/{job_id}")
    async def hints(job_id: str, request: Request) -> Response:
        now = time.time()
        first[:] = first or [now]
        raw = (await request.body()).decode()
        failing = mode == "error" and now - first[0] < fail_for
        record.append(
            {
                "t": now,
                "job": job_id,
                "auth": request.headers.get("authorization"),
                "raw": raw,
                "body": json.loads(raw),
                "failed": failing or mode == "hang",
            }
        )
        if mode == "hang":
            with contextlib.suppress(asyncio.CancelledError):  # the server's stop ends it
                await asyncio.sleep(10)
        return Response(status_code=500 if failing else 204)

    return app


@contextlib.contextmanager
def supervisor(mode: str = "ok", fail_for: float = 0.0, limit: float = 120.0) -> Iterator[Any]:
    """Serve the app on 127.0.0.1 from a thread; yields ``(url, record)``; stopped on exit,
    or after ``limit`` seconds whatever happens."""
    record: list[dict[str, Any]] = []
    port = _free_port()
    config = uvicorn.Config(
        _app(record, mode, fail_for),
        host="127.0.0.1",
        port=port,
        log_level="warning",
        timeout_graceful_shutdown=1,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="test-supervisor", daemon=True)
    thread.start()
    timer = threading.Timer(limit, lambda: setattr(server, "should_exit", True))
    timer.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}", record
    finally:
        timer.cancel()
        server.should_exit = True
        thread.join(15)


# ----- real training runs ---------------------------------------------------------------------


def train(
    out: Path, url: str | None, replicas: int = 1, seconds: float = 6.0, interval: float = 2.5
) -> tuple[list[list[dict[str, Any]]], list[str]]:
    """Run the training on ``replicas`` gloo processes (rank r sends token ``tok-r``); the
    per-rank step records (the last one the end record) and stderr texts."""
    out.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    procs = []
    for rank in range(replicas):
        e = replica_env(
            port,
            replicas,
            rank,
            ADAPTRAIN_JOB_ID=JOB,
            ADAPTRAIN_JOB_TOKEN=f"tok-{rank}",
            ADAPTRAIN_HINTS_INTERVAL=str(interval),
        )
        if url is not None:
            e["ADAPTRAIN_SUPERVISOR_URL"] = url
        err = open(out / f"rank{rank}.err", "w")
        cmd = [sys.executable, SCRIPT, "--out", str(out), "--seconds", str(seconds)]
        procs.append(subprocess.Popen(cmd, env=e, stderr=err, stdout=subprocess.DEVNULL))
        err.close()
    try:
        for p in procs:
            assert p.wait(timeout=150) == 0, (out / "rank0.err").read_text()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    logs = []
    for rank in range(replicas):
        with open(out / f"run-rank{rank}.jsonl") as f:
            logs.append([json.loads(line) for line in f])
    return logs, [(out / f"rank{r}.err").read_text() for r in range(replicas)]


def _changes(steps: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """When each batch-size change happened in a rank's step records: between the end of the
    last step at the old size and the end of the first one at the new size (the post is
    offered at the start of that step)."""
    return [(a["t"], b["t"]) for a, b in zip(steps, steps[1:]) if b["bsz"] != a["bsz"]]


# ----- tests ----------------------------------------------------------------------------------


def test_env_accessors(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "ADAPTRAIN_JOB_TOKEN",
        "ADAPTRAIN_HINTS_INTERVAL",
        "ADAPTRAIN_CHECKPOINT_INTERVAL",
    ):
        monkeypatch.delenv(name, raising=False)
    assert env.job_token() is None
    assert env.hints_interval() == 30.0
    assert env.checkpoint_interval() == 0.0
    monkeypatch.setenv("ADAPTRAIN_JOB_TOKEN", "s3cret")
    monkeypatch.setenv("ADAPTRAIN_HINTS_INTERVAL", "0.5")
    monkeypatch.setenv("ADAPTRAIN_CHECKPOINT_INTERVAL", "600")
    assert (env.job_token(), env.hints_interval(), env.checkpoint_interval()) == (
        "s3cret",
        0.5,
        600,
    )
    for name, bad in (
        ("ADAPTRAIN_HINTS_INTERVAL", "0"),
        ("ADAPTRAIN_HINTS_INTERVAL", "-1"),
        ("ADAPTRAIN_HINTS_INTERVAL", "soon"),
        ("ADAPTRAIN_CHECKPOINT_INTERVAL", "-5"),
        ("ADAPTRAIN_CHECKPOINT_INTERVAL", "inf"),
        ("ADAPTRAIN_CHECKPOINT_INTERVAL", "nan"),
    ):
        monkeypatch.setenv(name, bad)
        accessor = env.hints_interval if "HINTS" in name else env.checkpoint_interval
        with pytest.raises(ValueError, match=name):
            accessor()
        monkeypatch.delenv(name)
    monkeypatch.setenv("ADAPTRAIN_CHECKPOINT_INTERVAL", "0")
    assert env.checkpoint_interval() == 0.0


def test_one_process_posts_valid_hints_at_the_interval_and_after_each_change(
    tmp_path: Path,
) -> None:
    interval = 2.5
    with supervisor() as (url, record):
        (steps,), (err,) = train(tmp_path, url, seconds=7.0, interval=interval)
    end, steps = steps[-1], steps[:-1]
    assert end["httpx"] and "adaptrain-hints" in end["threads"]
    assert len(record) >= 3, record
    for r in record:
        Hints.model_validate_json(r["raw"])  # the contract, strictly
        assert r["job"] == JOB and r["auth"] == "Bearer tok-0"
    assert end["reporter"]["posted"] == len(record) and end["reporter"]["failures"] == 0
    bodies = [r["body"] for r in record]
    assert bodies[-1]["perfParams"] is not None and bodies[-1]["gradParams"] is not None
    assert bodies[-1]["profile"] and bodies[-1]["initBatchSize"] == 32
    assert bodies[-1]["maxBatchSize"] == 512 and bodies[-1]["localBszBounds"] == [8, 128]
    assert bodies[-1]["progress"]["progress"] > 0
    # Two posts closer than the interval only when the batch size changed in between.
    changes = _changes(steps)
    assert changes, "the batch size never changed: nothing to check the early post against"
    # (1 s: the slack between a step's record and the server's clock reading of its post, on
    # two cores busy with other work the sender thread may be that late)
    for a, b in zip(record, record[1:]):
        if b["t"] - a["t"] < interval - 0.1:
            assert any(a["t"] - 1.0 < t0 <= b["t"] for t0, _ in changes), (a["t"], b["t"])
    # ... and every change is posted at the next step boundary, long before the interval.
    for t0, t1 in changes:
        assert any(t0 - 0.3 <= r["t"] <= t1 + 1.0 for r in record), (t0, [r["t"] for r in record])
    assert WARNING not in err


def test_standalone_run_starts_no_thread_and_never_imports_httpx(tmp_path: Path) -> None:
    (steps,), (err,) = train(tmp_path, None, seconds=2.0)
    end = steps[-1]
    assert not end["httpx"] and "adaptrain-hints" not in end["threads"]
    assert end["reporter"] is None and len(steps) > 10


def test_only_rank_0_of_two_gloo_replicas_posts(tmp_path: Path) -> None:
    with supervisor() as (url, record):
        logs, errs = train(tmp_path, url, replicas=2, seconds=5.0, interval=1.0)
    assert len(record) >= 3
    assert {r["auth"] for r in record} == {"Bearer tok-0"}  # rank 1 sends tok-1: never
    for r in record:
        Hints.model_validate_json(r["raw"])
    assert all(row["numReplicas"] == 2 for row in record[-1]["body"]["profile"])
    assert record[-1]["body"]["maxProfiledReplicas"] == 2
    end0, end1 = logs[0][-1], logs[1][-1]
    assert end0["httpx"] and "adaptrain-hints" in end0["threads"]
    assert not end1["httpx"] and "adaptrain-hints" not in end1["threads"]
    assert end1["reporter"] is None


def test_a_failing_supervisor_is_logged_once_retried_and_its_recovery_logged(
    tmp_path: Path,
) -> None:
    # 500 for 2.5 s after the first post: failures at 0 s and 1 s (backoff 1 s, then 2 s),
    # then the retry at ~3 s goes through.
    with supervisor("error", fail_for=2.5) as (url, record):
        (steps,), (err,) = train(tmp_path, url, seconds=7.0, interval=1.0)
    rep = steps[-1]["reporter"]
    failed = [r for r in record if r["failed"]]
    assert len(failed) >= 2 and rep["failures"] == len(failed)
    assert rep["posted"] == len(record) - len(failed) >= 1
    gaps = [b["t"] - a["t"] for a, b in zip(failed, failed[1:])]
    assert all(g >= 0.9 for g in gaps), gaps  # backed off, not one post per step
    assert err.count(WARNING) == 1, err
    assert err.count(RECOVERED) == 1, err


def _step_times(steps: list[dict[str, Any]]) -> list[float]:
    return [s["dt"] for s in steps[20:-1]]  # past the first steps (imports, first fit)


def test_a_hanging_or_absent_supervisor_does_not_slow_training(tmp_path: Path) -> None:
    (ref,), _ = train(tmp_path / "ref", None, seconds=4.0)
    with supervisor("hang") as (url, record):
        (hang,), (hang_err,) = train(tmp_path / "hang", url, seconds=8.0, interval=1.0)
    down_url = f"http://127.0.0.1:{_free_port()}"  # nobody listens there
    (down,), (down_err,) = train(tmp_path / "down", down_url, seconds=5.0, interval=1.0)
    # A post that blocked a step would make it last the 5 s timeout (the server answers after
    # 10 s); the connection refused would cost each due step a connect.
    assert record and hang[-1]["reporter"]["failures"] >= 1 and hang[-1]["reporter"]["posted"] == 0
    assert down[-1]["reporter"]["failures"] >= 2 and down[-1]["reporter"]["posted"] == 0
    base = statistics.median(_step_times(ref))
    for steps in (hang, down):
        times = _step_times(steps)
        assert max(times) < 1.0, max(times)
        assert statistics.median(times) < 2.0 * base, (statistics.median(times), base)
    assert hang_err.count(WARNING) == 1 and down_err.count(WARNING) == 1, (hang_err, down_err)
    assert RECOVERED not in hang_err + down_err


def test_a_reporter_follows_the_supervisor_to_the_url_its_file_names(tmp_path: Path) -> None:
    # A server restarted on another port rewrites server.json; a replica it re-adopted still
    # has the old URL in its environment and must find the new one after a failed post.
    from adaptrain.torch._hints import HintsReporter

    url_file = tmp_path / "server.json"
    with supervisor() as (old_url, old_record):
        url_file.write_text(json.dumps({"url": old_url}))
        rep = HintsReporter(old_url, "job-a", "secret", 0.1, backoff=0.1, url_file=str(url_file))
        rep.offer({"n": 1})
        deadline = time.monotonic() + 20
        while rep.posted < 1:
            assert time.monotonic() < deadline, rep.last_error
            time.sleep(0.05)
    try:
        with supervisor() as (new_url, new_record):
            assert new_url != old_url
            url_file.write_text(json.dumps({"url": new_url}))
            rep.offer({"n": 2})
            deadline = time.monotonic() + 20
            while not new_record:
                assert time.monotonic() < deadline, rep.last_error
                time.sleep(0.05)
    finally:
        rep.close(timeout=5)
    assert [r["body"] for r in old_record] == [{"n": 1}]
    assert new_record[0]["body"] == {"n": 2} and new_record[0]["auth"] == "Bearer secret"
    assert rep.failures >= 1 and rep.endpoint == f"{new_url}/hints/job-a"
