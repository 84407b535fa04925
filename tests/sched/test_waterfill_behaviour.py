"""Behaviour of our default policy ``waterfill`` beyond the constraint checks of test_policies:
warm-start stability, restart penalty, packing, weighting and argument validation."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from _sched_cases import cluster as _cluster
from _sched_cases import concave as _concave
from _sched_cases import random_jobs as _jobs

from adaptrain.sched import (
    Arrivals,
    ClusterSpec,
    Exploration,
    ExploringSpeedup,
    Growth,
    JobInfo,
    LinearSpeedup,
    NodeInfo,
    Objective,
    PowerSpeedup,
    RampSpeedup,
    Search,
    Sharing,
    WaterfillPolicy,
    check_allocations,
    replica_bound,
)
from adaptrain.sched._plan import WeightedGeneticSearch


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_second_round_keeps_allocation(seed):
    """Warm start of the local search: with nothing changed, a second round reproduces the
    first (no restarts). (The genetic refinement keeps searching in later rounds and may move
    a job when that raises the fitness net of the restart factor: see the tests below.)"""
    nodes = _cluster()
    jobs = _jobs(9, seed)
    policy = WaterfillPolicy(search=Search(method="local"))
    first = policy.optimize(jobs, nodes, {}, 0.0)
    first = {k: v for k, v in first.items() if v}
    second = policy.optimize(jobs, nodes, first, 60.0)
    second = {k: v for k, v in second.items() if v}
    assert second == first


def test_restart_penalty_blocks_small_gains_for_young_jobs():
    """A job that just restarted keeps its size when growing gains little; an old one grows
    under Pollux's penalty alone (``grow_payback=None``). With the default growth payback of 3
    rounds the old job stays too: 11% is less than the 1/6 of its new speed a growth must
    repay (see ``test_growth_repays_its_restart_within_grow_payback_rounds``)."""
    nodes = _cluster(1, 4)
    fn = _concave(0.15)  # growing 2 -> 4 gains 11%: less than the young job's restart cost
    base = {"a": [0, 0]}
    young = {"a": JobInfo(0.0, max_replicas=4, speedup_fn=fn, age=60.0, num_restarts=1)}
    old = {"a": JobInfo(0.0, max_replicas=4, speedup_fn=fn, age=1e5, num_restarts=1)}
    pollux_penalty = WaterfillPolicy(growth=Growth(payback=None))
    assert pollux_penalty.optimize(young, nodes, base, 60.0)["a"] == [0, 0]
    assert len(pollux_penalty.optimize(old, nodes, base, 60.0)["a"]) == 4
    assert WaterfillPolicy().optimize(old, nodes, base, 60.0)["a"] == [0, 0]


def test_single_node_jobs_are_packed_and_multi_node_jobs_get_whole_nodes():
    nodes = _cluster(4, 4)
    jobs = {
        "big": JobInfo(0.0, max_replicas=8, min_replicas=8, speedup_fn=LinearSpeedup()),
        "s1": JobInfo(1.0, max_replicas=2, speedup_fn=LinearSpeedup()),
        "s2": JobInfo(2.0, max_replicas=2, speedup_fn=LinearSpeedup()),
        "s3": JobInfo(3.0, max_replicas=3, speedup_fn=LinearSpeedup()),
    }
    alloc = WaterfillPolicy().optimize(jobs, nodes, {}, 0.0)
    check_allocations({k: v for k, v in alloc.items() if v}, jobs, nodes, interference=True)
    assert len(alloc["big"]) == 8 and len(set(alloc["big"])) == 2  # two full nodes
    for k in ("s1", "s2", "s3"):
        assert len(alloc[k]) == jobs[k].max_replicas and len(set(alloc[k])) == 1


def test_waiting_job_is_admitted_by_taking_a_gpu_from_the_cheapest_donor():
    """A new short job gets a GPU from a full cluster; the job losing least gives it up."""
    nodes = _cluster(1, 4)
    jobs = {
        "long": JobInfo(
            0.0,
            max_replicas=4,
            speedup_fn=_concave(0.5),
            remaining_work=1e6,
            age=1e4,
            num_restarts=1,
        ),
        "new": JobInfo(1.0, max_replicas=1, speedup_fn=LinearSpeedup(), remaining_work=100.0),
    }
    alloc = WaterfillPolicy().optimize(jobs, nodes, {"long": [0, 0, 0, 0]}, 60.0)
    assert len(alloc["new"]) == 1 and len(alloc["long"]) == 3


@pytest.mark.parametrize(
    ("config", "kwargs"),
    [
        (Objective, {"theta": 0.0}),
        (Objective, {"future_gamma": -1.0}),
        (ClusterSpec, {"gpus_per_node": 0}),
        (ClusterSpec, {"round_seconds": float("nan")}),
        (Search, {"method": "anneal"}),
        (Search, {"min_nodes": 1}),
        (Exploration, {"growth": 0.5}),
        (Exploration, {"growth": float("nan")}),
        (Arrivals, {"rate_window": 60.0}),
        (Sharing, {"pool": 0}),
        (Growth, {"payback": 0.0}),
    ],
)
def test_bad_settings_raise_naming_the_setting(config, kwargs):
    (name,) = kwargs
    with pytest.raises(ValueError, match=name):
        config(**kwargs)


def test_settings_of_the_wrong_type_are_refused():
    with pytest.raises(TypeError, match="Objective"):
        WaterfillPolicy(objective=Exploration())


def test_empty_job_set():
    assert WaterfillPolicy().optimize({}, _cluster(), {}, 0.0) == {}


def _fitness(policy: WaterfillPolicy, jobs, base, alloc, gpus: int = 16) -> float:
    """The genetic search's objective, computed independently: sum_j w_j s_j (x Pollux's
    restart factor if the job's placement changed, at most 1 - the growth cost if a running job
    grew), -10 per job left without GPUs. The weights are the policy's, on the jobs' speedups up
    to their bounds on ``gpus`` GPUs (these jobs have no profile, so no exploration or first-size
    rule changes them)."""
    keys = list(jobs)
    curves = {k: policy._curve(jobs[k], min(jobs[k].max_replicas, gpus)) for k in keys}
    weight = policy._weights(jobs, keys, curves, gpus)
    total = 0.0
    for k in keys:
        a = sorted(alloc.get(k, []))
        if not a:
            total -= 10.0
            continue
        job = jobs[k]
        s = float(job.speedup_fn(len(set(a)), len(a)))
        had = sorted(base.get(k, []))
        if a != had:
            d = policy.restart_delay
            rho = max(job.age - d * job.num_restarts, 0.0) / (job.age + d)
            if had and len(a) > len(had):
                rho = min(rho, 1.0 - d / (policy.grow_payback * policy.round_seconds))
            s *= rho
        total += weight[k] * s
    return total


def test_genetic_refinement_never_worse_than_local_search():
    """The genetic answer's fitness is at least the local search's (its seed), round after
    round. (On these concave curves the local search is already optimal; see the next test
    for a case it misses.)"""
    nodes = _cluster()
    for seed in range(4):
        jobs = _jobs(12, seed, age=600.0)
        genetic = WaterfillPolicy()
        local = WaterfillPolicy(search=Search(method="local"))
        base: dict[str, list[int]] = {}
        for t in range(4):
            a_gen = {k: v for k, v in genetic.optimize(jobs, nodes, base, 60.0 * t).items() if v}
            a_loc = {k: v for k, v in local.optimize(jobs, nodes, base, 60.0 * t).items() if v}
            check_allocations(a_gen, jobs, nodes, interference=True)
            f_gen = _fitness(genetic, jobs, base, a_gen)
            f_loc = _fitness(genetic, jobs, base, a_loc)
            assert f_gen >= f_loc - 1e-9
            base = a_gen


def test_genetic_refinement_repacks_instead_of_splitting_a_job():
    """Two jobs hold 2 GPUs on each of two 4-GPU nodes; a short job that scales on one node but
    not across nodes wants 4 GPUs. The local search keeps the old placements and splits the new
    job 2 + 2; the genetic refinement moves an old job (cheap restart) to give it a whole node."""

    def one_node_only(n, r):
        r = np.asarray(r, dtype=float)
        n = np.asarray(n, dtype=float)
        return np.where(r > 0, r / (1.0 + 3.0 * np.maximum(n - 1, 0)), 0.0)

    nodes = _cluster(2, 4)
    old = dict(speedup_fn=_concave(0.9), remaining_work=1e5, age=1e5, num_restarts=1)
    jobs = {
        "a": JobInfo(0.0, max_replicas=2, **old),
        "b": JobInfo(1.0, max_replicas=2, **old),
        "c": JobInfo(
            2.0, max_replicas=4, speedup_fn=one_node_only, remaining_work=600.0, age=600.0
        ),
    }
    base = {"a": [0, 0], "b": [1, 1]}
    local = WaterfillPolicy(search=Search(method="local")).optimize(jobs, nodes, base, 60.0)
    assert len(local["c"]) == 4 and len(set(local["c"])) == 2  # split: speedup 1 instead of 4
    genetic = WaterfillPolicy()
    alloc = {k: v for k, v in genetic.optimize(jobs, nodes, base, 60.0).items() if v}
    check_allocations(alloc, jobs, nodes, interference=True)
    assert len(alloc["c"]) == 4 and len(set(alloc["c"])) == 1
    assert _fitness(genetic, jobs, base, alloc, 8) > _fitness(genetic, jobs, base, local, 8) + 1.0


def test_genetic_state_roundtrip_replays_identically():
    """state_dict -> load_state_dict -> the next round is identical to the uninterrupted one."""
    nodes = _cluster()
    jobs = _jobs(10, 5, age=600.0)
    policy = WaterfillPolicy(seed=3)
    first = {k: v for k, v in policy.optimize(jobs, nodes, {}, 0.0).items() if v}
    state = policy.state_dict()
    assert state["prev_states"] is not None
    second = policy.optimize(jobs, nodes, first, 60.0)
    other = WaterfillPolicy(seed=99)
    other.load_state_dict(state)
    assert other.optimize(jobs, nodes, first, 60.0) == second
    local = WaterfillPolicy(
        search=Search(method="local"),
        arrivals=Arrivals(sparse_theta=None, sparse_payback=None, sparse_work=None),
        sharing=Sharing(profiles=False, calibrate=False),
    )
    assert local.state_dict() == {}
    assert WaterfillPolicy(search=Search(method="local")).state_dict() == {
        "arrivals": {"keys": [], "times": []},
        "profiles": {"apps": {}, "configs": {}},
        "calibration": {"apps": {}, "versions": {}},
    }


def test_new_job_without_estimate_is_admitted_ahead_of_a_long_job():
    """A job without a remaining-work estimate gets the top weight (as under LAS): on a full
    2-GPU node it takes a GPU from a long job. (With the former prior, the median estimate of
    the known jobs, it got the long job's tiny weight and waited.)"""
    nodes = _cluster(1, 2)
    jobs = {
        "long": JobInfo(
            0.0,
            max_replicas=2,
            speedup_fn=LinearSpeedup(),
            remaining_work=1e6,
            age=1e4,
            num_restarts=1,
        ),
        "new": JobInfo(
            1.0, max_replicas=1, speedup_fn=LinearSpeedup(), remaining_work=None, age=60.0
        ),
    }
    for search in ("local", "genetic"):
        policy = WaterfillPolicy(search=Search(method=search))
        assert policy._weights(jobs, list(jobs))["new"] == 1.0
        alloc = policy.optimize(jobs, nodes, {"long": [0, 0]}, 60.0)
        assert alloc.get("new") == [0] and alloc.get("long") == [0]


def _fragmented(seed: int) -> tuple[dict[str, JobInfo], dict[str, list[int]]]:
    """Nine jobs whose speedup drops across nodes, spread 1-2 GPUs each over four 4-GPU nodes:
    a search problem where the genetic runs of different seeds end in different answers."""
    rng = np.random.default_rng(seed)

    def curve(a: float, pen: float):
        def fn(n, r):
            r = np.asarray(r, dtype=float)
            n = np.asarray(n, dtype=float)
            return np.where(r > 0, r**a / (1.0 + pen * np.maximum(n - 1, 0)), 0.0)

        return fn

    jobs = {
        f"j{i}": JobInfo(
            float(i),
            max_replicas=int(rng.integers(2, 9)),
            speedup_fn=curve(float(rng.uniform(0.7, 1.0)), float(rng.uniform(0.5, 3.0))),
            remaining_work=float(rng.uniform(600, 1e5)),
            age=float(rng.uniform(300, 5000)),
            num_restarts=1,
        )
        for i in range(9)
    }
    base, used = {}, 0
    for k in jobs:
        c = min(int(rng.integers(1, 3)), 16 - used)
        base[k] = sorted((used + j) % 4 for j in range(c))
        used += c
    return jobs, base


def _dip(n, r):
    """Linear up to one node (4 GPUs), a dip across the node boundary up to 8, then linear."""
    r = np.asarray(r, dtype=float)
    return np.where(r <= 4, r, np.where(r <= 8, 4.0 - 0.05 * (r - 4), 3.8 + (r - 8)))


def test_exploring_speedup_is_the_model_up_to_the_tried_size_and_optimistic_beyond():
    fn = ExploringSpeedup(_dip, max_profiled_replicas=4, beta=0.5)
    r = np.arange(1, 13)
    n = np.ceil(r / 4)
    got = fn(n, r)
    np.testing.assert_array_equal(got[:4], _dip(n, r)[:4])
    want = np.maximum(_dip(n, r), 4.0 * (r / 4.0) ** 0.5)
    np.testing.assert_allclose(got[4:], want[4:])
    assert got[7] == pytest.approx(4.0 * 2**0.5)  # r = 8: the bound, above the dip
    assert got[11] == pytest.approx(_dip(3, 12))  # r = 12: the model, above the bound
    assert isinstance(fn(2, 8), float) and fn(2, 8) == pytest.approx(got[7])
    with pytest.raises(ValueError, match="max_profiled_replicas"):
        ExploringSpeedup(_dip, 0)
    with pytest.raises(ValueError, match="beta"):
        ExploringSpeedup(_dip, 4, beta=1.5)


def _flat(n, r):
    """A job early in training: s(r) = r ** 0.0945 on one node (s(4) = 1.14, yolov3's first
    epoch), and lower across nodes."""
    r = np.asarray(r, dtype=float)
    return np.where(r <= 4, r**0.0945, 0.45)


def test_exploring_speedup_observed_exponent():
    # a poor scaler so far: the floor grows at its own exponent, not at beta
    fn = ExploringSpeedup(_flat, 4, beta=0.5, observed=True)
    e = np.log(float(_flat(1, 4))) / np.log(4.0)
    assert fn.beta == pytest.approx(e) and e < 0.1
    assert fn(4, 16) == pytest.approx(float(_flat(1, 4)) * 4.0**e)
    assert ExploringSpeedup(_flat, 4, beta=0.5).beta == 0.5  # off by default
    assert fn(4, 16) < ExploringSpeedup(_flat, 4, beta=0.5)(4, 16)
    # a good scaler keeps beta; r0 = 1 has no exponent to observe
    assert ExploringSpeedup(_dip, 4, beta=0.5, observed=True).beta == 0.5
    assert ExploringSpeedup(_flat, 1, beta=0.5, observed=True).beta == 0.5
    # a job slower on r0 GPUs than on one: a flat floor at s(r0)
    slow = ExploringSpeedup(lambda n, r: 0.8 * np.asarray(r, float) ** 0, 4, 0.5, observed=True)
    assert slow.beta == 0.0 and slow(4, 16) == pytest.approx(0.8)


@pytest.mark.parametrize("search", ["local", "genetic"])
def test_a_job_that_has_not_scaled_is_not_sent_across_nodes(search):
    """Alone on an idle cluster, a long job whose goodput barely grew from 1 to 4 GPUs (its
    model: flat on one node, worse across) keeps its node; presumed to scale on at beta = 0.5
    (``explore_observed=False``) it is restarted on 16 GPUs to measure them."""
    nodes = _cluster(4, 4)
    jobs = {
        "a": JobInfo(
            0.0,
            max_replicas=8,
            replica_limit=64,
            max_profiled_replicas=4,
            speedup_fn=_flat,
            remaining_work=10 * 3600.0,
            age=90.0,
        )
    }
    base = {"a": [0, 0, 0, 0]}
    kept = WaterfillPolicy(search=Search(method=search)).optimize(jobs, nodes, base, 0.0)
    assert kept["a"] == [0, 0, 0, 0]
    grown = WaterfillPolicy(
        search=Search(method=search), exploration=Exploration(observed=False)
    ).optimize(jobs, nodes, base, 0.0)
    assert len(grown["a"]) == 16


def _dip_job(remaining_work: float | None) -> dict[str, JobInfo]:
    return {
        "a": JobInfo(
            0.0,
            max_replicas=8,  # the exploration cap: twice the largest size tried
            max_profiled_replicas=4,
            speedup_fn=_dip,
            remaining_work=remaining_work,
            age=36000.0,
            num_restarts=1,
        )
    }


@pytest.mark.parametrize("search", ["local", "genetic"])
def test_long_job_explores_across_the_node_boundary_short_job_does_not(search):
    """A job held below a dip of its learned curve (lower from 5 to 8 GPUs) with free GPUs
    around: a long job is grown to measure the larger size; a short job, or any job with
    exploration off, keeps its node."""
    nodes = _cluster(4, 4)
    base = {"a": [0, 0, 0, 0]}
    long_job = _dip_job(remaining_work=10 * 3600.0 * 4)  # 10 h left at 4 GPUs
    grown = WaterfillPolicy(search=Search(method=search)).optimize(long_job, nodes, base, 0.0)
    assert len(grown["a"]) == 8
    check_allocations(grown, long_job, nodes, interference=True)
    kept = WaterfillPolicy(
        search=Search(method=search), exploration=Exploration(beta=None)
    ).optimize(long_job, nodes, base, 0.0)
    assert len(kept["a"]) == 4
    short_job = _dip_job(remaining_work=0.5 * 3600.0 * 4)  # 30 min left: not worth a restart
    assert (
        len(
            WaterfillPolicy(search=Search(method=search)).optimize(short_job, nodes, base, 0.0)["a"]
        )
        == 4
    )
    unknown = _dip_job(remaining_work=None)
    assert (
        len(WaterfillPolicy(search=Search(method=search)).optimize(unknown, nodes, base, 0.0)["a"])
        == 4
    )


def test_exploration_arguments_are_validated():
    with pytest.raises(ValueError, match="beta"):
        WaterfillPolicy(exploration=Exploration(beta=-0.1))
    with pytest.raises(ValueError, match="horizon"):
        WaterfillPolicy(exploration=Exploration(horizon=-1.0))
    with pytest.raises(ValueError, match="max_profiled_replicas"):
        JobInfo(0.0, max_replicas=4, max_profiled_replicas=-1)


@pytest.mark.parametrize("search", ["local", "genetic"])
def test_placement_never_shrinks_a_job_below_its_minimum(search):
    """Found by hypothesis: a job with min_replicas 2 chosen at 2 but fitting only 1 GPU once
    the others were placed was placed at 1. It must get its minimum or nothing."""
    nodes = _cluster(4, 2)
    bounds = {"j0": (0, 2), "j1": (0, 1), "j2": (2, 2), "j3": (0, 3)}
    jobs = {
        k: JobInfo(float(i), min_replicas=lo, max_replicas=hi, speedup_fn=LinearSpeedup())
        for i, (k, (lo, hi)) in enumerate(bounds.items())
    }
    alloc = WaterfillPolicy(search=Search(method=search)).optimize(jobs, nodes, {"j1": [0]}, 0.0)
    check_allocations({k: v for k, v in alloc.items() if v}, jobs, nodes, interference=True)


def _power(a: float, c: float = 1.0):
    def fn(n, r):
        r = np.asarray(r, dtype=float)
        return np.where(r > 0, c * r**a, 0.0)

    return fn


def test_ramp_speedup_is_the_model_up_to_the_tried_size_and_credited_to_the_cap():
    fn = RampSpeedup(_dip, max_profiled_replicas=2, cap=4, bonus=1.5)
    r = np.arange(1, 9)
    n = np.ceil(r / 4)
    got, model = fn(n, r), _dip(n, r)
    np.testing.assert_array_equal(got[:2], model[:2])
    assert got[2] == pytest.approx(model[2] + 0.75)  # halfway from the tried size to the cap
    np.testing.assert_allclose(got[3:], model[3:] + 1.5)
    assert isinstance(fn(1, 4), float) and fn(1, 4) == pytest.approx(got[3])
    for bad in ({"max_profiled_replicas": 0, "cap": 2}, {"max_profiled_replicas": 4, "cap": 4}):
        with pytest.raises(ValueError, match="ramp"):
            RampSpeedup(_dip, bonus=1.0, **bad)
    with pytest.raises(ValueError, match="bonus"):
        RampSpeedup(_dip, 1, 2, bonus=-1.0)


def _ramp_case(donor_fn, donor_work: float, donor_age: float, donor_restarts: int, **young):
    """Two 4-GPU nodes: a donor on 7 GPUs and a young job that has run on 1 GPU only (its cap
    is 2), whose learned curve s(r) = r ** 0.7 gives little for the first step (1.62) and more
    for the ramp (s(8) = 4.29), as for the cifar10 jobs of the Pollux workloads."""
    jobs = {
        "donor": JobInfo(
            0.0,
            max_replicas=8,
            max_profiled_replicas=7,
            speedup_fn=donor_fn,
            remaining_work=donor_work,
            age=donor_age,
            num_restarts=donor_restarts,
        ),
        "young": JobInfo(
            1.0,
            max_replicas=2,
            max_profiled_replicas=1,
            speedup_fn=young.pop("fn", _power(0.7)),
            remaining_work=4000.0,
            age=108.0,
            num_restarts=0,
            **young,
        ),
    }
    base = {"donor": [0, 0, 0, 0, 1, 1, 1], "young": [1]}
    return jobs, _cluster(2, 4), base


@pytest.mark.parametrize("search", ["local", "genetic"])
def test_young_job_held_by_its_cap_ramps_past_a_flat_donor(search):
    """The step to the cap (1 -> 2 GPUs) gains 0.58 weighted speedup less a 0.20 restart
    penalty, below the donor's loss (0.15 plus a 0.59 restart penalty), so without credit the
    young job waits at 1 GPU. The ramp it unlocks is credited (with the caps lifted it would
    reach 6 GPUs at the flat donor's expense, s(6) = 3.51) and it grows; not when the policy
    cannot tell the cap from the job's own limit (no replica_limit)."""
    case = dict(donor_fn=_power(0.3, 3.0), donor_work=3e4, donor_age=2500.0, donor_restarts=13)
    jobs, nodes, base = _ramp_case(**case, replica_limit=8)

    # the ramp at the allocator's cap of 2 (explore_growth widens it: tested below); the
    # weights computed above are the remaining-work ones (future_gamma: tested at the end), the
    # costs Pollux's penalty alone (grow_payback: tested at the end)
    def policy(ramp_credit=1.0):
        return WaterfillPolicy(
            search=Search(method=search),
            exploration=Exploration(growth=None, ramp_credit=ramp_credit),
            objective=Objective(future_gamma=None),
            growth=Growth(payback=None),
        )

    alloc = policy().optimize(jobs, nodes, base, 0.0)
    check_allocations({k: v for k, v in alloc.items() if v}, jobs, nodes, interference=True)
    assert len(alloc["young"]) == 2 and len(alloc["donor"]) == 6
    off = policy(ramp_credit=None).optimize(jobs, nodes, base, 0.0)
    assert len(off["young"]) == 1 and len(off["donor"]) == 7
    jobs, nodes, base = _ramp_case(**case)  # replica_limit unknown: no ramp to credit
    assert len(policy().optimize(jobs, nodes, base, 0.0)["young"]) == 1


@pytest.mark.parametrize("search", ["local", "genetic"])
def test_a_ramp_is_credited_only_as_far_as_it_wins_gpus(search):
    """A donor whose every GPU is worth 1 (linear, weight 1): with the caps lifted the young
    job still wins no GPU from it (its ramp gains at most 0.48 per GPU), so the ramp reaches
    nothing, earns no credit and the job waits. The credit of a ramp to 8 GPUs would have moved
    it (shown with that bonus applied by hand)."""
    case = dict(donor_fn=LinearSpeedup(), donor_work=None, donor_age=1e5, donor_restarts=1)
    jobs, nodes, base = _ramp_case(**case, replica_limit=8)

    # the ramp at the allocator's cap of 2, with the remaining-work weights computed above
    def policy(ramp_credit=1.0):
        return WaterfillPolicy(
            search=Search(method=search),
            exploration=Exploration(growth=None, ramp_credit=ramp_credit),
            objective=Objective(future_gamma=None),
        )

    alloc = policy().optimize(jobs, nodes, base, 0.0)
    assert len(alloc["young"]) == 1 and len(alloc["donor"]) == 7
    s = _power(0.7)
    rate = 60.0 / (108.0 + 30.0)  # one round over the young job's restart horizon
    forced = RampSpeedup(s, max_profiled_replicas=1, cap=2, bonus=rate * float(s(2, 8) - s(1, 2)))
    jobs, nodes, base = _ramp_case(**case, fn=forced)
    alloc = policy(ramp_credit=None).optimize(jobs, nodes, base, 0.0)
    assert len(alloc["young"]) == 2


def test_ramp_arguments_are_validated():
    with pytest.raises(ValueError, match="ramp_credit"):
        WaterfillPolicy(exploration=Exploration(ramp_credit=-0.5))
    with pytest.raises(ValueError, match="ramp_doublings"):
        WaterfillPolicy(exploration=Exploration(ramp_doublings=0))
    with pytest.raises(ValueError, match="round_seconds"):
        WaterfillPolicy(cluster=ClusterSpec(round_seconds=0.0))
    with pytest.raises(ValueError, match="replica_limit"):
        JobInfo(0.0, max_replicas=4, replica_limit=2)


@pytest.mark.parametrize(
    "r0, cap, limit, want",
    [
        (0, 1, 16, 4),  # never run: up to first_replicas (4), whatever the growth
        (0, 1, 2, 2),  # never run, within its limit
        (0, 1, None, 1),  # never run, no known limit
        (1, 2, 16, 4),
        (2, 4, 16, 8),
        (3, 6, 10, 10),  # within the job's limit
        (8, 16, 16, 16),  # the cap already at the limit
        (2, 4, None, 4),  # no known limit: the allocator's cap is the limit
    ],
)
def test_replica_bound_widens_the_allocators_cap_within_the_limit(r0, cap, limit, want):
    job = JobInfo(0.0, max_replicas=cap, max_profiled_replicas=r0, replica_limit=limit)
    new = r0 == 0  # first_replicas rules, explore_growth does not
    assert WaterfillPolicy().replica_bound(job) == want  # explore_growth = 4
    assert WaterfillPolicy(exploration=Exploration(growth=None)).replica_bound(job) == (
        want if new else cap
    )
    assert WaterfillPolicy(exploration=Exploration(growth=1.0)).replica_bound(job) == (
        want if new else cap
    )
    assert WaterfillPolicy(exploration=Exploration(first_replicas=None)).replica_bound(job) == (
        cap if new else want
    )
    assert WaterfillPolicy(exploration=Exploration(first_replicas=1)).replica_bound(job) == (
        cap if new else want
    )
    assert replica_bound(WaterfillPolicy(), job) == want
    assert replica_bound(object(), job) == cap  # a policy without its own rule


def _linear_job(**kw) -> JobInfo:
    """A job with a linear speedup that may grow to 16 GPUs."""
    return JobInfo(0.0, replica_limit=16, speedup_fn=LinearSpeedup(), **kw)


def _new_job(**kw) -> JobInfo:
    """A job just submitted, as the simulator reports it: no profile, a linear guess."""
    return JobInfo(
        10.0, max_replicas=1, replica_limit=16, speedup_fn=LinearSpeedup(), age=60.0, **kw
    )


@pytest.mark.parametrize("search", ["local", "genetic"])
def test_a_new_job_starts_on_up_to_first_replicas_free_gpus(search):
    nodes = _cluster(4, 4)
    policy = WaterfillPolicy(search=Search(method=search))
    alloc = policy.optimize({"new": _new_job()}, nodes, {}, 0.0)
    assert len(alloc["new"]) == 4 and len(set(alloc["new"])) == 1  # one node
    check_allocations(alloc, {"new": _new_job()}, nodes, interference=True, policy=policy)
    old = WaterfillPolicy(
        search=Search(method=search), exploration=Exploration(first_replicas=None)
    )
    assert len(old.optimize({"new": _new_job()}, nodes, {}, 0.0)["new"]) == 1


@pytest.mark.parametrize("search", ["local", "genetic"])
def test_a_new_jobs_unknown_scaling_wins_no_gpus_from_a_measured_job(search):
    """A measured job with a linear speedup and weight 1/2 (remaining work = theta) holds 7
    of 8 GPUs. Valued at r ** 0.5, the new job's second GPU gains 0.41 < 0.5: it takes the free
    GPU only. Taken at its linear guess (first_beta = 1) it would take 3 GPUs from the other.
    (Remaining-work weights alone, ``future_gamma=None``: divided by its speed to come, 4 at its
    fair share, the donor's GPUs are worth 1/4 each, and the new job rightly takes some.)"""
    theta = 16 * 3600.0
    donor = _linear_job(max_replicas=16, max_profiled_replicas=8, remaining_work=theta, age=1e5)
    jobs = {"donor": donor, "new": _new_job()}
    nodes, base = _cluster(2, 4), {"donor": [0, 0, 0, 0, 1, 1, 1]}
    objective = Objective(theta=theta, future_gamma=None)
    alloc = WaterfillPolicy(search=Search(method=search), objective=objective).optimize(
        jobs, nodes, base, 0.0
    )
    assert len(alloc["new"]) == 1 and alloc["donor"] == base["donor"]
    eager = WaterfillPolicy(
        search=Search(method=search), objective=objective, exploration=Exploration(first_beta=1.0)
    )
    alloc = eager.optimize(jobs, nodes, base, 0.0)
    assert len(alloc["new"]) == 4 and len(alloc["donor"]) == 4


def test_power_speedup_is_the_cautious_prior():
    fn = PowerSpeedup(0.5)
    np.testing.assert_allclose(fn(np.ones(4), np.array([0, 1, 4, 9])), [0.0, 1.0, 2.0, 3.0])
    assert isinstance(fn(1, 4), float) and fn(1, 4) == 2.0
    assert PowerSpeedup(1.0)(2, 8) == LinearSpeedup()(2, 8)
    with pytest.raises(ValueError, match="beta"):
        PowerSpeedup(-0.1)


def test_first_arguments_are_validated():
    with pytest.raises(ValueError, match="first_replicas"):
        WaterfillPolicy(exploration=Exploration(first_replicas=0))
    with pytest.raises(ValueError, match="first_beta"):
        WaterfillPolicy(exploration=Exploration(first_beta=1.5))


@pytest.mark.parametrize("search", ["local", "genetic"])
def test_lone_job_grows_four_times_its_tried_size(search):
    """A job that has run on 2 GPUs, alone on 16 with a linear speedup and hours of work left:
    the allocator's cap holds it at 4; explore_growth = 4 takes it to 8 in one step. The
    allocation is valid for the policy's bound and breaks the allocator's cap."""
    nodes = _cluster(4, 4)
    job = _linear_job(
        max_replicas=4, max_profiled_replicas=2, remaining_work=1e6, age=1e4, num_restarts=1
    )
    jobs, base = {"a": job}, {"a": [0, 0]}
    policy = WaterfillPolicy(search=Search(method=search))
    alloc = policy.optimize(jobs, nodes, base, 0.0)
    assert len(alloc["a"]) == 8
    check_allocations(alloc, jobs, nodes, interference=True, policy=policy)
    with pytest.raises(RuntimeError, match="outside"):
        check_allocations(alloc, jobs, nodes)  # the allocator's cap alone
    capped = WaterfillPolicy(search=Search(method=search), exploration=Exploration(growth=None))
    alloc = capped.optimize(jobs, nodes, base, 0.0)
    assert len(alloc["a"]) == 4
    check_allocations(alloc, jobs, nodes, interference=True)


def test_a_policy_bound_beyond_the_job_limit_is_an_error():
    class Greedy:
        def replica_bound(self, job):
            return 64

    job = JobInfo(0.0, max_replicas=2, replica_limit=8, max_profiled_replicas=1)
    with pytest.raises(RuntimeError, match="replica_bound gave 64"):
        replica_bound(Greedy(), job)
    with pytest.raises(RuntimeError, match="replica_bound gave 64"):
        check_allocations({"a": [0]}, {"a": job}, _cluster(1, 4), policy=Greedy())


def test_fair_shares_water_fill():
    """Max-min fair shares: a job capped below the even share keeps its cap and the others
    split the rest; the shares never exceed the GPUs."""
    from adaptrain.sched.waterfill import _fair_shares

    assert _fair_shares({"a": 2, "b": 100, "c": 100}, 10) == {"a": 2.0, "b": 4.0, "c": 4.0}
    assert _fair_shares({"a": 1, "b": 3}, 64) == {"a": 1.0, "b": 3.0}
    assert _fair_shares({"a": 5, "b": 5, "c": 0}, 6) == {"c": 0.0, "a": 3.0, "b": 3.0}
    assert _fair_shares({}, 8) == {}


def _scaling_pair(remaining: float = 3.6e4) -> dict[str, JobInfo]:
    """Two modelled jobs with the same remaining work: ``flat`` barely scales (its goodput peak
    is at 2 GPUs), ``linear`` scales on every GPU."""

    def flat(n, r):
        r = np.asarray(r, dtype=float)
        return np.where(r > 0, np.minimum(r, 2.0) ** 0.2, 0.0)

    common = dict(remaining_work=remaining, age=3600.0, num_restarts=1, max_replicas=16)
    return {
        "flat": JobInfo(0.0, speedup_fn=flat, **common),
        "linear": JobInfo(1.0, speedup_fn=LinearSpeedup(), **common),
    }


def test_weights_divided_by_the_speed_to_come():
    """With ``future_gamma`` a job's weight is divided by ``s_future ** gamma``, its speedup at
    its max-min fair share of the GPUs (capped at its goodput peak): on 16 GPUs ``flat``
    keeps 2 (s = 2 ** 0.2) and ``linear`` gets the other 14 (s = 14). Without it (``None``)
    both keep the remaining-work weight, and a job without a model keeps its weight either way."""
    jobs = _scaling_pair()
    keys = list(jobs)
    policy = WaterfillPolicy(objective=Objective(future_gamma=0.5))
    curves = {k: policy._curve(jobs[k], 16) for k in keys}
    plain = WaterfillPolicy(objective=Objective(future_gamma=None))._weights(jobs, keys, curves, 16)
    assert plain["flat"] == plain["linear"]
    w = policy._weights(jobs, keys, curves, 16)
    np.testing.assert_allclose(w["flat"], plain["flat"] / (2.0**0.2) ** 0.5)
    np.testing.assert_allclose(w["linear"], plain["linear"] / 14.0**0.5)
    assert policy._weights(jobs, keys) == plain  # no curves given: the plain weights
    jobs["new"] = JobInfo(2.0, speedup_fn=None, remaining_work=None, max_replicas=4)
    curves["new"] = policy._curve(jobs["new"], 4)
    assert policy._weights(jobs, list(jobs), curves, 16)["new"] == 1.0


@pytest.mark.parametrize("search", ["local", "genetic"])
def test_speed_to_come_moves_gpus_to_the_slow_job(search):
    """On 4 GPUs ``linear`` gains 1 per GPU, ``flat`` 2 ** 0.2 - 1 = 0.15 for its second GPU.
    With plain weights ``linear`` keeps 3 GPUs. The fair split gives each 2, so the speeds to
    come are 2 ** 0.2 and 2; with gamma = 6 (above 3.43) flat's second GPU, 0.149 / 2 ** 1.2,
    is worth more than linear's third, 1 / 2 ** 6."""
    nodes = _cluster(1, 4)
    jobs = _scaling_pair()
    base = {"flat": [0], "linear": [0, 0, 0]}
    plain = WaterfillPolicy(
        search=Search(method=search), objective=Objective(future_gamma=None)
    ).optimize(jobs, nodes, base, 0.0)
    assert len(plain["flat"]) == 1 and len(plain["linear"]) == 3
    jobs = {k: dataclasses.replace(j, age=1e6) for k, j in jobs.items()}  # cheap restarts
    # (and growth priced by Pollux's penalty alone: flat's second GPU repays no 1/6 of its speed)
    strong = WaterfillPolicy(
        search=Search(method=search),
        objective=Objective(future_gamma=6.0),
        growth=Growth(payback=None),
    )
    strong = strong.optimize(jobs, nodes, base, 0.0)
    assert len(strong["flat"]) == 2 and len(strong["linear"]) == 2


def test_future_gamma_must_be_non_negative():
    with pytest.raises(ValueError, match="future_gamma"):
        WaterfillPolicy(objective=Objective(future_gamma=-0.5))
    WaterfillPolicy(objective=Objective(future_gamma=0.0))  # 0 (or None): weights not divided


def _old_job(a: float) -> JobInfo:
    """A job on 4 GPUs for a long time (restart penalty about 0), measured up to 8 GPUs, with
    speedup ``r ** a`` and hours of work left."""
    fn = _power(a)
    return JobInfo(
        0.0,
        speedup_fn=fn,
        max_replicas=8,
        max_profiled_replicas=8,
        remaining_work=1e5,
        age=1e7,
        num_restarts=1,
    )


@pytest.mark.parametrize("search", ["local", "genetic"])
def test_growth_repays_its_restart_within_grow_payback_rounds(search):
    """Alone on 8 GPUs, a job on 4 whose Pollux penalty is about 0 grows to 8 however little it
    gains. With ``grow_payback = 3`` a growth keeps at most 1 - 30 / 180 of its new speed: a
    job with ``s = r ** 0.1`` (1.149 -> 1.231, +7%) stays on 4, a linear one (4 -> 8) grows."""
    nodes, base = _cluster(2, 4), {"a": [0, 0, 0, 0]}
    flat = {"a": _old_job(0.1)}
    plain = WaterfillPolicy(search=Search(method=search), growth=Growth(payback=None))
    assert len(plain.optimize(flat, nodes, base, 0.0)["a"]) == 8
    policy = WaterfillPolicy(search=Search(method=search))  # grow_payback = 3 rounds
    assert policy._grow_cost() == pytest.approx(30.0 / 180.0)
    assert policy.optimize(flat, nodes, base, 0.0)["a"] == base["a"]
    linear = {"a": _old_job(1.0)}
    assert len(policy.optimize(linear, nodes, base, 0.0)["a"]) == 8
    # a job not running yet is placed as before: the floor prices growth, not admission
    assert len(policy.optimize(flat, nodes, {}, 0.0)["a"]) >= 1


def test_genetic_fitness_prices_growth_not_shrinks():
    """The genetic fitness: a running job that grows keeps ``min(rho, 1 - grow_cost)`` of its new
    speed, one that shrinks or moves keeps Pollux's ``rho`` (here about 1)."""
    from adaptrain.sched._plan import WeightedGeneticSearch

    nodes, base = _cluster(2, 4), {"a": [0, 0, 0, 0]}
    jobs, weights = {"a": _old_job(0.5)}, {"a": 1.0}
    rho = (1e7 - 30.0) / (1e7 + 30.0)
    g = WeightedGeneticSearch(grow_cost=0.25)
    grown = g.fitness(jobs, nodes, base, weights, {"a": [0] * 4 + [1] * 4})
    assert grown == pytest.approx(0.75 * float(_power(0.5)(2, 8)))
    shrunk = g.fitness(jobs, nodes, base, weights, {"a": [0, 0]})
    assert shrunk == pytest.approx(rho * float(_power(0.5)(1, 2)))
    plain = WeightedGeneticSearch().fitness(jobs, nodes, base, weights, {"a": [0] * 4 + [1] * 4})
    assert plain == pytest.approx(rho * float(_power(0.5)(2, 8)))


def test_grow_payback_is_validated():
    from adaptrain.sched._plan import WeightedGeneticSearch

    with pytest.raises(ValueError, match="payback"):
        WaterfillPolicy(growth=Growth(payback=0.0))
    with pytest.raises(ValueError, match="grow_cost"):
        WeightedGeneticSearch(grow_cost=1.5)
    assert WaterfillPolicy(growth=Growth(payback=None))._grow_cost() == 0.0
    assert (
        WaterfillPolicy(growth=Growth(payback=0.1))._grow_cost() == 1.0
    )  # at most the whole speed


def _ending_job(remaining_seconds: float) -> JobInfo:
    """A linear job on 4 GPUs (restart penalty about 0) with ``remaining_seconds`` left at that
    size (remaining work on one GPU = 4 x that)."""
    return dataclasses.replace(_old_job(1.0), remaining_work=4.0 * remaining_seconds)


@pytest.mark.parametrize("search", ["local", "genetic"])
def test_a_job_about_to_end_grows_only_if_it_ends_sooner(search):
    """Growing 4 -> 8 GPUs halves the job's remaining time T but costs a 30 s restart: it ends
    sooner only if T / 2 + 30 < T, i.e. T > 60 s. ``payback_remaining`` prices the growth at
    ``30 / T`` of the new speed when T is under the payback horizon (3 rounds, 180 s), so the job
    stays at T = 50 s and grows at T = 90 s; without it, it grows whenever T > 36 s (1/6)."""
    nodes, base = _cluster(2, 4), {"a": [0, 0, 0, 0]}
    policy = WaterfillPolicy(search=Search(method=search))
    assert policy.payback_remaining
    assert policy.optimize({"a": _ending_job(50.0)}, nodes, base, 0.0)["a"] == base["a"]
    assert len(policy.optimize({"a": _ending_job(90.0)}, nodes, base, 0.0)["a"]) == 8
    plain = WaterfillPolicy(search=Search(method=search), growth=Growth(payback_remaining=False))
    assert len(plain.optimize({"a": _ending_job(50.0)}, nodes, base, 0.0)["a"]) == 8


def test_grow_costs_follow_the_remaining_time_under_the_horizon():
    policy = WaterfillPolicy()  # restart 30 s, horizon 3 rounds of 60 s
    base = {k: [0, 0, 0, 0] for k in ("end", "long", "new")}
    jobs = {
        "end": _ending_job(50.0),
        "long": _ending_job(500.0),  # beyond the horizon: the constant floor, not listed
        "new": JobInfo(0.0, max_replicas=8),  # no model, no estimate
        "idle": _ending_job(10.0),  # not running: admission is not a growth
    }
    costs = policy._grow_costs(jobs, base)
    assert costs == {"end": pytest.approx(30.0 / 50.0)}
    assert policy._grow_costs({"a": _ending_job(10.0)}, {"a": [0] * 4}) == {"a": 1.0}
    assert WaterfillPolicy(growth=Growth(payback_remaining=False))._grow_costs(jobs, base) == {}
    assert WaterfillPolicy(cluster=ClusterSpec(restart_delay=0.0))._grow_costs(jobs, base) == {}
    # without the round floor, the remaining time alone sets the horizon
    assert WaterfillPolicy(growth=Growth(payback=None))._grow_costs(jobs, base) == {
        "end": pytest.approx(0.6),
        "long": pytest.approx(30.0 / 500.0),
    }


def test_genetic_fitness_takes_per_job_grow_costs():
    from adaptrain.sched._plan import WeightedGeneticSearch

    nodes, base = _cluster(2, 4), {"a": [0, 0, 0, 0]}
    jobs, weights = {"a": _old_job(0.5)}, {"a": 1.0}
    g = WeightedGeneticSearch(grow_cost=0.25)
    grown = {"a": [0] * 4 + [1] * 4}
    s8 = float(_power(0.5)(2, 8))
    assert g.fitness(jobs, nodes, base, weights, grown) == pytest.approx(0.75 * s8)
    assert g.fitness(jobs, nodes, base, weights, grown, {"a": 0.6}) == pytest.approx(0.4 * s8)
    assert g.fitness(jobs, nodes, base, weights, grown, {"b": 0.6}) == pytest.approx(0.75 * s8)


def _recorded_bests(policy: WaterfillPolicy) -> list[float]:
    """Wrap the first genetic run's steps to record the best score of its initial population
    (its first evaluation), then of each generation's."""
    search, bests = policy._genetic, []
    step, evaluate = search._generation, search._evaluate

    def first_evaluation(states, base):
        out = evaluate(states, base)
        if not bests:
            bests.append(float(out[:, 0].min()))
        return out

    def generation(pop, F, rank, crowd, base):
        out = step(pop, F, rank, crowd, base)
        bests.append(float(out[1][:, 0].min()))
        return out

    search._evaluate, search._generation = first_evaluation, generation
    return bests


@pytest.mark.parametrize(
    ("p", "want"), [(1.0, (7, 1)), (0.5, (6, 2)), (0.0, (5, 3)), (-1.0, (5, 3))]
)
def test_the_local_search_maximises_the_weighted_utility_of_exponent_p(p, want):
    """Two linear jobs on one 8-GPU node, weights 1 and 0.5 (remaining work 0 and ``theta``).
    The exact optima of ``sum_j w_j U(r_j)``: linear (p = 1) 7 + 0.5 at (7, 1); ``2 sqrt r``
    (p = 0.5) 6.313 at (6, 2) against 6.292 at (7, 1); ``log r`` (p = 0) 2.159 at (5, 3) against
    2.138 at (6, 2); ``-1 / r`` (p = -1) -0.367 at (5, 3) against -0.375 at (4, 4)."""
    theta = 16 * 3600.0
    jobs = {
        k: JobInfo(
            float(i),
            max_replicas=8,
            speedup_fn=LinearSpeedup(),
            remaining_work=rem,
            age=1e5,
            max_profiled_replicas=8,
        )
        for i, (k, rem) in enumerate((("a", 0.0), ("b", theta)))
    }
    policy = WaterfillPolicy(
        search=Search(method="local"), objective=Objective(theta=theta, p=p, future_gamma=None)
    )
    out = policy.optimize(jobs, {0: NodeInfo(8)}, {}, 0.0)
    assert (len(out["a"]), len(out["b"])) == want


@pytest.mark.parametrize(
    ("r", "free", "min_nodes", "want"),
    [
        # 8 replicas on four empty nodes: packed on two, or spread over three / four
        (8, {0: 4, 1: 4, 2: 4, 3: 4}, 2, {0: 4, 1: 4}),
        (8, {0: 4, 1: 4, 2: 4, 3: 4}, 3, {0: 3, 1: 3, 2: 2}),
        (8, {0: 4, 1: 4, 2: 4, 3: 4}, 4, {0: 2, 1: 2, 2: 2, 3: 2}),
        # uneven free GPUs: the least free node gives what it has, the others the rest
        (6, {0: 4, 1: 1, 2: 2, 3: 4}, 3, {0: 2, 2: 2, 3: 2}),
        (7, {0: 4, 1: 1, 2: 4}, 3, {0: 3, 1: 1, 2: 3}),
        # 12 replicas already span three nodes: packed as before
        (12, {0: 4, 1: 4, 2: 4, 3: 4}, 3, {0: 4, 1: 4, 2: 4}),
        # only two nodes free of multi-node jobs: packed on two (the floor is soft)
        (8, {0: 4, 1: 4}, 3, {0: 4, 1: 4}),
        # a job that fits on one node stays there
        (4, {0: 4, 1: 4, 2: 4}, 3, {0: 4}),
        # one that fits on no single node: packed on the emptiest nodes, as without the option
        (4, {0: 3, 1: 3}, 2, {0: 3, 1: 1}),
        (4, {0: 3, 1: 3, 2: 1}, 3, {0: 2, 1: 1, 2: 1}),
    ],
)
def test_the_node_floor_spreads_a_multi_node_job_over_the_emptiest_nodes(r, free, min_nodes, want):
    alloc = WaterfillPolicy._fit(r, dict(free), {n: False for n in free}, 4, min_nodes)
    assert alloc is not None and len(alloc) == r
    assert {n: alloc.count(n) for n in set(alloc)} == want


@pytest.mark.parametrize("search", ["local", "genetic"])
def test_with_a_node_floor_no_multi_node_job_spans_two_nodes(search):
    """The job of ``test_single_node_jobs_are_packed_and_multi_node_jobs_get_whole_nodes`` (8
    replicas, two whole nodes by default) spans three nodes or more under ``min_nodes=3``, in
    the local search and in the genetic refinement (which values two nodes at nothing), and the
    interference rule holds. A job already running on two nodes keeps them in the local search
    (an unchanged size keeps its nodes: no restart it does not price); the genetic refinement
    moves it off them."""
    nodes = _cluster(4, 4)
    jobs = {
        "big": JobInfo(0.0, max_replicas=8, min_replicas=8, speedup_fn=LinearSpeedup()),
        "s1": JobInfo(1.0, max_replicas=2, speedup_fn=LinearSpeedup()),
        "s2": JobInfo(2.0, max_replicas=2, speedup_fn=LinearSpeedup()),
    }
    for seed in range(3):
        policy = WaterfillPolicy(search=Search(method=search, min_nodes=3), seed=seed)
        alloc = {k: v for k, v in policy.optimize(jobs, nodes, {}, 0.0).items() if v}
        check_allocations(alloc, jobs, nodes, interference=True)
        assert len(alloc["big"]) == 8 and len(set(alloc["big"])) >= 3
        if search == "genetic":  # a running job on two nodes is worth nothing there
            base = {"big": [0] * 4 + [1] * 4, "s1": [2, 2], "s2": [3, 3]}
            again = policy.optimize(jobs, nodes, base, 600.0)
            check_allocations({k: v for k, v in again.items() if v}, jobs, nodes, interference=True)
            assert len(again["big"]) == 8 and len(set(again["big"])) >= 3


def test_the_genetic_refinement_values_two_nodes_at_nothing_under_a_node_floor():
    nodes = _cluster(4, 4)
    jobs = {"big": JobInfo(0.0, max_replicas=8, speedup_fn=LinearSpeedup(), age=1e5)}
    packed, spread = {"big": [0] * 4 + [1] * 4}, {"big": [0] * 3 + [1] * 3 + [2] * 2}
    for floor, want in ((2, True), (3, False)):
        search = WaterfillPolicy(search=Search(min_nodes=floor))._genetic
        assert search.min_nodes == floor
        fit = {
            name: search.fitness(jobs, nodes, alloc, {"big": 1.0}, alloc)
            for name, alloc in (("packed", packed), ("spread", spread))
        }
        assert (fit["packed"] == fit["spread"]) is want  # the model prices replicas alone
        assert fit["spread"] > 0


@pytest.mark.parametrize("bad", [1, 0, -2, 2.5, True, "3"])
def test_min_nodes_is_validated(bad):
    with pytest.raises(ValueError, match="min_nodes"):
        WaterfillPolicy(search=Search(min_nodes=bad))
    with pytest.raises(ValueError, match="min_nodes"):
        WeightedGeneticSearch(min_nodes=bad)
