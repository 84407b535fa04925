"""Who may call the service: loopback by default, a token required off loopback, every call
checked against it, and a job's own token good for that job's hints and discovery only.
All traffic goes to 127.0.0.1."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from _service_jobs import http, share, wait_for, wait_job

pytestmark = pytest.mark.timeout(90)

TOKEN = "s3cret-token-0123456789abcdef"

#: writes the job's token where the test (as the admin) can fetch it, then waits
HOLD = """
import os, time
with open(os.path.join(os.environ["ADAPTRAIN_SHARE_PATH"], "token.txt"), "w") as f:
    f.write(os.environ["ADAPTRAIN_JOB_TOKEN"])
time.sleep(60)
"""

HINTS = {"initBatchSize": 32, "maxBatchSize": 256, "localBszBounds": [8, 64]}


def _server_cli(tmp_path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ADAPTRAIN_")}
    return subprocess.run(
        [sys.executable, "-m", "adaptrain", "server", "--port", "0", "--state-dir",
         str(tmp_path / "state"), *args],
        capture_output=True, text=True, timeout=30, env=env,
    )  # fmt: skip


def test_a_non_loopback_address_needs_a_token(tmp_path):
    proc = _server_cli(tmp_path, "--host", "0.0.0.0")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "not a loopback address" in proc.stderr and "--token-file" in proc.stderr
    assert "listening" not in proc.stdout
    short = tmp_path / "short"
    short.write_text("abc\n")
    proc = _server_cli(tmp_path, "--host", "0.0.0.0", "--token-file", str(short))
    assert proc.returncode == 2 and "at least 16 characters" in proc.stderr, proc.stderr
    empty = tmp_path / "empty"
    empty.write_text("\n")
    proc = _server_cli(tmp_path, "--token-file", str(empty))
    assert proc.returncode == 2 and "is empty" in proc.stderr, proc.stderr
    proc = _server_cli(tmp_path, "--token-file", str(tmp_path / "missing"))
    assert proc.returncode == 2 and "--token-file" in proc.stderr, proc.stderr


def _cli(srv, *args: str, token_env: str | None = None, cwd: str | None = None):
    env = {k: v for k, v in srv.env.items() if k != "ADAPTRAIN_TOKEN"}
    env["ADAPTRAIN_SERVER"] = srv.url
    if token_env is not None:
        env["ADAPTRAIN_TOKEN"] = token_env
    return subprocess.run(
        [sys.executable, "-m", "adaptrain", *args], capture_output=True, text=True, env=env,
        timeout=60, cwd=cwd,
    )  # fmt: skip


@pytest.fixture
def token_server(server, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    work = tmp_path / "work"
    work.mkdir()
    (work / "hold.py").write_text(HOLD)
    srv = server("--slots", "2", "--interval", "5", "--grace", "5", "--token-file",
                 str(token_file))  # fmt: skip
    return srv, str(token_file), str(work)


def test_with_a_token_every_api_call_needs_it(token_server):
    srv, token_file, work = token_server
    calls = [
        ("GET", "/jobs", None),
        ("POST", "/jobs", {"name": "x", "command": ["true"]}),
        ("GET", "/jobs/x", None),
        ("DELETE", "/jobs/x", None),
        ("GET", "/jobs/x/logs", None),
        ("GET", "/jobs/x/files/a.txt", None),
        ("GET", "/cluster", None),
        ("GET", "/metrics", None),
        ("PUT", "/hints/x", HINTS),
        ("GET", "/discover/x/0?timeout=0", None),
    ]
    for token in (None, "wrong-token-0123456789", TOKEN + "x", TOKEN[:-1]):
        with http(srv, token) as c:
            for method, path, body in calls:
                resp = c.request(method, path, json=body)
                assert resp.status_code == 401, (token, method, path, resp.text)
                assert "token" in resp.json()["detail"]
            # a scheme other than Bearer is no token either
            resp = c.get("/jobs", headers={"Authorization": f"Basic {TOKEN}"})
            assert resp.status_code == 401
    with http(srv, TOKEN) as c:
        assert c.get("/jobs").status_code == 200
        assert c.get("/cluster").status_code == 200
        assert c.get("/metrics").status_code == 200
        assert c.get("/jobs/x").status_code == 404
    # the CLI: refused without the token, served with --token-file or ADAPTRAIN_TOKEN
    proc = _cli(srv, "ls")
    assert proc.returncode != 0 and "token" in proc.stderr, proc.stderr
    proc = _cli(srv, "ls", token_env="wrong-token-0123456789")
    assert proc.returncode != 0 and "token" in proc.stderr, proc.stderr
    assert _cli(srv, "ls", "--token-file", token_file).returncode == 0
    assert _cli(srv, "ls", token_env=TOKEN).returncode == 0
    proc = _cli(srv, "submit", "--name", "a", "--", "python", "hold.py", cwd=work)
    assert proc.returncode != 0 and "token" in proc.stderr, proc.stderr
    proc = _cli(srv, "submit", "--name", "a", "--token-file", token_file, "--", "python",
                "hold.py", cwd=work)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    wait_job(srv, "a", ("Running",), token=TOKEN)
    assert "a" in _cli(srv, "ls", token_env=TOKEN).stdout
    assert _cli(srv, "describe", "a").returncode != 0
    assert _cli(srv, "delete", "a").returncode != 0
    assert _cli(srv, "delete", "a", "--token-file", token_file).returncode == 0


def _job_token(srv, name: str) -> str:
    path = os.path.join(share(srv.state_dir, name), "token.txt")
    wait_for(lambda: os.path.exists(path) and os.path.getsize(path) > 0, 30, f"{name}'s token")
    with open(path) as f:
        return f.read().strip()


@pytest.mark.parametrize("server_token", [True, False], ids=["server-token", "loopback-open"])
def test_a_job_token_authorises_only_that_jobs_hints_and_discovery(server, tmp_path, server_token):
    args = ["--slots", "2", "--interval", "5", "--grace", "5"]
    if server_token:
        (tmp_path / "token").write_text(TOKEN)
        args += ["--token-file", str(tmp_path / "token")]
    srv = server(*args)
    admin = TOKEN if server_token else None
    with http(srv, admin) as c:
        for name in ("a", "b"):
            resp = c.post("/jobs", json={"name": name, "command": [sys.executable, "-c", HOLD]})
            assert resp.status_code == 201, resp.text
    tokens = {name: _job_token(srv, name) for name in ("a", "b")}
    assert tokens["a"] != tokens["b"] and len(tokens["a"]) >= 16

    for token, expect in [
        (None, 401),
        ("wrong-token-0123456789", 401),
        (tokens["b"], 401),
        (tokens["a"], 204),
    ]:
        with http(srv, token) as c:
            resp = c.put("/hints/a", json=HINTS)
            assert resp.status_code == expect, (token, resp.text)
            # authorisation comes before the body's validation: no probing without a token
            resp = c.put("/hints/a", json={"initBatchSize": "x"})
            assert resp.status_code == (422 if expect == 204 else 401), (token, resp.text)
            resp = c.get("/discover/a/0", params={"timeout": 0})
            assert resp.status_code == (200 if expect == 204 else 401), (token, resp.text)
            if expect == 204:
                assert resp.json() == ["127.0.0.1"]
    with http(srv, tokens["a"]) as c:
        # a job's token is no admin token
        if server_token:
            for method, path in [("GET", "/jobs"), ("GET", "/jobs/a"), ("DELETE", "/jobs/b"),
                                 ("GET", "/jobs/a/logs"), ("GET", "/cluster")]:  # fmt: skip
                assert c.request(method, path).status_code == 401, (method, path)
        # ... nor good for another job's discovery
        assert c.get("/discover/b/0", params={"timeout": 0}).status_code == 401
        # an unknown job: 404 where the server is open anyway, 401 where it has a token
        resp = c.put("/hints/nosuchjob", json=HINTS)
        assert resp.status_code == (401 if server_token else 404), resp.text
    if server_token:  # the server's token is good for every job's calls
        with http(srv, TOKEN) as c:
            assert c.put("/hints/b", json=HINTS).status_code == 204
    with http(srv, admin) as c:
        detail = c.get("/jobs/a").json()
        assert detail["hints"]["initBatchSize"] == 32
        for name in ("a", "b"):
            assert c.delete(f"/jobs/{name}").status_code == 200
    for name in ("a", "b"):
        wait_job(srv, name, ("Cancelled",), token=admin, timeout=30)
