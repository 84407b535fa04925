"""`adaptrain simulate` end to end on tiny traces, and trace interpolation."""

from __future__ import annotations

import json
import os

import pytest

from adaptrain.cli._main import main
from adaptrain.sim.traces import Application, load_applications


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


def test_throughput_interpolation(tiny_app_writer, tmp_path):
    d = tiny_app_writer(tmp_path)
    # overwrite placements with a slope in local_bsz to check linear interpolation
    with open(os.path.join(d, "placements.csv"), "w") as f:
        f.write("placement,local_bsz,step_time,sync_time\n1,4,1.0,0.1\n1,16,4.0,0.4\n")
        f.write("12,4,2.0,1.0\n12,16,5.0,1.0\n")
    app = Application(d)
    assert app.get_throughput((1,), 10) == pytest.approx((2.5, 0.25))
    # rotations of a placement share a profile: (2, 1) is (1, 2)
    assert app.get_throughput((2, 1), 8) == pytest.approx((3.0, 1.0))
    assert app.min_local_bsz == 4 and app.max_local_bsz == 16
    with pytest.raises(ValueError, match="outside"):
        app.get_throughput((1,), 32)
    m = app.measurements()  # placements rows, then the tiny scalability.csv rows
    assert m["num_nodes"].tolist()[:4] == [1, 1, 2, 2]
    assert m["num_replicas"].tolist()[:4] == [1, 1, 3, 3]
    assert m["step_time"].tolist()[:4] == [1.0, 4.0, 2.0, 5.0]
    assert m["sync_time"].tolist()[:4] == [0.1, 0.4, 1.0, 1.0]
    assert len(m["local_bsz"]) == 4 + 8 and m["num_replicas"][-1] == 64


def test_grad_stats_and_progress(tiny_app_writer, tmp_path):
    d = tiny_app_writer(tmp_path)
    with open(os.path.join(d, "validation-16.csv"), "w") as f:
        f.write(
            "progress,iteration,metric,grad_sqr,grad_var\n50,4,0.5,3.0,2.0\n110,8,0.6,5.0,4.0\n"
        )
    app = load_applications(str(tmp_path))["toy"]
    assert (app.init_batch_size, app.max_batch_size, app.max_epochs) == (8, 16, 2)
    # halfway between bsz 8 (sqr 1, var 0) and 16 (sqr 3, var 2) at epoch 0
    assert app.get_grad_stats(12, 0) == pytest.approx((2.0, 1.0))
    # epoch-end progress is the minimum across validated batch sizes
    assert app.get_progress(0) == 0.0
    assert app.get_progress(1) == 50.0 and app.get_progress(2) == 110.0
    with pytest.raises(ValueError, match="outside"):
        app.get_grad_stats(32, 0)


# ---- review fixes: settings reach the policies, validation, strict JSON, plot folder ------


def test_make_policy_passes_cluster_settings():
    from adaptrain.cli.simulate import make_policy
    from adaptrain.sched import PolluxPolicy, WaterfillPolicy

    wf = make_policy("waterfill", seed=3, gpus_per_node=2, restart_delay=10.0, interval=45.0)
    assert (wf.gpus_per_node, wf.restart_delay, wf.round_seconds) == (2, 10.0, 45.0)
    assert wf._runs[0].restart_delay == 10.0  # the genetic refinement's restart factor too
    po = make_policy("pollux", seed=3, restart_delay=10.0)
    assert po.restart_delay == 10.0
    # the CLI's defaults are the policies' own defaults (the standard configuration)
    d_wf, d_po = make_policy("waterfill"), make_policy("pollux")
    ref_wf, ref_po = WaterfillPolicy(), PolluxPolicy()
    assert (d_wf.gpus_per_node, d_wf.restart_delay, d_wf.round_seconds) == (
        ref_wf.gpus_per_node,
        ref_wf.restart_delay,
        ref_wf.round_seconds,
    )
    assert d_po.restart_delay == ref_po.restart_delay


def test_waterfill_from_cli_uses_the_node_size():
    # 4 nodes x 2 GPUs, one perfectly scalable job that may use 8 GPUs: with the real node size
    # the local search packs it on all 4 nodes (with 4-GPU nodes assumed it stopped at 6).
    from adaptrain.cli.simulate import make_policy
    from adaptrain.sched import JobInfo, LinearSpeedup, NodeInfo

    nodes = {i: NodeInfo(2) for i in range(4)}
    job = JobInfo(
        creation_timestamp=0.0,
        max_replicas=8,
        speedup_fn=LinearSpeedup(),
        age=600.0,
        remaining_work=1e6,
        max_profiled_replicas=8,
    )
    policy = make_policy("waterfill", gpus_per_node=2)
    policy._runs = []  # the local search alone (its genetic refinement hid the wrong size)
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
    png = "/proc/adaptrain-review-s20.png"
    rc = main(["simulate", wl, "--traces", tiny_traces, "--policy", "tiresias", "--plot", png])
    assert rc == 2
    captured = capsys.readouterr()
    assert "--plot /proc/adaptrain-review-s20.png: cannot write it" in captured.err
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
