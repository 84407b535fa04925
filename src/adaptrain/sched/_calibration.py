"""Goodput models calibrated at the configurations an application has measured.

A job's throughput model (Pollux, Qiao et al., OSDI'21, Sec. 3.1; AdaptDL's
:class:`~adaptrain.core.goodput.PerfParams`) prices an all-reduce by two regimes, within one
node or across nodes, and by the replica count: it cannot tell two nodes from four. Measured
clusters can. On the Pollux artifact's cluster, 5-8 replicas on two nodes run 20-70% slower
than on three or four for every model (``placements.csv``), and a fit to a job's measurements
is a compromise between the two, wrong at both. The scheduler sees the job's measurements (its
:attr:`~adaptrain.sched.policy_base.JobInfo.profile`), so it need not trust the model where a
measurement says otherwise.

:class:`ThroughputCalibration` pools the step times the jobs of one application have measured
(the same model on the same hardware) and, for a job's goodput model, scales its throughput at
each measured ``(num_nodes, num_replicas)`` by the measured over the modelled throughput there:

    X'(n, r, b, s) = X(n, r, b, s) * rho(n, r),
    rho(n, r) = exp(mean_{b measured at (n, r)} log(r b / T_meas(n, r, b) / X(n, r, b, 0))),

with ``T_meas`` the measured optimizer-step time (geometric mean over the jobs that measured
it) and ``X`` the model's samples per second (:meth:`GoodputFunction.throughput`). Elsewhere the
model stands as fitted, so the correction never reaches a configuration nobody has run on.
The goodput's batch-size choice and statistical efficiency are untouched, and a job's one-GPU
goodput, the base of its speedup, is calibrated like any other configuration (its remaining
work, in one-GPU seconds, is rescaled to match).

Pure: numpy only, no I/O; :meth:`ThroughputCalibration.state_dict` holds numbers (keyed by
application and job names).
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from adaptrain.core.goodput import GoodputFunction, predict_step_times

from .memo import Memo, memoized
from .policy_base import JobInfo
from .speedup import SpeedupFunction

__all__ = ["CalibratedGoodput", "ThroughputCalibration"]

Config = tuple[int, int]
Key = tuple[int, int, int]


class CalibratedGoodput(GoodputFunction):
    """A :class:`~adaptrain.core.goodput.GoodputFunction` whose throughput at each
    ``(num_nodes, num_replicas)`` in ``factors`` is multiplied by that factor (module docstring);
    other configurations keep the model's."""

    def __init__(
        self,
        perf_params: Any,
        grad_params: Any,
        init_batch_size: float,
        factors: Mapping[Config, float],
    ) -> None:
        super().__init__(perf_params, grad_params, init_batch_size)
        for (n, r), f in factors.items():
            if not (1 <= n <= r):
                raise ValueError(f"factor at (num_nodes={n}, num_replicas={r}): need 1 <= n <= r")
            if not (math.isfinite(f) and f > 0):
                raise ValueError(f"factor {f!r} at ({n}, {r}) must be positive and finite")
        self._factors = dict(factors)
        shape = (
            max((n for n, _ in factors), default=0) + 1,
            max((r for _, r in factors), default=0) + 1,
        )
        self._table = np.ones(shape)
        for (n, r), f in factors.items():
            self._table[n, r] = f

    @property
    def factors(self) -> dict[Config, float]:
        """The throughput factors, per ``(num_nodes, num_replicas)``."""
        return dict(self._factors)

    def throughput(
        self, num_nodes: Any, num_replicas: Any, atomic_bsz: Any, accum_steps: Any
    ) -> Any:
        """The model's samples per second times the factor at ``(num_nodes, num_replicas)``."""
        base = super().throughput(num_nodes, num_replicas, atomic_bsz, accum_steps)
        n, r = np.broadcast_arrays(np.asarray(num_nodes), np.asarray(num_replicas))
        inside = (n < self._table.shape[0]) & (r < self._table.shape[1])
        fac = np.ones(n.shape)
        fac[inside] = self._table[n[inside], r[inside]]
        out = base * fac
        return float(out) if np.ndim(out) == 0 else out

    def __repr__(self) -> str:
        return (
            f"CalibratedGoodput({self.perf_params!r}, {self.grad_params!r}, "
            f"init_batch_size={self.init_batch_size!r}, factors={self._factors!r})"
        )


@memoized(maxsize=256)  # each holds a (nodes x replicas) memo table once filled
def _calibrated_speedup(
    perf: tuple, grad: tuple, init_batch_size: float, factors: tuple, limits: tuple
) -> SpeedupFunction:
    """The speedup of a goodput model with ``factors`` (sorted ``((n, r), f)`` pairs) and the
    batch ``limits`` (sorted items of :meth:`SpeedupFunction.limits`); pure, so memoised."""
    model = CalibratedGoodput(perf, grad, init_batch_size, dict(factors))
    return SpeedupFunction(model, **dict(limits))


class ThroughputCalibration:
    """Per application, the step times its jobs have measured, and goodput models calibrated
    by them (module docstring).

    :meth:`observe` takes each job's :attr:`~adaptrain.sched.policy_base.JobInfo.profile`
    (jobs without an ``application`` are skipped) and keeps those of the ``max_jobs`` jobs of
    each application that reported a change most recently; :meth:`calibrate` returns a job
    whose speedup is calibrated. ``cache_size`` bounds the factor sets kept.
    """

    def __init__(self, max_jobs: int = 16, cache_size: int = 256) -> None:
        if max_jobs < 1:
            raise ValueError(f"max_jobs={max_jobs} must be >= 1")
        if cache_size < 1:
            raise ValueError(f"cache_size={cache_size} must be >= 1")
        self.max_jobs = max_jobs
        self.cache_size = cache_size
        # application -> job -> {(nodes, replicas, atomic_bsz): step seconds}, latest last
        self._apps: dict[str, collections.OrderedDict[str, dict[Key, float]]] = {}
        self._version: dict[str, int] = {}
        self._factor_cache = Memo(cache_size)

    def observe(self, jobs: Mapping[str, JobInfo]) -> None:
        """Take in the jobs' measured step times (in job-name order).

        Raises:
            ValueError: on a profile entry that is not ``(nodes, replicas, atomic_bsz) ->
                (step_time, sync_time)`` with ``1 <= nodes <= replicas``, a positive micro-batch
                and a positive, finite step time.
        """
        for name in sorted(jobs):
            job = jobs[name]
            if job.application is None or not job.profile:
                continue
            measured = {}
            for key, times in job.profile.items():
                n, r, b = (int(v) for v in key)
                step = float(times[0])
                if not (1 <= n <= r and b >= 1 and math.isfinite(step) and step > 0):
                    raise ValueError(
                        f"job {name!r}: profile entry {key!r} -> {times!r} needs "
                        "1 <= num_nodes <= num_replicas, atomic_bsz >= 1 and a positive step time"
                    )
                measured[n, r, b] = step
            app = self._apps.setdefault(job.application, collections.OrderedDict())
            if app.get(name) == measured:
                continue
            app[name] = measured
            app.move_to_end(name)
            while len(app) > self.max_jobs:
                app.popitem(last=False)
            self._version[job.application] = self._version.get(job.application, 0) + 1

    def factors(self, application: str, perf_params: Any) -> dict[Config, float]:
        """The throughput factors of a model with ``perf_params`` for ``application``, per
        measured ``(num_nodes, num_replicas)`` (empty if it has measured nothing)."""
        app = self._apps.get(application)
        if not app:
            return {}
        perf = tuple(float(v) for v in perf_params)
        key = (application, self._version[application], perf)
        hit = self._factor_cache.get(key)
        if hit is not None:
            return dict(hit)
        logs: dict[Key, list[float]] = {}
        for measured in app.values():
            for k, step in measured.items():
                logs.setdefault(k, []).append(math.log(step))
        keys = sorted(logs)
        n, r, b = (np.array([k[i] for k in keys], dtype=float) for i in range(3))
        step = np.exp([np.mean(logs[k]) for k in keys])  # geometric mean over the jobs
        _, optim = predict_step_times(perf, n, r, b)
        log_ratio = np.log(optim / step)  # measured over modelled samples per second
        by_config: dict[Config, list[float]] = {}
        for k, v in zip(keys, log_ratio):
            by_config.setdefault((k[0], k[1]), []).append(float(v))
        out = {c: math.exp(sum(v) / len(v)) for c, v in by_config.items()}
        out = {c: f for c, f in out.items() if math.isfinite(f) and f > 0}
        self._factor_cache.put(key, out)
        return dict(out)  # a copy: the cached one stays as computed

    def calibrate(self, job: JobInfo) -> JobInfo:
        """``job`` with its speedup calibrated at its application's measured configurations
        and its remaining work rescaled to the calibrated one-GPU goodput; unchanged without an
        application, measurements, or a goodput-model speedup based at one GPU."""
        fn = job.speedup_fn
        if job.application is None or not isinstance(fn, SpeedupFunction):
            return job
        g = fn.goodput_fn
        factors = self.factors(job.application, g.perf_params)
        if not factors or fn.base_goodput != float(fn.goodput(1, 1)):
            return job  # nothing measured, or a rebased speedup: left as it is
        new = _calibrated_speedup(
            tuple(g.perf_params),
            tuple(g.grad_params),
            float(g.init_batch_size),
            tuple(sorted(factors.items())),
            tuple(sorted(fn.limits().items())),
        )
        rem = job.remaining_work
        if rem is not None:  # the same progress at the calibrated one-GPU rate
            rem = rem * fn.base_goodput / new.base_goodput
        return dataclasses.replace(job, speedup_fn=new, remaining_work=rem)

    def state_dict(self) -> dict:
        """``"apps"``: per application, per job (oldest first), its measurements flattened as
        ``[nodes, replicas, atomic_bsz, step_time, ...]``; ``"versions"``: per application the
        count of changes seen."""
        return {
            "apps": {
                app: {
                    job: [float(x) for k in sorted(m) for x in (*k, m[k])]
                    for job, m in jobs.items()
                }
                for app, jobs in self._apps.items()
            },
            "versions": {app: float(v) for app, v in self._version.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output."""
        apps: dict[str, collections.OrderedDict[str, dict[Key, float]]] = {}
        for app, jobs in state["apps"].items():
            apps[app] = collections.OrderedDict()
            for job, flat in jobs.items():
                if len(flat) % 4:
                    raise ValueError(
                        f"measurements of job {job!r} ({app!r}) need (nodes, replicas, "
                        f"atomic_bsz, step_time) quadruples, got {len(flat)} numbers"
                    )
                apps[app][job] = {
                    (int(flat[i]), int(flat[i + 1]), int(flat[i + 2])): float(flat[i + 3])
                    for i in range(0, len(flat), 4)
                }
        versions = {app: int(v) for app, v in state["versions"].items()}
        if set(versions) != set(apps):
            raise ValueError("calibration state: versions and applications do not match")
        self._apps = apps
        self._version = versions
        self._factor_cache.clear()
