"""What a service job reports to the policy, from the hints its rank 0 posts."""

from __future__ import annotations

import pytest

from adaptrain.core.goodput import GoodputFunction
from adaptrain.sched import job_info
from adaptrain.service.models import Hints
from adaptrain.service.reports import job_report, speedup_from_hints

PERF = {"alpha_c": 0.01, "beta_c": 0.001, "alpha_n": 0.02, "beta_n": 0.001, "alpha_r": 0.01,
        "beta_r": 0.0005, "gamma": 1.5}  # fmt: skip
HINTS = Hints(
    initBatchSize=64,
    maxBatchSize=1024,
    localBszBounds=(16, 256),
    maxProfiledReplicas=2,
    gradientAccumulation=True,
    gradParams={"norm": 0.5, "var": 2.0},
    perfParams=PERF,
    profile=[{"numNodes": 1, "numReplicas": 2, "atomicBsz": 64, "stepTime": 0.1, "syncTime": 0.02}],
    progress={"epoch": 3, "samples": 100, "progress": 1e4},
).model_dump()
SPEC = {"min_replicas": 0, "max_replicas": 8, "preemptible": True}


def _report(hints=HINTS, **kw):
    args = dict(submitted=0.0, attained_service=10.0, spec=SPEC, group=2, hints=hints,
                running=True, cooldown=False, max_nodes=4, max_replicas=16)  # fmt: skip
    args.update(kw)
    return job_report(**args)


def test_the_speedup_is_the_goodput_models():
    fn = speedup_from_hints(HINTS, 4, 16)
    model = GoodputFunction(list(PERF.values()), (0.5, 2.0), 64)
    best = model.optimize(1, 2, max_batch_size=1024, atomic_bsz_range=(16, 256), accumulation=True)
    assert fn(1, 2) == pytest.approx(float(best[0]) / fn.base_goodput)
    assert fn(1, 1) == pytest.approx(1.0)


def test_a_report_carries_profile_bounds_restarts_and_epoch():
    report = _report()
    assert report.profile == {(1, 2, 64): (0.1, 0.02)}
    assert report.max_profiled_replicas == 2 and report.num_restarts == 2 and report.epoch == 3
    info = job_info(report, cluster_replicas=16, now=100.0)
    # the exploration cap: twice the largest size run; the limit: the spec and the batch bounds
    assert info.max_replicas == 4 and info.replica_limit == min(8, 1024 // 16)
    assert info.age == 100.0 and info.preemptible


def test_no_hints_no_model():
    info = job_info(_report(hints=None), cluster_replicas=16, now=0.0)
    assert info.speedup_fn is None and info.max_replicas == 1 and info.replica_limit == 8


@pytest.mark.parametrize(("spec", "cooldown", "pinned"), [
    ({**SPEC, "preemptible": False}, False, True),
    (SPEC, True, True),
    (SPEC, False, False),
])  # fmt: skip
def test_a_job_in_its_cooldown_or_not_preemptible_is_pinned(spec, cooldown, pinned):
    assert _report(spec=spec, cooldown=cooldown).preemptible is not pinned
    assert _report(spec=spec, cooldown=cooldown, running=False).preemptible
