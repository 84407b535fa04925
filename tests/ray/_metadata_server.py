"""A stand-in for the AWS and GCP metadata servers on 127.0.0.1, for the spot-notice tests.

Every node of a test cluster points its ``ADAPTRAIN_AWS_METADATA_URL`` (or GCP's) at
``{url}/<node>``: each node prefix has its own state, so a test can interrupt one node only.
It answers as the real services do:

* AWS IMDSv2: ``PUT /<node>/latest/api/token`` needs ``X-aws-ec2-metadata-token-ttl-seconds``
  (1..21600) and returns a token; ``GET /<node>/latest/meta-data/spot/instance-action`` needs
  ``X-aws-ec2-metadata-token`` with a token it issued (else 401), and answers 404 until
  :meth:`aws_interrupt`, then ``{"action": "terminate", "time": "...Z"}``.
* GCP: ``GET /<node>/computeMetadata/v1/instance/preempted`` needs ``Metadata-Flavor:
  Google`` (else 403) and answers ``FALSE`` until :meth:`gcp_preempt`, then ``TRUE``.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class MetadataServer:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.tokens: set[str] = set()
        self.aws_action: dict[str, dict] = {}
        self.gcp_preempted: set[str] = set()
        self.requests: list[tuple[str, str, dict]] = []  # (method, path, lower-case headers)
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _send(self, code: int, body: str = "") -> None:
                data = body.encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _split(self) -> tuple[str, str]:
                _, node, rest = self.path.split("/", 2)
                return node, "/" + rest

            def do_PUT(self) -> None:  # noqa: N802
                outer._record("PUT", self.path, self.headers)
                node, path = self._split()
                if path != "/latest/api/token":
                    return self._send(404)
                ttl = self.headers.get("X-aws-ec2-metadata-token-ttl-seconds")
                if ttl is None or not ttl.isdigit() or not 1 <= int(ttl) <= 21600:
                    return self._send(400, "missing or invalid TTL")
                token = secrets.token_hex(8)
                with outer.lock:
                    outer.tokens.add(token)
                return self._send(200, token)

            def do_GET(self) -> None:  # noqa: N802
                outer._record("GET", self.path, self.headers)
                node, path = self._split()
                if path == "/latest/meta-data/spot/instance-action":
                    with outer.lock:
                        ok = self.headers.get("X-aws-ec2-metadata-token") in outer.tokens
                        action = outer.aws_action.get(node)
                    if not ok:
                        return self._send(401)
                    if action is None:
                        return self._send(404, "Not Found")
                    return self._send(200, json.dumps(action))
                if path == "/computeMetadata/v1/instance/preempted":
                    if self.headers.get("Metadata-Flavor") != "Google":
                        return self._send(403, "Missing Metadata-Flavor:Google header.")
                    with outer.lock:
                        flag = node in outer.gcp_preempted
                    return self._send(200, "TRUE" if flag else "FALSE")
                return self._send(404)

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def _record(self, method: str, path: str, headers) -> None:
        with self.lock:
            self.requests.append((method, path, {k.lower(): v for k, v in headers.items()}))

    def node_url(self, node: str) -> str:
        return f"{self.url}/{node}"

    def aws_interrupt(self, node: str, seconds: float = 120.0) -> float:
        """Schedule ``node``'s termination in ``seconds``; the deadline (whole seconds)."""
        deadline = int(time.time() + seconds)
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(deadline))
        with self.lock:
            self.aws_action[node] = {"action": "terminate", "time": stamp}
        return float(deadline)

    def gcp_preempt(self, node: str) -> None:
        with self.lock:
            self.gcp_preempted.add(node)

    def polled(self, node: str) -> int:
        """How many notice reads ``node`` made."""
        with self.lock:
            return sum(
                1
                for m, p, _ in self.requests
                if m == "GET" and p.startswith(f"/{node}/") and "api/token" not in p
            )

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
