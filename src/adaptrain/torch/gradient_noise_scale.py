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
norm² of the averaged buckets is taken (that of the carrying bucket during the next step's
all-reduce, from the second of two send buffers used in turn), the values are unscaled by the mixed-precision loss
scale², and the *previous* step's measurements (whose replica sum has arrived meanwhile) become
unbiased samples by :func:`adaptrain.core.gns.unbiased_estimate` with ``count = R`` (the
accumulated local gradient of each replica is one sample of ``local_bsz·accum_steps``
samples), folded into debiased EMAs (:func:`adaptrain.core.gns.ema_update`, smoothing
``0.999 ** scale`` as AdaptDL once enough history is seen; before that a memory growing with
the history, :func:`adaptrain.core.gns.window_smoothing`). Samples with non-finite values are
skipped.
"""

from __future__ import annotations

import logging
import math
import time
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


class _SendBuffer:
    """A reused ``n + 2`` element send buffer for the bucket that carries the previous norms.

    ``head`` (the first ``n`` elements, storage offset 0 as DDP needs) receives the bucket,
    ``tail`` the carried value as a (high, low) float pair. On the CPU ``tail_np`` is a numpy
    view of ``tail``: writing and reading two floats through it costs ~0.1 µs instead of a
    tensor allocation and two dispatches.
    """

    __slots__ = ("n", "dtype", "big", "head", "tail", "tail_np")

    def __init__(self, n: int, like: torch.Tensor) -> None:
        self.n = n
        self.dtype = like.dtype
        self.big = torch.empty(n + 2, dtype=like.dtype, device=like.device)
        self.head = self.big[:n]
        self.tail = self.big[n:]
        self.tail_np = self.tail.numpy() if like.device.type == "cpu" else None

    def put_carry(self, x: float) -> None:
        t = self.tail_np
        if t is not None:
            t[0] = x  # rounds to the buffer's dtype: the high part
            t[1] = x - float(t[0])
        else:
            self.tail.copy_(_encode(x).to(self.dtype))

    def get_carry(self) -> float:
        t = self.tail_np
        if t is not None:
            return float(t[0]) + float(t[1])
        return _decode(self.tail.double())


class _HookState:
    """Per-step buffers shared by the communication hook and the estimator (not checkpointed).

    With ``R ≥ 2`` replicas the hook appends one 0-dim tensor per bucket to ``local``
    (``|g_i|²/R²`` before the all-reduce) and its all-reduce output to ``results`` (in hook
    order, so every replica sums in the same order); the future's callback marks completion in
    ``done``. Plain lists, reduced once per step in :meth:`GradientNoiseScale.finish_step`.
    """

    def __init__(self, process_group: Any, world_size: int) -> None:
        self.process_group = process_group
        self.world_size = world_size
        self.enabled = True
        self.divisor = float(world_size)  # replicas × loader accumulation steps
        self.scaler: Any = None  # the enabled GradScaler of this step, if any
        self.inv_scale: torch.Tensor | None = None  # 1 / loss scale, captured at hook time
        self.local: list[torch.Tensor] = []  # |bucket / divisor|² before the all-reduce (R ≥ 2)
        self.local_raw: list[torch.Tensor] = []  # |bucket|² of the carrying bucket (undivided)
        self.results: list[torch.Tensor] = []  # the buckets' all-reduce outputs (R ≥ 2)
        self.done: list[bool] = []  # one entry per completed all-reduce (R ≥ 2)
        # single replica: per bucket index
        self.local1: dict[int, torch.Tensor] = {}
        self.prev_sq: dict[int, torch.Tensor] = {}
        self.cross: dict[int, torch.Tensor] = {}
        self.prev: dict[int, tuple[tuple[int, ...], torch.Tensor]] = {}
        self.num_buckets_seen = 0
        # The previous step's local norm², piggybacked on this step's smallest bucket (R ≥ 2).
        self.carry: float | None = None
        self.carried: float | None = None  # ... and its all-reduced value
        # Reused send buffers of carrying buckets, two per bucket used in turn (key: index,
        # parity), so that the last carrying bucket's output survives the next step's hook.
        self.send: dict[tuple[int, int], _SendBuffer] = {}
        self.parity = 0
        self.carry_head: torch.Tensor | None = None  # this step's carrying-bucket output
        # The previous step's carrying-bucket output whose norm² is still to be taken (the next
        # carrying hook takes it while its all-reduce runs), and that norm².
        self.deferred: torch.Tensor | None = None
        self.deferred_norm: torch.Tensor | None = None
        self.min_size = -1  # size and index of the smallest bucket seen this step
        self.min_idx = -1
        self.carry_idx: int | None = None  # the smallest bucket carries (cheapest copy)
        self.t_last_hook = 0.0  # when the last bucket was handed to the hook
        self.t_done = 0.0  # when its all-reduce completed

    def reset_step(self) -> None:
        self.local = []
        self.local_raw = []
        self.results = []
        self.done = []
        self.carry_head = None
        if self.world_size == 1:
            self.local1 = {}
            self.prev_sq = {}
            self.cross = {}
        self.inv_scale = None
        self.num_buckets_seen = 0
        self.min_size = -1
        self.min_idx = -1


def _first(f: torch.futures.Future) -> torch.Tensor:
    return f.value()[0]


def _hook_single(state: _HookState, bucket: Any, buf: torch.Tensor, idx: int) -> None:
    """Single replica: norms of this step's and the previous step's bucket and their dot."""
    inv = state.inv_scale
    cur = buf if inv is None else buf * inv.to(buf.dtype)
    # DDP may rebuild its buckets (other parameter order): compare like with like.
    layout = tuple(id(p) for p in bucket.parameters())
    sig, prev = state.prev.get(idx, (None, None))
    if prev is not None and sig == layout and prev.shape == cur.shape:
        state.local1[idx] = _sqnorm(cur)
        state.prev_sq[idx] = _sqnorm(prev)
        state.cross[idx] = torch.dot(cur.float(), prev.float())
        prev.copy_(cur)
    else:
        state.prev[idx] = (layout, cur.detach().clone())


def gns_allreduce_hook(state, bucket):  # no annotations: DDP checks them literally
    """DDP communication hook: averaging all-reduce plus the noise-scale norms of the bucket.

    Divides the bucket by ``state.divisor`` (replicas × loader accumulation steps, so that the
    update is the mean gradient, as AdaptDL's accumulation does), records ``|bucket|²``, and
    all-reduces it; the smallest bucket of a step also carries the previous step's local norm²
    (two extra elements), so no collective is added. The outputs of the all-reduces are
    recorded (in hook order) for :meth:`GradientNoiseScale.finish_step`. Gradients are
    bit-identical to DDP's default hook when ``divisor`` is the world size.

    Per bucket and step this costs one BLAS dot on top of torch's Python ``allreduce_hook``.
    The carrying bucket is divided straight into the reused send buffer (one pass instead of
    divide + copy), and its local norm² is taken from the undivided bucket *after* its
    all-reduce is launched, overlapping the communication.
    """
    buf = bucket.buffer()
    group = state.process_group
    if not state.enabled:
        buf.div_(state.divisor)
        return dist.all_reduce(buf, group=group, async_op=True).get_future().then(_first)
    idx = bucket.index()
    state.num_buckets_seen += 1
    if state.scaler is not None and state.inv_scale is None:
        # The loss scale of this backward (GradScaler creates it lazily in scale()); a copy,
        # since update() changes it in place after the step.
        scale = getattr(state.scaler, "_scale", None)
        if scale is not None:
            state.inv_scale = 1.0 / scale.detach().double()
    if state.world_size == 1:
        buf.div_(state.divisor)
        _hook_single(state, bucket, buf, idx)
        return dist.all_reduce(buf, group=group, async_op=True).get_future().then(_first)
    float_buf = buf.dtype is torch.float32 or buf.dtype is torch.float64
    done = state.done
    is_last = bucket.is_last()
    if is_last:
        state.t_last_hook = time.perf_counter()
    n = buf.numel()
    if state.min_size < 0 or n < state.min_size:
        state.min_size, state.min_idx = n, idx
    carry = state.carry
    if carry is not None and float_buf and (state.carry_idx is None or idx == state.carry_idx):
        state.carry = None
        state.parity ^= 1
        key = (idx, state.parity)
        sb = state.send.get(key)
        if sb is None or sb.n != n or sb.dtype != buf.dtype:
            sb = state.send[key] = _SendBuffer(n, buf)
        head = sb.head
        torch.div(buf, state.divisor, out=head)  # the same kernel and rounding as div_
        sb.put_carry(carry)
        state.carry_head = head  # its norm² is taken during the next step's carrying hook

        def _split(f: torch.futures.Future) -> torch.Tensor:
            state.carried = sb.get_carry()  # read now: the buffer is reused next step
            done.append(is_last)
            if is_last:
                state.t_done = time.perf_counter()
            return head

        fut = dist.all_reduce(sb.big, group=group, async_op=True).get_future().then(_split)
        # While the all-reduce runs: |g_i|² of the undivided bucket (untouched by it), and
        # |mean g|² of the previous step's carrying bucket (in the other send buffer).
        state.local_raw.append(torch.dot(buf, buf))
        prev = state.deferred
        if prev is not None:
            state.deferred_norm = torch.dot(prev, prev)
            state.deferred = None
        return fut

    buf.div_(state.divisor)
    state.local.append(torch.dot(buf, buf) if float_buf else _sqnorm(buf))  # = |g_i|² / R²
    state.results.append(buf)  # all-reduced in place

    def _keep(f: torch.futures.Future) -> torch.Tensor:
        done.append(is_last)
        if is_last:
            state.t_done = time.perf_counter()
        return f.value()[0]

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
        θ = min(smoothing, 1 − 1/(1 + window_fraction · t)) ** S_count
        ema ← θ · ema + (1 − θ) · sample   (debiased)

    where ``t`` is the scale already folded in (samples × their scale, in initial-batch steps).
    AdaptDL uses the fixed ``θ = 0.999^S``: a memory of ~1000 steps from the very first step,
    so the first steps' statistics (tiny noise scale, large gradients) dominate the estimate for
    hundreds of steps and the noise scale is underestimated ~10× at step 100 of a char-LM run
    (measured: 0.26 vs ~3 in units of B0). The growing window (memory ``≈ window_fraction · t``,
    capped by ``smoothing``) forgets that transient; ``window_fraction=None`` restores
    AdaptDL's rule.

    Progress (scale-invariant iterations) grows by ``gain(S)`` per optimizer step.

    Args:
        adp: the owning model (kept for API compatibility; may be None).
        optimizer: the optimizer (kept for API compatibility; may be None).
        mp_scaler: a ``torch.amp.GradScaler`` whose scale multiplies the gradients, or None.
        num_replicas: replicas ``R`` (default: the process group's world size, else 1).
        accum_scale: scale of one micro-batch over all replicas, ``R·local_bsz/B0`` (default 1:
            the whole step is the initial batch).
        smoothing: EMA smoothing per unit of scale (AdaptDL: 0.999), the longest memory.
        window_fraction: memory of the average as a fraction of the history seen so far
            (default 0.25); None for AdaptDL's fixed ``smoothing``.
    """

    def __init__(
        self,
        adp: Any = None,
        optimizer: torch.optim.Optimizer | None = None,
        mp_scaler: Any = None,
        num_replicas: int | None = None,
        accum_scale: float | None = None,
        smoothing: float = 0.999,
        window_fraction: float | None = 0.25,
    ) -> None:
        if num_replicas is None:
            num_replicas = dist.get_world_size() if dist.is_initialized() else 1
        if num_replicas < 1:
            raise ValueError(f"num_replicas={num_replicas} must be ≥ 1")
        if not 0.0 <= smoothing < 1.0:
            raise ValueError(f"smoothing={smoothing} must lie in [0, 1)")
        if window_fraction is not None and not window_fraction > 0:
            raise ValueError(
                f"window_fraction={window_fraction} must be > 0 (or None for a fixed smoothing)"
            )
        self._adp = adp
        self._optimizer = optimizer
        self._mp_scaler = mp_scaler
        self._num_replicas = int(num_replicas)
        self._accum_scale = float(accum_scale) if accum_scale else 1.0
        self._accum_count = 0
        self._smoothing = smoothing
        self._window_fraction = window_fraction
        self._clock = 0.0  # scale folded into the averages so far (initial-batch steps)
        self._sqr = _gns.ema_init(0.0)
        self._var = _gns.ema_init(0.0)
        self._progress = 0.0
        self._biased = False
        self._prev_scale: float | None = None
        self._hook_state: _HookState | None = None
        self._pending: tuple | None = None  # last step's measurements, not folded yet

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
        taken = self._fold_pending() if self._pending is not None else False
        if hs is not None and hs.enabled and hs.num_buckets_seen > 0:
            pend = self._pending = self._package(hs, scale)
            if hs.world_size > 1:
                hs.carry = pend[2]
                if hs.min_idx >= 0:
                    hs.carry_idx = hs.min_idx
            hs.reset_step()  # consumed: a second optimizer.step() must not count it again
        return taken

    def flush(self) -> bool:
        """Fold the pending step in now. Collective: call it on every replica at once."""
        taken = self._fold_pending()
        if self._hook_state is not None:
            self._hook_state.carry = None
        return taken

    def _package(self, hs: _HookState, scale: float) -> tuple:
        """This step's raw measurements as Python floats.

        ``(R, complete, local, total, scale, head, inv2)`` for ``R ≥ 2`` (``local`` is this
        replica's ``|g_i|²``, still to be averaged over the replicas; ``total`` lacks the norm²
        of ``head``, the carrying bucket's output, and the loss-scale factor ``inv2``) and ``(1, complete, scale, cur,
        prev, cross)`` for a single replica.
        """
        inv2 = 1.0 if hs.inv_scale is None else float(hs.inv_scale) ** 2
        ws = hs.world_size
        if ws > 1:
            loc, raw, res = hs.local, hs.local_raw, hs.results
            n_local = len(loc) + len(raw)
            complete = n_local > 0 and len(hs.done) == n_local
            local = sum([float(v) for v in loc])
            if raw:
                local += sum([float(v) for v in raw]) / (hs.divisor * hs.divisor)
            local *= ws * ws * inv2
            # the norms of the averaged buckets are taken here, on the main thread: in the
            # future's callback the BLAS dot might run on another thread with another
            # summation order, and the replicas would disagree in the last bits
            total = sum([float(_sqnorm(r)) for r in res])
            head = hs.carry_head
            if head is not None:  # its norm² is taken later (see gns_allreduce_hook)
                hs.deferred, hs.deferred_norm = head, None
            return (ws, complete, local, total, float(scale), head, inv2)
        complete = bool(hs.local1) and len(hs.local1) == hs.num_buckets_seen
        return (
            1,
            complete,
            float(scale),
            sum(float(v) for v in hs.local1.values()),
            sum(float(v) for v in hs.prev_sq.values()),
            sum(float(v) for v in hs.cross.values()),
        )

    def _fold_pending(self) -> bool:
        pend, self._pending = self._pending, None
        if pend is None:
            return False
        ws = pend[0]
        if ws > 1:
            hs = self._hook_state
            if hs is not None and hs.carried is not None:
                reduced = hs.carried
                hs.carried = None
            else:  # the carrying bucket never ran (e.g. half-precision buckets): reduce now
                t = _encode(pend[2])
                dist.all_reduce(t, group=hs.process_group if hs is not None else None)
                reduced = _decode(t)
                if hs is not None:
                    hs.carry = None
            total, head = pend[3], pend[5]
            if head is not None:
                norm = hs.deferred_norm if hs is not None and hs.deferred is None else None
                if norm is None:  # no carrying hook ran since (flush): take it now
                    norm = _sqnorm(head)
                total += float(norm)
                if hs is not None:
                    hs.deferred = hs.deferred_norm = None
            return self._take_sample(ws, pend[1], pend[4], reduced / ws, total * pend[6])
        _, complete, scale, cur, prev, cross = pend
        if (
            not complete
            or self._prev_scale is None
            or not math.isclose(self._prev_scale, scale, rel_tol=1e-9)
        ):
            # First step, or the previous gradient came from another batch size.
            self._prev_scale = scale
            return False
        # Consecutive-step estimator on unscaled gradients (count = 2, scale 2S).
        local = (cur + prev) / 2.0
        total = (cur + prev + 2.0 * cross) / 4.0
        return self._take_sample(2, True, 2.0 * scale, local, total, biased=True)

    @property
    def last_sync_time(self) -> float:
        """Seconds between the last bucket's hook and the end of its all-reduce (last step)."""
        hs = self._hook_state
        if hs is None or hs.t_done < hs.t_last_hook:
            return 0.0
        return hs.t_done - hs.t_last_hook

    def _take_sample(
        self,
        count: int,
        complete: bool,
        step_scale: float,
        local: float,
        total: float,
        biased: bool = False,
    ) -> bool:
        """Fold one measurement (``count`` gradients at total scale ``step_scale``) in."""
        if not complete:
            return False
        self._prev_scale = step_scale / 2.0 if biased else step_scale
        if not (math.isfinite(local) and math.isfinite(total)):
            logger.warning("GradientNoiseScale: non-finite gradient statistics, sample skipped")
            return False
        if biased != self._biased:
            # Switching estimator (e.g. after a restart on another replica count): start over.
            self._sqr = _gns.ema_init(0.0)
            self._var = _gns.ema_init(0.0)
            self._clock = 0.0
            self._biased = biased
        est = _gns.unbiased_estimate(local, total, count, step_scale / count)
        base = _gns.window_smoothing(self._smoothing, self._clock, self._window_fraction)
        theta = base**step_scale
        self._clock += step_scale
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
            "clock": self._clock,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._sqr = _gns.EMAState(*state["sqr"])
        self._var = _gns.EMAState(*state["var"])
        self._progress = float(state["progress"])
        self._biased = bool(state["biased"])
        self._prev_scale = state["prev_scale"]
        self._accum_scale = float(state["accum_scale"])
        # checkpoints from before the growing window: treat the history as long
        self._clock = float(state.get("clock", 1e9))
