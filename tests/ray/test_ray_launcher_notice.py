"""``adaptrain ray submit`` checkpoints before a node goes away and carries on without it:
a Ray drain request (``ray drain-node --deadline-remaining-seconds``), with the real
adaptrain.torch library, and AWS/GCP spot notices from a metadata server on 127.0.0.1."""

from __future__ import annotations

import subprocess
import sys
import time
from collections import Counter

import pytest
from _launcher_jobs import COUNT, TRAIN, leftover_processes, records, wait_for, write_job
from _metadata_server import MetadataServer
from _ray_cluster import local_ray_cluster  # before ray
from _ray_launcher_harness import log_env, running, script_args

from adaptrain.ray.launcher import RayLauncher

pytestmark = [pytest.mark.slow]


def notice_events(launcher: RayLauncher, kind: str) -> list[tuple[float, str]]:
    return [(t, msg) for t, k, msg in launcher.events if k == kind]


@pytest.mark.timeout(240)
def test_drain_notice_checkpoints_before_the_deadline_and_rescales(tmp_path):
    """Two replicas of a real adaptrain.torch job on two nodes; rank 0's node is drained with
    a 40 s deadline: its checkpoint comes off the node in time and the job finishes on the
    other node from it, every sample of every epoch trained exactly once."""
    code = write_job(str(tmp_path / "wd"), "train.py", TRAIN)
    env = log_env(tmp_path)
    log = env["LAUNCHER_TEST_LOG"]
    with local_ray_cluster(workers=[{"num_cpus": 1}, {"num_cpus": 1}]) as cluster:
        launcher = RayLauncher(
            code,
            script_args(tmp_path, "--epochs", "4", "--step-sleep", "0.3"),
            max_workers=2,
            cpus=1,
            env=env,
            spot="off",
            checkpoint_timeout=60,
            rescale_interval=3600,  # only the notice rescales this job
            poll_interval=0.5,
        )
        with running(launcher, str(tmp_path)) as run:
            wait_for(
                lambda: len([r for r in records(log, "step") if r["rank"] == 0]) >= 6,
                150,
                "six steps of rank 0",
                run,
            )
            assert len(launcher.launches) == 1 and len(launcher.launches[0]) == 2
            rank0_node = next(iter(launcher.launches[0]))
            drained = time.time()
            out = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "ray.scripts.scripts",  # the `ray` command
                    "drain-node",
                    "--address",
                    cluster.address,
                    "--node-id",
                    rank0_node,
                    "--reason",
                    "DRAIN_NODE_REASON_PREEMPTION",
                    "--reason-message",
                    "spot reclaimed",
                    "--deadline-remaining-seconds",
                    "40",
                ],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert out.returncode == 0, out.stderr[-2000:]
            wait_for(lambda: len(launcher.launches) >= 2, 90, "the launch after the drain", run)
            arrived = notice_events(launcher, "checkpoint")
            assert arrived, run.describe()
            assert arrived[0][0] < drained + 40, "the checkpoint arrived after the deadline"
            assert launcher.launches[1] == {
                n: 1 for n in launcher.launches[1] if n != rank0_node
            }  # one replica, not on the drained node
            assert rank0_node not in launcher.launches[1]
            assert run.join(180) == 0, run.describe()
        steps = records(log, "step")
        assert {r["replicas"] for r in steps if r["group"] == 1} == {1}
        # resumed from the drain's checkpoint: no epoch lost or repeated a sample
        for epoch in range(4):
            seen = Counter(i for r in steps if r["epoch"] == epoch for i in r["ids"])
            assert sorted(seen) == list(range(96)), f"epoch {epoch}: samples lost"
            assert max(seen.values()) == 1, f"epoch {epoch}: samples trained twice"
        assert any(r["group"] == 0 for r in steps) and any(r["group"] == 1 for r in steps)
        assert [k for _, k, _ in launcher.events].count("notice") == 1
    assert not leftover_processes(str(tmp_path))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("cloud", ["aws", "gcp"])
def test_spot_notice_checkpoints_and_rescales_onto_the_other_node(tmp_path, cloud):
    """Each node reads its own metadata URL (its raylet's environment); one node gets a spot
    notice: the job checkpoints, leaves it and finishes on the other one."""
    metadata = MetadataServer()
    var = f"ADAPTRAIN_{cloud.upper()}_METADATA_URL"
    code = write_job(str(tmp_path / "wd"), "count.py", COUNT)
    env = log_env(tmp_path)
    log = env["LAUNCHER_TEST_LOG"]
    try:
        with local_ray_cluster(
            workers=[
                {"num_cpus": 1, "env_vars": {var: metadata.node_url("n0")}},
                {"num_cpus": 1, "env_vars": {var: metadata.node_url("n1")}},
            ]
        ):
            launcher = RayLauncher(
                code,
                script_args(tmp_path, "--steps", "70", "--delay", "0.2"),
                max_workers=2,
                cpus=1,
                env=env,
                spot=cloud,
                spot_interval=0.5,
                rescale_interval=3600,
                poll_interval=0.5,
            )
            with running(launcher, str(tmp_path)) as run:
                wait_for(
                    lambda: len([r for r in records(log, "step") if r["rank"] == 0]) >= 8,
                    60,
                    "eight steps of rank 0",
                    run,
                )
                wait_for(lambda: metadata.polled("n0") and metadata.polled("n1"), 30, "polls", run)
                assert len(launcher.launches[0]) == 2
                noticed = time.time()
                node = "n1"
                if cloud == "aws":
                    deadline = metadata.aws_interrupt(node, seconds=60)
                else:
                    metadata.gcp_preempt(node)
                    deadline = noticed + 30
                wait_for(lambda: len(launcher.launches) >= 2, 60, "the launch after it", run)
                arrived = notice_events(launcher, "checkpoint")
                assert arrived and arrived[0][0] < deadline, run.describe()
                notices = notice_events(launcher, "notice")
                assert len(notices) == 1 and cloud.upper() in notices[0][1]
                assert sum(launcher.launches[1].values()) == 1
                assert run.join(120) == 0, run.describe()
            starts = [s for s in records(log, "start") if s["group"] == 1]
            stopped = max(c["step"] for c in records(log, "checkpoint") if c["group"] == 0)
            assert [s["step"] for s in starts] == [stopped] and stopped >= 8
            assert max(s["step"] for s in records(log, "step")) == 70
            # the noticed node is the one left out
            noticed_node = next(n for n in launcher.launches[0] if n not in launcher.launches[1])
            assert launcher._excluded.get(noticed_node)
    finally:
        metadata.close()
    assert not leftover_processes(str(tmp_path))
