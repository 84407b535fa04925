"""Step-time profile, gradient statistics and goodput-driven batch-size choice (rank-local).

The :class:`~adaptrain.torch.data.AdaptiveDataLoader` brackets every micro-batch with
:func:`profile_step_start` / :func:`profile_step_commit`; :class:`AdaptiveDataParallel` reports
the all-reduce wait (:func:`profile_sync_time`), the noise-scale statistics
(:func:`update_grad_params`) and the progress (:func:`update_progress`), both at once after
each optimizer step (:func:`update_step`). The profile is kept per
configuration ``(num_nodes, num_replicas, atomic_bsz)`` as sums and counts of accumulation-step
and optimizer-step times; :func:`get_goodput_fn` fits
:class:`~adaptrain.core.goodput.PerfParams` with :func:`~adaptrain.core.goodput.fit_perf_params`
to the configurations with at least :data:`MIN_SAMPLES` optimizer steps (refitting when one
newly qualifies or after :data:`REFIT_SAMPLES` new steps), and :func:`suggest_batch_size`
maximises :meth:`GoodputFunction.optimize` within a bounded step (:data:`MAX_STEP`, up or
down) of what was measured. It proposes a new ``(atomic_bsz, accum_steps)`` only after the
current configuration has been measured, if the predicted goodput beats the current one by
``min_improvement`` (5%; plus :data:`UNDO_MARGIN` to return to the configuration just left),
or, while one micro-batch size has been profiled, to explore the step up when the prior
predicts it within :data:`EXPLORE_TOLERANCE` of the current goodput. Pollux (Qiao et al.,
OSDI 2021) explores through its scheduler instead; these rules stand in for it in a single job.

Like AdaptDL, the non-synchronising part of an optimizer step (step time − sync time) counts as
an accumulation-step sample, so a job that never accumulates still fits the compute model.

Unlike AdaptDL, the fit does not take the plain mean of every step ever timed. Each
configuration also keeps its last :data:`RECENT_STEPS` step times, and the fit uses their mean
after dropping the **stalls**, steps longer than :data:`STALL_FACTOR` × their median (with their
sync times). A stall is a pause that has nothing to do with the batch size: a full collection of
Python's garbage collector (~0.2 s in a process that has imported torch and scipy, against 3–5 ms
steps), the host preempting a replica, or waiting for a replica that was. With the plain mean,
one such pause among the 10 steps that decide whether a new size pays reads as a 40% slower
step, and the job falls back from a size it had just measured (seen on digits: batch 28 → 17).
Steps of ordinary jitter stay in, so the estimate remains a mean, not a median. The sync time
(measured on sampled steps only) falls back to its running mean when the recent steps keep no
measured one; a stall's wait is left out of that mean too. Configurations restored from
checkpoints of earlier versions (no recent steps) use the plain means.

Everything is checkpointed as the State ``"adaptdl-metrics"`` (JSON: numbers only).
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import statistics
import sys
import threading
import time
from collections import deque
from typing import Any

import numpy as np
import torch.distributed as dist

import adaptrain.checkpoint as _checkpoint
from adaptrain import env
from adaptrain.core import gns as _gns
from adaptrain.core.goodput import GoodputFunction, PerfParams, fit_perf_params
from adaptrain.dist.checkpoint import register_reset_hook

__all__ = [
    "set_batch_size",
    "profile_step_start",
    "profile_sync_time",
    "profile_step_commit",
    "update_grad_params",
    "update_progress",
    "update_step",
    "get_progress",
    "get_goodput_fn",
    "suggest_batch_size",
    "prefetch_fit_solver",
    "wait_for_solver_prefetch",
    "sched_hints",
]

logger = logging.getLogger(__name__)

#: Optimizer steps profiled at a configuration before it enters the fit (and before leaving it).
MIN_SAMPLES = 10
#: Largest factor of one move, up or down (total batch; micro-batch beyond the largest profiled).
MAX_STEP = 2.0
#: Exploration tries the bounded step up if predicted ≥ (1 − this) × the current goodput.
#: With the one-size prior (half of a step is fixed cost) a 2× step is predicted at ≥ 2/3 of the
#: current goodput even without gradient noise, so at 0.5 a job that may grow always measures a
#: second size (11 steps; on a 2-core host a 2× batch often costs ~1.1×, not the prior's 1.5×).
EXPLORE_TOLERANCE = 0.5
#: Extra predicted gain needed to return to the configuration the job just left.
UNDO_MARGIN = 0.1
#: New optimizer steps of the fitted configurations that trigger a refit.
REFIT_SAMPLES = 20
#: Step times kept per configuration (and kind of step) for the fit's stall-free mean.
RECENT_STEPS = 64
#: A step longer than this × the median of its configuration's recent steps is a stall.
STALL_FACTOR = 3.0

_FIELDS = (
    "accum_step_time",
    "accum_count",
    "optim_step_time",
    "optim_sync_time",
    "optim_count",
    "optim_sync_count",  # optimizer steps whose sync time was measured (sampled steps)
)


class _MetricsState(_checkpoint.State):
    def __init__(self) -> None:
        super().__init__("adaptdl-metrics")
        self.profile: dict[tuple[int, int, int], dict[str, float]] = {}
        # Per configuration, the last RECENT_STEPS optimizer steps as (step, sync or -1.0)
        # (sync -1: not measured on that step) and accumulation steps as step times.
        self.recent: dict[tuple[int, int, int], tuple[deque, deque]] = {}
        self.perf_params: PerfParams | None = None
        self.grad_params: tuple[float, float] | None = None
        self.init_batch_size: int | None = None
        self.max_batch_size: int | None = None
        self.local_bsz_bounds: tuple[int, int] | None = None
        self.gradient_accumulation = False
        self.progress = 0.0
        # Decision history (checkpointed): the configuration of the last suggestion call and
        # the one before the last move, as (nodes, replicas, atomic_bsz, accum_steps).
        self.last_config: tuple[int, int, int, int] | None = None
        self.previous_config: tuple[int, int, int, int] | None = None
        # What the current perf_params were fitted on (not checkpointed: refit after a load).
        self.fit_keys: tuple[tuple[int, int, int], ...] | None = None
        self.fit_total = 0
        self.fit_min_samples = 0
        # Not checkpointed: the step being timed.
        self.atomic_bsz: int | None = None
        self.step_start: float | None = None
        self.sync_time: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "profile": [[*k, *(v.get(f, 0.0) for f in _FIELDS)] for k, v in self.profile.items()],
            "recent": [[*k, [list(x) for x in o], list(a)] for k, (o, a) in self.recent.items()],
            "perf_params": None if self.perf_params is None else list(self.perf_params),
            "grad_params": None if self.grad_params is None else list(self.grad_params),
            "init_batch_size": self.init_batch_size,
            "max_batch_size": self.max_batch_size,
            "local_bsz_bounds": None
            if self.local_bsz_bounds is None
            else list(self.local_bsz_bounds),
            "gradient_accumulation": self.gradient_accumulation,
            "progress": self.progress,
            "last_config": None if self.last_config is None else list(self.last_config),
            "previous_config": None if self.previous_config is None else list(self.previous_config),
        }

    def from_dict(self, d: dict[str, Any]) -> None:
        self.profile = {}
        for r in d["profile"]:
            rec = dict(zip(_FIELDS, map(float, r[3:])))
            # checkpoints from before sampling measured the sync time on every step
            rec.setdefault("optim_sync_count", rec["optim_count"])
            self.profile[int(r[0]), int(r[1]), int(r[2])] = rec
        self.recent = {}
        for r in d.get("recent", ()):  # absent in checkpoints of earlier versions
            optim = deque(((float(a), float(b)) for a, b in r[3]), maxlen=RECENT_STEPS)
            accum = deque(map(float, r[4]), maxlen=RECENT_STEPS)
            self.recent[int(r[0]), int(r[1]), int(r[2])] = (optim, accum)
        self.perf_params = None if d["perf_params"] is None else PerfParams(*d["perf_params"])
        self.grad_params = None if d["grad_params"] is None else tuple(d["grad_params"])
        self.init_batch_size = d["init_batch_size"]
        self.max_batch_size = d["max_batch_size"]
        b = d["local_bsz_bounds"]
        self.local_bsz_bounds = None if b is None else (b[0], b[1])
        self.gradient_accumulation = bool(d["gradient_accumulation"])
        self.progress = float(d["progress"])
        last, prev = d.get("last_config"), d.get("previous_config")
        self.last_config = None if last is None else tuple(int(x) for x in last)
        self.previous_config = None if prev is None else tuple(int(x) for x in prev)
        self.fit_keys, self.fit_total, self.fit_min_samples = None, 0, 0

    def save(self, fileobj: Any) -> None:
        fileobj.write(json.dumps(self.to_dict()).encode())

    def load(self, fileobj: Any) -> None:
        self.from_dict(json.loads(fileobj.read().decode()))


_STATE: _MetricsState | None = None


def _state() -> _MetricsState:
    global _STATE
    if _STATE is None:
        _STATE = _MetricsState()
        _checkpoint.load_state(_STATE)
    return _STATE


def _forget() -> None:
    global _STATE
    _STATE = None


register_reset_hook(_forget)


def _num_replicas() -> int:
    return dist.get_world_size() if dist.is_initialized() else env.num_replicas()


def _num_nodes() -> int:
    return min(max(env.num_nodes(), 1), _num_replicas())


def set_batch_size(
    init_batch_size: int,
    max_batch_size: int | None,
    local_bsz_bounds: tuple[int, int] | None,
    gradient_accumulation: bool,
) -> None:
    """Record the loader's batch-size limits (called by the loader)."""
    if not init_batch_size or init_batch_size < 1:
        raise ValueError(f"init_batch_size={init_batch_size} must be a positive integer")
    if max_batch_size is not None and max_batch_size < init_batch_size:
        raise ValueError(
            f"max_batch_size={max_batch_size} is below init_batch_size={init_batch_size}"
        )
    if local_bsz_bounds is not None:
        lo, hi = local_bsz_bounds
        if (lo is not None and lo < 1) or (lo is not None and hi is not None and hi < lo):
            raise ValueError(f"local_bsz_bounds={local_bsz_bounds} must satisfy 1 ≤ min ≤ max")
    s = _state()
    s.init_batch_size = int(init_batch_size)
    s.max_batch_size = None if max_batch_size is None else int(max_batch_size)
    s.local_bsz_bounds = None if local_bsz_bounds is None else tuple(local_bsz_bounds)
    s.gradient_accumulation = bool(gradient_accumulation)


def profile_step_start(atomic_bsz: int) -> None:
    """Start timing a micro-batch of ``atomic_bsz`` samples on this replica."""
    s = _state()
    s.atomic_bsz = int(atomic_bsz)
    s.step_start = time.perf_counter()
    s.sync_time = None


def profile_sync_time(sync_time: float) -> None:
    """Add time spent waiting for the gradient all-reduce to the step being timed."""
    s = _state()
    s.sync_time = (s.sync_time or 0.0) + float(sync_time)


def profile_step_commit(accumulation_step: bool = False) -> None:
    """Finish timing the micro-batch started by :func:`profile_step_start` (else a no-op)."""
    s = _state()
    if s.step_start is None or s.atomic_bsz is None:
        return
    step_time = time.perf_counter() - s.step_start
    _record(_num_nodes(), _num_replicas(), s.atomic_bsz, step_time, accumulation_step, s.sync_time)
    s.atomic_bsz = None
    s.step_start = None
    s.sync_time = None


def _record(
    num_nodes: int,
    num_replicas: int,
    atomic_bsz: int,
    step_time: float,
    accumulation_step: bool,
    sync_time: float | None = None,
) -> None:
    """Add one timed micro-batch to the profile of its configuration."""
    s = _state()
    key = (num_nodes, num_replicas, atomic_bsz)
    rec = s.profile.get(key)
    if rec is None:
        rec = s.profile[key] = dict.fromkeys(_FIELDS, 0.0)
    recent = s.recent.get(key)
    if recent is None:  # a new configuration, or one restored from an earlier version
        recent = s.recent[key] = (deque(maxlen=RECENT_STEPS), deque(maxlen=RECENT_STEPS))
    optim, accum = recent
    if accumulation_step:
        rec["accum_step_time"] += step_time
        rec["accum_count"] += 1
        accum.append(step_time)
    else:
        rec["optim_step_time"] += step_time
        sync = -1.0
        if sync_time is not None:  # measured on this step
            sync = min(sync_time, step_time)
            # The running mean is the fit's fallback when the recent steps keep no sync time:
            # a stall's wait (measured after a few steps, on sampled steps only) stays out.
            if len(optim) < 5 or step_time <= STALL_FACTOR * statistics.median(x[0] for x in optim):
                rec["optim_sync_time"] += sync
                rec["optim_sync_count"] += 1
        rec["optim_count"] += 1
        optim.append((step_time, sync))


def update_grad_params(sqr: float, var: float) -> None:
    """Latest noise-scale statistics ``(|G|², tr Σ / B0)`` (called after each optimizer step)."""
    _state().grad_params = (float(sqr), float(var))


def update_progress(progress: float) -> None:
    _state().progress = float(progress)


def update_step(progress: float, grad_params: tuple[float, float]) -> None:
    """:func:`update_progress` and :func:`update_grad_params` in one call, for values that
    are Python floats already (AdaptiveDataParallel's report after each optimizer step)."""
    s = _STATE if _STATE is not None else _state()
    s.progress = progress
    s.grad_params = grad_params


def get_progress() -> float:
    """Training progress in scale-invariant iterations (sum of gains)."""
    return _state().progress


def _qualified(min_samples: int) -> list[tuple[tuple[int, int, int], dict[str, float]]]:
    """Profiled configurations with at least ``min_samples`` optimizer steps, in key order."""
    return sorted(
        (k, v) for k, v in _state().profile.items() if v["optim_count"] >= max(min_samples, 1)
    )


def _fit_perf_params(min_samples: int = 1) -> None:
    """Refit PerfParams to the configurations with ≥ ``min_samples`` optimizer steps."""
    s = _state()
    rows = _qualified(min_samples)
    if not rows:
        return
    nodes, replicas, bsz = (np.array(x) for x in zip(*(k for k, _ in rows)))
    accum, optim = np.array([_step_times(k, r) for k, r in rows], dtype=np.float64).T
    accum = np.clip(accum, 1e-9, None)
    optim = np.maximum(optim, accum)
    s.perf_params = fit_perf_params(nodes, replicas, bsz, accum, optim)
    s.fit_keys = tuple(k for k, _ in rows)
    s.fit_total = int(sum(r["optim_count"] for _, r in rows))
    s.fit_min_samples = int(min_samples)


def _stall_free_mean(times: np.ndarray) -> tuple[float, np.ndarray]:
    """Mean of ``times`` without the stalls (> STALL_FACTOR × median), and the kept mask."""
    keep = times <= STALL_FACTOR * np.median(times)
    return float(times[keep].mean()), keep


def _step_times(key: tuple[int, int, int], rec: dict[str, float]) -> tuple[float, float]:
    """``(compute, optimizer step)`` seconds of one configuration, for the fit.

    The optimizer step's compute part is its time minus the mean sync time (measured on sampled
    steps only, it stands for every step), pooled with the accumulation steps by their counts.
    Means are over the recent steps without stalls; over every step timed when the
    configuration has no recent steps (restored from a checkpoint of an earlier version).
    """
    n_accum, n_optim = rec["accum_count"], rec["optim_count"]
    optim = rec["optim_step_time"] / n_optim
    sync = rec["optim_sync_time"] / max(rec["optim_sync_count"], 1)
    accum = rec["accum_step_time"] / n_accum if n_accum else 0.0
    recent_optim, recent_accum = _state().recent.get(key, ((), ()))
    if recent_optim:
        pairs = np.asarray(recent_optim, dtype=np.float64)
        optim, keep = _stall_free_mean(pairs[:, 0])
        measured = pairs[keep, 1]
        measured = measured[measured >= 0]
        if measured.size:
            sync = float(measured.mean())
    if recent_accum and n_accum:
        accum = _stall_free_mean(np.asarray(recent_accum, dtype=np.float64))[0]
    sync = min(sync, optim)
    return (n_accum * accum + n_optim * (optim - sync)) / (n_accum + n_optim), optim


_prefetch_thread: threading.Thread | None = None


def _import_solver() -> None:
    try:
        importlib.import_module("scipy.optimize")
    except Exception:  # pragma: no cover - the fit will raise the error where it matters
        logger.debug("prefetching scipy.optimize failed", exc_info=True)


def prefetch_fit_solver() -> threading.Thread | None:
    """Import the step-time fit's solver (``scipy.optimize``) in a daemon thread, once.

    The import takes 0.3–1 s on a 2-core CPU host. :func:`~adaptrain.core.goodput.fit_perf_params`
    imports it lazily (a restarting replica that never fits should not pay it), so the first
    batch-size decision would pay it on the training's critical path, with every replica waiting
    for rank 0's broadcast. Started when autoscaling is switched on, the import overlaps the first
    profiled steps instead; a fit that comes before it finishes waits for the same module lock.
    The loader waits for it (:func:`wait_for_solver_prefetch`) before forking worker processes.

    Returns:
        The thread, or None when the module is imported already or a prefetch was started
        before in this process.
    """
    global _prefetch_thread
    if _prefetch_thread is not None or "scipy.optimize" in sys.modules:
        return None
    _prefetch_thread = threading.Thread(
        target=_import_solver, name="adaptrain-prefetch-scipy", daemon=True
    )
    _prefetch_thread.start()
    return _prefetch_thread


def wait_for_solver_prefetch() -> None:
    """Block until the import started by :func:`prefetch_fit_solver` has finished.

    Call it before forking processes (data-loader workers): a fork in the middle of an import
    leaves that module's lock held in the child by a thread the child does not have, and the
    child would hang if it imported the same module.
    """
    thread = _prefetch_thread
    if thread is not None and thread.is_alive():
        thread.join()


def get_goodput_fn(
    min_samples: int = MIN_SAMPLES, refit_samples: int = REFIT_SAMPLES
) -> GoodputFunction | None:
    """The goodput model fitted to this job's profile, or None until there is enough data.

    Only configurations with at least ``min_samples`` profiled optimizer steps enter the fit.
    The model is refitted when a configuration newly qualifies, or once ``refit_samples`` new
    optimizer steps of the qualified configurations have been profiled since the last fit.
    The defaults are those of :func:`suggest_batch_size`, so both see the same cached model.
    """
    s = _state()
    if s.grad_params is None or s.init_batch_size is None:
        return None
    rows = _qualified(min_samples)
    keys = tuple(k for k, _ in rows)
    total = int(sum(r["optim_count"] for _, r in rows))
    stale = (
        s.perf_params is None
        or s.fit_keys != keys
        or s.fit_min_samples != int(min_samples)
        or total - s.fit_total >= max(int(refit_samples), 1)
    )
    if rows and stale:
        try:
            _fit_perf_params(min_samples)
        except ValueError as exc:  # degenerate profile (e.g. zero times): wait for more data
            logger.debug("perf params not fitted yet: %s", exc)
    if s.perf_params is None:
        return None
    return GoodputFunction(s.perf_params, s.grad_params, s.init_batch_size)


def suggest_batch_size(
    num_nodes: int,
    num_replicas: int,
    current_atomic_bsz: int,
    current_accum_steps: int,
    min_improvement: float = 0.05,
    *,
    min_samples: int = MIN_SAMPLES,
    max_step: float = MAX_STEP,
    explore_tolerance: float = EXPLORE_TOLERANCE,
    undo_margin: float = UNDO_MARGIN,
    refit_samples: int = REFIT_SAMPLES,
) -> tuple[int, int] | None:
    """Best ``(atomic_bsz, accum_steps)`` if it beats the current one by ``min_improvement``.

    ``accum_steps`` counts micro-batches per optimizer step (≥ 1). Returns None when batch-size
    adaptation is off (no ``max_batch_size`` above the initial batch), the model is not fitted
    yet, or no move passes the rules below. Rules against thrashing and blind jumps:

    * **Evidence first.** Nothing moves until the current configuration has ``min_samples``
      profiled optimizer steps, and only configurations with that many steps enter the fit of
      the step-time model (a size tried for a few noisy steps cannot flip the decision).
      The fit is redone when a configuration qualifies or after ``refit_samples`` new steps.
    * **Bounded step.** A move may change the total batch by at most ``max_step``×, up or
      down (a single replica entering accumulation may grow ``2·max_step``×, it needs two
      micro-batches), and may use micro-batches at most ``max_step``× the largest profiled
      one on this replica count: the model extrapolates at most that far beyond what was
      measured. The job's limits win over the bound: a move from a total below the initial
      batch may grow to it (bounds permitting), one from above ``max_step · max_batch_size``
      (a restart with a smaller one) shrink to ``max_batch_size``, and when no total within
      the bound fits ``local_bsz_bounds`` (or for a single replica without accumulation,
      which only runs the initial batch) the search drops the lower bound.
    * **Hysteresis.** A move needs a predicted gain ``goodput_best / goodput_current − 1`` of
      at least ``min_improvement``; returning to the configuration this job just left needs
      ``min_improvement + undo_margin`` (no 32 → 52 → 32 flips on timing noise).
    * **Exploration.** While only one micro-batch size has been profiled on this replica
      count, the step-time model rests on AdaptDL's prior (half of the step is fixed cost).
      Then the bounded step up (to the initial batch at least; a single replica above it
      through two micro-batches) is *tried* if its predicted goodput is at least
      ``1 − explore_tolerance`` of the current one, so that the next fit has two sizes to
      draw a compute line through instead of a prior.
    """
    if min_improvement < 0:
        raise ValueError(f"min_improvement={min_improvement} must be ≥ 0")
    if current_accum_steps < 1 or current_atomic_bsz < 1:
        raise ValueError(
            f"current_atomic_bsz={current_atomic_bsz} and current_accum_steps="
            f"{current_accum_steps} must be ≥ 1 (accum_steps counts micro-batches per step)"
        )
    if max_step <= 1:
        raise ValueError(f"max_step={max_step} must be > 1 (factor of one bounded move)")
    if not 0 <= explore_tolerance < 1 or undo_margin < 0:
        raise ValueError(
            f"explore_tolerance={explore_tolerance} must lie in [0, 1) and "
            f"undo_margin={undo_margin} must be ≥ 0"
        )
    s = _state()
    if s.max_batch_size is None or s.init_batch_size is None:
        return None
    current = (int(num_nodes), int(num_replicas), int(current_atomic_bsz), int(current_accum_steps))
    if s.last_config is not None and s.last_config != current:
        s.previous_config = s.last_config  # the job moved since the last call
    s.last_config = current
    rec = s.profile.get(current[:3])
    if rec is None or rec["optim_count"] < max(min_samples, 1):
        return None  # dwell: measure the current configuration first
    fn = get_goodput_fn(min_samples, refit_samples)
    if fn is None:
        return None
    profiled = [k[2] for k, _ in _qualified(min_samples) if k[:2] == current[:2]]
    largest = max(profiled, default=current[2])
    lo, hi = s.local_bsz_bounds or (None, None)
    cap = int(max_step * largest)
    hi = max(cap if hi is None else min(hi, cap), lo or 1)  # never below the user's minimum
    lo = lo or 1
    total = num_replicas * current_atomic_bsz * current_accum_steps
    step_total = max_step * total
    if num_replicas == 1 and current_accum_steps == 1 and s.gradient_accumulation:
        step_total *= 2  # a single replica grows through ≥ 2 micro-batches (noise estimate)
    max_batch = max(min(s.max_batch_size, int(step_total)), s.init_batch_size)
    # The shrink is bounded too: ``optimize`` alone searches from the initial batch up.
    min_batch = min(max(total / max_step, s.init_batch_size), max_batch)
    search = {
        "max_batch_size": max_batch,
        "atomic_bsz_range": (lo, hi),
        "accumulation": s.gradient_accumulation,
    }
    best, atomic, extra = fn.optimize(num_nodes, num_replicas, min_batch_size=min_batch, **search)
    if not best > 0 and min_batch > s.init_batch_size:
        # Nothing within the bound fits the micro-batch bounds: the bounds win (see above).
        best, atomic, extra = fn.optimize(num_nodes, num_replicas, **search)
    atomic, accum = int(atomic), int(extra) + 1
    best_atomic, best_accum = atomic, accum
    now = _predicted_goodput(fn, num_nodes, num_replicas, current_atomic_bsz, current_accum_steps)
    reason = "predicted gain"
    if (atomic, accum) == current[2:] or best <= 0:
        atomic = accum = 0
    elif best < now * (1.0 + min_improvement):
        atomic = accum = 0
    elif s.previous_config == (*current[:2], atomic, accum) and best < now * (
        1.0 + min_improvement + undo_margin
    ):
        atomic = accum = 0
    if not atomic and len(set(profiled)) <= 1 and max_batch > total:
        # Exploration: one bounded step up (to the initial batch at least), to measure a
        # second size.
        up = max_batch
        cand = _configuration(up, num_replicas, lo, hi, s.gradient_accumulation, s.init_batch_size)
        if cand is not None and cand[0] not in profiled:
            # its total may lie below the initial batch, as the current one (scored alike)
            value = _predicted_goodput(fn, num_nodes, num_replicas, *cand)
            if value >= (1.0 - explore_tolerance) * now:
                atomic, accum, best, reason = cand[0], cand[1], value, "exploration"
    if not atomic:
        logger.debug(
            "batch size stays (atomic %d × %d): predicted goodput %.4g, best %.4g at (%d × %d)",
            current_atomic_bsz,
            current_accum_steps,
            now,
            best,
            best_atomic,
            best_accum,
        )
        return None
    logger.info(
        "batch size: (atomic %d × %d) → (atomic %d × %d), predicted goodput %.4g → %.4g (%s)",
        current_atomic_bsz,
        current_accum_steps,
        atomic,
        accum,
        now,
        best,
        reason,
    )
    return atomic, accum


def _predicted_goodput(
    fn: GoodputFunction, num_nodes: int, num_replicas: int, atomic_bsz: int, accum_steps: int
) -> float:
    """Goodput of ``(atomic_bsz, accum_steps)`` (micro-batches per step), 0 if not positive.

    A total below the initial batch (bounds forced it, e.g. after a rescale to fewer replicas,
    or a restart with a larger batch size) is scored as throughput × efficiency(total), which
    :meth:`GoodputFunction.evaluate` refuses.
    """
    total = num_replicas * atomic_bsz * accum_steps
    if total >= fn.init_batch_size:
        value = float(fn.evaluate(num_nodes, num_replicas, atomic_bsz, accum_steps - 1))
    else:
        value = float(
            fn.throughput(num_nodes, num_replicas, atomic_bsz, accum_steps - 1)
            * fn.efficiency(total)
        )
    return value if np.isfinite(value) and value > 0 else 0.0


def _configuration(
    batch: int,
    num_replicas: int,
    min_atomic: int,
    max_atomic: int,
    accumulation: bool,
    init_batch_size: float,
) -> tuple[int, int] | None:
    """``(atomic_bsz, accum_steps)`` with a total of at most ``batch`` and a micro-batch in
    ``[min_atomic, max_atomic]``, or None. A single replica without accumulation cannot grow
    (the goodput model keeps it at the initial batch); with accumulation it runs at least two
    micro-batches above the initial batch (as :meth:`GoodputFunction.optimize` does: the
    gradient noise is estimated from them)."""
    if num_replicas == 1 and not accumulation:
        return None
    local = batch // num_replicas
    min_accum = 2 if num_replicas == 1 and local > init_batch_size else 1
    best = None
    accums = {max(1, local // max_atomic), math.ceil(local / max_atomic)}
    for accum in {max(a, min_accum) for a in accums}:
        if accum > 1 and not accumulation:
            continue
        atomic = min(max_atomic, local // accum)
        if atomic >= max(min_atomic, 1) and (best is None or atomic * accum > best[0] * best[1]):
            best = (atomic, accum)
    return best


def _finite(x: Any) -> float | None:
    """``x`` as a float, or None when it is not a finite number."""
    try:
        value = float(x)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def sched_hints(
    atomic_bsz: int | None = None, accum_steps: int | None = None
) -> dict[str, Any] | None:
    """The scheduling hints of this replica's metrics (AdaptDL's fields, in its names), or None
    before the training loader has set its batch size.

    ``initBatchSize``, ``maxBatchSize``, ``localBszBounds``, ``maxProfiledReplicas``,
    ``gradientAccumulation``, ``gradParams`` (``{"norm": |G|², "var"}``, clipped at 0),
    ``perfParams`` (the last fit; none is done here), ``profile`` (per configuration: the mean
    optimizer-step and sync times and the step count) and, given the current micro-batch
    ``atomic_bsz`` and ``accum_steps``, ``batchSize``, ``atomicBsz``, ``accumSteps``, ``gain``,
    ``goodput`` and ``throughput`` (the last two when the model is fitted). Every number is
    finite; what is not is None.
    """
    s = _state()
    if s.init_batch_size is None:
        return None
    init = int(s.init_batch_size)
    max_bsz = s.max_batch_size
    bounds = None
    if s.local_bsz_bounds is not None:
        lo, hi = s.local_bsz_bounds
        lo = int(lo or 1)
        hi = hi if hi is not None else max_bsz
        bounds = None if hi is None else [lo, max(int(hi), lo)]
    grad = None
    if s.grad_params is not None:
        sqr, var = (_finite(v) for v in s.grad_params)
        if sqr is not None and var is not None:
            grad = {"norm": max(sqr, 0.0), "var": max(var, 0.0)}
    perf = None
    if s.perf_params is not None:
        values = [_finite(v) for v in s.perf_params]
        if all(v is not None for v in values):
            perf = dict(zip(PerfParams._fields, values))
    profile = []
    for (nodes, replicas, bsz), rec in sorted(s.profile.items()):
        count = int(rec["optim_count"])
        step = _finite(rec["optim_step_time"] / count) if count else None
        if step is None or step <= 0:
            continue
        sync = _finite(rec["optim_sync_time"] / max(rec["optim_sync_count"], 1)) or 0.0
        profile.append(
            {
                "numNodes": int(nodes),
                "numReplicas": int(replicas),
                "atomicBsz": int(bsz),
                "stepTime": step,
                "syncTime": min(max(sync, 0.0), step),
                "count": count,
            }
        )
    hints: dict[str, Any] = {
        "initBatchSize": init,
        "maxBatchSize": None if max_bsz is None else int(max_bsz),
        "localBszBounds": bounds,
        "maxProfiledReplicas": max((k[1] for k in s.profile), default=0),
        "gradientAccumulation": bool(s.gradient_accumulation),
        "gradParams": grad,
        "perfParams": perf,
        "profile": profile,
        "batchSize": None,
        "atomicBsz": None,
        "accumSteps": None,
        "gain": None,
        "goodput": None,
        "throughput": None,
    }
    if atomic_bsz and accum_steps:
        replicas, nodes = _num_replicas(), _num_nodes()
        batch = int(atomic_bsz) * int(accum_steps) * replicas
        hints.update(batchSize=batch, atomicBsz=int(atomic_bsz), accumSteps=int(accum_steps))
        if grad is not None:
            hints["gain"] = _finite(_gns.gain(grad["norm"], grad["var"], batch / init))
        if perf is not None and grad is not None:
            fn = GoodputFunction(s.perf_params, s.grad_params, init)
            args = (nodes, replicas, int(atomic_bsz), int(accum_steps) - 1)
            hints["throughput"] = _finite(fn.throughput(*args))
            if batch >= init:
                hints["goodput"] = _finite(fn.evaluate(*args))
    return hints
