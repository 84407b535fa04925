"""Throughput fits shared between the jobs of one application.

A job's goodput model (Pollux, Qiao et al., OSDI'21, Sec. 3) has two parts: throughput
parameters fitted to the step times the job has measured on the sizes it has run on, and its
gradient statistics. The throughput part is a property of the model and the hardware, so jobs
of one application (:attr:`~adaptrain.sched.policy_base.JobInfo.application`: the same model
on the same cluster) could share it. Pollux does not: each job learns its own curve from one
GPU up, growing at most twofold a round (AdaptDL's exploration rule), a restart per step.

:class:`ApplicationProfiles` keeps, per application, the throughput parameters of the job that
has run on the most replicas (ties: the latest seen), or with ``pool`` a fit pooled from several
jobs' fits (below), and gives a job that has run on fewer:

- its speedup from those parameters with the job's own gradient statistics (a job that has
  never run: the statistics of the application's earliest epoch seen);
- that job's largest size as the one it "has run on", so that the policy's exploration cap
  starts there rather than at the job's own;
- its remaining-work estimate at the shared one-GPU goodput (its own, scaled). A job that has
  never run has no estimate; ``work_prior`` (the default) gives it the largest work seen left
  in a job of the application (its whole run), else it keeps none.

A job of an application seen for the first time, one that has run on as many replicas as
any, or one whose speedup is neither a goodput model's nor the unmeasured guess, is left as it
is. Pure: no I/O, no environment; state in :meth:`state_dict` is numbers.

One job's fit can be wrong where it has measured little. A job that jumps from one node to 63
GPUs has a single multi-node measurement, which cannot separate the fixed and per-replica
network costs. Its fit may then put one network cost on every multi-node size, and shared, it
values every later job of the application low at 8-32 GPUs (a cifar10 fit in
``benchmarks/results/sched.md``). With ``pool`` (K jobs) the shared parameters
are refitted instead (:func:`~adaptrain.core.goodput.fit_perf_params`) to the fits of the K
jobs of the application that have run on the most replicas, each read only at the
configurations (nodes, replicas) it has run on. :meth:`observe` learns those from the
allocations it is given: the policy's own placements. The pooled fit is redone whenever a pooled
job runs on a multi-GPU configuration new to it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from adaptrain.core.goodput import GoodputFunction, fit_perf_params, predict_step_times

from .memo import Memo
from .policy_base import JobInfo
from .speedup import LinearSpeedup, SpeedupFunction

__all__ = ["ApplicationProfiles"]

_NUMBERS = ("r0", "work", "epoch0", "init_batch_size")


class ApplicationProfiles:
    """Per-application throughput fits, shared with every job of the application (module
    docstring). ``cache_size`` bounds the speedup functions kept (one per application,
    throughput fit and gradient statistics); ``work_prior`` gives a job that has never run the
    largest work seen left in a job of its application as its remaining-work estimate (``False``:
    the job keeps none); ``pool`` (a number of jobs, or ``None`` for the largest job's fit alone)
    shares a fit to several jobs' fits at the configurations they ran on (module docstring)."""

    def __init__(
        self, cache_size: int = 256, work_prior: bool = True, pool: int | None = None
    ) -> None:
        if cache_size < 1:
            raise ValueError(f"cache_size={cache_size} must be >= 1")
        if pool is not None and pool < 1:
            raise ValueError(f"pool={pool} must be >= 1 jobs, or None (the largest job's fit)")
        self.cache_size = int(cache_size)
        self.work_prior = bool(work_prior)
        self.pool = pool
        self._apps: dict[str, dict[str, Any]] = {}
        # (nodes, replicas) configurations each job has run on, from the allocations observed
        self._configs: dict[str, set[tuple[int, int]]] = {}
        self._fns = Memo(self.cache_size)

    def observe(
        self,
        jobs: Mapping[str, JobInfo],
        allocations: Mapping[str, Sequence[int]] | None = None,
    ) -> None:
        """Note each modelled job's throughput fit, size, remaining work and gradient
        statistics under its application; with ``pool``, the configuration each job runs on
        (``allocations``: its node per replica, as the policy placed it) and the fits to pool."""
        stale, allocations = set(), allocations or {}
        for name, job in jobs.items():
            fn, app = job.speedup_fn, job.application
            new = self.pool is not None and self._note(name, allocations.get(name))
            if app is None or not isinstance(fn, SpeedupFunction):
                continue
            rec = self._apps.setdefault(app, {"r0": 0, "work": 0.0, "grad0": None, "epoch0": 0})
            g = fn.goodput_fn
            if self.pool is not None and any(r >= 2 for _, r in self._configs.get(name, ())):
                rec.setdefault("fits", {})[name] = tuple(float(v) for v in g.perf_params)
                if new:
                    stale.add(app)
            if job.max_profiled_replicas >= rec["r0"]:
                rec["r0"] = int(job.max_profiled_replicas)
                rec["perf"] = tuple(float(v) for v in g.perf_params)
                rec["init_batch_size"] = float(g.init_batch_size)
                rec["limits"] = fn.limits()
            if job.remaining_work is not None:  # progress left x init batch size
                rec["work"] = max(rec["work"], job.remaining_work * fn.base_goodput)
            epoch = 1 if job.epoch is None else int(job.epoch)
            if rec["grad0"] is None or epoch < rec["epoch0"]:
                rec["grad0"] = tuple(float(v) for v in g.grad_params)
                rec["epoch0"] = epoch
        for app in stale:
            self._refit(self._apps[app])
        if self.pool is not None:  # forget the configurations of jobs gone and not pooled
            keep = set(jobs).union(*(rec.get("fits", {}) for rec in self._apps.values()))
            self._configs = {k: v for k, v in self._configs.items() if k in keep}

    def _note(self, name: str, nodes: Sequence[int] | None) -> bool:
        """Record the configuration of ``nodes`` (a node per replica) for job ``name``; whether
        it is a multi-GPU configuration new to the job."""
        if not nodes:
            return False
        config = (len(set(nodes)), len(nodes))
        seen = self._configs.setdefault(name, set())
        if config in seen:
            return False
        seen.add(config)
        return config[1] >= 2

    def _refit(self, rec: dict[str, Any]) -> None:
        """Refit the application's shared parameters to its ``pool`` largest jobs' fits, each
        read at the configurations it has run on, at both ends of the atomic batch range."""
        fits = sorted(rec["fits"].items(), key=lambda kv: -max(r for _, r in self._configs[kv[0]]))
        rec["fits"] = dict(fits[: self.pool])
        lo, hi = rec["limits"]["atomic_bsz_range"] or (None, None)
        bsz = np.array([lo or 1.0, hi or max(2.0, 2.0 * rec["init_batch_size"])], dtype=float)
        cols: list[list[np.ndarray]] = [[], [], [], [], []]
        for name, perf in rec["fits"].items():
            configs = sorted(self._configs[name])
            n = np.repeat(np.array([c[0] for c in configs], dtype=float), len(bsz))
            r = np.repeat(np.array([c[1] for c in configs], dtype=float), len(bsz))
            b = np.tile(bsz, len(configs))
            accum, optim = predict_step_times(perf, n, r, b)
            for col, v in zip(cols, (n, r, b, accum, optim)):
                col.append(v)
        n, r, b, accum, optim = (np.concatenate(c) for c in cols)
        rec["pooled"] = tuple(float(v) for v in fit_perf_params(n, r, b, accum, optim))

    def bound_view(self, job: JobInfo) -> JobInfo:
        """``job`` with its application's largest size and the exploration cap from it, its
        speedup untouched (all :meth:`~adaptrain.sched.WaterfillPolicy.replica_bound` reads)."""
        rec = self._record(job)
        return job if rec is None else self._bounded(job, rec)

    def share(self, job: JobInfo, work_prior: bool | None = None) -> JobInfo:
        """``job`` as its application's profile sees it (module docstring); unchanged if the
        application has no larger profile. ``work_prior`` overrides the instance's setting for
        this call (``None``: the instance's)."""
        prior = self.work_prior if work_prior is None else bool(work_prior)
        rec = self._record(job)
        if rec is None:
            return job
        own = job.speedup_fn
        if isinstance(own, SpeedupFunction):
            grad = tuple(float(v) for v in own.goodput_fn.grad_params)
        elif (
            rec["grad0"] is not None
            and job.max_profiled_replicas == 0
            and (own is None or isinstance(own, LinearSpeedup))
        ):  # never run, no model: the application's earliest statistics
            grad = rec["grad0"]
        else:  # a speedup of the caller's own making: kept
            return job
        fn = self._speedup(job.application, rec, grad)
        rem = job.remaining_work
        if rem is None:
            rem = rec["work"] / fn.base_goodput if prior and rec["work"] > 0 else None
        elif isinstance(own, SpeedupFunction):  # the same progress at the shared rate
            rem = rem * own.base_goodput / fn.base_goodput
        return dataclasses.replace(self._bounded(job, rec), speedup_fn=fn, remaining_work=rem)

    @staticmethod
    def _bounded(job: JobInfo, rec: dict[str, Any]) -> JobInfo:
        """``job`` with the application's largest size and AdaptDL's cap from it."""
        return dataclasses.replace(
            job,
            max_profiled_replicas=rec["r0"],
            max_replicas=max(job.max_replicas, min(2 * rec["r0"], job.replica_limit)),
        )

    def _record(self, job: JobInfo) -> dict[str, Any] | None:
        rec = self._apps.get(job.application) if job.application is not None else None
        if rec is None or rec["r0"] <= job.max_profiled_replicas or job.replica_limit is None:
            return None
        return rec

    def _speedup(self, app: str, rec: dict[str, Any], grad: tuple) -> SpeedupFunction:
        perf = rec.get("pooled") or rec["perf"]
        key = (app, perf, grad, rec["init_batch_size"])
        return self._fns.get_or_compute(
            key,
            lambda: SpeedupFunction(
                GoodputFunction(perf, grad, rec["init_batch_size"]), **rec["limits"]
            ),
        )

    def state_dict(self) -> dict:
        """``"apps"``: per application its largest size, throughput fit, batch limits, work and
        earliest gradient statistics, as numbers (``nan`` for a limit that is ``None``), and with
        ``pool`` its pooled fit and the pooled jobs' fits; ``"configs"``: per job the
        configurations it has run on, ``[nodes, replicas, nodes, replicas, ...]``."""

        def num(v: Any) -> float:
            return math.nan if v is None else float(v)

        out = {}
        for app, rec in self._apps.items():
            lim = rec["limits"]
            lo, hi = lim["atomic_bsz_range"] or (None, None)
            out[app] = {
                **{k: float(rec[k]) for k in _NUMBERS},
                "perf": list(rec["perf"]),
                "grad0": [] if rec["grad0"] is None else list(rec["grad0"]),
                "limits": [
                    num(lim["max_batch_size"]),
                    num(lo),
                    num(hi),
                    float(bool(lim["accumulation"])),
                    float(lim["max_nodes"]),
                    float(lim["max_replicas"]),
                ],
                "pooled": list(rec.get("pooled", ())),
                "fits": {k: list(perf) for k, perf in rec.get("fits", {}).items()},
            }
        configs = {
            k: [float(x) for config in sorted(v) for x in config] for k, v in self._configs.items()
        }
        return {"apps": out, "configs": configs}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (or, before pooling, its ``"apps"`` alone)."""

        def opt(v: float, kind: type) -> Any:
            return None if math.isnan(v) else kind(v)

        if set(state) == {"apps", "configs"}:
            state, flat = state["apps"], state["configs"]
        else:  # the older format: the applications alone
            flat = {}
        configs = {}
        for k, v in flat.items():
            if len(v) % 2:
                raise ValueError(f"configurations of {k!r} need (nodes, replicas) pairs, got {v}")
            configs[k] = {(int(v[i]), int(v[i + 1])) for i in range(0, len(v), 2)}
        apps = {}
        for app, st in state.items():
            mbs, lo, hi, acc, nodes, reps = (float(v) for v in st["limits"])
            if len(st["perf"]) != 7 or len(st["grad0"]) not in (0, 2):
                raise ValueError(
                    f"profile of {app!r} needs 7 throughput parameters and 0 or 2 gradient "
                    f"statistics, got {len(st['perf'])} and {len(st['grad0'])}"
                )
            rng = None if math.isnan(lo) and math.isnan(hi) else (opt(lo, int), opt(hi, int))
            fits = {k: tuple(float(x) for x in p) for k, p in st.get("fits", {}).items()}
            pooled = tuple(float(v) for v in st.get("pooled", ()))
            if len(pooled) not in (0, 7) or any(len(p) != 7 for p in fits.values()):
                raise ValueError(f"profile of {app!r}: a pooled fit needs 7 throughput parameters")
            if set(fits) - set(configs):
                raise ValueError(f"profile of {app!r}: pooled jobs without configurations")
            apps[app] = {
                "r0": int(st["r0"]),
                "work": float(st["work"]),
                "epoch0": int(st["epoch0"]),
                "init_batch_size": float(st["init_batch_size"]),
                "perf": tuple(float(v) for v in st["perf"]),
                "grad0": tuple(float(v) for v in st["grad0"]) or None,
                "limits": {
                    "max_batch_size": opt(mbs, float),
                    "atomic_bsz_range": rng,
                    "accumulation": bool(acc),
                    "max_nodes": int(nodes),
                    "max_replicas": int(reps),
                },
                **({"fits": fits} if fits else {}),
                **({"pooled": pooled} if pooled else {}),
            }
        self._apps = apps
        self._configs = configs
        self._fns.clear()
