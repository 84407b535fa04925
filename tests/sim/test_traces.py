"""Reading an application's traces: throughput interpolated in the local batch size, placements
that share a profile, the measurements table, gradient statistics and epoch-end progress."""

from __future__ import annotations

import os

import pytest

from adaptrain.sim.traces import Application, load_applications


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
