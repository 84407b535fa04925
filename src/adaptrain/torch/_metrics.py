"""Step-time profile, gradient statistics and goodput-driven batch-size choice (rank-local).

The :class:`~adaptrain.torch.data.AdaptiveDataLoader` brackets every micro-batch with
:func:`profile_step_start` / :func:`profile_step_commit`; :class:`AdaptiveDataParallel` reports
the all-reduce wait (:func:`profile_sync_time`), the noise-scale statistics
(:func:`update_grad_params`) and the progress (:func:`update_progress`). The profile is kept per
configuration ``(num_nodes, num_replicas, atomic_bsz)`` as sums and counts of accumulation-step
and optimizer-step times; :func:`get_goodput_fn` refits
:class:`~adaptrain.core.goodput.PerfParams` with :func:`~adaptrain.core.goodput.fit_perf_params`
whenever new optimizer steps were profiled, and :func:`suggest_batch_size` maximises
:meth:`GoodputFunction.optimize` with hysteresis: it proposes a new ``(atomic_bsz, accum_steps)``
only if the predicted goodput beats the current configuration's by ``min_improvement`` (5%).

Like AdaptDL, the non-synchronising part of an optimizer step (step time − sync time) counts as
an accumulation-step sample, so a job that never accumulates still fits the compute model.
Everything is checkpointed as the State ``"adaptdl-metrics"`` (JSON: numbers only).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import numpy as np
import torch.distributed as dist

import adaptrain.checkpoint as _checkpoint
from adaptrain import env
from adaptrain.core.goodput import GoodputFunction, PerfParams, fit_perf_params
from adaptrain.dist.checkpoint import register_reset_hook

__all__ = [
    "set_batch_size",
    "profile_step_start",
    "profile_sync_time",
    "profile_step_commit",
    "update_grad_params",
    "update_progress",
    "get_progress",
    "get_goodput_fn",
    "suggest_batch_size",
]

logger = logging.getLogger(__name__)

_FIELDS = ("accum_step_time", "accum_count", "optim_step_time", "optim_sync_time", "optim_count")


class _MetricsState(_checkpoint.State):
    def __init__(self) -> None:
        super().__init__("adaptdl-metrics")
        self.profile: dict[tuple[int, int, int], dict[str, float]] = {}
        self.perf_params: PerfParams | None = None
        self.grad_params: tuple[float, float] | None = None
        self.init_batch_size: int | None = None
        self.max_batch_size: int | None = None
        self.local_bsz_bounds: tuple[int, int] | None = None
        self.gradient_accumulation = False
        self.progress = 0.0
        self.dirty = False  # profile changed since the last fit
        # Not checkpointed: the step being timed.
        self.atomic_bsz: int | None = None
        self.step_start: float | None = None
        self.sync_time = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "profile": [[*k, *(v.get(f, 0.0) for f in _FIELDS)] for k, v in self.profile.items()],
            "perf_params": None if self.perf_params is None else list(self.perf_params),
            "grad_params": None if self.grad_params is None else list(self.grad_params),
            "init_batch_size": self.init_batch_size,
            "max_batch_size": self.max_batch_size,
            "local_bsz_bounds": None
            if self.local_bsz_bounds is None
            else list(self.local_bsz_bounds),
            "gradient_accumulation": self.gradient_accumulation,
            "progress": self.progress,
        }

    def from_dict(self, d: dict[str, Any]) -> None:
        self.profile = {
            (int(r[0]), int(r[1]), int(r[2])): dict(zip(_FIELDS, map(float, r[3:])))
            for r in d["profile"]
        }
        self.perf_params = None if d["perf_params"] is None else PerfParams(*d["perf_params"])
        self.grad_params = None if d["grad_params"] is None else tuple(d["grad_params"])
        self.init_batch_size = d["init_batch_size"]
        self.max_batch_size = d["max_batch_size"]
        b = d["local_bsz_bounds"]
        self.local_bsz_bounds = None if b is None else (b[0], b[1])
        self.gradient_accumulation = bool(d["gradient_accumulation"])
        self.progress = float(d["progress"])
        self.dirty = False

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
    s.sync_time = 0.0


def profile_sync_time(sync_time: float) -> None:
    """Add time spent waiting for the gradient all-reduce to the step being timed."""
    _state().sync_time += float(sync_time)


def profile_step_commit(accumulation_step: bool = False) -> None:
    """Finish timing the micro-batch started by :func:`profile_step_start` (else a no-op)."""
    s = _state()
    if s.step_start is None or s.atomic_bsz is None:
        return
    step_time = time.perf_counter() - s.step_start
    _record(_num_nodes(), _num_replicas(), s.atomic_bsz, step_time, accumulation_step, s.sync_time)
    s.atomic_bsz = None
    s.step_start = None
    s.sync_time = 0.0


def _record(
    num_nodes: int,
    num_replicas: int,
    atomic_bsz: int,
    step_time: float,
    accumulation_step: bool,
    sync_time: float = 0.0,
) -> None:
    """Add one timed micro-batch to the profile of its configuration."""
    s = _state()
    rec = s.profile.setdefault((num_nodes, num_replicas, atomic_bsz), dict.fromkeys(_FIELDS, 0.0))
    if accumulation_step:
        rec["accum_step_time"] += step_time
        rec["accum_count"] += 1
    else:
        rec["optim_step_time"] += step_time
        rec["optim_sync_time"] += min(sync_time, step_time)
        rec["optim_count"] += 1
        s.dirty = True


def update_grad_params(sqr: float, var: float) -> None:
    """Latest noise-scale statistics ``(|G|², tr Σ / B0)`` (called after each optimizer step)."""
    _state().grad_params = (float(sqr), float(var))


def update_progress(progress: float) -> None:
    _state().progress = float(progress)


def get_progress() -> float:
    """Training progress in scale-invariant iterations (sum of gains)."""
    return _state().progress


def _fit_perf_params() -> None:
    s = _state()
    rows = [(k, v) for k, v in s.profile.items() if v["optim_count"] > 0]
    if not rows:
        return
    nodes, replicas, bsz = (np.array(x) for x in zip(*(k for k, _ in rows)))
    v = {f: np.array([r[f] for _, r in rows], dtype=np.float64) for f in _FIELDS}
    accum = (v["accum_step_time"] + v["optim_step_time"] - v["optim_sync_time"]) / (
        v["accum_count"] + v["optim_count"]
    )
    optim = v["optim_step_time"] / v["optim_count"]
    accum = np.clip(accum, 1e-9, None)
    optim = np.maximum(optim, accum)
    s.perf_params = fit_perf_params(nodes, replicas, bsz, accum, optim)
    s.dirty = False


def get_goodput_fn() -> GoodputFunction | None:
    """The goodput model fitted to this job's profile, or None until there is enough data."""
    s = _state()
    if s.grad_params is None or s.init_batch_size is None:
        return None
    if s.dirty or s.perf_params is None:
        try:
            _fit_perf_params()
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
) -> tuple[int, int] | None:
    """Best ``(atomic_bsz, accum_steps)`` if it beats the current one by ``min_improvement``.

    ``accum_steps`` counts micro-batches per optimizer step (≥ 1). Returns None when batch-size
    adaptation is off (no ``max_batch_size`` above the initial batch), the model is not fitted
    yet, or the predicted gain ``goodput_best / goodput_current − 1`` is below
    ``min_improvement`` (hysteresis against thrashing).
    """
    if min_improvement < 0:
        raise ValueError(f"min_improvement={min_improvement} must be ≥ 0")
    if current_accum_steps < 1 or current_atomic_bsz < 1:
        raise ValueError(
            f"current_atomic_bsz={current_atomic_bsz} and current_accum_steps="
            f"{current_accum_steps} must be ≥ 1 (accum_steps counts micro-batches per step)"
        )
    s = _state()
    if s.max_batch_size is None or s.init_batch_size is None:
        return None
    fn = get_goodput_fn()
    if fn is None:
        return None
    best, atomic, extra = fn.optimize(
        num_nodes,
        num_replicas,
        max_batch_size=s.max_batch_size,
        atomic_bsz_range=s.local_bsz_bounds,
        accumulation=s.gradient_accumulation,
    )
    atomic, accum = int(atomic), int(extra) + 1
    if (atomic, accum) == (int(current_atomic_bsz), int(current_accum_steps)) or best <= 0:
        return None
    current = float(
        fn.evaluate(num_nodes, num_replicas, current_atomic_bsz, current_accum_steps - 1)
    )
    if np.isfinite(current) and current > 0 and best < current * (1.0 + min_improvement):
        return None
    logger.info(
        "batch size: (atomic %d × %d) → (atomic %d × %d), predicted goodput %.4g → %.4g",
        current_atomic_bsz,
        current_accum_steps,
        atomic,
        accum,
        current,
        best,
    )
    return atomic, accum
