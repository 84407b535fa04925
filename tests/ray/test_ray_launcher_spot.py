"""Spot notices read from a metadata server on 127.0.0.1 (IMDSv2, GCP), and the hints receiver
of ``adaptrain ray submit``'s rank-0 host (no cluster needed)."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from _metadata_server import MetadataServer

from adaptrain.ray._launch_host import HintsReceiver
from adaptrain.ray._spot import (
    AwsSpotWatcher,
    GcpSpotWatcher,
    MetadataUnavailable,
    SpotMonitor,
)


@pytest.fixture
def metadata():
    server = MetadataServer()
    try:
        yield server
    finally:
        server.close()


def test_aws_imdsv2_session_token_then_instance_action(metadata):
    watcher = AwsSpotWatcher(metadata.node_url("a"))
    assert watcher.poll() is None  # 404: nothing scheduled
    assert watcher.poll() is None
    deadline = metadata.aws_interrupt("a", seconds=90)
    notice = watcher.poll()
    assert notice is not None and notice.source == "aws"
    assert notice.deadline == deadline
    assert "terminate" in notice.detail
    puts = [r for r in metadata.requests if r[0] == "PUT"]
    gets = [r for r in metadata.requests if r[0] == "GET"]
    # one session token, sent with every read
    assert len(puts) == 1 and puts[0][2]["x-aws-ec2-metadata-token-ttl-seconds"] == "21600"
    assert len(gets) == 3 and all("x-aws-ec2-metadata-token" in h for _, _, h in gets)
    assert AwsSpotWatcher(metadata.node_url("b")).poll() is None  # per node


def test_aws_token_rejected_is_renewed(metadata):
    watcher = AwsSpotWatcher(metadata.node_url("a"))
    assert watcher.poll() is None
    metadata.tokens.clear()  # the service forgot the session (expired)
    metadata.aws_interrupt("a")
    assert watcher.poll() is not None
    assert sum(r[0] == "PUT" for r in metadata.requests) == 2


def test_gcp_preempted_flag_needs_the_flavor_header(metadata):
    watcher = GcpSpotWatcher(metadata.node_url("a"))
    assert watcher.poll() is None
    metadata.gcp_preempt("a")
    before = time.time()
    notice = watcher.poll()
    assert notice is not None and notice.source == "gcp"
    assert before + 25 < notice.deadline < time.time() + 35
    assert all(h.get("metadata-flavor") == "Google" for _, _, h in metadata.requests)
    assert GcpSpotWatcher(metadata.node_url("b")).poll() is None


def test_no_metadata_server_is_given_up_after_a_few_polls(metadata):
    closed = f"http://127.0.0.1:{_free_port()}"
    with pytest.raises(MetadataUnavailable):
        AwsSpotWatcher(closed, timeout=0.5).poll()
    with pytest.raises(MetadataUnavailable):
        GcpSpotWatcher(closed, timeout=0.5).poll()
    monitor = SpotMonitor(
        [AwsSpotWatcher(closed, timeout=0.5), GcpSpotWatcher(metadata.node_url("a"))],
        interval=0.05,
        give_up=3,
    )
    for _ in range(3):
        assert monitor.poll_once() is None
    assert monitor.active == ["gcp"]  # AWS never answered: dropped; GCP answered: kept


@pytest.mark.timeout(30)
def test_monitor_thread_keeps_the_first_notice(metadata):
    monitor = SpotMonitor([GcpSpotWatcher(metadata.node_url("n"))], interval=0.05)
    monitor.start()
    try:
        time.sleep(0.3)
        assert monitor.notice is None
        metadata.gcp_preempt("n")
        deadline = time.monotonic() + 10
        while monitor.notice is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert monitor.notice is not None and monitor.notice.source == "gcp"
    finally:
        monitor.stop()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


HINTS = {
    "initBatchSize": 32,
    "maxProfiledReplicas": 2,
    "perfParams": {
        "alpha_c": 0.01,
        "beta_c": 0.001,
        "alpha_n": 0.01,
        "beta_n": 0.001,
        "alpha_r": 0.005,
        "beta_r": 0.0005,
        "gamma": 1.5,
    },
    "gradParams": {"norm": 1.0, "var": 10.0},
}


@pytest.mark.timeout(30)
def test_hints_receiver_takes_rank0s_valid_hints_with_the_token():
    receiver = HintsReceiver("my job", "s3cret")
    try:
        url = f"{receiver.url}/hints/my%20job"
        good = {"Authorization": "Bearer s3cret"}
        with httpx.Client(timeout=5) as c:
            assert c.put(url, json=HINTS).status_code == 401
            assert c.put(url, json=HINTS, headers={"Authorization": "Bearer no"}).status_code == 401
            assert receiver.latest() == (0, None)
            bad = dict(HINTS, initBatchSize=0)
            assert c.put(url, json=bad, headers=good).status_code == 422
            assert c.put(url, content=b"{", headers=good).status_code == 422
            assert c.put(f"{receiver.url}/hints/other", json=HINTS, headers=good).status_code == 404
            assert c.put(url, json=HINTS, headers=good).status_code == 204
        seq, body = receiver.latest()
        assert seq == 1
        assert body["maxProfiledReplicas"] == 2 and body["perfParams"]["gamma"] == 1.5
        json.dumps(body)  # plain data, as it travels back to the launcher
    finally:
        receiver.close()
