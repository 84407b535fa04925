"""Plots of simulation results: the JCT CDF's steps and the allocations' step curves."""

from __future__ import annotations

import numpy as np
import pytest

from adaptrain.sim.simulator import SimResult

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")

from adaptrain.sim.plot import cdf_points, make_figure  # noqa: E402


def _result(jcts, timeline=()):
    return SimResult(
        jcts=dict(jcts),
        makespan=0.0,
        gpu_utilization=0.0,
        policy_seconds=[],
        timeline=list(timeline),
    )


def test_cdf_starts_at_the_first_jct_at_zero():
    x, y = cdf_points([300.0, 100.0, 200.0])
    assert x.tolist() == [100.0, 100.0, 200.0, 300.0]
    assert y.tolist() == pytest.approx([0.0, 1 / 3, 2 / 3, 1.0])
    x, y = cdf_points([])
    assert x.size == 0 and y.size == 0


def test_single_job_draws_a_visible_cdf_and_allocations_are_post_steps():
    import matplotlib.pyplot as plt

    timeline = [
        {"time": 60.0, "allocations": {"a": 4}},
        {"time": 120.0, "allocations": {"a": 4, "b": 2}},
        {"time": 180.0, "allocations": {}},
    ]
    fig = make_figure({"tiresias": _result({"a": 210.0}, timeline)}, gpus=8)
    try:
        ax1, ax2 = fig.axes
        (cdf,) = ax1.get_lines()
        xy = np.asarray(cdf.get_xydata())
        # a vertical step at the one JCT, from 0 to 1 (was a single, invisible point)
        assert xy.tolist() == [[210.0, 0.0], [210.0, 1.0]]
        used, running = ax2.get_lines()[:2]
        assert used.get_drawstyle() == "steps-post" and running.get_drawstyle() == "steps-post"
        assert np.asarray(used.get_ydata()).tolist() == [4, 6, 0]
        assert np.asarray(running.get_ydata()).tolist() == [1, 2, 0]
    finally:
        plt.close(fig)
