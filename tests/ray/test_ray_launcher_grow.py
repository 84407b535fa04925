"""``adaptrain ray submit`` grows a job onto the nodes the autoscaler grants, as far as its
goodput says it is worth.

Ray's ``AutoscalingCluster`` does not run here: the Ray wheel lacks the fake provider's
``fake_multi_node/example.yaml`` (its config template and defaults), and its ``start()`` runs
``ray stop --force``, which would end every Ray process on the machine. The test plays the
autoscaler instead, reading what Ray's own (v1) autoscaler reads: the bundles that
``ray.autoscaler.sdk.request_resources`` stored in the GCS, and adds a node to the
``cluster_utils`` cluster when they do not fit.
"""

from __future__ import annotations

import json
import time

import pytest
from _launcher_jobs import COUNT, leftover_processes, records, wait_for, write_job
from _ray_cluster import add_worker, alive_nodes, local_ray_cluster  # before ray
from _ray_launcher_harness import log_env, running, script_args

from adaptrain.ray.launcher import RayLauncher

pytestmark = [pytest.mark.slow]


def requested() -> list[dict] | None:
    """The bundles of the last ``request_resources`` (what the autoscaler would read)."""
    from ray.experimental.internal_kv import _internal_kv_get

    raw = _internal_kv_get(b"autoscaler_resource_request")
    return None if raw is None else json.loads(raw)


def workers() -> list[dict]:
    return [n for n in alive_nodes() if n["Resources"].get("CPU", 0) > 0]


def grant(cluster, cap: int) -> int:
    """The test's autoscaler: one 1-CPU node per requested 1-CPU bundle, at most ``cap``."""
    bundles = requested() or []
    have = len(workers())
    if have < min(len(bundles), cap):
        add_worker(cluster, num_cpus=1)
        cluster.wait_for_nodes()
        return have + 1
    return have


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "model, replicas",
    [("scales", [1, 2]), ("slow", [1])],
    ids=["scaling-job-grows", "slow-network-job-stays"],
)
def test_job_grows_when_the_autoscaler_grants_nodes(tmp_path, model, replicas):
    code = write_job(str(tmp_path / "wd"), "count.py", COUNT)
    env = log_env(tmp_path)
    with local_ray_cluster(workers=[{"num_cpus": 1}]) as cluster:
        launcher = RayLauncher(
            code,
            script_args(tmp_path, "--steps", "60", "--delay", "0.25", "--hints", model),
            max_workers=2,
            cpus=1,
            env=env,
            spot="off",
            cluster_rescale_timeout=2,
            rescale_interval=4,
            poll_interval=0.5,
        )
        with running(launcher, str(tmp_path)) as run:
            # no model yet: it explores, asking for two replica-sized bundles
            wait_for(lambda: requested() == [{"CPU": 1.0}] * 2, 30, "a request for 2", run)
            wait_for(lambda: records(env["LAUNCHER_TEST_LOG"], "hints"), 60, "hints", run)
            assert grant(cluster, cap=2) == 2  # the new node joins
            granted = time.monotonic()
            if model == "scales":
                wait_for(lambda: len(launcher.launches) >= 2, 60, "a second launch", run)
                assert time.monotonic() - granted < 30
            else:
                # s(2) = 0.94 across two nodes: it withdraws its ask and stays on one
                wait_for(lambda: requested() == [{"CPU": 1.0}], 30, "a request for 1", run)
                time.sleep(8)  # two rescale intervals with a free node
            assert run.join(120) == 0, run.describe()
        log = env["LAUNCHER_TEST_LOG"]
        starts = records(log, "start")
        assert [len(launch) and sum(launch.values()) for launch in launcher.launches] == replicas
        assert sorted({s["replicas"] for s in starts}) == replicas
        if model == "scales":
            # the second launch runs on two nodes, by ID, and resumes where the first stopped
            assert len(launcher.launches[1]) == 2
            assert {n["NodeID"] for n in workers()} == set(launcher.launches[1])
            first = [s for s in starts if s["group"] == 1 and s["rank"] == 0][0]
            stopped = max(c["step"] for c in records(log, "checkpoint") if c["group"] == 0)
            assert first["step"] == stopped > 0
        assert max(s["step"] for s in records(log, "step")) == 60
        assert requested() == []  # the ask is withdrawn when the job ends
        import ray

        assert ray.is_initialized()  # the test's connection is left alone
    assert not leftover_processes(str(tmp_path))
