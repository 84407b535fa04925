"""What the simulator and its trace readers refuse up front: more GPUs per node than the traces
measure, fixed batch sizes outside an application's range, malformed workload rows, non-finite
submission times, and more epochs than the validation files hold."""

from __future__ import annotations

import os

import pytest

from adaptrain.sched import ClusterSpec, OptimusPolicy, Search, TiresiasPolicy, WaterfillPolicy
from adaptrain.sim import Application, Simulator, WorkloadJob, load_applications, load_workload

# ----- more GPUs per node than the traces measure ----------------------------------------------


def test_simulator_rejects_more_gpus_per_node_than_the_traces_measure(tiny_traces):
    apps = load_applications(tiny_traces)
    w = [WorkloadJob("a", 0.0, "toy", 8, 16)]
    with pytest.raises(ValueError, match=r"gpus_per_node=8.*\b4\b"):
        Simulator(w, apps, TiresiasPolicy(), cluster=ClusterSpec(gpus_per_node=8), num_nodes=1)
    # the limit itself is fine
    Simulator(
        [WorkloadJob("a", 0.0, "toy", 4, 16)],
        apps,
        TiresiasPolicy(),
        cluster=ClusterSpec(gpus_per_node=4),
    )


def test_a_placement_with_ten_or_more_replicas_on_a_node_never_aliases(tiny_app_writer, tmp_path):
    d = tiny_app_writer(tmp_path)
    with open(os.path.join(d, "placements.csv"), "a") as f:  # a distinctive 2-node measurement
        for b in (4, 8, 16):
            f.write(f"11,{b},5.0,0.5\n")
    app = Application(d)
    assert app.get_throughput((1, 1), 8) == (5.0, 0.5)
    # 11 replicas on one node is not "11" (1 + 1 replicas on two nodes): no trace measures it
    with pytest.raises(ValueError, match="no throughput"):
        app.get_throughput((11,), 8)
    assert app.max_gpus_per_node == 4


# ----- fixed batch sizes outside the application's range ----------------------------------------


@pytest.mark.parametrize(
    ("policy", "replicas", "batch_size"),
    [
        (TiresiasPolicy, 1, 0),
        (TiresiasPolicy, 1, 4),  # below the initial batch size 8
        (TiresiasPolicy, 1, 32),  # above the largest batch size 16
        (TiresiasPolicy, 4, 8),  # 2 per replica: below the smallest profiled local batch, 4
        (OptimusPolicy, 1, 0),
        (OptimusPolicy, 1, -8),
        (OptimusPolicy, 1, 4),
        (OptimusPolicy, 1, 32),
    ],
)
def test_a_bad_fixed_batch_size_is_rejected_up_front(tiny_traces, policy, replicas, batch_size):
    apps = load_applications(tiny_traces)
    w = [WorkloadJob("ok", 0.0, "toy", 1, 8), WorkloadJob("bad", 0.0, "toy", replicas, batch_size)]
    with pytest.raises(ValueError, match=rf"'bad'.*batch_size={batch_size}\b.*\[\d+, 16\]"):
        Simulator(w, apps, policy(), num_nodes=1)
    # adaptive policies choose the batch size themselves: the column is not used
    Simulator(w, apps, WaterfillPolicy(search=Search(method="local")), num_nodes=1)


# ----- malformed workloads ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("row", "problem"),
    [
        ("b,5,toy", "3 fields"),
        ("b,5,toy,1,8,9", "6 fields"),
        ("b,inf,toy,1,8", "time"),
        ("b,nan,toy,1,8", "time"),
        ("b,-1,toy,1,8", "time"),
        ("b,later,toy,1,8", "time"),
        ("b,5,toy,two,8", "num_replicas"),
        ("b,5,toy,1,", "batch_size"),
    ],
)
def test_a_malformed_workload_row_names_the_file_row_and_problem(tmp_path, row, problem):
    path = tmp_path / "w.csv"
    path.write_text(f"name,time,application,num_replicas,batch_size\na,0,toy,1,8\n{row}\n")
    with pytest.raises(ValueError) as info:
        load_workload(str(path))
    msg = str(info.value)
    assert str(path) in msg and "row 2" in msg and problem in msg, msg


@pytest.mark.parametrize("time", [float("inf"), float("nan")])
def test_simulator_rejects_a_non_finite_submission_time(tiny_traces, time):
    # inf: the run never ended (the job is never submitted); nan: a misleading stall message
    apps = load_applications(tiny_traces)
    w = [WorkloadJob("a", 0.0, "toy", 1, 8), WorkloadJob("b", time, "toy", 1, 8)]
    with pytest.raises(ValueError, match=rf"'b'.*time={time}"):
        Simulator(w, apps, TiresiasPolicy(), num_nodes=1)


# ----- more epochs than the validation files hold -----------------------------------------------


@pytest.mark.parametrize("max_epochs", [3, 100, 0, -1])
def test_max_epochs_beyond_the_validation_files_is_rejected(tiny_app_writer, tmp_path, max_epochs):
    d = tiny_app_writer(tmp_path)  # two epochs
    with pytest.raises(ValueError, match=rf"max_epochs={max_epochs}\b.*\b2\b"):
        Application(d, max_epochs=max_epochs)
    app = Application(d, max_epochs=2)
    assert app.get_progress(app.max_epochs) == 120.0
