"""``adaptrain ray submit`` after failures: a replica that crashes restarts the job from the
newest checkpoint rank 0's node holds; a checkpoint that does not arrive within
``--checkpoint-timeout`` restarts it from the previous one, never from nothing."""

from __future__ import annotations

import time

import pytest
from _launcher_jobs import COUNT, leftover_processes, records, wait_for, write_job
from _metadata_server import MetadataServer
from _ray_cluster import local_ray_cluster  # before ray
from _ray_launcher_harness import log_env, running, script_args

from adaptrain.ray.launcher import RayLauncher

pytestmark = [pytest.mark.slow]


def events(launcher: RayLauncher, kind: str) -> list[tuple[float, str]]:
    return [(t, msg) for t, k, msg in launcher.events if k == kind]


@pytest.mark.timeout(200)
def test_crash_then_checkpoint_timeout_restart_from_the_checkpoint_held(tmp_path):
    metadata = MetadataServer()
    code = write_job(str(tmp_path / "wd"), "count.py", COUNT)
    env = log_env(tmp_path)
    log = env["LAUNCHER_TEST_LOG"]
    var = "ADAPTRAIN_AWS_METADATA_URL"
    try:
        with local_ray_cluster(
            workers=[
                {"num_cpus": 1, "env_vars": {var: metadata.node_url("n0")}},
                {"num_cpus": 1, "env_vars": {var: metadata.node_url("n1")}},
            ]
        ):
            launcher = RayLauncher(
                code,
                script_args(
                    tmp_path,
                    *("--steps", "40", "--delay", "0.2", "--save-every", "5"),
                    *("--fail-group", "0", "--fail-step", "12", "--hang-group", "1"),
                ),
                max_workers=1,
                cpus=1,
                env=env,
                spot="aws",
                spot_interval=0.5,
                checkpoint_timeout=5,
                rescale_interval=3600,
                poll_interval=0.5,
            )
            with running(launcher, str(tmp_path)) as run:
                # launch 0 crashes at step 12: launch 1 restores checkpoint 1 (step 10)
                wait_for(lambda: len(launcher.launches) >= 2, 90, "the launch after the crash", run)
                assert events(launcher, "failed")[0][1] == "rank 0 exited with status 1"
                assert "checkpoint 1 arrived" in events(launcher, "checkpoint")[0][1]
                assert launcher.launches[1] == launcher.launches[0]  # the node is fine
                wait_for(
                    lambda: [r for r in records(log, "step") if r["group"] == 1],
                    60,
                    "launch 1 training",
                    run,
                )
                # launch 1 is stuck (ignores SIGTERM, half-written checkpoint): a spot
                # notice on its node must not wait for it longer than the timeout
                node = next(
                    n for n in ("n0", "n1") if metadata.polled(n)
                )  # the only host polls its node's server
                metadata.aws_interrupt(node, seconds=120)
                wait_for(lambda: len(launcher.launches) >= 3, 60, "the launch after it", run)
                notice_at = events(launcher, "notice")[0][0]
                late = events(launcher, "no-checkpoint")
                assert late and "did not arrive within 5 s" in late[0][1], run.describe()
                assert "restarting from checkpoint 1" in late[0][1]
                relaunched = [t for t, k, m in launcher.events if k == "launched"][-1]
                assert 5 <= relaunched - notice_at < 45
                assert launcher.launches[2].keys() != launcher.launches[1].keys()
                assert run.join(90) == 0, run.describe()
            starts = {s["group"]: s for s in records(log, "start")}
            assert starts[0]["step"] == 0 and starts[0]["restored"] is None
            assert starts[1]["step"] == 10 and starts[1]["restored"] == 1
            # launch 1 got past step 10 but wrote nothing whole: launch 2 starts at 10 again
            assert max(r["step"] for r in records(log, "step") if r["group"] == 1) > 10
            assert starts[2]["step"] == 10 and starts[2]["restored"] == 1
            assert max(r["step"] for r in records(log, "step")) == 40
            assert launcher.checkpoint_seq is not None and launcher.checkpoint_seq >= 2
    finally:
        metadata.close()
    assert not leftover_processes(str(tmp_path))


@pytest.mark.timeout(120)
def test_repeated_failures_with_no_progress_give_up(tmp_path):
    code = write_job(str(tmp_path / "wd"), "crash.py", "import sys\nsys.exit(3)\n")
    with local_ray_cluster(workers=[{"num_cpus": 1}]):
        launcher = RayLauncher(
            code,
            ["--tag", str(tmp_path)],
            max_workers=1,
            cpus=1,
            spot="off",
            max_failures=2,
            poll_interval=0.3,
            checkpoint_timeout=5,
        )
        start = time.monotonic()
        assert launcher.run() == 3
        assert time.monotonic() - start < 90
        assert len(launcher.launches) == 3  # the first try and two restarts
        assert events(launcher, "gave-up")
    assert not leftover_processes(str(tmp_path))
