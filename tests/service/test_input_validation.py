"""Every input the API takes is validated: a bad request gets a 4xx naming what is wrong, never
a 500; ``cp`` never reads outside the job's share folder."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from urllib.parse import urlsplit

import pytest
from _service_jobs import http, share, wait_job

pytestmark = pytest.mark.timeout(90)

OK_HINTS = {"initBatchSize": 32}


def _raw(srv, request: bytes, body_chunks=(), timeout: float = 20.0) -> tuple[int, bytes]:
    """Send a raw HTTP/1.1 request (and then ``body_chunks``, stopping when the server stops
    reading); the status and body of the reply."""
    parts = urlsplit(srv.url)
    with socket.create_connection((parts.hostname, parts.port), timeout=timeout) as sock:
        sock.sendall(request)
        try:
            for chunk in body_chunks:
                sock.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed: read its answer
        data = b""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                got = sock.recv(65536)
            except ConnectionResetError:
                break
            if not got:
                break
            data += got
            if b"\r\n\r\n" in data:
                head, _, rest = data.partition(b"\r\n\r\n")
                length = [
                    ln for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length:")
                ]
                if length and len(rest) >= int(length[0].split(b":")[1]):
                    break
    assert data, "no reply"
    head, _, rest = data.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), rest


def _check(resp, status: int | tuple[int, ...], *words: str) -> None:
    statuses = (status,) if isinstance(status, int) else status
    assert resp.status_code in statuses, (resp.request.method, resp.request.url, resp.text)
    text = resp.text
    for word in words:
        assert word in text, (word, resp.request.url, text)


@pytest.fixture
def srv(server):
    return server("--slots", "2", "--interval", "5", "--grace", "5")


def test_job_specs_are_validated(srv):
    bad = [
        ({"name": "Bad_Name", "command": ["true"]}, "DNS label"),
        ({"name": "-lead", "command": ["true"]}, "DNS label"),
        ({"name": "trail-", "command": ["true"]}, "DNS label"),
        ({"name": "a" * 64, "command": ["true"]}, "DNS label"),
        ({"name": "a.b", "command": ["true"]}, "DNS label"),
        ({"name": "", "command": ["true"]}, "DNS label"),
        ({"name": "ü", "command": ["true"]}, "DNS label"),
        ({"name": 5, "command": ["true"]}, "name"),
        ({"command": []}, "command"),
        ({"command": "true"}, "command"),
        ({"command": ["a\x00b"]}, "command"),
        ({}, "command"),
        ({"command": ["true"], "min_replicas": 3, "max_replicas": 2}, "min_replicas=3"),
        ({"command": ["true"], "max_replicas": 0}, "max_replicas"),
        ({"command": ["true"], "min_replicas": -1}, "min_replicas"),
        ({"command": ["true"], "max_replicas": 5000}, "max_replicas"),
        ({"command": ["true"], "max_replicas": 1.5}, "max_replicas"),
        ({"command": ["true"], "max_replicas": "two"}, "max_replicas"),
        ({"command": ["true"], "max_replicas": None}, "max_replicas"),
        ({"command": ["true"], "max_restarts": -1}, "max_restarts"),
        ({"command": ["true"], "preemptible": "maybe"}, "preemptible"),
        ({"command": ["true"], "env": {"1X": "y"}}, "1X"),
        ({"command": ["true"], "env": {"ADAPTRAIN_JOB_ID": "y"}}, "set by the server"),
        ({"command": ["true"], "env": {"X": "a\x00b"}}, "env"),
        ({"command": ["true"], "env": {"X": 1}}, "env"),
        ({"command": ["true"], "workdir": "not base64!"}, "workdir"),
        ({"command": ["true"], "workdir": "aGVsbG8="}, "workdir"),
        ({"command": ["true"], "unknown": 1}, "unknown"),
    ]
    with http(srv) as c:
        for spec, word in bad:
            resp = c.post("/jobs", json=spec)
            _check(resp, 422, word)
        # min_replicas beyond the cluster: a job that could never start
        _check(c.post("/jobs", json={"command": ["true"], "min_replicas": 3, "max_replicas": 3}),
               422, "exceeds the cluster")  # fmt: skip
        for body, word in [(b"{", "json"), (b"[1, 2]", ""), (b"null", ""), (b"", "")]:
            resp = c.post("/jobs", content=body, headers={"Content-Type": "application/json"})
            _check(resp, 422, word)
        # names in paths
        for name in ("Bad_Name", "a" * 64, "-x", "a..b"):
            for method, path in [("GET", f"/jobs/{name}"), ("DELETE", f"/jobs/{name}"),
                                 ("GET", f"/jobs/{name}/logs"), ("PUT", f"/hints/{name}"),
                                 ("GET", f"/discover/{name}/0")]:  # fmt: skip
                resp = c.request(method, path, json=OK_HINTS if method == "PUT" else None)
                _check(resp, (400, 422), "DNS label" if resp.status_code == 400 else "")
        # the longest name is fine, and its job runs
        name = "a" * 63
        resp = c.post("/jobs", json={"name": name, "command": [sys.executable, "-c", "pass"]})
        _check(resp, 201)
        # query parameters
        for params in ({"offset": -1}, {"rank": "x"}, {"limit": 0}, {"rank": -1}):
            _check(c.get(f"/jobs/{name}/logs", params=params), 422)
    wait_job(srv, name, ("Succeeded",), timeout=30)


def test_hints_are_validated(srv):
    with http(srv) as c:
        resp = c.post("/jobs", json={"name": "h", "command": [sys.executable, "-c",
                                     "import time; time.sleep(60)"]})  # fmt: skip
        _check(resp, 201)
    token_path = os.path.join(srv.state_dir, "state.db")
    import sqlite3

    with sqlite3.connect(token_path) as db:
        token = db.execute("SELECT token FROM jobs WHERE name = 'h'").fetchone()[0]
    good = {
        "initBatchSize": 32,
        "maxBatchSize": 512,
        "localBszBounds": [8, 128],
        "maxProfiledReplicas": 2,
        "gradientAccumulation": True,
        "gradParams": {"norm": 0.5, "var": 2.0},
        "perfParams": {
            "alpha_c": 0.1,
            "beta_c": 0.01,
            "alpha_n": 0.1,
            "beta_n": 0.01,
            "alpha_r": 0.01,
            "beta_r": 0.001,
            "gamma": 1.5,
        },  # fmt: skip
        "profile": [
            {
                "numNodes": 1,
                "numReplicas": 2,
                "atomicBsz": 32,
                "stepTime": 0.1,
                "syncTime": 0.01,
                "count": 3,
            }
        ],  # fmt: skip
        "progress": {"epoch": 1, "samples": 100, "progress": 1000.0},
        "batchSize": 64,
        "atomicBsz": 32,
        "accumSteps": 0,
        "gain": 1.2,
        "goodput": 100.0,
        "throughput": 200.0,
    }

    def with_(path: str, value):
        out = json.loads(json.dumps(good))
        *head, last = path.split(".")
        node = out
        for key in head:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if value is _DROP:
            del node[last]
        elif isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value
        return out

    bad = [
        ("initBatchSize", _DROP),
        ("initBatchSize", 0),
        ("initBatchSize", -1),
        ("initBatchSize", "x"),
        ("initBatchSize", 1.5),
        ("initBatchSize", None),
        ("initBatchSize", 1 << 40),
        ("maxBatchSize", 16),
        ("localBszBounds", [0, 4]),
        ("localBszBounds", [64, 8]),
        ("localBszBounds", [8]),
        ("localBszBounds", "8-64"),
        ("maxProfiledReplicas", -1),
        ("gradientAccumulation", "yes"),
        ("gradParams.norm", -1.0),
        ("gradParams.var", _DROP),
        ("gradParams", [0.5, 2.0]),
        ("perfParams.gamma", 0.5),
        ("perfParams.alpha_c", -0.1),
        ("perfParams.beta_n", _DROP),
        ("profile", {}),
        ("profile.0.stepTime", 0.0),
        ("profile.0.syncTime", -1.0),
        ("profile.0.numNodes", 3),
        ("profile.0.count", 0),
        ("profile.0.extra", 1),
        ("progress.epoch", -1),
        ("progress.samples", "many"),
        ("batchSize", 0),
        ("accumSteps", -1),
        ("gain", -0.5),
        ("goodput", -1.0),
        ("throughput", "fast"),
        ("unknownField", 1),
    ]
    non_finite = ["gain", "goodput", "throughput", "gradParams.norm", "gradParams.var",
                  "perfParams.alpha_c", "perfParams.gamma", "profile.0.stepTime",
                  "profile.0.syncTime", "progress.progress"]  # fmt: skip
    with http(srv, token) as c:
        _check(c.put("/hints/h", json=good), 204)
        _check(c.put("/hints/h", json=OK_HINTS), 204)
        for path, value in bad:
            _check(c.put("/hints/h", json=with_(path, value)), 422, path.split(".")[-1])
        for path in non_finite:
            for literal in ("NaN", "Infinity", "-Infinity", "1e999"):
                body = json.dumps(with_(path, "@@")).replace('"@@"', literal)
                resp = c.put("/hints/h", content=body, headers={"Content-Type": "application/json"})
                _check(resp, 422, path.split(".")[-1])
        for body in (b"", b"{", b"[]", b'"x"', b"\xff\xfe"):
            resp = c.put("/hints/h", content=body, headers={"Content-Type": "application/json"})
            _check(resp, 422)
        resp = c.put("/hints/h", json={**good, "profile": [good["profile"][0]] * 5000})
        _check(resp, 422, "profile")
        # the last good hints stay
    with http(srv) as c:
        assert c.get("/jobs/h").json()["hints"]["initBatchSize"] == 32
        # discovery's timeout
        for timeout in ("-1", "601", "nan", "inf", "x"):
            resp = c.get("/discover/h/0", params={"timeout": timeout},
                         headers={"Authorization": f"Bearer {token}"})  # fmt: skip
            _check(resp, 422, "timeout")
        _check(c.get("/discover/h/x", headers={"Authorization": f"Bearer {token}"}), 422)
        c.delete("/jobs/h")
    wait_job(srv, "h", ("Cancelled",), timeout=30)


_DROP = object()


def test_bodies_over_the_limit_get_413(srv):
    limit = 128 * 1024 * 1024
    # a declared length over the limit: refused before a byte of the body is read
    status, body = _raw(
        srv,
        b"POST /jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(limit + 1).encode() + b"\r\n\r\n",
        [b'{"command": ["'],
    )
    assert status == 413 and b"exceeds" in body, (status, body)
    status, body = _raw(srv, b"POST /jobs HTTP/1.1\r\nHost: x\r\nContent-Length: 12x\r\n\r\n")
    assert 400 <= status < 500, (status, body)
    # a chunked body (no declared length) that grows over the limit: cut off at the limit
    chunk = b"x" * (1 << 20)

    def chunks():
        yield b'f\r\n{"command": ["x\r\n'
        for _ in range(limit // len(chunk) + 2):
            yield f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
        yield b'3\r\n"]}\r\n0\r\n\r\n'

    t0 = time.monotonic()
    status, body = _raw(
        srv,
        b"POST /jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n",
        chunks(),
        timeout=60,
    )
    assert status == 413 and b"exceeds" in body, (status, body[:300])
    assert time.monotonic() - t0 < 50
    with http(srv) as c:  # the server is fine
        assert c.get("/jobs").status_code == 200


def test_cp_reads_nothing_outside_the_share_folder(srv, tmp_path):
    with http(srv) as c:
        _check(c.post("/jobs", json={"name": "files", "command": [sys.executable, "-c", "pass"]}),
               201)  # fmt: skip
    wait_job(srv, "files", ("Succeeded",), timeout=30)
    root = share(srv.state_dir, "files")
    secret = tmp_path / "secret.txt"
    secret.write_text("not yours")
    with open(os.path.join(root, "ok.txt"), "w") as f:
        f.write("yours")
    os.makedirs(os.path.join(root, "sub"))
    with open(os.path.join(root, "sub", "deep.txt"), "w") as f:
        f.write("deep")
    os.symlink(str(secret), os.path.join(root, "link.txt"))
    os.symlink(str(tmp_path), os.path.join(root, "linkdir"))
    os.symlink("sub/deep.txt", os.path.join(root, "inside.txt"))  # a link that stays inside
    dest = tmp_path / "got"

    # the CLI
    srv.cli("cp", "files:ok.txt", str(dest))
    assert dest.read_text() == "yours"
    srv.cli("cp", "files:sub/deep.txt", str(dest))
    assert dest.read_text() == "deep"
    srv.cli("cp", "files:inside.txt", str(dest))
    assert dest.read_text() == "deep"
    for source in ("files:../../state.db", "files:sub/../../workdir/x", "files:/etc/passwd",
                   f"files:{secret}", "files:link.txt", "files:linkdir/secret.txt",
                   "files:sub/../link.txt", "files:nosuch.txt", "files:sub"):  # fmt: skip
        dest.write_text("untouched")
        proc = srv.cli("cp", source, str(dest), check=False)
        assert proc.returncode != 0, (source, proc.stdout)
        assert proc.stderr.startswith("adaptrain cp:") and "Traceback" not in proc.stderr
        assert dest.read_text() == "untouched", source
    # the API, with the paths as sent (percent-encoded dots and slashes reach the server)
    with http(srv) as c:
        _check(c.get("/jobs/files/files/ok.txt"), 200, "yours")
        for path in ("%2e%2e/%2e%2e/state.db", "sub/%2e%2e/%2e%2e/state.db", "%2fetc%2fpasswd",
                     "/etc/passwd", "link.txt", "linkdir/secret.txt", "a%00b", "%00",
                     "sub%2f..%2f..%2f..%2fstate.db", "..%5c..%5cstate.db", "x" * 5000,
                     "sub"):  # fmt: skip
            resp = c.get(f"/jobs/files/files/{path}")
            _check(resp, (400, 403, 404, 414), "")
            assert "not yours" not in resp.text and "CREATE TABLE" not in resp.text
        _check(c.get("/jobs/nosuch/files/ok.txt"), 404)
