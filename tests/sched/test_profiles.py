"""Throughput fits shared between the jobs of one application (``ApplicationProfiles`` and
``WaterfillPolicy(share_profiles=True)``)."""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adaptrain.core.goodput import GoodputFunction, predict_step_times
from adaptrain.sched import (
    Arrivals,
    ClusterSpec,
    JobInfo,
    LinearSpeedup,
    NodeInfo,
    Search,
    Sharing,
    WaterfillPolicy,
    check_allocations,
)
from adaptrain.sched._profiles import ApplicationProfiles
from adaptrain.sched.speedup import SpeedupFunction

# two throughput fits of one application: the first scales well (cheap synchronisation), the
# second, fitted on few GPUs, predicts costly multi-node synchronisation
GOOD = (0.02, 0.001, 0.05, 0.002, 0.01, 0.0005, 1.5)
POOR = (0.02, 0.001, 0.5, 0.2, 0.01, 0.0005, 1.5)
LIMITS = {"max_batch_size": 4096, "atomic_bsz_range": (16, 256), "accumulation": True}


def _fn(perf, grad=(1.0, 4.0), nodes=32, reps=32) -> SpeedupFunction:
    return SpeedupFunction(
        GoodputFunction(perf, grad, 64), max_nodes=nodes, max_replicas=reps, **LIMITS
    )


def _job(perf, r0, *, app="yolo", grad=(1.0, 4.0), work=1e4, epoch=3, limit=32, **kw):
    fn = LinearSpeedup() if perf is None else _fn(perf, grad)
    return JobInfo(
        0.0,
        max_replicas=min(max(2 * r0, 1), limit),
        speedup_fn=fn,
        remaining_work=None if perf is None else work,
        max_profiled_replicas=r0,
        replica_limit=limit,
        application=app,
        epoch=None if perf is None else epoch,
        **kw,
    )


def test_a_job_gets_the_fit_of_its_application_s_largest_job_with_its_own_statistics():
    big = _job(GOOD, 16, grad=(1.0, 2.0), work=5e4, epoch=30)
    small = _job(POOR, 2, grad=(1.0, 9.0), work=2e4, epoch=1)
    prof = ApplicationProfiles()
    prof.observe({"big": big, "small": small})
    shared = prof.share(small)
    g = shared.speedup_fn.goodput_fn
    assert tuple(g.perf_params) == GOOD
    assert tuple(g.grad_params) == (1.0, 9.0)  # its own gradient statistics
    assert shared.max_profiled_replicas == 16 and shared.max_replicas == 32
    # the same progress left, at the shared fit's one-GPU goodput
    own = small.speedup_fn.base_goodput
    assert shared.remaining_work == pytest.approx(2e4 * own / shared.speedup_fn.base_goodput)
    # what the policy sees: the shared fit scales further than the job's own
    assert shared.speedup_fn(4, 16) > small.speedup_fn(4, 16)
    # the largest job, another application's and an unlabelled one are left as they are
    assert prof.share(big) is big
    other = _job(POOR, 2, app="bert")
    assert prof.share(other) is other
    unlabelled = _job(POOR, 2, app=None)
    assert prof.share(unlabelled) is unlabelled
    # a speedup of the caller's own making is not replaced
    custom = JobInfo(
        0.0,
        max_replicas=4,
        speedup_fn=lambda n, r: r,
        max_profiled_replicas=2,
        replica_limit=32,
        application="yolo",
    )
    assert prof.share(custom) is custom


def test_a_job_never_run_gets_the_earliest_statistics_and_the_work_only_with_the_prior():
    early = _job(GOOD, 8, grad=(1.0, 0.5), work=3e4, epoch=0)
    late = _job(POOR, 4, grad=(1.0, 8.0), work=6e4, epoch=20)
    prof = ApplicationProfiles(work_prior=False)
    prior = ApplicationProfiles()
    for p in (prof, prior):
        p.observe({"late": late, "early": early})
    new = _job(None, 0)
    shared, with_prior = prof.share(new), prior.share(new)
    for s in (shared, with_prior):
        g = s.speedup_fn.goodput_fn
        assert tuple(g.perf_params) == GOOD and tuple(g.grad_params) == (1.0, 0.5)
        assert s.max_profiled_replicas == 8 and s.max_replicas == 16
    # without the prior: no estimate of its own, none given (it weighs as any new job) ...
    assert shared.remaining_work is None
    # ... with it (the default), the most work seen left in a job of the application, as
    # progress x batch size
    most = max(3e4 * early.speedup_fn.base_goodput, 6e4 * late.speedup_fn.base_goodput)
    assert with_prior.remaining_work == pytest.approx(most / with_prior.speedup_fn.base_goodput)
    # the prior chosen per call (the policy's sparse_work), the instance's setting otherwise
    assert with_prior.remaining_work == prof.share(new, work_prior=True).remaining_work
    assert prior.share(new, work_prior=False).remaining_work is None
    # the bound alone: no speedup built
    view = prof.bound_view(new)
    assert view.speedup_fn is new.speedup_fn and view.max_replicas == 16


def _numbers(v) -> bool:
    if isinstance(v, dict):
        return all(_numbers(x) for x in v.values())
    return isinstance(v, float) or all(isinstance(x, float) for x in v)


def test_profiles_state_round_trips_and_replays():
    prof = ApplicationProfiles()
    prof.observe({"a": _job(GOOD, 16, epoch=0), "b": _job(POOR, 2, app="bert", epoch=5)})
    state = prof.state_dict()
    assert _numbers(state)
    other = ApplicationProfiles()
    other.load_state_dict(state)
    assert other.state_dict() == state
    old = ApplicationProfiles()  # the layout before pooling: the applications alone
    old.load_state_dict(state["apps"])
    assert old.state_dict() == state
    r = np.arange(1, 33)
    n = -(-r // 4)
    for job in (_job(POOR, 2), _job(None, 0)):
        x, y = prof.share(job), other.share(job)
        np.testing.assert_array_equal(x.speedup_fn(n, r), y.speedup_fn(n, r))
        assert x.remaining_work == y.remaining_work
        assert x.max_replicas == y.max_replicas
    with pytest.raises(ValueError, match="7 throughput parameters"):
        other.load_state_dict({"yolo": {**state["apps"]["yolo"], "perf": [1.0]}})


def test_waterfill_widens_the_bound_from_the_application_and_round_trips_its_state():
    policy = WaterfillPolicy(cluster=ClusterSpec(gpus_per_node=4), seed=0)
    jobs = {"big": _job(GOOD, 16, age=3600.0), "small": _job(POOR, 2, age=600.0)}
    nodes = {i: NodeInfo(4) for i in range(8)}
    assert policy.replica_bound(jobs["small"]) == 8  # four times its own size, none observed
    alloc = policy.optimize(jobs, nodes, {}, 0.0)
    assert policy.replica_bound(jobs["small"]) == 32  # four times the application's largest
    check_allocations({k: v for k, v in alloc.items() if v}, jobs, nodes, policy=policy)
    off = WaterfillPolicy(
        cluster=ClusterSpec(gpus_per_node=4), sharing=Sharing(profiles=False), seed=0
    )
    off.optimize(jobs, nodes, {}, 0.0)
    assert off.replica_bound(jobs["small"]) == 8 and "profiles" not in off.state_dict()
    # the work prior for new jobs: on by default, off with share_work=False
    assert (
        policy._profiles.work_prior
        and not WaterfillPolicy(sharing=Sharing(work=False))._profiles.work_prior
    )
    # save -> load -> replay: the same allocations
    twin = WaterfillPolicy(cluster=ClusterSpec(gpus_per_node=4), seed=0)
    twin.load_state_dict(policy.state_dict())
    a1 = a2 = alloc
    for t in (60.0, 120.0):
        new = {**jobs, f"n{t:g}": _job(None, 0)}
        a1 = policy.optimize(new, nodes, a1, t)
        a2 = twin.optimize(new, nodes, a2, t)
        assert a1 == a2


# the application's true throughput: a per-replica network cost on multi-node sizes
TRUE = (0.0174, 0.0007, 0.122, 0.0026, 0.033, 0.0009, 2.07)
# a fit to the same step times on one node and on 64 GPUs over 16 nodes alone, degenerate: the
# whole network cost fixed (as a cifar10 fit in benchmarks/results/sched.md)
DEGEN = (*TRUE[:2], TRUE[2] + 62 * TRUE[3], 1e-8, *TRUE[4:])


def _step_time(perf, nodes, replicas, bsz=64.0):
    return float(predict_step_times(perf, nodes, replicas, bsz)[1])


def _observe_runs(prof, jobs, runs):
    """Observe ``jobs`` once per allocation in ``runs`` (job -> node per replica)."""
    for alloc in runs:
        prof.observe(jobs, alloc)


def test_pooled_fit_reads_each_job_at_the_configurations_it_ran_on():
    assert _step_time(DEGEN, 16, 64) == pytest.approx(_step_time(TRUE, 16, 64), rel=1e-5)
    assert _step_time(DEGEN, 4, 16) > 1.3 * _step_time(TRUE, 4, 16)
    jobs = {"mid": _job(TRUE, 16), "big": _job(DEGEN, 64), "new": _job(TRUE, 2)}
    runs = [
        {"mid": [0], "big": [1]},
        {"mid": [0] * 4, "big": [1] * 4},
        {"mid": [n for n in range(4) for _ in range(4)], "big": [1] * 4},
        {
            "mid": [n for n in range(4) for _ in range(4)],
            "big": [n for n in range(16) for _ in range(4)],
        },
    ]
    largest, pooled = ApplicationProfiles(), ApplicationProfiles(pool=2)
    for prof in (largest, pooled):
        _observe_runs(prof, jobs, runs)
    # the default shares the fit of the job on the most replicas, degenerate at 16 GPUs
    assert tuple(largest.share(jobs["new"]).speedup_fn.goodput_fn.perf_params) == DEGEN
    # pooled: each fit read only where its job ran (the degenerate one on one node and at 64)
    perf = tuple(pooled.share(jobs["new"]).speedup_fn.goodput_fn.perf_params)
    for nodes, replicas in ((1, 1), (1, 4), (4, 16), (16, 64)):
        assert _step_time(perf, nodes, replicas) == pytest.approx(
            _step_time(TRUE, nodes, replicas), rel=0.05
        )
    state = pooled.state_dict()
    assert _numbers(state) and set(state["apps"]["yolo"]["fits"]) == {"mid", "big"}
    assert state["configs"]["big"] == [1.0, 1.0, 1.0, 4.0, 16.0, 64.0]
    # a round on configurations already seen refits nothing
    pooled.observe(jobs, runs[-1])
    assert pooled.state_dict() == state
    # pool=1: the job on the most replicas alone, read where it ran
    one = ApplicationProfiles(pool=1)
    _observe_runs(one, jobs, runs)
    assert set(one.state_dict()["apps"]["yolo"]["fits"]) == {"big"}


def test_pooled_profiles_round_trip_replay_and_errors():
    jobs = {"mid": _job(TRUE, 16), "big": _job(DEGEN, 64), "new": _job(TRUE, 2)}
    runs = [{"mid": [0], "big": [0, 0]}, {"mid": [0] * 4, "big": [0, 1, 2, 3] * 2}]
    prof = ApplicationProfiles(pool=4)
    _observe_runs(prof, jobs, runs)
    twin = ApplicationProfiles(pool=4)
    twin.load_state_dict(prof.state_dict())
    assert twin.state_dict() == prof.state_dict()
    # save -> load -> replay: the same refits from the same new configurations
    more = {
        "mid": [n for n in range(4) for _ in range(4)],
        "big": [n for n in range(16) for _ in range(4)],
    }
    for p in (prof, twin):
        p.observe(jobs, more)
    assert twin.state_dict() == prof.state_dict()
    r = np.arange(1, 33)
    n = -(-r // 4)
    np.testing.assert_array_equal(
        prof.share(jobs["new"]).speedup_fn(n, r), twin.share(jobs["new"]).speedup_fn(n, r)
    )
    # a job gone and not pooled is forgotten
    prof.observe({"mid": jobs["mid"], "big": jobs["big"], "other": _job(TRUE, 1)}, {"other": [0]})
    assert "new" not in prof.state_dict()["configs"]
    with pytest.raises(ValueError, match="pool=0"):
        ApplicationProfiles(pool=0)
    with pytest.raises(ValueError, match="pool=0"):
        WaterfillPolicy(sharing=Sharing(pool=0))
    assert WaterfillPolicy(sharing=Sharing(pool=3))._profiles.pool == 3
    state = prof.state_dict()
    with pytest.raises(ValueError, match="pairs"):
        twin.load_state_dict({**state, "configs": {"big": [1.0, 2.0, 3.0]}})
    with pytest.raises(ValueError, match="without configurations"):
        twin.load_state_dict({**state, "configs": {}})


@st.composite
def labelled_jobs(draw):
    num_nodes, gpus = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    nodes = {i: NodeInfo(gpus) for i in range(num_nodes)}
    jobs = {}
    for j in range(draw(st.integers(1, 7))):
        limit = draw(st.integers(1, 16))
        r0 = draw(st.integers(0, limit))
        perf = None if r0 == 0 else draw(st.sampled_from([GOOD, POOR]))
        jobs[f"j{j}"] = _job(
            perf,
            r0,
            app=draw(st.sampled_from(["a", "b", None])),
            limit=limit,
            min_replicas=draw(st.integers(0, 1)),
            num_restarts=draw(st.integers(0, 2)),
            age=draw(st.floats(0, 1e4)),
        )
    base = {}
    free = collections.Counter({n: gpus for n in nodes})
    for key, job in jobs.items():  # one node each, where it fits
        want = draw(st.integers(0, job.max_replicas))
        node = next((n for n in nodes if free[n] >= want), None)
        if want and node is not None and want >= job.min_replicas:
            base[key] = [node] * want
            free[node] -= want
    return jobs, nodes, base


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(labelled_jobs())
def test_waterfill_with_shared_profiles_respects_constraints(case):
    """Capacity, min replicas, interference avoidance and the policy's bound (widened by the
    application's largest size, never past a job's replica_limit), round after round."""
    jobs, nodes, base = case
    policy = WaterfillPolicy(
        cluster=ClusterSpec(gpus_per_node=max(n.gpus for n in nodes.values())), seed=0
    )
    for t in (0.0, 60.0):
        alloc = {k: v for k, v in policy.optimize(jobs, nodes, base, t).items() if v}
        check_allocations(alloc, jobs, nodes, interference=True, policy=policy)
        for k, v in alloc.items():
            assert len(v) <= jobs[k].replica_limit
        base = alloc


def _labelled_round(every: float) -> dict[str, JobInfo]:
    """Nine jobs created ``every`` seconds apart: a yolo job that has run on 16 GPUs with much
    work left, two yolo jobs never run (their work unknown) and six bert jobs."""
    rng = np.random.default_rng(7)
    jobs = {"big": _job(GOOD, 16, work=4e6, epoch=2)}
    jobs.update({f"new{i}": _job(None, 0) for i in range(2)})
    for i in range(6):
        perf = GOOD if i % 2 else POOR
        jobs[f"bert{i}"] = _job(perf, 4, app="bert", work=float(rng.uniform(2e3, 4e4)))
    return {
        k: dataclasses.replace(j, creation_timestamp=every * i, age=3600.0, num_restarts=1)
        for i, (k, j) in enumerate(jobs.items())
    }


def test_sparse_work_drops_the_work_prior_only_while_arrivals_are_sparse():
    """``Arrivals(sparse_work=False)``: a job never run gets no work prior (weight 1,
    as any new job) in rounds with sparse arrivals, and the prior otherwise."""
    nodes = {i: NodeInfo(4) for i in range(4)}

    def counts(jobs, share_work=True, sparse_work=None):
        policy = WaterfillPolicy(
            search=Search(method="local"),
            arrivals=Arrivals(sparse_theta=None, sparse_payback=None, sparse_work=sparse_work),
            sharing=Sharing(work=share_work),
        )
        out = policy.optimize(jobs, nodes, {}, 9 * 3600.0)
        return {k: len(v) for k, v in out.items() if v}, policy

    sparse, dense = _labelled_round(3600.0), _labelled_round(450.0)
    without, _ = counts(sparse, share_work=False)
    assert without != counts(sparse)[0]  # the prior decides the new jobs' sizes here
    got, policy = counts(sparse, sparse_work=False)
    assert got == without and policy.sparse_now
    with_prior = counts(dense)[0]
    assert with_prior != counts(dense, share_work=False)[0]  # here too
    got, policy = counts(dense, sparse_work=False)
    assert got == with_prior and not policy.sparse_now
