"""The arrival-rate estimate (``adaptrain.sched._arrivals``) and ``WaterfillPolicy``'s settings
while arrivals are sparse: flatter weights (``sparse_theta``), a longer growth payback
(``sparse_payback``) and no work prior for new jobs (``sparse_work``)."""

from __future__ import annotations

import dataclasses

import pytest
from _sched_cases import cluster as _cluster
from _sched_cases import random_jobs as _jobs

from adaptrain.sched import Arrivals, Growth, NodeInfo, Objective, Search, WaterfillPolicy
from adaptrain.sched._arrivals import ArrivalRate

HOUR = 3600.0


def test_rate_is_arrivals_over_their_span_per_gpu_hour():
    est = ArrivalRate(window=24 * HOUR, min_span=HOUR)
    for i, t in enumerate([0.0, 1800.0, 3600.0, 7200.0]):
        est.observe(f"j{i}", t)
    # 3 gaps over 2 h on 8 GPUs: 1.5 arrivals per hour, 0.1875 per GPU-hour
    assert est.rate(7200.0, 8) == pytest.approx(3 / 2 / 8)
    # the span is first to last arrival: a quiet hour after them changes nothing
    assert est.rate(7200.0 + HOUR, 8) == pytest.approx(3 / 2 / 8)
    assert est.rate(7200.0, 0) is None


def test_rate_needs_two_arrivals_over_min_span():
    est = ArrivalRate(min_span=HOUR)
    assert est.rate(0.0, 4) is None
    est.observe("a", 0.0)
    assert est.rate(10.0, 4) is None
    est.observe("b", 1800.0)
    assert est.rate(1800.0, 4) is None  # half an hour: too short to tell
    est.observe("c", 3600.0)
    assert est.rate(3600.0, 4) == pytest.approx(2 / 1 / 4)
    # a job created after ``now`` (a clock skew) is not counted yet
    est.observe("d", 5000.0)
    assert est.rate(3600.0, 4) == pytest.approx(2 / 1 / 4)


def test_a_job_counts_once_and_old_jobs_leave_the_window():
    est = ArrivalRate(window=4 * HOUR, min_span=HOUR)
    est.observe("a", 0.0)
    est.observe("b", 2 * HOUR)
    est.observe("b", 3 * HOUR)  # the same job seen again in a later round
    assert est.rate(2 * HOUR, 1) == pytest.approx(1 / 2)
    est.observe("c", 5 * HOUR)
    # at 5 h the window is (1 h, 5 h]: "a" has left it, "b" and "c" span 3 h
    assert est.rate(5 * HOUR, 1) == pytest.approx(1 / 3)
    assert "a" not in est.state_dict()["keys"]


def test_arrival_rate_state_roundtrip_replays_identically():
    est = ArrivalRate(window=6 * HOUR)
    for i in range(5):
        est.observe(f"j{i}", 1000.0 * i * i)
    other = ArrivalRate(window=6 * HOUR)
    other.load_state_dict(est.state_dict())
    for t, key in [(20000.0, "x"), (30000.0, "y")]:
        est.observe(key, t)
        other.observe(key, t)
        assert other.rate(t, 16) == est.rate(t, 16)
    assert other.state_dict() == est.state_dict()
    with pytest.raises(ValueError, match="one time per key"):
        other.load_state_dict({"keys": ["a"], "times": []})


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"window": 0.0}, "window"),
        ({"window": float("inf")}, "window"),
        ({"min_span": 0.0}, "min_span"),
        ({"window": HOUR, "min_span": 2 * HOUR}, "min_span"),
    ],
)
def test_arrival_rate_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ArrivalRate(**kwargs)


def _spread(jobs, every: float):
    """The same jobs, created ``every`` seconds apart in key order."""
    return {
        k: dataclasses.replace(j, creation_timestamp=every * i)
        for i, (k, j) in enumerate(jobs.items())
    }


def _counts(alloc):
    return {k: len(v) for k, v in alloc.items() if v}


@pytest.mark.parametrize("seed", [0, 6, 12])
def test_sparse_arrivals_use_the_flatter_theta(seed):
    """9 jobs on 16 GPUs: created an hour apart (8 / 8 h / 16 GPUs = 0.0625 arrivals per
    GPU-hour, under the default ``sparse_rate`` 0.21) the round weighs them as ``theta`` =
    ``sparse_theta`` would; created 7.5 minutes apart (0.5 per GPU-hour) as ``theta`` would.
    The two fixed thetas size these jobs differently, so the gate decides the answer."""
    nodes = _cluster()
    now = 9 * HOUR
    sparse, dense = _spread(_jobs(9, seed), HOUR), _spread(_jobs(9, seed), 450.0)
    flat = WaterfillPolicy(
        search=Search(method="local"),
        arrivals=Arrivals(sparse_theta=None),
        objective=Objective(theta=48 * HOUR),
    )
    steep = WaterfillPolicy(search=Search(method="local"), arrivals=Arrivals(sparse_theta=None))
    want_flat = _counts(flat.optimize(sparse, nodes, {}, now))
    assert want_flat != _counts(steep.optimize(sparse, nodes, {}, now))

    gated = WaterfillPolicy(search=Search(method="local"))
    assert _counts(gated.optimize(sparse, nodes, {}, now)) == want_flat
    assert gated.theta_now == 48 * HOUR
    gated = WaterfillPolicy(search=Search(method="local"))
    got = _counts(gated.optimize(dense, nodes, {}, now))
    assert got == _counts(
        WaterfillPolicy(
            search=Search(method="local"), arrivals=Arrivals(sparse_theta=None)
        ).optimize(dense, nodes, {}, now)
    )
    assert gated.theta_now == 16 * HOUR


def test_gate_stays_shut_until_an_hour_of_arrivals_is_seen():
    nodes = {0: NodeInfo(4)}
    jobs = _spread(_jobs(3, 0), 1200.0)  # three jobs over 40 minutes
    policy = WaterfillPolicy(search=Search(method="local"))
    policy.optimize(jobs, nodes, {}, 2400.0)
    assert policy.theta_now == policy.theta


def test_gated_policy_state_roundtrip_keeps_the_arrivals():
    """The arrivals seen travel in the state dict: a restored policy that sees one job next
    round still knows the earlier arrivals were sparse (alone, one job tells nothing)."""
    nodes = _cluster()
    jobs = _spread(_jobs(9, 0), HOUR)
    first, last = dict(list(jobs.items())[:5]), dict(list(jobs.items())[8:])
    policy = WaterfillPolicy(seed=5)
    a = {k: v for k, v in policy.optimize(first, nodes, {}, 5 * HOUR).items() if v}
    state = policy.state_dict()
    assert len(state["arrivals"]["keys"]) == 5 and state["prev_states"] is not None
    other = WaterfillPolicy(seed=0)
    other.load_state_dict(state)
    assert other.optimize(last, nodes, a, 9 * HOUR) == policy.optimize(last, nodes, a, 9 * HOUR)
    assert other.theta_now == policy.theta_now == 48 * HOUR
    fresh = WaterfillPolicy(seed=0)
    fresh.optimize(last, nodes, a, 9 * HOUR)
    assert fresh.theta_now == 16 * HOUR


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"sparse_theta": 0.0}, "sparse_theta"),
        ({"sparse_payback": 0.0}, "sparse_payback"),
        ({"sparse_payback": -3.0}, "sparse_payback"),
        ({"sparse_rate": -1.0}, "sparse_rate"),
        ({"sparse_rate": float("nan")}, "sparse_rate"),
        ({"rate_window": 0.0}, "window"),
    ],
)
def test_bad_arrival_settings_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Arrivals(**kwargs)


def _second_round(policy, jobs, nodes, now):
    """Replica counts of a second round after the largest job of the first completes: the
    others may grow into its GPUs (priced by the growth payback)."""
    first = {k: v for k, v in policy.optimize(jobs, nodes, {}, now).items() if v}
    done = max(first, key=lambda k: (len(first[k]), k))
    rest = {k: j for k, j in jobs.items() if k != done}
    base = {k: v for k, v in first.items() if k in rest}
    return _counts(policy.optimize(rest, nodes, base, now + 60.0))


@pytest.mark.parametrize("search", ["local", "genetic"])
@pytest.mark.parametrize("seed", [0, 3])
def test_sparse_arrivals_use_the_sparse_growth_payback(search, seed):
    """``sparse_payback`` is the growth payback of the rounds with sparse arrivals, in the
    local search and in the genetic refinement: the gated policy answers as one with that
    ``grow_payback`` throughout, and as its own ``grow_payback`` when arrivals are dense."""
    nodes, now = _cluster(), 9 * HOUR
    sparse, dense = _spread(_jobs(9, seed), HOUR), _spread(_jobs(9, seed), 450.0)

    def make(grow_payback, sparse_payback=None):
        return WaterfillPolicy(
            search=Search(method=search),
            seed=seed,
            growth=Growth(payback=grow_payback),
            arrivals=Arrivals(sparse_theta=None, sparse_payback=sparse_payback, sparse_work=None),
        )

    cheap = _second_round(make(grow_payback=100.0), sparse, nodes, now)
    dear = _second_round(make(grow_payback=0.5), sparse, nodes, now)
    assert cheap != dear  # the payback decides whether jobs grow into the freed GPUs
    gated = make(grow_payback=0.5, sparse_payback=100.0)
    assert _second_round(gated, sparse, nodes, now) == cheap
    assert gated.sparse_now and gated.payback_now == 100.0 and gated.theta_now == gated.theta
    dear = _second_round(make(grow_payback=0.5), dense, nodes, now)
    assert dear != _second_round(make(grow_payback=100.0), dense, nodes, now)  # here too
    gated = make(grow_payback=0.5, sparse_payback=100.0)
    assert _second_round(gated, dense, nodes, now) == dear
    assert not gated.sparse_now and gated.payback_now == 0.5


def test_gate_without_sparse_theta_keeps_its_arrivals_in_the_state():
    """Any setting for sparse arrivals opens the gate: the arrivals travel in the state dict
    even without ``sparse_theta``, and none are kept without any such setting."""
    nodes, jobs = _cluster(), _spread(_jobs(5, 0), HOUR)
    policy = WaterfillPolicy(
        search=Search(method="local"), arrivals=Arrivals(sparse_theta=None, sparse_work=None)
    )
    policy.optimize(jobs, nodes, {}, 5 * HOUR)
    assert policy.sparse_now and len(policy.state_dict()["arrivals"]["keys"]) == 5
    other = WaterfillPolicy(
        search=Search(method="local"), arrivals=Arrivals(sparse_theta=None, sparse_work=None)
    )
    other.load_state_dict(policy.state_dict())
    assert other.state_dict() == policy.state_dict()
    plain = WaterfillPolicy(
        search=Search(method="local"),
        arrivals=Arrivals(sparse_theta=None, sparse_payback=None, sparse_work=None),
    )
    plain.optimize(jobs, nodes, {}, 5 * HOUR)
    assert not plain.sparse_now and "arrivals" not in plain.state_dict()
