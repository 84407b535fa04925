"""Gradient noise scale (GNS) tracking for :class:`~adaptrain.torch.AdaptiveDataParallel`.

The statistics are ``sqr = |G|²`` (squared norm of the true gradient) and ``var = tr(Σ)/B0``
(gradient variance at the initial batch size ``B0``), as in McCandlish et al. (2018,
arXiv:1812.06162) and AdaScale (Johnson et al., 2020, arXiv:2007.05105). They are collected
WITHOUT per-parameter backward hooks: a DDP communication hook (:func:`gns_allreduce_hook`)
sees every gradient bucket once per optimizer step,

* before the all-reduce it computes the local bucket norm² ``|g_i|²`` (``R ≥ 2`` replicas), or
  for a single replica the norm² of the bucket, of the previous step's bucket and their dot
  product (the consecutive-step estimator keeps the previous gradient, ``count = 2``);
* the smallest bucket of each step also carries the previous step's local norm² (two float32
  elements appended to a copy of it), so the replicas' norms are summed without any extra
  collective.

Once per step (:meth:`GradientNoiseScale.finish_step`, in the optimizer's step pre-hook) the
norm² of the averaged buckets is taken, the values are unscaled by the mixed-precision loss
scale², and the *previous* step's measurements (whose replica sum has arrived meanwhile) become
unbiased samples by :func:`adaptrain.core.gns.unbiased_estimate` with ``count = R`` (the
accumulated local gradient of each replica is one sample of ``local_bsz·accum_steps``
samples), folded into debiased EMAs (:func:`adaptrain.core.gns.ema_update`, smoothing
``0.999 ** scale`` as AdaptDL). Samples with non-finite values are skipped.
"""

from __future__ import annotations

import logging
import math
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from adaptrain.core import gns as _gns

__all__ = ["GradientNoiseScale", "gns_allreduce_hook"]

logger = logging.getLogger(__name__)


def _sqnorm(t: torch.Tensor) -> torch.Tensor:
    """``|t|²`` as a 0-dim tensor (BLAS dot, no temporary; half precision upcast)."""
    if t.dtype not in (torch.float32, torch.float64):
        t = t.float()
    return torch.dot(t, t)


def _encode(x: float) -> torch.Tensor:
    """A float64 as two float32 (high, low) that survive a float32 sum all-reduce."""
    hi = float(np.float32(x))
    return torch.tensor([hi, x - hi], dtype=torch.float32)


def _decode(t: torch.Tensor) -> float:
    hi, lo = t.tolist()
    return hi + lo


class _HookState:
    """Per-step buffers shared by the communication hook and the estimator (not checkpointed)."""

    def __init__(self, process_group: Any, world_size: int) -> None:
        self.process_group = process_group
        self.world_size = world_size
        self.enabled = True
        self.divisor = float(world_size)  # replicas × loader accumulation steps
        self.scaler: Any = None  # the enabled GradScaler of this step, if any
        self.inv_scale: torch.Tensor | None = None  # 1 / loss scale, captured at hook time
        self.local: dict[int, torch.Tensor] = {}  # |bucket|² before the all-reduce
        self.results: dict[int, torch.Tensor] = {}  # the all-reduced buckets (R ≥ 2)
        self.prev_sq: dict[int, torch.Tensor] = {}
        self.cross: dict[int, torch.Tensor] = {}
        self.prev: dict[int, tuple[tuple[int, ...], torch.Tensor]] = {}  # single replica
        self.num_buckets_seen = 0
        # The previous step's local norm², piggybacked on this step's smallest bucket (R ≥ 2).
        self.carry: torch.Tensor | None = None
        self.carried: torch.Tensor | None = None  # ... and its all-reduced value
        self.send: dict[int, torch.Tensor] = {}  # reused send buffers of carrying buckets
        self.sizes: dict[int, int] = {}  # bucket sizes seen this step
        self.carry_idx: int | None = None  # the smallest bucket carries (cheapest copy)
        self.t_last_hook = 0.0  # when the last bucket was handed to the hook
        self.t_done = 0.0  # when its all-reduce completed

    def reset_step(self) -> None:
        self.local = {}
        self.results = {}
        self.prev_sq = {}
        self.cross = {}
        self.inv_scale = None
        self.num_buckets_seen = 0
        self.sizes = {}


def gns_allreduce_hook(state, bucket):  # no annotations: DDP checks them literally
    """DDP communication hook: averaging all-reduce plus the noise-scale norms of the bucket.

    Divides the bucket by ``state.divisor`` (replicas × loader accumulation steps, so that the
    update is the mean gradient, as AdaptDL's accumulation does), records ``|bucket|²``, and
    all-reduces it; the smallest bucket of a step also carries the previous step's local norm²
    (two extra float32 elements), so no collective is added. Gradients are bit-identical to
    DDP's default hook when ``divisor`` is the world size.
    """
    buf = bucket.buffer()
    buf.div_(state.divisor)
    group = state.process_group
    if not state.enabled:
        return (
            dist.all_reduce(buf, group=group, async_op=True)
            .get_future()
            .then(lambda f: f.value()[0])
        )
    idx = bucket.index()
    state.num_buckets_seen += 1
    if state.scaler is not None and state.inv_scale is None:
        # The loss scale of this backward (GradScaler creates it lazily in scale()); a copy,
        # since update() changes it in place after the step.
        scale = getattr(state.scaler, "_scale", None)
        if scale is not None:
            state.inv_scale = 1.0 / scale.detach().double()
    if state.world_size == 1:
        inv = state.inv_scale
        cur = buf if inv is None else buf * inv.to(buf.dtype)
        # DDP may rebuild its buckets (other parameter order): compare like with like.
        layout = tuple(id(p) for p in bucket.parameters())
        sig, prev = state.prev.get(idx, (None, None))
        if prev is not None and sig == layout and prev.shape == cur.shape:
            state.local[idx] = _sqnorm(cur)
            state.prev_sq[idx] = _sqnorm(prev)
            state.cross[idx] = torch.dot(cur.float(), prev.float())
            prev.copy_(cur)
        else:
            state.prev[idx] = (layout, cur.detach().clone())
        return (
            dist.all_reduce(buf, group=group, async_op=True)
            .get_future()
            .then(lambda f: f.value()[0])
        )
    state.local[idx] = _sqnorm(buf)  # = |g_i|² / R²
    is_last = bucket.is_last()
    if is_last:
        state.t_last_hook = time.perf_counter()
    state.sizes[idx] = buf.numel()
    carry = state.carry
    if (
        carry is not None
        and (state.carry_idx is None or idx == state.carry_idx)
        and buf.dtype in (torch.float32, torch.float64)
    ):
        state.carry = None
        n = buf.numel()
        big = state.send.get(idx)
        if big is None or big.numel() != n + 2 or big.dtype != buf.dtype:
            big = state.send[idx] = torch.empty(n + 2, dtype=buf.dtype, device=buf.device)
        big[:n].copy_(buf)  # a reused buffer: no large allocation per step
        big[n:].copy_(carry)

        def _split(f: torch.futures.Future) -> torch.Tensor:
            out = f.value()[0]
            state.carried = out[n:].clone()  # the buffer is reused next step
            state.results[idx] = out[:n]  # a prefix view: storage offset 0, as DDP needs
            if is_last:
                state.t_done = time.perf_counter()
            return out[:n]

        return dist.all_reduce(big, group=group, async_op=True).get_future().then(_split)

    def _keep(f: torch.futures.Future) -> torch.Tensor:
        out = f.value()[0]
        state.results[idx] = out
        if is_last:
            state.t_done = time.perf_counter()
        return out

    return dist.all_reduce(buf, group=group, async_op=True).get_future().then(_keep)


class GradientNoiseScale:
    """Tracks the gradient noise scale of an :class:`AdaptiveDataParallel` model.

    API-compatible with ``adaptdl.torch.gradient_noise_scale.GradientNoiseScale``: ``sqr_avg()``,
    ``var_avg()``, ``gain(scale)``, ``get_progress()``/``set_progress()``, ``raw_sqr_avg``,
    ``raw_var_avg``, ``accum_scale``, ``accum_count``. Unlike AdaptDL, the statistics are one
    scalar over all parameter groups (they come from DDP buckets, which mix groups).

    Update rule per optimizer step with ``R`` replicas and total scale ``S = B/B0``::

        L = mean_i |g_i|²,  T = |mean_i g_i|²          (R ≥ 2, count = R)
        L = (|g_t|² + |g_{t-1}|²)/2,  T = |(g_t + g_{t-1})/2|²   (R = 1, count = 2, scale 2S)
        (sqr, var) = unbiased_estimate(L, T, count, S_count / count)
        ema ← 0.999^S_count · ema + (1 − 0.999^S_count) · sample   (debiased)

    Progress (scale-invariant iterations) grows by ``gain(S)`` per optimizer step.

    Args:
        adp: the owning model (kept for API compatibility; may be None).
        optimizer: the optimizer (kept for API compatibility; may be None).
        mp_scaler: a ``torch.amp.GradScaler`` whose scale multiplies the gradients, or None.
        num_replicas: replicas ``R`` (default: the process group's world size, else 1).
        accum_scale: scale of one micro-batch over all replicas, ``R·local_bsz/B0`` (default 1:
            the whole step is the initial batch).
        smoothing: EMA smoothing per unit of scale (AdaptDL: 0.999).
    """

    def __init__(
        self,
        adp: Any = None,
        optimizer: torch.optim.Optimizer | None = None,
        mp_scaler: Any = None,
        num_replicas: int | None = None,
        accum_scale: float | None = None,
        smoothing: float = 0.999,
    ) -> None:
        if num_replicas is None:
            num_replicas = dist.get_world_size() if dist.is_initialized() else 1
        if num_replicas < 1:
            raise ValueError(f"num_replicas={num_replicas} must be ≥ 1")
        if not 0.0 <= smoothing < 1.0:
            raise ValueError(f"smoothing={smoothing} must lie in [0, 1)")
        self._adp = adp
        self._optimizer = optimizer
        self._mp_scaler = mp_scaler
        self._num_replicas = int(num_replicas)
        self._accum_scale = float(accum_scale) if accum_scale else 1.0
        self._accum_count = 0
        self._smoothing = smoothing
        self._sqr = _gns.ema_init(0.0)
        self._var = _gns.ema_init(0.0)
        self._progress = 0.0
        self._biased = False
        self._prev_scale: float | None = None
        self._hook_state: _HookState | None = None
        self._pending: SimpleNamespace | None = None  # last step's measurements, not folded yet

    # ----- AdaptDL-compatible accessors -------------------------------------------------------
    @property
    def accum_scale(self) -> float:
        return self._accum_scale

    @property
    def accum_count(self) -> int:
        return self._accum_count

    @property
    def should_zero_grad(self) -> bool:
        return self._accum_count == 0

    def set_accum_scale(self, accum_scale: float) -> None:
        if not accum_scale > 0:
            raise ValueError(f"accum_scale={accum_scale} must be positive")
        self._accum_scale = float(accum_scale)

    def reset_accumulation(self) -> None:
        """Forget the micro-batches counted for the current step."""
        self._accum_count = 0

    @property
    def raw_sqr_avg(self) -> np.ndarray:
        return np.array([float(_gns.ema_value(self._sqr))])

    @property
    def raw_var_avg(self) -> np.ndarray:
        return np.array([float(_gns.ema_value(self._var))])

    def sqr_avg(self) -> float:
        """Estimate of ``|G|²``, the squared l2-norm of the true gradient (clipped at 0)."""
        return max(float(_gns.ema_value(self._sqr)), 0.0)

    def var_avg(self) -> float:
        """Estimate of ``tr(Σ)/B0``, the gradient variance at the initial batch size (≥ 0)."""
        return max(float(_gns.ema_value(self._var)), 0.0)

    def gain(self, scale: float) -> float:
        """AdaScale gain ``(var + sqr)/(var/scale + sqr)`` at ``scale`` (1 before any estimate)."""
        # core.gns.gain's formula on Python floats (its numpy path costs ~20 µs per call, and
        # this runs twice per optimizer step); test_gns checks that both agree.
        sqr, var = self.sqr_avg(), self.var_avg()
        denom = var / scale + sqr
        return (var + sqr) / denom if denom > 0 else 1.0

    def get_progress(self) -> float:
        return self._progress

    def set_progress(self, progress: float) -> None:
        self._progress = float(progress)

    @property
    def num_updates(self) -> int:
        """Number of samples folded into the averages."""
        return self._sqr.count

    # ----- collection --------------------------------------------------------------------------
    def register(self, ddp: torch.nn.parallel.DistributedDataParallel) -> None:
        """Install :func:`gns_allreduce_hook` as ``ddp``'s communication hook."""
        group = ddp.process_group
        ws = dist.get_world_size(group)
        if ws != self._num_replicas:
            raise RuntimeError(
                f"GradientNoiseScale has num_replicas={self._num_replicas} but the DDP process "
                f"group has {ws}; construct it with num_replicas={ws}"
            )
        self._hook_state = _HookState(group, ws)
        ddp.register_comm_hook(self._hook_state, gns_allreduce_hook)

    def begin_step(self, accum_steps: int = 1, enabled: bool = True) -> None:
        """Prepare the hook for the synchronising backward of a new optimizer step.

        Args:
            accum_steps: micro-batches averaged into this step by the loader (the hook divides
                the gradient by ``replicas × accum_steps``).
            enabled: collect statistics this step.
        """
        hs = self._hook_state
        if hs is None:
            return
        hs.reset_step()
        hs.enabled = enabled
        hs.divisor = float(hs.world_size * max(int(accum_steps), 1))
        scaler = self._mp_scaler
        hs.scaler = scaler if (enabled and scaler is not None and scaler.is_enabled()) else None

    def count_micro_batch(self) -> None:
        self._accum_count += 1

    def finish_step(self, scale: float) -> bool:
        """End of an optimizer step: fold the *previous* step's measurements into the averages.

        The statistics lag one step: the replicas' local norms of step ``t`` travel with the
        smallest gradient bucket of step ``t+1`` (no extra collective, nothing waited for); a
        one-step lag in an EMA over ~1000 steps is immaterial. :meth:`flush` folds the last
        step in as well.

        Args:
            scale: total scale ``S = B/B0`` of this step (global batch over initial batch).

        Returns:
            True when a sample was folded in.
        """
        hs = self._hook_state
        self._accum_count = 0
        taken = self._fold_pending(collective_ok=True)
        if hs is not None and hs.enabled and hs.num_buckets_seen > 0:
            self._pending = self._package(hs, scale)
            if hs.world_size > 1:
                hs.carry = _encode(self._pending.local)
                if hs.sizes:
                    hs.carry_idx = min(hs.sizes, key=hs.sizes.__getitem__)
            hs.reset_step()  # consumed: a second optimizer.step() must not count it again
        return taken

    def flush(self) -> bool:
        """Fold the pending step in now. Collective: call it on every replica at once."""
        taken = self._fold_pending(collective_ok=True)
        if self._hook_state is not None:
            self._hook_state.carry = None
        return taken

    def _package(self, hs: _HookState, scale: float) -> SimpleNamespace:
        inv2 = 1.0 if hs.inv_scale is None else float(hs.inv_scale) ** 2
        ws = hs.world_size
        if ws > 1:
            complete = bool(hs.local) and len(hs.results) == len(hs.local)
            local = sum(float(v) for v in hs.local.values()) * ws * ws * inv2
            total = sum(float(_sqnorm(r)) for r in hs.results.values()) * inv2
            return SimpleNamespace(
                world_size=ws, complete=complete, local=local, total=total, scale=float(scale)
            )
        complete = bool(hs.local) and len(hs.local) == hs.num_buckets_seen
        return SimpleNamespace(
            world_size=1,
            complete=complete,
            scale=float(scale),
            cur=sum(float(v) for v in hs.local.values()),
            prev=sum(float(v) for v in hs.prev_sq.values()),
            cross=sum(float(v) for v in hs.cross.values()),
        )

    def _fold_pending(self, collective_ok: bool) -> bool:
        pend, self._pending = self._pending, None
        if pend is None:
            return False
        if pend.world_size > 1:
            hs = self._hook_state
            if hs is not None and hs.carried is not None:
                reduced = _decode(hs.carried)
                hs.carried = None
            else:  # the carrying bucket never ran (e.g. half-precision buckets): reduce now
                t = _encode(pend.local)
                dist.all_reduce(t, group=hs.process_group if hs is not None else None)
                reduced = _decode(t)
                if hs is not None:
                    hs.carry = None
            pend.local = reduced / pend.world_size
        return self._take_sample(pend)

    @property
    def last_sync_time(self) -> float:
        """Seconds between the last bucket's hook and the end of its all-reduce (last step)."""
        hs = self._hook_state
        if hs is None or hs.t_done < hs.t_last_hook:
            return 0.0
        return hs.t_done - hs.t_last_hook

    def _take_sample(self, pkg: SimpleNamespace, scale: float | None = None) -> bool:
        scale = pkg.scale
        if pkg.world_size > 1:
            if not pkg.complete:
                return False
            count = pkg.world_size
            local, total = pkg.local, pkg.total
            step_scale = scale
            biased = False
        else:
            # Consecutive-step estimator on unscaled gradients (count = 2).
            if (
                not pkg.complete
                or self._prev_scale is None
                or not math.isclose(self._prev_scale, scale, rel_tol=1e-9)
            ):
                # First step, or the previous gradient came from another batch size.
                self._prev_scale = scale
                return False
            count = 2
            local = (pkg.cur + pkg.prev) / 2.0
            total = (pkg.cur + pkg.prev + 2.0 * pkg.cross) / 4.0
            step_scale = 2.0 * scale
            biased = True
        self._prev_scale = scale
        if not (math.isfinite(local) and math.isfinite(total)):
            logger.warning("GradientNoiseScale: non-finite gradient statistics, sample skipped")
            return False
        if biased != self._biased:
            # Switching estimator (e.g. after a restart on another replica count): start over.
            self._sqr = _gns.ema_init(0.0)
            self._var = _gns.ema_init(0.0)
            self._biased = biased
        est = _gns.unbiased_estimate(local, total, count, step_scale / count)
        theta = self._smoothing**step_scale
        self._sqr = _gns.ema_update(self._sqr, est.sqr, theta)
        self._var = _gns.ema_update(self._var, est.var, theta)
        return True

    # ----- checkpointing -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Averages, progress and estimator mode (numbers only).

        The step still pending is not included: call :meth:`flush` on every replica first
        (AdaptiveDataParallel's checkpoint does, in its State's collective ``sync()``).
        """
        return {
            "sqr": tuple(self._sqr),
            "var": tuple(self._var),
            "progress": self._progress,
            "biased": self._biased,
            "prev_scale": self._prev_scale,
            "accum_scale": self._accum_scale,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._sqr = _gns.EMAState(*state["sqr"])
        self._var = _gns.EMAState(*state["var"])
        self._progress = float(state["progress"])
        self._biased = bool(state["biased"])
        self._prev_scale = state["prev_scale"]
        self._accum_scale = float(state["accum_scale"])
