"""``adaptrain.env``: precedence of ADAPTRAIN_* over torchrun's variables, the rendezvous under
torchrun (a real torchrun launch), and one warning per stray variable."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from adaptrain import env
from adaptrain.dist.spawn import free_port

TORCHRUN = ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")


def test_adaptrain_variables_win_outside_torchrun(monkeypatch):
    for name in TORCHRUN:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_PORT", "1111")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    assert (env.master_addr(), env.master_port()) == ("10.0.0.1", 1111)
    monkeypatch.setenv("ADAPTRAIN_MASTER_PORT", "2222")
    monkeypatch.setenv("ADAPTRAIN_MASTER_ADDR", "10.0.0.2")
    assert (env.master_addr(), env.master_port()) == ("10.0.0.2", 2222)
    monkeypatch.setenv("ADAPTRAIN_NUM_RESTARTS", "3")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert env.num_restarts() == 3 and env.launched_by_torchrun()


def test_torchrun_rendezvous_wins_under_torchrun(monkeypatch, caplog):
    monkeypatch.setattr(env, "_warned", set(), raising=False)  # each stray value is warned of once
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("MASTER_PORT", "1111")
    monkeypatch.setenv("ADAPTRAIN_MASTER_PORT", "2222")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.setenv("ADAPTRAIN_MASTER_ADDR", "10.0.0.2")
    with caplog.at_level("WARNING", logger="adaptrain.env"):
        assert env.master_port() == 1111
    assert "ADAPTRAIN_MASTER_PORT=2222 ignored" in caplog.text
    assert env.master_addr() == "10.0.0.2"  # torchrun gave none: ours stands
    for ours, theirs, fn in (
        ("ADAPTRAIN_REPLICA_RANK", "RANK", env.replica_rank),
        ("ADAPTRAIN_NUM_REPLICAS", "WORLD_SIZE", env.num_replicas),
        ("ADAPTRAIN_LOCAL_RANK", "LOCAL_RANK", env.local_rank),
    ):
        monkeypatch.setenv(theirs, "1")
        monkeypatch.setenv(ours, "3")
        assert fn() == 1, ours
        monkeypatch.delenv("TORCHELASTIC_RUN_ID")
        assert fn() == 3, ours  # outside torchrun ours wins
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")


@pytest.mark.timeout(120)
def test_stray_adaptrain_rendezvous_variables_do_not_hang_a_torchrun_job(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch, torch.distributed as dist
            import adaptrain.torch as adl
            adl.init_process_group("gloo")
            t = torch.ones(1) * (dist.get_rank() + 1)
            dist.all_reduce(t)
            with open(__file__ + f".{dist.get_rank()}", "w") as f:
                f.write(str(int(t)))
            """
        )
    )
    port = free_port()
    environ = dict(
        os.environ,
        ADAPTRAIN_MASTER_PORT=str(free_port()),
        ADAPTRAIN_REPLICA_RANK="0",
        ADAPTRAIN_NUM_REPLICAS="3",
        OMP_NUM_THREADS="1",
    )
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node=2",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            str(script),
        ],
        env=environ,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert [(tmp_path / f"job.py.{r}").read_text() for r in range(2)] == ["3", "3"]


def test_adaptdl_names(monkeypatch):
    monkeypatch.setenv("ADAPTRAIN_SCHED_VERSION", "1.2")
    assert env.adaptdl_sched_version() == env.adaptrain_sched_version() == "1.2"


def test_job_id_prefers_ours_then_torchrun_s_run_id_but_not_its_default(monkeypatch):
    monkeypatch.delenv("ADAPTRAIN_JOB_ID", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert env.job_id() is None
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's default: no identity
    assert env.job_id() is None
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-7")
    assert env.job_id() == "run-7"
    monkeypatch.setenv("ADAPTRAIN_JOB_ID", "")  # empty counts as unset
    assert env.job_id() == "run-7"
    monkeypatch.setenv("ADAPTRAIN_JOB_ID", "ns/job-1")
    assert env.job_id() == "ns/job-1"


@pytest.mark.parametrize("value", ["70000", "-1"])
def test_a_port_out_of_range_names_the_variable(monkeypatch, value):
    for name in TORCHRUN:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ADAPTRAIN_MASTER_PORT", value)
    with pytest.raises(ValueError, match=f"ADAPTRAIN_MASTER_PORT={value} is not a port"):
        env.master_port()


def test_num_nodes_under_torchrun_ignores_a_stray_adaptrain_num_replicas(monkeypatch):
    # torchrun --nproc-per-node=2 on one node: its WORLD_SIZE wins over ADAPTRAIN_NUM_REPLICAS,
    # and so does its node count, WORLD_SIZE // LOCAL_WORLD_SIZE.
    monkeypatch.delenv("ADAPTRAIN_NUM_NODES", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    for stray in (None, "2", "3"):
        if stray is None:
            monkeypatch.delenv("ADAPTRAIN_NUM_REPLICAS", raising=False)
        else:
            monkeypatch.setenv("ADAPTRAIN_NUM_REPLICAS", stray)
        assert (env.num_replicas(), env.num_nodes()) == (2, 1), stray
    for name in TORCHRUN:  # outside torchrun ADAPTRAIN_NUM_REPLICAS wins, one per node
        monkeypatch.delenv(name, raising=False)
    assert (env.num_replicas(), env.num_nodes()) == (3, 3)


@pytest.mark.parametrize(
    ("name", "value", "accessor"),
    [
        ("ADAPTRAIN_LOCAL_RANK", "-1", env.local_rank),
        ("ADAPTRAIN_REPLICA_RANK", "-2", env.replica_rank),
        ("ADAPTRAIN_NUM_REPLICAS", "0", env.num_replicas),
        ("ADAPTRAIN_NUM_NODES", "0", env.num_nodes),
        ("ADAPTRAIN_NUM_NODES", "-3", env.num_nodes),
        ("ADAPTRAIN_NUM_RESTARTS", "-1", env.num_restarts),
    ],
)
def test_negative_ranks_and_empty_sizes_name_the_variable(monkeypatch, name, value, accessor):
    for var in ("TORCHELASTIC_RUN_ID", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"{name}={value}"):
        accessor()


def test_a_zero_local_world_size_names_the_variable(monkeypatch):
    for var in ("TORCHELASTIC_RUN_ID", "ADAPTRAIN_NUM_NODES", "ADAPTRAIN_NUM_REPLICAS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "0")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE=0"):
        env.num_nodes()


@pytest.mark.usefixtures("fresh_checkpoints")
def test_a_stray_variable_under_torchrun_is_warned_of_once(monkeypatch, caplog) -> None:
    # Every micro-batch's step-time profile asks num_nodes() -> num_replicas(): the warning is
    # logged once, not at each of them.
    from adaptrain.torch import _metrics

    monkeypatch.setattr(env, "_warned", set(), raising=False)
    monkeypatch.delenv("ADAPTRAIN_NUM_NODES", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("ADAPTRAIN_NUM_REPLICAS", "5")
    with caplog.at_level("WARNING", logger="adaptrain.env"):
        for _ in range(20):
            _metrics.profile_step_start(8)
            _metrics.profile_step_commit()
        assert env.num_replicas() == 2
    warned = [r for r in caplog.records if "ADAPTRAIN_NUM_REPLICAS=5 ignored" in r.message]
    assert len(warned) == 1
    # Another stray value is news: warned of too.
    monkeypatch.setenv("ADAPTRAIN_NUM_REPLICAS", "6")
    with caplog.at_level("WARNING", logger="adaptrain.env"):
        env.num_replicas()
    assert "ADAPTRAIN_NUM_REPLICAS=6 ignored" in caplog.text
