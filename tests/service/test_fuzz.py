"""Fuzz a real server through its OpenAPI schema with schemathesis: valid and invalid requests
to every operation, the job-token ones (hints, discovery) with a real job's token too; no
reply may be a 5xx. The examples are bounded so that the test takes well under a minute."""

from __future__ import annotations

import os
import sqlite3
import sys
import time

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")
from _service_jobs import wait_job  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402

pytestmark = pytest.mark.timeout(120)

#: examples per operation and generation mode
EXAMPLES = int(os.environ.get("ADAPTRAIN_FUZZ_EXAMPLES", "40"))


def test_the_api_never_answers_5xx(server, tmp_path):
    # no program is found on an empty PATH: the fuzzed jobs' random commands cannot run anything
    empty = tmp_path / "empty-path"
    empty.mkdir()
    srv = server("--slots", "2", "--interval", "600", "--grace", "2", "--max-restarts", "1",
                 env={"PATH": str(empty)})  # fmt: skip
    schema = schemathesis.openapi.from_url(f"{srv.url}/openapi.json")
    resp = httpx.post(f"{srv.url}/jobs", json={
        "name": "fz", "command": [sys.executable, "-c", "import time; time.sleep(300)"]})  # fmt: skip
    assert resp.status_code == 201, resp.text
    wait_job(srv, "fz", ("Running",), timeout=30)
    with sqlite3.connect(os.path.join(srv.state_dir, "state.db")) as db:
        token = db.execute("SELECT token FROM jobs WHERE name = 'fz'").fetchone()[0]
    auth = {"Authorization": f"Bearer {token}"}

    operations = [r.ok() for r in schema.get_all_operations()]
    names = sorted(f"{op.method.upper()} {op.path}" for op in operations)
    assert "PUT /hints/{job}" in names and "GET /discover/{job}/{group}" in names, names
    failures: list[str] = []
    counts: dict[str, int] = {}
    unsatisfiable: list[str] = []
    t0 = time.monotonic()
    for op in operations:
        for mode in schemathesis.GenerationMode:
            try:
                _fuzz(op, mode, auth, failures, counts)
            except Unsatisfiable:  # no invalid request exists (e.g. GET /jobs: no inputs)
                assert mode == schemathesis.GenerationMode.NEGATIVE, op.path
                unsatisfiable.append(f"{op.method.upper()} {op.path}")
    elapsed = time.monotonic() - t0
    assert not failures, f"{len(failures)} failures, e.g.:\n" + "\n\n".join(failures[:5])
    assert set(counts) == set(names), counts
    print(f"fuzzed in {elapsed:.1f} s: {counts}; no invalid request for {unsatisfiable}")
    # the server still serves, and its job is untouched
    assert httpx.get(f"{srv.url}/jobs/fz").json()["status"] == "Running"
    assert elapsed < 90, elapsed


def _fuzz(op, mode, auth: dict, failures: list[str], counts: dict[str, int]) -> None:
    """``EXAMPLES`` requests to operation ``op``, generated in ``mode``; each 5xx (or dropped
    connection) recorded in ``failures``."""
    label = f"{op.method.upper()} {op.path}"
    job_call = "{job}" in op.path
    strategies = [op.as_strategy(generation_mode=mode)]
    if job_call:  # the real job: past the token check, into the body and the query
        strategies.append(op.as_strategy(generation_mode=mode, path_parameters={"job": "fz"}))

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(case=st.one_of(strategies))
    def run(case) -> None:
        if op.path.startswith("/discover"):  # it waits that long for a future group
            case.query = dict(case.query or {})
            timeout = case.query.get("timeout", 30.0)
            if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
                case.query["timeout"] = min(timeout, 0.2)
        try:
            reply = case.call(headers=auth if job_call else None, timeout=20)
        except Exception as exc:  # noqa: BLE001 - the server dropped the connection
            failures.append(f"{label}: {type(exc).__name__}: {exc}\n{case.as_curl_command()}")
            return
        counts[label] = counts.get(label, 0) + 1
        if reply.status_code >= 500:
            failures.append(
                f"{label} -> {reply.status_code}: {reply.text[:300]}\n{case.as_curl_command()}"
            )

    run()
