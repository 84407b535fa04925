"""A multi-node Ray cluster on 127.0.0.1 for the Ray tests, stopped by the test that starts it.

Every node of :class:`ray.cluster_utils.Cluster` on this machine advertises the same IP; with
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` and ``node_ip_address="127.0.0.1"`` on each node they
coexist. The head has no CPUs (nothing is scheduled on it), the workers have what the test asks.
Health checks every second detect a node killed without warning in about three seconds.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence

import pytest

# read by Ray when it is imported (it decides then whether 127.0.0.1 names this node): import
# this module before ray
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
ray = pytest.importorskip("ray", reason="the Ray tests need `pip install adaptrain[ray]`")
from ray.cluster_utils import Cluster  # noqa: E402

HEALTH = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}


@contextlib.contextmanager
def local_ray_cluster(
    workers: Sequence[dict] = ({"num_cpus": 2}, {"num_cpus": 2}),
    connect: bool = True,
    head_args: dict | None = None,
) -> Iterator[Cluster]:
    """A head with 0 CPUs (and ``head_args`` added to its ``add_node`` arguments) and one
    worker node per entry of ``workers``; the driver connected when ``connect``. Shut down on
    exit, whatever happened."""
    # a short folder: Ray's unix sockets live under it, and their paths are limited to 107 bytes
    tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    old_tmp = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = tmp
    cluster = None
    try:
        cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 0,
                "node_ip_address": "127.0.0.1",
                "include_dashboard": False,
                "_system_config": HEALTH,
                **(head_args or {}),
            },
        )
        for args in workers:
            add_worker(cluster, **args)
        cluster.wait_for_nodes()
        if connect:
            ray.init(address=cluster.address, _node_ip_address="127.0.0.1")
        yield cluster
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
        if old_tmp is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = old_tmp


def add_worker(cluster: Cluster, **args):
    """One more worker node on 127.0.0.1 (``add_node``'s keyword arguments)."""
    args.setdefault("num_cpus", 2)
    return cluster.add_node(node_ip_address="127.0.0.1", **args)


def alive_nodes() -> list[dict]:
    return [n for n in ray.nodes() if n["Alive"]]
