"""``adaptrain simulate`` end to end on tiny traces: its results, the settings it hands the
policies, and the inputs it refuses with exit status 2 and one line, never a traceback."""

from __future__ import annotations

import json
import os

import pytest

from adaptrain.cli._main import main


def _workload(tmp_path, rows):
    path = os.path.join(str(tmp_path), "workload-t.csv")
    with open(path, "w") as f:
        f.write("name,time,application,num_replicas,batch_size\n")
        for r in rows:
            f.write(",".join(map(str, r)) + "\n")
    return path


def test_cli_json(tiny_traces, tmp_path, capsys):
    wl = _workload(tmp_path, [("a", 0, "toy", 1, 8), ("b", 53, "toy", 4, 16)])
    rc = main(
        ["simulate", wl, "--traces", tiny_traces, "--policy", "tiresias", "--json", "--nodes", "1"]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert {"avg_jct", "p99_jct", "makespan", "policy_s_per_round"} <= set(out)
    assert out["avg_jct"] == pytest.approx((210 + 337) / 2)
    assert out["makespan"] == 390


def test_cli_text_two_policies_and_plot(tiny_traces, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    wl = _workload(tmp_path, [("a", 0, "toy", 2, 16), ("b", 10, "toy", 1, 8)])
    png = os.path.join(str(tmp_path), "out.png")
    rc = main(
        [
            "simulate",
            wl,
            "--traces",
            tiny_traces,
            "--policy",
            "tiresias",
            "--policy",
            "optimus",
            "--plot",
            png,
            "--no-progress",
            "--nodes",
            "2",
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "tiresias" in text and "optimus" in text and "avg JCT" in text
    assert os.path.getsize(png) > 1000


def test_cli_bad_workload(tiny_traces, tmp_path, capsys):
    rc = main(["simulate", os.path.join(str(tmp_path), "missing.csv"), "--traces", tiny_traces])
    assert rc == 2
    assert "does not exist" in capsys.readouterr().err


# ----- settings reach the policies; bad inputs; strict JSON; the plot's folder ------------------


def test_make_policy_gives_every_policy_the_cluster():
    from adaptrain.cli.simulate import make_policy
    from adaptrain.sched import ClusterSpec, WaterfillPolicy

    spec = ClusterSpec(gpus_per_node=2, round_seconds=45.0, restart_delay=10.0)
    wf = make_policy("waterfill", seed=3, cluster=spec)
    assert wf.cluster == spec
    assert (wf.gpus_per_node, wf.restart_delay, wf.round_seconds) == (2, 10.0, 45.0)
    assert wf._genetic.restart_delay == 10.0  # the genetic refinement's restart factor too
    po = make_policy("pollux", seed=3, cluster=spec)
    assert po.cluster == spec and po.restart_delay == 10.0
    # the CLI's defaults are the policies' own defaults (the standard configuration)
    assert make_policy("waterfill").cluster == WaterfillPolicy().cluster == ClusterSpec()


def test_waterfill_from_cli_uses_the_node_size():
    # 4 nodes x 2 GPUs, one perfectly scalable job that may use 8 GPUs: with the real node size
    # the local search packs it on all 4 nodes (with 4-GPU nodes assumed it stopped at 6).
    from adaptrain.cli.simulate import make_policy
    from adaptrain.sched import ClusterSpec, JobInfo, LinearSpeedup, NodeInfo

    nodes = {i: NodeInfo(2) for i in range(4)}
    job = JobInfo(
        creation_timestamp=0.0,
        max_replicas=8,
        speedup_fn=LinearSpeedup(),
        age=600.0,
        remaining_work=1e6,
        max_profiled_replicas=8,
    )
    policy = make_policy("waterfill", cluster=ClusterSpec(gpus_per_node=2))
    policy._genetic = None  # the local search alone (its genetic refinement hid the wrong size)
    assert len(policy.optimize({"a": job}, nodes, {}, 0.0)["a"]) == 8


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--interval", "0"),
        ("--interval", "nan"),
        ("--nodes", "0"),
        ("--gpus-per-node", "0"),
        ("--restart-delay", "-5"),
        ("--interference", "1"),
        ("--interference", "1.5"),
    ],
)
def test_cli_rejects_bad_settings(tiny_traces, tmp_path, capsys, flag, value):
    wl = _workload(tmp_path, [("a", 0, "toy", 1, 8)])
    rc = main(["simulate", wl, "--traces", tiny_traces, "--policy", "tiresias", flag, value])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("adaptrain simulate: ") and flag in err and "Traceback" not in err


def test_cli_rejects_duplicate_job_names(tiny_traces, tmp_path, capsys):
    wl = _workload(tmp_path, [("a", 0, "toy", 1, 8), ("a", 10, "toy", 1, 8)])
    rc = main(["simulate", wl, "--traces", tiny_traces, "--policy", "tiresias", "--json"])
    assert rc == 2
    assert "duplicate job names ['a']" in capsys.readouterr().err


def test_cli_json_of_an_empty_workload_is_strict_json(tiny_traces, tmp_path, capsys):
    wl = _workload(tmp_path, [])
    rc = main(["simulate", wl, "--traces", tiny_traces, "--policy", "tiresias", "--json"])
    assert rc == 0

    def no_nan(name):
        raise AssertionError(f"non-standard JSON constant {name}")

    out = json.loads(capsys.readouterr().out, parse_constant=no_nan)
    assert out["avg_jct"] is None and out["p99_jct"] is None and out["num_jobs"] == 0


def test_cli_plot_into_a_missing_folder(tiny_traces, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    wl = _workload(tmp_path, [("a", 0, "toy", 1, 8)])
    png = os.path.join(str(tmp_path), "new", "sub", "out.png")
    args = ["simulate", wl, "--traces", tiny_traces, "--policy", "tiresias", "--no-progress"]
    assert main([*args, "--plot", png]) == 0
    assert os.path.getsize(png) > 1000
    # a folder that cannot be created is reported before simulating, with exit code 2
    blocker = os.path.join(str(tmp_path), "file")
    with open(blocker, "w") as f:
        f.write("x")
    capsys.readouterr()
    assert main([*args, "--plot", os.path.join(blocker, "out.png")]) == 2
    captured = capsys.readouterr()
    assert "--plot" in captured.err and "avg JCT" not in captured.out


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc, a folder no one can write")
def test_cli_plot_that_cannot_be_written_is_reported_before_simulating(
    tiny_traces, tmp_path, capsys
):
    pytest.importorskip("matplotlib")
    wl = _workload(tmp_path, [("a", 0, "toy", 1, 8)])
    png = "/proc/adaptrain-simulate-plot.png"
    rc = main(["simulate", wl, "--traces", tiny_traces, "--policy", "tiresias", "--plot", png])
    assert rc == 2
    captured = capsys.readouterr()
    assert "--plot /proc/adaptrain-simulate-plot.png: cannot write it" in captured.err
    assert "avg JCT" not in captured.out  # nothing simulated first


def test_cli_workload_that_is_not_utf8_or_is_a_folder(tiny_traces, tmp_path, capsys):
    binary = os.path.join(str(tmp_path), "binary.csv")
    with open(binary, "wb") as f:
        f.write(b"\xff\xfe\x00name,time\n")
    assert main(["simulate", binary, "--traces", tiny_traces]) == 2
    err = capsys.readouterr().err
    assert "binary.csv" in err and "not a UTF-8 CSV file" in err and "Traceback" not in err
    assert main(["simulate", str(tmp_path), "--traces", tiny_traces]) == 2
    assert "is a folder; give a WORKLOAD.csv file" in capsys.readouterr().err


def test_cli_empty_workload_warns(tiny_traces, tmp_path, capsys):
    wl = _workload(tmp_path, [])
    assert main(["simulate", wl, "--traces", tiny_traces, "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert "has no jobs" in captured.err and "(0 jobs)" in captured.out


def test_cli_rounds_only(tiny_traces, tmp_path, capsys):
    # one job submitted at 53 on a free 4-GPU node: waterfill places it on arrival on its first
    # size, the whole node, and keeps it there (30 s restart, 120 s of training: JCT 150); with
    # --rounds-only it waits for the round at 60 (JCT 157)
    wl = _workload(tmp_path, [("a", 53, "toy", 1, 8)])
    args = ["simulate", wl, "--traces", tiny_traces, "--json", "--nodes", "1", "--no-progress"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["avg_jct"] == 150
    assert main([*args, "--rounds-only"]) == 0
    assert json.loads(capsys.readouterr().out)["avg_jct"] == 157
    text = ["simulate", wl, "--traces", tiny_traces, "--nodes", "1", "--no-progress"]
    assert main(text) == 0
    assert "placed on arrival 1/1" in capsys.readouterr().out
    assert main([*text, "--rounds-only"]) == 0
    assert "placed on arrival 0/1" in capsys.readouterr().out


def test_cli_reports_too_many_gpus_per_node_cleanly(tiny_traces, tmp_path, capsys):
    wl = tmp_path / "w.csv"
    wl.write_text("name,time,application,num_replicas,batch_size\na,0,toy,8,16\n")
    args = ["simulate", str(wl), "--traces", tiny_traces, "--policy", "tiresias", "--json"]
    rc = main([*args, "--nodes", "1", "--gpus-per-node", "8"])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("adaptrain simulate: ") and "gpus_per_node=8" in err
    assert "Traceback" not in err


def test_cli_rejects_a_negative_seed(tiny_traces, tmp_path, capsys):
    wl = tmp_path / "w.csv"
    wl.write_text("name,time,application,num_replicas,batch_size\na,0,toy,1,8\n")
    rc = main(["simulate", str(wl), "--traces", tiny_traces, "--seed", "-1", "--json"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "--seed must be >= 0, got -1" in err and "Traceback" not in err
