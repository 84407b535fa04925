"""Cloud interruption notices read from a node's metadata server, for ``adaptrain ray submit``.

A spot (preemptible) instance learns that it will be reclaimed from its cloud's metadata
server, shortly before it happens:

AWS (IMDSv2)
    ``PUT /latest/api/token`` with ``X-aws-ec2-metadata-token-ttl-seconds`` gives a session
    token; ``GET /latest/meta-data/spot/instance-action`` with ``X-aws-ec2-metadata-token``
    answers 404 while nothing is scheduled, and ``{"action": "terminate", "time":
    "2024-05-01T12:00:00Z"}`` about two minutes before the instance is stopped or terminated.
    A 401 means the token expired: a new one is fetched and the read retried once.
GCP
    ``GET /computeMetadata/v1/instance/preempted`` with ``Metadata-Flavor: Google`` answers
    ``FALSE``, then ``TRUE`` once the instance is being preempted; it gets about 30 seconds
    (:data:`GCP_NOTICE_SECONDS`) before it is stopped.

Each watcher's base URL is configurable (``ADAPTRAIN_AWS_METADATA_URL`` and
``ADAPTRAIN_GCP_METADATA_URL``, read on the node by :mod:`adaptrain.env`) so that tests and
proxies can stand in for the link-local server. Only the standard library is used: these
run in a small actor on every node of the job.
"""

from __future__ import annotations

import calendar
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass

__all__ = [
    "GCP_NOTICE_SECONDS",
    "AwsSpotWatcher",
    "GcpSpotWatcher",
    "MetadataUnavailable",
    "SpotMonitor",
    "SpotNotice",
]

logger = logging.getLogger(__name__)

#: Seconds between GCP's preemption notice and the instance's stop (its documented ACPI
#: soft-off window).
GCP_NOTICE_SECONDS = 30.0


class MetadataUnavailable(Exception):
    """The metadata server did not answer, or answered something unexpected."""


@dataclass(frozen=True)
class SpotNotice:
    """A notice that this node will go away.

    Attributes:
        source: ``"aws"``, ``"gcp"`` or ``"drain"`` (a Ray drain request).
        deadline: ``time.time()`` by which the node is gone, or None if unknown.
        detail: what the notice said, for the job's log.
    """

    source: str
    deadline: float | None
    detail: str

    def as_dict(self) -> dict:
        return asdict(self)


def _request(
    url: str, headers: dict[str, str], timeout: float, method: str = "GET"
) -> tuple[int, str]:
    """``(status, body)`` of one request; HTTP error statuses are returned, not raised."""
    req = urllib.request.Request(url, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read(1 << 16).decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.read(1 << 16).decode("utf-8", "replace")
    except (OSError, ValueError) as exc:  # refused, timed out, unreachable, bad URL
        raise MetadataUnavailable(f"{method} {url}: {exc}") from None


def _parse_utc(text: str) -> float | None:
    """Seconds since the epoch of an ISO-8601 UTC time such as ``2024-05-01T12:00:00Z``."""
    for fmt in ("%Y-%m-%dT%H:%M:%SZ", "%Y-%m-%dT%H:%M:%S.%fZ"):
        try:
            return float(calendar.timegm(time.strptime(text, fmt)))
        except (TypeError, ValueError):
            continue
    return None


class AwsSpotWatcher:
    """Polls the AWS spot ``instance-action`` through IMDSv2 (a session token per request
    set, renewed a minute before it expires or when the server rejects it).

    Args:
        base_url: the metadata service, ``http://169.254.169.254`` on EC2.
        timeout: seconds one request may take.
        token_ttl: seconds a session token lives (IMDSv2 allows 1..21600).
    """

    source = "aws"

    def __init__(self, base_url: str, timeout: float = 2.0, token_ttl: int = 21600) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = float(timeout)
        self.token_ttl = int(token_ttl)
        self._token: str | None = None
        self._token_expiry = 0.0

    def _session_token(self) -> str:
        if self._token is not None and time.monotonic() < self._token_expiry:
            return self._token
        status, body = _request(
            f"{self.base_url}/latest/api/token",
            {"X-aws-ec2-metadata-token-ttl-seconds": str(self.token_ttl)},
            self.timeout,
            method="PUT",
        )
        if status != 200 or not body.strip():
            raise MetadataUnavailable(f"IMDSv2 token request answered {status}")
        self._token = body.strip()
        self._token_expiry = time.monotonic() + max(self.token_ttl - 60, self.token_ttl / 2)
        return self._token

    def poll(self) -> SpotNotice | None:
        """The pending interruption, or None.

        Raises:
            MetadataUnavailable: no metadata service answered as IMDSv2 does.
        """
        url = f"{self.base_url}/latest/meta-data/spot/instance-action"
        for attempt in range(2):
            token = self._session_token()
            status, body = _request(url, {"X-aws-ec2-metadata-token": token}, self.timeout)
            if status == 401 and attempt == 0:  # expired or revoked: a new session
                self._token = None
                continue
            break
        if status == 404:
            return None
        if status != 200:
            raise MetadataUnavailable(f"GET {url} answered {status}")
        try:
            action = json.loads(body)
            when = _parse_utc(action.get("time"))
            what = str(action.get("action", "terminate"))
        except (ValueError, AttributeError):
            when, what = None, "terminate"
        stamp = "" if when is None else f" at {action.get('time')}"
        return SpotNotice("aws", when, f"AWS spot instance-action: {what}{stamp}")


class GcpSpotWatcher:
    """Polls GCP's ``instance/preempted`` flag.

    Args:
        base_url: the metadata server, ``http://metadata.google.internal`` (169.254.169.254).
        timeout: seconds one request may take.
    """

    source = "gcp"

    def __init__(self, base_url: str, timeout: float = 2.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = float(timeout)

    def poll(self) -> SpotNotice | None:
        url = f"{self.base_url}/computeMetadata/v1/instance/preempted"
        status, body = _request(url, {"Metadata-Flavor": "Google"}, self.timeout)
        if status != 200:
            raise MetadataUnavailable(f"GET {url} answered {status}")
        flag = body.strip().upper()
        if flag == "TRUE":
            return SpotNotice(
                "gcp",
                time.time() + GCP_NOTICE_SECONDS,
                f"GCP instance preempted (stopped within {GCP_NOTICE_SECONDS:g} s)",
            )
        if flag == "FALSE":
            return None
        raise MetadataUnavailable(f"GET {url} answered {body[:80]!r}, not TRUE or FALSE")


class SpotMonitor:
    """Polls watchers from a daemon thread and keeps the first notice.

    On a machine of another cloud, or none, a watcher's server never answers: a watcher that
    fails ``give_up`` times in a row before it ever answered is dropped, so such a node stops
    knocking after a few seconds. One that answered once is kept whatever happens later (a
    metadata server under load can miss a poll).

    Args:
        watchers: objects with ``poll() -> SpotNotice | None`` (and a ``source`` name).
        interval: seconds between two rounds of polls.
        give_up: failures before a watcher that never answered is dropped.
    """

    def __init__(self, watchers: list, interval: float = 5.0, give_up: int = 3) -> None:
        self.watchers = list(watchers)
        self.interval = float(interval)
        self.give_up = int(give_up)
        self._notice: SpotNotice | None = None
        self._answered: set[int] = set()
        self._failures: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def notice(self) -> SpotNotice | None:
        with self._lock:
            return self._notice

    @property
    def active(self) -> list[str]:
        """The sources still polled."""
        return [w.source for w in self.watchers]

    def poll_once(self) -> SpotNotice | None:
        """One round over the watchers; the notice, if any (kept for :attr:`notice`)."""
        for w in list(self.watchers):
            key = id(w)
            try:
                notice = w.poll()
            except MetadataUnavailable as exc:
                self._failures[key] = self._failures.get(key, 0) + 1
                if key not in self._answered and self._failures[key] >= self.give_up:
                    logger.debug("no %s metadata server here (%s): not watched", w.source, exc)
                    self.watchers.remove(w)
                continue
            self._answered.add(key)
            self._failures[key] = 0
            if notice is not None:
                with self._lock:
                    if self._notice is None:
                        self._notice = notice
                return notice
        return None

    def start(self) -> None:
        if self._thread is None and self.watchers:
            self._thread = threading.Thread(target=self._run, name="adaptrain-spot", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set() and self.watchers and self.notice is None:
            self.poll_once()
            self._stop.wait(self.interval)
