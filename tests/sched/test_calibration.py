"""Goodput models calibrated at measured configurations (``CalibratedGoodput``,
``ThroughputCalibration`` and ``WaterfillPolicy(calibrate=True)``)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from adaptrain.core.goodput import GoodputFunction, predict_step_times
from adaptrain.sched import (
    JobInfo,
    LinearSpeedup,
    NodeInfo,
    Sharing,
    WaterfillPolicy,
    check_allocations,
)
from adaptrain.sched._calibration import CalibratedGoodput, ThroughputCalibration
from adaptrain.sched.speedup import SpeedupFunction

# cheap synchronisation: the model scales well across nodes
PERF = (0.02, 0.001, 0.05, 0.002, 0.01, 0.0005, 1.5)
GRAD = (1.0, 50.0)  # noisy gradients: large batches pay
B0 = 64
LIMITS = {"max_batch_size": 4096, "atomic_bsz_range": (16, 256), "accumulation": True}


def _fn(perf=PERF, grad=GRAD) -> SpeedupFunction:
    return SpeedupFunction(GoodputFunction(perf, grad, B0), max_nodes=8, max_replicas=32, **LIMITS)


def _step(n: int, r: int, b: int, perf=PERF) -> float:
    """The model's optimizer-step time at (n, r, b)."""
    _, optim = predict_step_times(perf, np.array([n]), np.array([r]), np.array([b]))
    return float(optim[0])


def _job(profile=None, *, app="yolo", work=1e4, limit=32, r0=8, **kw) -> JobInfo:
    return JobInfo(
        0.0,
        max_replicas=limit,
        speedup_fn=_fn(),
        remaining_work=work,
        max_profiled_replicas=r0,
        replica_limit=limit,
        application=app,
        epoch=3,
        profile=profile,
        **kw,
    )


def test_calibrated_goodput_scales_throughput_at_the_listed_configurations_only():
    base = GoodputFunction(PERF, GRAD, B0)
    cal = CalibratedGoodput(PERF, GRAD, B0, {(2, 8): 0.5, (1, 1): 2.0})
    n = np.array([2, 2, 1, 1, 3])
    r = np.array([8, 6, 1, 4, 12])
    b = np.array([32, 32, 64, 32, 32])
    s = np.zeros(5, dtype=int)
    ratio = cal.throughput(n, r, b, s) / base.throughput(n, r, b, s)
    np.testing.assert_allclose(ratio, [0.5, 1.0, 2.0, 1.0, 1.0])
    # scalars, accumulation steps and configurations beyond the factor table
    assert cal.throughput(2, 8, 32, 3) == pytest.approx(0.5 * base.throughput(2, 8, 32, 3))
    assert cal.throughput(9, 40, 32, 0) == pytest.approx(base.throughput(9, 40, 32, 0))
    assert cal.factors == {(2, 8): 0.5, (1, 1): 2.0}
    # the batch-size search sees the calibrated throughput
    g_cal = cal.optimize(2, 8, **LIMITS)[0]
    g_base = base.optimize(2, 8, **LIMITS)[0]
    assert g_cal == pytest.approx(0.5 * g_base)


@pytest.mark.parametrize(
    "factors", [{(3, 2): 1.0}, {(0, 0): 1.0}, {(1, 2): 0.0}, {(1, 2): math.nan}]
)
def test_calibrated_goodput_rejects_bad_factors(factors):
    with pytest.raises(ValueError, match="factor"):
        CalibratedGoodput(PERF, GRAD, B0, factors)


def test_factors_are_measured_over_modelled_throughput_geometric_means_over_batches_and_jobs():
    cal = ThroughputCalibration()
    # (2, 8) measured at two batch sizes, 2x and 8x slower than modelled: factor 1/4;
    # (1, 4) by two jobs, 1.5x faster and as modelled: factor sqrt(1.5)
    a = {(2, 8, 32): (2.0 * _step(2, 8, 32), 0.0), (2, 8, 64): (8.0 * _step(2, 8, 64), 0.0)}
    a[(1, 4, 32)] = (_step(1, 4, 32) / 1.5, 0.0)
    b = {(1, 4, 32): (_step(1, 4, 32), 0.0)}
    cal.observe({"a": _job(a), "b": _job(b), "other": _job(b, app="bert")})
    f = cal.factors("yolo", PERF)
    assert set(f) == {(2, 8), (1, 4)}
    assert f[(2, 8)] == pytest.approx(0.25)
    assert f[(1, 4)] == pytest.approx(math.sqrt(1.5))
    assert cal.factors("bert", PERF) == {(1, 4): pytest.approx(1.0)}
    assert cal.factors("unseen", PERF) == {}
    f.clear()  # the caller's copy: the cached factors stay
    assert cal.factors("yolo", PERF)[(2, 8)] == pytest.approx(0.25)


def test_calibrate_corrects_the_speedup_where_measured_and_rescales_the_remaining_work():
    slow = {(2, 8, 32): (4.0 * _step(2, 8, 32), 0.0), (1, 1, 64): (_step(1, 1, 64) / 2, 0.0)}
    job = _job(slow)
    cal = ThroughputCalibration()
    cal.observe({"j": job})
    out = cal.calibrate(job)
    fn, new = job.speedup_fn, out.speedup_fn
    assert isinstance(new.goodput_fn, CalibratedGoodput)
    assert new.limits() == fn.limits()
    # one GPU measured twice as fast: every unmeasured size's speedup halves
    assert new.base_goodput == pytest.approx(2.0 * fn.base_goodput)
    assert new(1, 4) == pytest.approx(fn(1, 4) / 2)
    assert new(3, 12) == pytest.approx(fn(3, 12) / 2)
    # (2, 8) measured 4x slower at its batch size: its best goodput is at most a quarter's
    # worth more than the model's at any batch size, halved by the base
    assert new(2, 8) < fn(2, 8) / 2
    assert out.remaining_work == pytest.approx(1e4 / 2)  # the same progress, twice the rate
    # the same answer again (memoised)
    assert cal.calibrate(job).speedup_fn is new


def test_calibrate_leaves_jobs_it_cannot_calibrate_as_they_are():
    cal = ThroughputCalibration()
    prof = {(1, 2, 32): (_step(1, 2, 32) * 2, 0.0)}
    cal.observe({"j": _job(prof)})
    for job in (
        _job(prof, app=None),  # no application
        _job(prof, app="bert"),  # nothing measured for it
        JobInfo(0.0, speedup_fn=LinearSpeedup(), application="yolo", profile=prof),
        _job(prof).__class__(
            0.0, max_replicas=8, speedup_fn=_fn().rebased(1, 2), application="yolo"
        ),  # a speedup based elsewhere than one GPU
    ):
        assert cal.calibrate(job) is job


def test_observe_rejects_bad_profiles_and_skips_jobs_without_an_application():
    cal = ThroughputCalibration()
    cal.observe({"x": _job({(1, 2, 32): (-1.0, 0.0)}, app=None)})  # skipped: no application
    for bad in ({(3, 2, 32): (0.1, 0.0)}, {(1, 2, 0): (0.1, 0.0)}, {(1, 2, 32): (math.inf, 0.0)}):
        with pytest.raises(ValueError, match="job 'x'"):
            cal.observe({"x": _job(bad)})
    with pytest.raises(ValueError, match="max_jobs"):
        ThroughputCalibration(max_jobs=0)


def test_the_latest_max_jobs_jobs_are_kept():
    cal = ThroughputCalibration(max_jobs=2)
    for i, k in enumerate((1.0, 2.0, 4.0)):  # three jobs, one after another
        cal.observe({f"j{i}": _job({(1, 2, 32): (k * _step(1, 2, 32), 0.0)})})
    # j0 is forgotten: the geometric mean of 1/2 and 1/4
    assert cal.factors("yolo", PERF)[(1, 2)] == pytest.approx(math.sqrt(1 / 8))
    # a job whose profile has not changed is not moved to the end
    cal.observe({"j1": _job({(1, 2, 32): (2.0 * _step(1, 2, 32), 0.0)})})
    cal.observe({"j3": _job({(1, 2, 32): (_step(1, 2, 32), 0.0)})})
    assert cal.factors("yolo", PERF)[(1, 2)] == pytest.approx(math.sqrt(1 / 4))


def test_state_dict_round_trip_then_replay_gives_the_same_calibration():
    first = {"a": _job({(2, 8, 32): (3.0 * _step(2, 8, 32), 0.01)})}
    later = {
        "b": _job({(1, 4, 64): (0.5 * _step(1, 4, 64), 0.0), (2, 8, 32): (_step(2, 8, 32), 0)})
    }
    cal = ThroughputCalibration()
    cal.observe(first)
    state = cal.state_dict()
    assert set(state) == {"apps", "versions"}
    assert all(isinstance(x, float) for v in state["apps"]["yolo"].values() for x in v)
    copy = ThroughputCalibration()
    copy.load_state_dict(state)
    for c in (cal, copy):
        c.observe(later)
    job = later["b"]
    a, b = cal.calibrate(job), copy.calibrate(job)
    assert cal.factors("yolo", PERF) == copy.factors("yolo", PERF)
    for n, r in ((1, 1), (1, 4), (2, 8), (3, 12)):
        assert a.speedup_fn(n, r) == b.speedup_fn(n, r)
    assert a.remaining_work == b.remaining_work
    with pytest.raises(ValueError, match="quadruples"):
        copy.load_state_dict({"apps": {"yolo": {"a": [1.0, 2.0, 32.0]}}, "versions": {"yolo": 1}})


def _two_node_trap(calibrate: bool, sizes=range(5, 9)) -> int:
    """Replicas a policy gives one job on 2 nodes x 4 GPUs when its model scales past one node
    but the job measured ``sizes`` on two nodes 3x slower than the model (and 4 GPUs on one
    node as modelled)."""
    prof = {(1, 4, 64): (_step(1, 4, 64), 0.0)}
    for r in sizes:
        prof[(2, r, 32)] = (3.0 * _step(2, r, 32), 0.0)
    job = _job(prof, limit=8, r0=8, num_restarts=1, age=3600.0)
    nodes = {0: NodeInfo(4), 1: NodeInfo(4)}
    pol = WaterfillPolicy(sharing=Sharing(calibrate=calibrate), seed=0)
    alloc = pol.optimize({"j": job}, nodes, {}, 0.0)
    check_allocations(alloc, {"j": job}, nodes)
    return len(alloc["j"])


def test_the_policy_keeps_a_job_off_a_configuration_measured_slow():
    assert _fn()(2, 8) > _fn()(1, 4)  # the model alone prefers 8 GPUs on two nodes
    assert _two_node_trap(calibrate=False) == 8
    assert _two_node_trap(calibrate=True) == 4


def test_an_unmeasured_neighbour_keeps_the_model_s_value():
    # measured slow on 8 GPUs over two nodes only: 7 there is still valued as the model says
    assert _two_node_trap(calibrate=True, sizes=[8]) == 7


def test_policy_state_dict_holds_the_calibration():
    job = _job({(1, 4, 64): (2.0 * _step(1, 4, 64), 0.0)})
    nodes = {0: NodeInfo(4), 1: NodeInfo(4)}
    pol = WaterfillPolicy(seed=0)
    pol.optimize({"j": job}, nodes, {}, 0.0)
    state = pol.state_dict()
    assert state["calibration"]["apps"]["yolo"]["j"] == [1.0, 4.0, 64.0, 2.0 * _step(1, 4, 64)]
    other = WaterfillPolicy(seed=0)
    other.load_state_dict(state)
    assert other.state_dict()["calibration"] == state["calibration"]
    assert "calibration" not in WaterfillPolicy(sharing=Sharing(calibrate=False)).state_dict()
