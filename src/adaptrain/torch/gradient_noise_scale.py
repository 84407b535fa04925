"""Gradient noise scale (GNS) tracking for :class:`~adaptrain.torch.AdaptiveDataParallel`.

The statistics are ``sqr = |G|²`` (squared norm of the true gradient) and ``var = tr(Σ)/B0``
(gradient variance at the initial batch size ``B0``), as in McCandlish et al. (2018,
arXiv:1812.06162) and AdaScale (Johnson et al., 2020, arXiv:2007.05105).

They are *sampled*: early in training on every optimizer step, later on one step in
:func:`adaptrain.core.gns.sample_interval` (at most ``max_interval``), chosen so that the
average keeps at least ``samples_per_window`` samples within its memory. Every other step is
plain DDP: no communication hook, no Python per bucket, DDP's C++ all-reduce. On a sampled
step, and only there,

* a hook on the forward's output (the first gradient of the backward pass) queues an
  autograd-engine callback: one hook per step whatever the number of parameters (a
  post-accumulate-grad hook on every parameter when the norms must be taken per parameter,
  below, under gradient accumulation, or when the loss did not reach the output);
* that callback runs at the end of the backward pass, before DDP's finalisation: DDP has not
  copied the averages back yet, so ``p.grad`` is still this replica's accumulated gradient; it
  takes the local norm² ``|g_i|²`` with one ``_foreach_norm`` (while the buckets' all-reduces
  are in flight) and queues its all-reduce (one float64) behind DDP's last bucket, waited for
  one step later, never on the critical path. With ``gradient_as_bucket_view`` or a static
  graph DDP may have averaged the gradients by then: each parameter's hook takes its norm²
  instead, before DDP's own hook of that parameter launches its bucket;
* it then queues a second callback, which therefore runs after DDP's finalisation (the trick
  AdaptDL uses): the gradients are averaged, and it takes their norm² with one
  ``_foreach_norm``;
* the time between the two callbacks is the all-reduce wait left after the backward pass
  (:meth:`GradientNoiseScale.take_sync_time`, the goodput model's sync time).

At the next :meth:`GradientNoiseScale.finish_step` (the optimizer's step pre-hook) the
measurement becomes an unbiased sample by :func:`adaptrain.core.gns.unbiased_estimate` with
``count = R`` (the accumulated local gradient of each replica is one sample of
``local_bsz·accum_steps`` samples), folded into debiased EMAs (:func:`adaptrain.core.gns.ema_update`)
with smoothing ``base ** span``: ``span`` is the scale elapsed since the previous sample
(``S`` per step), ``base`` is ``0.999`` per unit of scale as in AdaptDL once enough history is
seen, before that a memory growing with the history (:func:`adaptrain.core.gns.window_smoothing`).
A single replica uses two consecutive sampled steps (``count = 2``). Samples with non-finite
values are skipped (their span is carried to the next sample).

Gradient accumulation by the :class:`~adaptrain.torch.data.AdaptiveDataLoader`: the gradients
of a step are divided by the number of micro-batches in the second callback (DDP has divided by
the replicas), so the update uses the mean gradient, as AdaptDL's accumulation does; such steps
are armed even when not sampled. Because no communication hook is installed, a compression
hook (PowerSGD…) can be registered on the model with ``register_comm_hook``; the statistics then
cannot use the hook's average: a lossy compressor's average is not the mean gradient, and with
error feedback it also carries earlier steps' residuals (with PowerSGD rank 1 on digits it read
``var`` 0 and ``sqr`` 13× too high, so the batch size would never grow). On a sampled step of a
model with a communication hook, the local gradients are therefore copied in the parameters'
hooks (before the hook sees them) and all-reduced densely, asynchronously, beside the hook's own
traffic, one dense all-reduce per sample: the statistics exact. Samples are dense early (every
step for the first ~100 steps, 272 in the first 1000 at a fixed scale), then one step in up to
64: more than a rank-1 PowerSGD hook's own traffic (0.006 of dense per step).

``sketch_size`` (``AdaptiveDataParallel(stats_sketch_size=...)``) trades that traffic for
precision: a model of more than ``4 × sketch_size`` parameters then all-reduces a count sketch
of its local gradients (:func:`~adaptrain.core.compress.count_sketch`, the same hash on every
replica), whose sum is the sketch of the mean; its squared norm estimates ``|ḡ|²`` without bias
with a relative error of about ``sqrt(2/sketch_size)`` (1.1% at 16384 values, 64 KB). ``sqr =
(R·|ḡ|² − L)/(R − 1)`` is a difference, so for two replicas one sample's ``sqr`` carries about
``2·(1 + var/sqr)`` times that error: 22% at a noise ratio of 10, which the moving average over
its samples divides by their square root. Off by default.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.autograd import Variable

from adaptrain.core import gns as _gns
from adaptrain.core.compress import count_sketch

__all__ = ["GradientNoiseScale"]

logger = logging.getLogger(__name__)

#: A count-sketch size for ``sketch_size`` (64 KB in fp32; relative error of one sample's
#: ``|ḡ|²`` ≈ 1.1%).
SKETCH_SIZE = 1 << 14
_SKETCH_SEED = 0x5EED


def _sqnorm(t: torch.Tensor) -> torch.Tensor:
    """``|t|²`` of a flat tensor as a 0-dim tensor (BLAS dot, no temporary; half upcast)."""
    if t.dtype not in (torch.float32, torch.float64):
        t = t.float()
    return torch.dot(t, t)


def _values(g: torch.Tensor) -> torch.Tensor:
    """The flat entries of a gradient: its coalesced values if sparse (an ``Embedding`` with
    ``sparse=True``), else a flat view."""
    return g.coalesce().values().reshape(-1) if g.is_sparse else g.reshape(-1)


def _sqnorm_all(grads: list[torch.Tensor]) -> torch.Tensor:
    """``Σ |g|²`` over a list of tensors (dense or sparse), as a float64 0-dim tensor."""
    if all(g.dtype in (torch.float32, torch.float64) and not g.is_sparse for g in grads):
        return torch.stack(torch._foreach_norm(grads)).double().square().sum()
    return torch.stack([_sqnorm(_values(g)).double() for g in grads]).sum()


def _inv_scale_sq(scaler: Any) -> torch.Tensor | None:
    """``1/loss_scale²`` of an enabled GradScaler (its current scale tensor), else None."""
    scale = getattr(scaler, "_scale", None) if scaler is not None else None
    return None if scale is None else scale.detach().double().reciprocal().square()


def _queue_callback(fn: Any) -> None:
    """Run ``fn`` when the current backward pass ends (after callbacks queued before it)."""
    Variable._execution_engine.queue_callback(fn)


class _StepCollector:
    """Per-step collection state (not checkpointed).

    ``stats`` marks a sampled step; ``snapshot`` (single replica) keeps this step's gradient
    for the next step's pair; ``accum`` is the number of micro-batches to divide by. ``local``
    receives the 0-dim ``|g_i|²`` of each parameter when ``in_hooks`` (R ≥ 2; otherwise of each
    sparse gradient, which DDP averages before the backward ends); ``snap`` copies of the local
    gradients when ``dense`` (a communication hook is registered), ``dense_reduce`` their sum in
    flight; ``reduce`` the replica's local norm² and its all-reduce in flight, ``result`` the
    step's measurement (tensors, read one step later), ``sync_time`` the wait measured between
    the callbacks.
    """

    __slots__ = (
        "params",
        "ddp",
        "in_hooks",
        "process_group",
        "world_size",
        "handles",
        "stats",
        "snapshot",
        "accum",
        "scale",
        "scaler",
        "local",
        "reduce",
        "queued",
        "t_backward",
        "sync_time",
        "result",
        "prev",
        "step_index",
        "dense",
        "snap",
        "dense_reduce",
        "index",
        "watch",
    )

    def __init__(
        self, params: list[torch.Tensor], ddp: Any, process_group: Any, world_size: int
    ) -> None:
        self.params = params
        self.ddp = ddp
        self.in_hooks = False  # this step's local norms are taken in the parameters' hooks
        self.process_group = process_group
        self.world_size = world_size
        self.handles: list[Any] = []
        self.stats = False
        self.snapshot = False
        self.accum = 1
        self.scale: float | None = None
        self.scaler: Any = None
        self.local: list[torch.Tensor] = []
        self.reduce: tuple[torch.Tensor, Any] | None = None  # local norm² and its all-reduce
        self.queued = False
        self.t_backward = 0.0
        self.sync_time: float | None = None
        self.result: tuple | None = None
        # single replica: (step index, scale, flat gradient) of the last snapshot
        self.prev: tuple[int, float | None, torch.Tensor] | None = None
        self.step_index = 0
        # sampled step of a model with a communication hook: local gradients copied in the
        # parameters' hooks (``snap``, by parameter position) for a dense all-reduce
        self.dense = False
        self.snap: dict[int, torch.Tensor] = {}
        # the summed local gradients, their all-reduce in flight, and 1/(accum² · loss scale²)
        self.dense_reduce: tuple[torch.Tensor, Any, torch.Tensor] | None = None
        self.index = {id(p): i for i, p in enumerate(params)}
        # the step's callback is to be queued by a hook on the forward's output
        # (``watch_output``): armed by ``begin_step``, "hooked" once the hook is in place
        self.watch: str | None = None

    def reset(self) -> None:
        self.stats = self.snapshot = self.queued = False
        self.watch = None
        self.accum = 1
        self.scaler = None
        self.local = []
        self.reduce = None
        self.result = None
        self.sync_time = None
        self.dense = False
        self.snap = {}
        self.dense_reduce = None


class GradientNoiseScale:
    """Tracks the gradient noise scale of an :class:`AdaptiveDataParallel` model.

    API-compatible with ``adaptdl.torch.gradient_noise_scale.GradientNoiseScale``: ``sqr_avg()``,
    ``var_avg()``, ``gain(scale)``, ``get_progress()``/``set_progress()``, ``raw_sqr_avg``,
    ``raw_var_avg``, ``accum_scale``, ``accum_count``. Unlike AdaptDL, the statistics are one
    scalar over all parameter groups, and they are sampled rather than taken on every step.

    Update rule per sample with ``R`` replicas and total scale ``S = B/B0``::

        L = mean_i |g_i|²,  T = |mean_i g_i|²          (R ≥ 2, count = R)
        L = (|g_t|² + |g_{t-1}|²)/2,  T = |(g_t + g_{t-1})/2|²   (R = 1, count = 2, scale 2S)
        (sqr, var) = unbiased_estimate(L, T, count, S_count / count)
        θ = min(smoothing, 1 − 1/(1 + window_fraction · t)) ** span
        ema ← θ · ema + (1 − θ) · sample   (debiased)

    where ``t`` is the scale already folded in (in initial-batch steps) and ``span`` the scale
    elapsed since the previous sample (``S`` per optimizer step). Sampling one step in ``k``
    (:func:`adaptrain.core.gns.sample_interval`) keeps the memory in steps while paying the
    statistics' cost on ``1/k`` of the steps. AdaptDL uses the fixed ``θ = 0.999^S`` on every
    step: a memory of ~1000 steps from the very first step, so the first steps' statistics
    (tiny noise scale, large gradients) dominate the estimate for hundreds of steps and the
    noise scale is underestimated ~10× at step 100 of a char-LM run (measured: 0.26 vs ~3 in
    units of B0). The growing window (memory ``≈ window_fraction · t``, capped by
    ``smoothing``) forgets that transient; ``window_fraction=None`` restores AdaptDL's rule
    and ``max_interval=1`` its every-step sampling.

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
        max_interval: at most this many optimizer steps between two samples (1: every step).
        samples_per_window: the fewest samples kept within the average's memory.
        sketch_size: under a communication hook, models of more than ``4 × sketch_size``
            parameters measure the mean gradient's norm through a count sketch of this many
            values instead of a dense all-reduce (e.g. :data:`SKETCH_SIZE`); None (default):
            dense, exact.
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
        max_interval: int = 64,
        samples_per_window: float = 16.0,
        sketch_size: int | None = None,
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
        if int(max_interval) < 1:
            raise ValueError(f"max_interval={max_interval} must be ≥ 1 (1: sample every step)")
        if not samples_per_window > 0:
            raise ValueError(f"samples_per_window={samples_per_window} must be positive")
        self._adp = adp
        self._optimizer = optimizer
        self._mp_scaler = mp_scaler
        self._num_replicas = int(num_replicas)
        self._accum_scale = float(accum_scale) if accum_scale else 1.0
        self._accum_count = 0
        self._smoothing = smoothing
        self._window_fraction = window_fraction
        self._max_interval = int(max_interval)
        self._samples_per_window = float(samples_per_window)
        if sketch_size is not None and int(sketch_size) < 1:
            raise ValueError(f"sketch_size={sketch_size} must be ≥ 1 (or None: dense)")
        self._sketch_size = None if sketch_size is None else int(sketch_size)
        self._clock = 0.0  # scale folded into the averages so far (initial-batch steps)
        self._history = 0.0  # scale of all optimizer steps so far (for the schedule)
        self._span = 0.0  # scale of the steps since the last measured step
        self._skipped = 0.0  # span of samples skipped since the last folded one
        self._steps_since = 0  # optimizer steps since the last measured step
        self._last_scale = 1.0  # scale of the last optimizer step
        self._settled: tuple[float, int] | None = None  # (scale, its final interval)
        self._target: tuple[float, int] | None = None  # (scale, settled_interval(scale))
        self._sqr = _gns.ema_init(0.0)
        self._var = _gns.ema_init(0.0)
        self._progress = 0.0
        self._biased = False
        self._prev_scale: float | None = None
        self._collector: _StepCollector | None = None
        self._pending: tuple | None = None  # last measured step, not folded yet
        self._avg_cache: tuple | None = None  # (sqr state, var state, (sqr, var)) of averages()
        # begin_step(output_hook=True) may hook the forward's output instead of every parameter
        # (False for a model with sparse gradients, or once a watched backward missed it)
        self._output_hook_ok = True

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
        """Reset the accumulation calculations and gradients of the current step (AdaptDL's).

        Forgets the micro-batches counted for the step and what the statistics measured on
        them (armed hooks, this step's gradient norms; with one replica, this step's gradient
        kept for the next step's pair), drops the micro-batches' gradients that
        AdaptiveDataParallel set aside, and zeroes the gradients: the optimizer's
        (``optimizer.zero_grad()``), or without an optimizer those of the registered model's
        parameters. A step whose gradients are not finite (a NaN loss) is thus discarded
        instead of being accumulated into the next steps. Steps already ended by
        :meth:`finish_step` are kept.
        """
        self._accum_count = 0
        c = self._collector
        if c is not None:
            self._remove_hooks()  # the step's hooks and measurement (``c.result`` included)
            if c.prev is not None and c.prev[0] == c.step_index:
                c.prev = None  # the gradient of the step being discarded
        rt = getattr(self._adp, "_rt", None)  # AdaptiveDataParallel's set-aside micro-batches
        if rt is not None and getattr(rt, "stash", None):
            rt.stash = []
        if self._optimizer is not None:
            self._optimizer.zero_grad()
        elif c is not None:
            for p in c.params:
                p.grad = None

    @property
    def raw_sqr_avg(self) -> np.ndarray:
        return np.array([float(_gns.ema_value(self._sqr))])

    @property
    def raw_var_avg(self) -> np.ndarray:
        return np.array([float(_gns.ema_value(self._var))])

    def sqr_avg(self) -> float:
        """Estimate of ``|G|²``, the squared l2-norm of the true gradient (clipped at 0)."""
        return self.averages()[0]

    def var_avg(self) -> float:
        """Estimate of ``tr(Σ)/B0``, the gradient variance at the initial batch size (≥ 0)."""
        return self.averages()[1]

    def averages(self) -> tuple[float, float]:
        """``(sqr_avg(), var_avg())``, recomputed only after a sample (or a load) changed them."""
        sqr, var = self._sqr, self._var  # EMAState tuples are replaced, never mutated
        cached = self._avg_cache
        if cached is not None and cached[0] is sqr and cached[1] is var:
            return cached[2]
        out = (max(float(_gns.ema_value(sqr)), 0.0), max(float(_gns.ema_value(var)), 0.0))
        self._avg_cache = (sqr, var, out)
        return out

    def gain(self, scale: float) -> float:
        """AdaScale gain ``(var + sqr)/(var/scale + sqr)`` at ``scale`` (1 before any estimate)."""
        return _gns.gain(self.sqr_avg(), self.var_avg(), float(scale))  # its float fast path

    def get_progress(self) -> float:
        return self._progress

    def set_progress(self, progress: float) -> None:
        self._progress = float(progress)

    def advance_progress(self, gain: float) -> float:
        """Add ``gain`` to the progress (``set_progress(get_progress() + gain)``); returns the
        new progress."""
        self._progress = progress = float(self._progress + gain)
        return progress

    @property
    def num_updates(self) -> int:
        """Number of samples folded into the averages."""
        return self._sqr.count

    # ----- sampling schedule -------------------------------------------------------------------
    def sample_interval(self, scale: float | None = None) -> int:
        """Optimizer steps between two samples at ``scale`` (default: the last step's)."""
        if scale is None:
            scale = self._last_scale
        settled = self._settled
        if settled is not None and settled[0] == scale:
            # At a given scale the interval only grows with the history (a longer memory), so
            # once it reached the cap or the memory its full length it stays there; skips the
            # arithmetic on most steps.
            return settled[1]
        k = _gns.sample_interval(
            self._smoothing,
            self._history,
            self._window_fraction,
            scale,
            self._samples_per_window,
            self._max_interval,
        )
        target = self._target
        if target is None or target[0] != scale:  # independent of the history: computed once
            target = self._target = (scale, self.settled_interval(scale))
        if k == target[1]:  # the cap, or the full memory's interval
            self._settled = (scale, k)
        return k

    def settled_interval(self, scale: float | None = None) -> int:
        """The interval at ``scale`` once the average's memory has reached its full length
        (``min(max_interval, floor(1/((1 − smoothing)·scale·samples_per_window)))``): where
        the early every-step phase ends up, e.g. 62 steps at scale 1 with the defaults."""
        if scale is None:
            scale = self._last_scale
        return _gns.sample_interval(
            self._smoothing,
            math.inf,
            self._window_fraction,
            scale,
            self._samples_per_window,
            self._max_interval,
        )

    # ----- collection --------------------------------------------------------------------------
    def register(self, ddp: torch.nn.parallel.DistributedDataParallel) -> None:
        """Collect the statistics of ``ddp``'s parameters (no communication hook is installed).

        Then call :meth:`begin_step` before the forward pass of each synchronising micro-batch
        and :meth:`finish_step` before each ``optimizer.step()``.
        """
        group = ddp.process_group
        ws = dist.get_world_size(group)
        if ws != self._num_replicas:
            raise RuntimeError(
                f"GradientNoiseScale has num_replicas={self._num_replicas} but the DDP process "
                f"group has {ws}; construct it with num_replicas={ws}"
            )
        params = [p for p in ddp.module.parameters() if p.requires_grad]
        self._collector = _StepCollector(params, ddp, group, ws)
        # DDP averages sparse gradients before the backward pass ends: their local norms can
        # only be taken in their parameters' hooks. DDP's own rule for which parameters get
        # sparse gradients (it supports no others):
        self._output_hook_ok = not any(
            bool(m.sparse)
            for m in ddp.module.modules()
            if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag))
        )

    def begin_step(
        self,
        accum_steps: int = 1,
        enabled: bool = True,
        scale: float | None = None,
        output_hook: bool = False,
    ) -> bool:
        """Prepare the synchronising backward pass of a new optimizer step.

        Args:
            accum_steps: micro-batches averaged into this step by the loader (the gradients
                are divided by ``accum_steps`` after DDP's average over the replicas).
            enabled: sample the statistics this step if the schedule asks for it.
            scale: total scale ``S = B/B0`` of this step, for the schedule (default: the last
                step's).
            output_hook: the caller passes this step's forward output to
                :meth:`watch_output`, which may then hook it instead of every parameter.

        Returns:
            True when the output is to be passed to :meth:`watch_output` (a sampled step
            hooking its output); passing it on other steps does nothing.
        """
        c = self._collector
        if c is None:
            return False
        if c.watch is not None:
            if c.watch == "hooked" and not c.queued:
                # The last watched backward never reached the forward's output (a loss from
                # elsewhere), or never ran: hook the parameters from now on.
                self._output_hook_ok = False
                logger.debug("GradientNoiseScale: the output was not hooked; hooking parameters")
            self._remove_hooks()  # the last step's state
        elif c.handles or c.stats or c.snapshot or c.queued or c.accum > 1:
            self._remove_hooks()  # the last step's state, or hooks whose backward never ran
        c.accum = max(int(accum_steps), 1)
        c.scale = scale
        if enabled:
            since = self._steps_since + 1  # steps since the last sample, this one included
            interval = self.sample_interval(scale)  # cached once settled
            c.stats = since >= interval
            # a single replica pairs two consecutive steps: keep the one before a sample
            c.snapshot = c.world_size == 1 and since + 1 >= interval
        if not (c.stats or c.snapshot or c.accum > 1):
            return False  # an unsampled step without accumulation: DDP alone
        if c.stats or c.snapshot:
            scaler = self._mp_scaler
            c.scaler = scaler if (scaler is not None and scaler.is_enabled()) else None
        # Any parameter's hook may come first (and one may be unused): hook them all.
        # Without bucket views or a static graph, DDP copies the averages back into the
        # gradients only in its finalisation, so the first callback still sees the local
        # gradients and takes their norm in one pass while the buckets are in flight.
        # Bucket views are reduced in place, and a static graph reduces everything in a
        # callback queued before ours on its first iteration: there the norms are taken
        # in each parameter's hook, before DDP's own hook launches its bucket (on the
        # critical path, so only when needed).
        ddp = c.ddp
        # A communication hook's average is not the mean gradient (module docstring).
        c.dense = c.stats and c.world_size > 1 and bool(getattr(ddp, "_comm_hooks", None))
        c.in_hooks = (
            c.stats
            and c.world_size > 1
            and (
                c.dense
                or bool(
                    getattr(ddp, "gradient_as_bucket_view", False)
                    or getattr(ddp, "static_graph", False)
                )
            )
        )
        if output_hook and not c.in_hooks and c.accum == 1 and self._output_hook_ok:
            c.watch = "armed"  # one hook on the output, in watch_output
            return True
        hook = self._on_grad_norm if c.in_hooks else self._on_grad
        c.handles = [p.register_post_accumulate_grad_hook(hook) for p in c.params]
        return False

    def watch_output(self, output: Any) -> None:
        """After the forward pass of a step prepared by ``begin_step(output_hook=True)``: hook
        the output's tensors that require a gradient (the first to receive one queues the
        step's callback), or, if there are none, every parameter as usual."""
        c = self._collector
        if c is None or c.watch != "armed":
            return
        leaves = torch.utils._pytree.tree_leaves(output)
        tensors = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            c.watch = "hooked"
            c.handles = [t.register_hook(self._on_output_grad) for t in tensors]
        else:
            c.watch = None
            c.handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in c.params]

    def _on_output_grad(self, grad: torch.Tensor) -> None:
        """The backward pass reached the forward's output: arm the end-of-backward callback."""
        c = self._collector
        if not c.queued:
            c.queued = True
            _queue_callback(self._end_of_backward)

    def begin_accumulation(self) -> None:
        """A non-synchronising micro-batch follows: make sure no hook of a step left armed
        (its backward never ran) measures or divides its gradients."""
        if self._collector is not None and self._collector.handles:
            self._remove_hooks()

    def _remove_hooks(self) -> None:
        c = self._collector
        for h in c.handles:
            h.remove()
        c.handles = []
        c.reset()

    def _on_grad(self, p: torch.Tensor) -> None:
        """A parameter's local gradient is accumulated: arm the end-of-backward callback.

        A sparse gradient's local norm² is taken here: DDP all-reduces sparse gradients on
        their own and writes the average back before the end of the backward pass."""
        c = self._collector
        if not c.queued:
            c.queued = True
            _queue_callback(self._end_of_backward)
        if c.stats and c.world_size > 1 and p.grad.is_sparse:
            c.local.append(_sqnorm(_values(p.grad)))

    def _on_grad_norm(self, p: torch.Tensor) -> None:
        """Sampled step: also take the local norm² now (DDP has not launched its bucket)."""
        c = self._collector
        if not c.queued:
            c.queued = True
            _queue_callback(self._end_of_backward)
        if c.stats:
            if c.dense:
                c.snap[c.index[id(p)]] = p.grad.detach().clone()
            else:
                c.local.append(_sqnorm(_values(p.grad)))

    def _end_of_backward(self) -> None:
        """Callback queued before DDP's: the backward pass is done, DDP still finishing.

        On a sampled step with several replicas the local norm² is taken (or summed from the
        hooks) and its all-reduce queued behind DDP's last bucket, so the two share their
        latency; it is waited for one step later.
        """
        c = self._collector
        c.t_backward = time.perf_counter()
        for h in c.handles:
            h.remove()
        c.handles = []  # the step's state stays: the second callback reads it
        if c.stats and c.world_size > 1:
            dense = None
            if c.dense:
                # Every replica sends every parameter (zeros where it has no gradient).
                flat = [
                    (g.to_dense() if g.is_sparse else g).reshape(-1)
                    if (g := c.snap.get(i)) is not None
                    else torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
                    for i, p in enumerate(c.params)
                ]
                c.snap = {}
                dense = torch.cat(flat) if flat else None
                local = _sqnorm(dense).double() if dense is not None else None
            elif c.in_hooks:
                local = torch.stack(c.local).double().sum() if c.local else None
            else:  # dense gradients are still local here; sparse ones were taken in hooks
                grads = [p.grad for p in c.params if p.grad is not None and not p.grad.is_sparse]
                local = _sqnorm_all(grads) if grads else None
                if c.local:  # sparse gradients' norms, taken in their hooks
                    parts = [x.double() for x in c.local] + ([local] if local is not None else [])
                    local = torch.stack(parts).sum()
            if local is not None:
                factor = 1.0 / float(c.accum * c.accum)
                local = local * factor
                inv2 = _inv_scale_sq(c.scaler)
                if inv2 is not None:
                    local = local * inv2
                red = local.reshape(1)
                c.reduce = (red, dist.all_reduce(red, group=c.process_group, async_op=True))
                if dense is not None:
                    size = self._sketch_size
                    if size is not None and dense.numel() > 4 * size:
                        # Same hash on every replica (the step index is common): the summed
                        # sketches are the sketch of the sum, |S ḡ|² estimates |ḡ|² unbiased.
                        dense = count_sketch(dense, size, seed=_SKETCH_SEED + c.step_index)
                    work = dist.all_reduce(dense, group=c.process_group, async_op=True)
                    scale = torch.tensor(factor, dtype=torch.float64)
                    c.dense_reduce = (dense, work, scale if inv2 is None else scale * inv2)
        _queue_callback(self._after_sync)  # now queued behind DDP's finalisation

    def _after_sync(self) -> None:
        """Callback after DDP's: the gradients are averaged over the replicas."""
        c = self._collector
        c.sync_time = time.perf_counter() - c.t_backward
        grads = [p.grad for p in c.params if p.grad is not None]
        if not grads:
            return
        if c.accum > 1:
            if any(g.is_sparse for g in grads):
                for g in grads:
                    g.div_(float(c.accum))
            else:
                torch._foreach_div_(grads, float(c.accum))
        if not (c.stats or c.snapshot):
            return
        inv2 = _inv_scale_sq(c.scaler)
        if c.world_size > 1:
            if c.reduce is None:
                return
            if c.dense_reduce is not None:  # the mean gradient: the dense all-reduce, waited later
                c.result = (*c.reduce, c.dense_reduce)
                c.dense_reduce = None
                return
            total = _sqnorm_all(grads)
            if inv2 is not None:
                total = total * inv2
            c.result = (*c.reduce, total)
            return
        flat = torch.cat([(g.to_dense() if g.is_sparse else g).reshape(-1) for g in grads])
        if inv2 is not None:
            flat = flat * inv2.sqrt().to(flat.dtype)
        prev = c.prev
        if (
            c.stats
            and prev is not None
            and prev[0] == c.step_index - 1
            and prev[1] == c.scale
            and prev[2].shape == flat.shape
        ):
            c.result = (_sqnorm(flat), _sqnorm(prev[2]), torch.dot(flat.float(), prev[2].float()))
        c.prev = (c.step_index, c.scale, flat)

    def count_micro_batch(self) -> None:
        self._accum_count += 1

    def finish_step(self, scale: float) -> bool:
        """End of an optimizer step: fold the *previous* measured step into the averages.

        The statistics lag one step: the replicas' local norms of step ``t`` are all-reduced
        asynchronously and waited for at the next step, never on the critical path; a one-step
        lag in an average over many steps is immaterial. :meth:`flush` folds the last one in.

        Args:
            scale: total scale ``S = B/B0`` of this step (global batch over initial batch).

        Returns:
            True when a sample was folded in.
        """
        self._accum_count = 0
        taken = self._fold_pending() if self._pending is not None else False
        scale = float(scale)
        self._span += scale
        self._history += scale
        c = self._collector
        if c is None:
            self._steps_since += 1
        else:
            if c.result is not None:
                self._pending = (c.world_size, c.result, scale, self._span)
                c.result = None
                self._span = 0.0
                self._steps_since = 0
            else:
                self._steps_since += 1
            c.step_index += 1
        self._last_scale = scale
        return taken

    def flush(self) -> bool:
        """Fold the pending step in now. Call it on every replica (AdaptiveDataParallel's
        checkpoint does, before saving)."""
        return self._fold_pending()

    def take_sync_time(self) -> float | None:
        """The all-reduce wait after this step's backward pass, if it was measured (once)."""
        c = self._collector
        if c is None or c.sync_time is None:
            return None
        t, c.sync_time = c.sync_time, None
        return t

    @property
    def last_sync_time(self) -> float:
        """Seconds the last measured step waited for its all-reduce after the backward pass."""
        c = self._collector
        return 0.0 if c is None or c.sync_time is None else c.sync_time

    def _fold_pending(self) -> bool:
        pend, self._pending = self._pending, None
        if pend is None:
            return False
        ws, result, scale, span = pend
        if ws > 1:
            red, work, total = result
            work.wait()
            local = float(red[0]) / ws
            if isinstance(total, tuple):  # dense all-reduce of the local gradients (comm hook)
                summed, dense_work, factor = total
                dense_work.wait()
                total = _sqnorm(summed).double() * factor / float(ws * ws)
            return self._take_sample(ws, True, scale, local, float(total), span=span)
        cur, prev, cross = (float(v) for v in result)
        # Consecutive-step estimator on unscaled gradients (count = 2, scale 2S).
        local = (cur + prev) / 2.0
        total = (cur + prev + 2.0 * cross) / 4.0
        return self._take_sample(2, True, 2.0 * scale, local, total, biased=True, span=span)

    def _take_sample(
        self,
        count: int,
        complete: bool,
        step_scale: float,
        local: float,
        total: float,
        biased: bool = False,
        span: float | None = None,
    ) -> bool:
        """Fold one measurement (``count`` gradients at total scale ``step_scale``) in.

        ``span`` is the scale elapsed since the previous sample (default ``step_scale``).
        """
        span = float(step_scale if span is None else span)
        if not complete:
            self._skipped += span
            return False
        self._prev_scale = step_scale / 2.0 if biased else step_scale
        if not (math.isfinite(local) and math.isfinite(total)):
            logger.warning("GradientNoiseScale: non-finite gradient statistics, sample skipped")
            self._skipped += span
            return False
        span += self._skipped
        self._skipped = 0.0
        if biased != self._biased:
            # Switching estimator (e.g. after a restart on another replica count): start over.
            self._sqr = _gns.ema_init(0.0)
            self._var = _gns.ema_init(0.0)
            self._clock = 0.0
            self._biased = biased
        est = _gns.unbiased_estimate(local, total, count, step_scale / count)
        base = _gns.window_smoothing(self._smoothing, self._clock, self._window_fraction)
        theta = base**span
        self._clock += span
        self._sqr = _gns.ema_update(self._sqr, est.sqr, theta)
        self._var = _gns.ema_update(self._var, est.var, theta)
        return True

    # ----- checkpointing -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Averages, progress, estimator mode and sampling schedule (numbers only).

        The step still pending is not included: call :meth:`flush` on every replica first
        (AdaptiveDataParallel's checkpoint does, in its State's collective ``sync()``).
        With one replica the consecutive-step estimator's previous gradient is not saved
        either (it would cost a gradient's worth of checkpoint): the first step after a
        restore has nothing to pair with, so a restart costs that estimator one sample, and
        save → load → replay then gives averages that differ by that sample.
        """
        return {
            "sqr": tuple(self._sqr),
            "var": tuple(self._var),
            "progress": self._progress,
            "biased": self._biased,
            "prev_scale": self._prev_scale,
            "accum_scale": self._accum_scale,
            "clock": self._clock,
            "history": self._history,
            "span": self._span,
            "skipped": self._skipped,
            "steps_since": self._steps_since,
            "last_scale": self._last_scale,
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
        # ... and from before sampling: sample at the next step
        self._history = float(state.get("history", self._clock))
        self._span = float(state.get("span", 0.0))
        self._skipped = float(state.get("skipped", 0.0))
        self._steps_since = int(state.get("steps_since", 0))
        self._last_scale = float(state.get("last_scale", 1.0))
        self._settled = None  # the history may be shorter now
