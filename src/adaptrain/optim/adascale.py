"""AdaScale: fairscale-compatible learning-rate scaling by the gradient-noise gain.

AdaScale (Johnson, Agrawal, Gu & Guestrin, "AdaScale SGD: A User-Friendly Algorithm for
Distributed Training", ICML 2020, arXiv:2007.05105) scales the learning rate of a step taken
with a batch ``S`` times larger than the base batch by the gain

    r_t = (var + sqr) / (var / S + sqr),       1 ≤ r_t ≤ S,

where ``sqr ≈ |∇F|²`` and ``var ≈ tr(Σ)/B0`` are moving averages of unbiased estimates built
from the ``K = world_size × num_gradients_to_accumulate`` micro-batch gradients that make up
each step (Appendix B.3; the estimator itself is :mod:`adaptrain.core.gns`, shared with
``adaptrain.torch``). One step at scale ``S`` makes the statistical progress of ``r_t`` base
steps, which is what ``step += optim.gain()`` counts in the loops below.

:class:`AdaScale` has fairscale 0.4.13's constructor, methods, defaults and numerics (the
per-sample clipping ``var ≥ 1e-6``, ``sqr ≥ 0``; the debiased EMA or Appendix-B.3 average; the
state kept under ``optimizer.state["adascale"]``), and differs where fairscale is wrong:

* **Estimated at** ``step()``. Per-micro-batch squared norms are taken by a tensor hook and
  *committed* only when the gradient is really accumulated into ``.grad`` (a
  post-accumulate-grad hook), so ``torch.autograd.grad`` calls (gradient penalties,
  diagnostics) never count. A backward pass whose gradients are then zeroed (``zero_grad`` of
  the wrapper or of the model, ``set_to_none`` or not) is forgotten: the first hook of the
  next backward pass notices that a ``.grad`` was set to None or modified in place since the
  end of the last one (a ``.grad`` replaced by another tensor counts as moved, as DDP's bucket
  rebuild does with ``gradient_as_bucket_view``; zero with ``zero_grad``). A backward pass
  that raises is forgotten too.
  When a replica's last expected backward pass ends, its ``n_groups + 1`` numbers are
  all-reduced (asynchronously, one small collective per step, as in fairscale); the moving
  averages are only updated in ``step()``, from the all-reduced numbers and the synchronised
  ``.grad``, so every replica computes the same gain. ``gain()`` called between the last
  backward pass and ``step()`` already includes the step's sample (what fairscale returns
  there) without committing it; a step that never comes (skipped by a ``GradScaler``) leaves
  the averages untouched.
* **Loss scaling.** Gradients rescaled in place between the end of backward and ``step()``
  (``torch.amp.GradScaler.unscale_``, gradient clipping) are measured, and the sample is
  expressed in the units the optimizer steps with; the loss scale never reaches the averages.
  A step skipped by the ``GradScaler`` (``inf``/``NaN`` found) discards its statistics. The
  rescaling is detected by re-reading a few entries of the largest gradient, so it must be
  uniform over all parameters (per-parameter clipping is not accounted for). With a
  ``GradScaler``, call ``scaler.unscale_(optim)`` before ``optim.gain()`` for the progress
  count to equal the gain ``step()`` applies.
* **Non-finite samples** (``inf``/``NaN`` gradients) leave the averages unchanged.
* **``set_scale`` keeps the averages.** They are in base-batch units, independent of ``S``;
  fairscale multiplies the variance average by ``S_old / S_new``, wrong by that factor when
  the scale follows the batch size.
* **``state_dict`` carries the settings** (``scale``, ``smoothing``,
  ``num_gradients_to_accumulate``, ``world_size``); ``load_state_dict`` restores them when the
  world size is the same.
* **Single process without accumulation** raises ``RuntimeError`` (nothing to estimate from).
* **No process group needed** when ``world_size`` is 1 (accumulation only).
* **Adaptive optimizers.** For Adam, AdamW, Adamax, NAdam, RAdam, RMSprop, Adagrad, Adadelta
  and Adafactor the learning rate is multiplied by ``sqrt(r_t)``, the rule AdaptDL applies to
  adaptive optimizers (their step is normalised by a running second moment, so the full gain
  over-shoots); ``gain()`` still returns ``r_t``, the statistical progress of the step. Pass
  ``sqrt_lr=True/False`` to override the choice.
* The state is stored as float64 tensors (``torch.load(weights_only=True)`` works);
  fairscale's numpy state loads too.
* **Memory.** On CPU the squared norms of gradients of 2^15 to 2^22 entries go through one
  buffer the wrapper keeps (the size of the largest such gradient), not a fresh temporary per
  norm: the same numbers, without the page faults of mapping one in for every norm
  (one per parameter per backward pass, and one per parameter per step).

Both loop styles of fairscale's documentation work as written::

    optim = AdaScale(SGD(model.parameters(), lr=0.1))          # under DDP, world_size ≥ 2
    scheduler = LambdaLR(optim, lr_lambda=lambda epoch: 0.1 ** (epoch // 30))
    step, last_epoch = 0.0, 0
    for batch in loader:
        optim.zero_grad()
        loss_fn(model(batch)).backward()
        step += optim.gain()
        optim.step()
        epoch = int(step // len(loader))
        if epoch > last_epoch:
            scheduler.step()
            last_epoch = epoch

Gradient accumulation in one process: ``AdaScale(opt, num_gradients_to_accumulate=4)`` and
four ``(loss / 4).backward()`` calls per ``step()`` (``is_scaled_loss=False`` for unscaled
losses, then ``scale_grad_by_num_grads_to_accum()`` before ``step()``). Under DDP, accumulate
inside ``model.no_sync()`` except for the last micro-batch.
"""

from __future__ import annotations

import logging
import math
import numbers
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.optim import Optimizer

from adaptrain.core.gns import (
    B3State,
    EMAState,
    GNSEstimate,
    b3_update,
    b3_value,
    ema_update,
    unbiased_estimate,
)
from adaptrain.core.gns import (
    gain as _gain,
)

__all__ = ["AdaScale", "ADAPTIVE_OPTIMIZERS"]

logger = logging.getLogger(__name__)

#: Optimizer classes whose learning rate AdaScale scales by ``sqrt(gain)`` (AdaptDL's rule).
ADAPTIVE_OPTIMIZERS: tuple[type[Optimizer], ...] = tuple(
    getattr(torch.optim, name)
    for name in (
        "Adam",
        "AdamW",
        "Adamax",
        "NAdam",
        "RAdam",
        "RMSprop",
        "Adagrad",
        "Adadelta",
        "SparseAdam",
        "Adafactor",
    )
    if hasattr(torch.optim, name)
)

#: fairscale clips every raw variance sample at this floor (and sqr at 0) before averaging.
_VAR_FLOOR = 1e-6

_KEYS_PER_NAME = ("", "_biased", "_unbias", "_total")
#: Gradient dtypes whose squared norm needs no conversion.
_PLAIN_DTYPES = (torch.float32, torch.float64)
#: CPU gradients of ``_SCRATCH_MIN`` to ``_SCRATCH_MAX`` entries are squared into a reused
#: buffer (see ``AdaScale._sqr``) instead of a fresh temporary.
_SCRATCH_MIN = 1 << 15
_SCRATCH_MAX = 1 << 22
#: Settings :meth:`AdaScale.state_dict` records beside the averages.
_CONFIG_KEYS = ("scale", "smoothing", "num_gradients_to_accumulate", "world_size")


def _is_number(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _one_argument(method: str, **given: Any) -> Any:
    """The one argument given under either of its names (fairscale's or torch's)."""
    passed = {k: v for k, v in given.items() if v is not None}
    if len(passed) != 1:
        names = " or ".join(repr(k) for k in given)
        raise TypeError(f"AdaScale.{method}() takes one argument, {names}; got {len(passed)}")
    return next(iter(passed.values()))


class _Callback:
    """A function queued on the autograd engine. The engine drops its final callbacks when a
    backward pass raises, so a weak reference to this object tells whether the backward pass
    that queued it is still running (a reentrant backward nested in it keeps it alive)."""

    __slots__ = ("fn", "__weakref__")

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn = fn

    def __call__(self) -> None:
        self.fn()


def _sqr_norm(grad: torch.Tensor) -> torch.Tensor:
    """``|grad|²`` as a 0-d tensor on the gradient's device (no host sync)."""
    # pow(2).sum() as fairscale: a pairwise (accurate) reduction; torch.dot, vector_norm and
    # torch._foreach_norm are faster but 100-1000x less accurate in float32 on CPU (1e-5
    # relative on 1M entries against 1e-8), and var = L − T is a difference.
    if grad.dtype in _PLAIN_DTYPES and grad.layout is torch.strided and not grad.requires_grad:
        return grad.pow(2).sum()  # the common case, without the conversions below
    if grad.is_sparse:
        grad = grad.coalesce()._values()
    grad = grad.detach()
    if grad.is_complex():
        grad = torch.view_as_real(grad)
    if grad.dtype in (torch.float16, torch.bfloat16):
        grad = grad.float()
    return grad.pow(2).sum()


def _floor_list(values: list[float], lo: float) -> list[float]:
    """:func:`adaptrain.core.gns.clip_estimate`'s floor on Python floats (NaN stays NaN)."""
    return [v if v >= lo or v != v else lo for v in values]


def _all_finite(values: list[float]) -> bool:
    return all(math.isfinite(v) for v in values)


class AdaScale(Optimizer):
    """Wrap ``optimizer`` and scale its learning rate by the AdaScale gain at every step.

    Args:
        optimizer: the optimizer to wrap (SGD first; adaptive optimizers use ``sqrt(gain)``).
        world_size: number of data-parallel replicas; default ``dist.get_world_size()`` when a
            process group is initialised, else 1.
        scale: batch size over the base batch size; default
            ``world_size × num_gradients_to_accumulate``.
        smoothing: moving-average constant θ in ``[0, 1)``; default
            ``max(1 − world_size × num_gradients_to_accumulate / 1000, 0)``.
        num_gradients_to_accumulate: backward passes per replica between two ``step()`` calls.
        is_scaled_loss: True when each micro-batch loss is divided by
            ``num_gradients_to_accumulate`` (the usual accumulation), False when it is not.
        debias_ewma: True (default) for an Adam-style debiased EMA; False for the
            mean-then-EMA average of the paper's Appendix B.3.
        sqrt_lr: keyword-only extension: scale the LR by ``sqrt(gain)`` instead of ``gain``.
            Default None: True exactly for :data:`ADAPTIVE_OPTIMIZERS`.

    Raises:
        RuntimeError: for a single replica without accumulation (``world_size ×
            num_gradients_to_accumulate == 1``): there is nothing to estimate the noise from.
        ValueError: for a scale below 1, a smoothing outside ``[0, 1)`` or an accumulation
            count below 1.
    """

    # GradScaler must unscale the gradients itself before calling step().
    _step_supports_amp_scaling = False

    def __init__(
        self,
        optimizer: Optimizer,
        world_size: int | None = None,
        scale: float | None = None,
        smoothing: float | None = None,
        num_gradients_to_accumulate: int = 1,
        is_scaled_loss: bool = True,
        debias_ewma: bool = True,
        *,
        sqrt_lr: bool | None = None,
    ) -> None:
        self._hook_handles: list[Any] = []  # first: a partly built object must survive __del__
        self._mirror: dict[str, tuple[torch.Tensor, int, list[Any]]] = {}  # see _read()
        self._scratch: dict[torch.dtype, torch.Tensor] = {}  # see _sqr()
        if not isinstance(optimizer, Optimizer):
            raise TypeError(
                f"optimizer={type(optimizer).__name__} is not a torch.optim.Optimizer; wrap one"
            )
        self._optimizer = optimizer
        if world_size is None:
            world_size = (
                dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
            )
        if not _is_number(world_size) or int(world_size) != world_size or world_size < 1:
            raise ValueError(f"world_size={world_size!r} must be an integer ≥ 1")
        self._world_size = int(world_size)
        if self._world_size > 1 and not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                f"world_size={world_size} but torch.distributed is not initialised: call "
                "torch.distributed.init_process_group first (AdaScale all-reduces its "
                "statistics), or use world_size=1 with num_gradients_to_accumulate ≥ 2"
            )
        self._is_scaled_loss = bool(is_scaled_loss)
        self._debias_ewma = bool(debias_ewma)
        self._sqrt_lr = isinstance(optimizer, ADAPTIVE_OPTIMIZERS) if sqrt_lr is None else sqrt_lr
        # Proxy the param_groups so torch.optim.lr_scheduler works on the wrapper.
        self.param_groups = self._optimizer.param_groups

        self._in_backward = False
        self._armed: weakref.ref | None = None  # the queued end-of-backward callback
        self._grads_divided = False
        self._clear_accumulators()
        self._num_grads_to_accum = 1
        self._smoothing = 0.0
        self.set_num_gradients_to_accumulate(num_gradients_to_accumulate, update_smoothing=True)
        if smoothing is not None:
            self._check_smoothing(smoothing)
            self._smoothing = float(smoothing)
        if self._world_size * self._num_grads_to_accum <= 1:
            raise RuntimeError(
                "AdaScale needs at least 2 gradients per step to estimate the gradient noise, "
                "but world_size=1 and num_gradients_to_accumulate=1: run data-parallel with "
                "world_size ≥ 2 or accumulate gradients (num_gradients_to_accumulate ≥ 2)"
            )
        if "adascale" not in self._optimizer.state:
            self._optimizer.state["adascale"] = self._fresh_state(len(self.param_groups))
        else:  # a wrapped optimizer that already carries (possibly fairscale's numpy) state
            self._optimizer.state["adascale"] = self._normalize_state(
                self._optimizer.state["adascale"], len(self.param_groups)
            )
        scale = self._world_size * self._num_grads_to_accum if scale is None else scale
        self._scale = self._checked_scale(scale)
        self._hook()

    # ------------------------------------------------------------------ state helpers
    @staticmethod
    def _check_smoothing(smoothing: float) -> None:
        if not _is_number(smoothing) or not 0.0 <= smoothing < 1.0:
            raise ValueError(f"smoothing={smoothing!r} must lie in [0, 1) (0 = no averaging)")

    @staticmethod
    def _fresh_state(n: int) -> dict[str, torch.Tensor]:
        z = torch.zeros(n, dtype=torch.float64)
        state = {"grad_sqr_avg": torch.ones(n, dtype=torch.float64)}
        state["grad_var_avg"] = z.clone()
        for name in ("grad_sqr_avg", "grad_var_avg"):
            for suffix in _KEYS_PER_NAME[1:]:
                state[name + suffix] = z.clone()
            state[name + "_count"] = torch.zeros(1, dtype=torch.int64)
        return state

    @classmethod
    def _normalize_state(cls, data: dict[str, Any], n: int) -> dict[str, torch.Tensor]:
        """Our tensor state from ours or fairscale's (numpy arrays, keys created lazily)."""
        state = cls._fresh_state(n)
        for key, value in data.items():
            if key in _CONFIG_KEYS:
                continue  # settings saved by state_dict(): the constructor's arguments win
            if key not in state:
                raise ValueError(
                    f"unknown AdaScale state entry {key!r}: not an AdaScale/fairscale state dict"
                )
            t = torch.as_tensor(value).detach().clone().reshape(-1)
            state[key] = t.to(state[key].dtype)
        for name in ("grad_sqr_avg", "grad_var_avg"):
            if state[name].numel() != n:
                raise ValueError(
                    f"AdaScale state has {state[name].numel()} parameter groups, the optimizer "
                    f"{n}: load it into an optimizer with the same param_groups"
                )
            if name + "_count" not in data:  # fairscale's debiased EMA keeps no count
                state[name + "_count"] = (
                    (state[name + "_unbias"] > 0).any().to(torch.int64).reshape(1)
                )
        return state

    @property
    def _state(self) -> dict[str, torch.Tensor]:
        return self._optimizer.state["adascale"]

    # The averages are kept as float64 tensors in ``optimizer.state["adascale"]`` (what
    # state_dict() saves) and computed on Python floats (IEEE doubles: the same arithmetic
    # as float64 tensors, without a tensor operation per number). ``_read`` caches each
    # entry's values while the tensor stored under its key is the same, unmodified object.
    def _read(self, key: str) -> list[Any]:
        t = self._state[key]
        cached = self._mirror.get(key)
        if cached is not None and cached[0] is t and cached[1] == t._version:
            return cached[2]
        values = t.tolist()
        self._mirror[key] = (t, t._version, values)
        return values

    def _write(self, key: str, values: list[Any], dtype: Any = np.float64) -> None:
        # a new tensor each time (as fairscale's new arrays); from_numpy: 3x torch.tensor's speed
        t = torch.from_numpy(np.array(values, dtype=dtype))
        self._state[key] = t
        self._mirror[key] = (t, t._version, values)

    def _ema(self, name: str) -> EMAState:
        """The EMA state of ``name`` as per-group lists of floats and one count."""
        return EMAState(
            self._read(name + "_biased"),
            self._read(name + "_unbias"),
            self._read(name + "_count")[0],
        )

    def _b3(self, name: str) -> B3State:
        return B3State(
            self._read(name), self._read(name + "_total"), self._read(name + "_count")[0]
        )

    def _store_ema(self, name: str, st: EMAState) -> None:
        self._write(name + "_biased", st.biased)
        self._write(name + "_unbias", st.weight)
        self._write(name + "_count", [st.count], np.int64)
        if st.count > 0:
            self._write(name, [b / w for b, w in zip(st.biased, st.weight)])

    def _store_b3(self, name: str, st: B3State) -> None:
        self._write(name + "_total", st.total)
        self._write(name + "_count", [st.count], np.int64)
        if st.count > 0:
            self._write(name, st.value)

    def _clear_accumulators(self) -> None:
        """Forget every gradient seen since the last step (or the last zeroing)."""
        self._drop_reduced()
        self._pending: dict[int, torch.Tensor] = {}
        self._bw_sqr: dict[int, torch.Tensor] = {}  # committed in the current backward pass
        self._bw_reset = False
        # every committed |g_i|² of the step's backward passes (summed in float64 when the
        # step's statistics are launched: one stack, one host transfer) and its group
        self._acc_vals: list[torch.Tensor] = []
        self._acc_groups: list[int] = []
        self._acc_count: dict[int, int] = {}  # per param: backward passes committed
        self._grad_record: dict[int, tuple[Any, int]] = {}
        self._grads_divided = False
        self._probe: tuple[int, Any, Any] | None = None

    def _drop_reduced(self) -> None:
        reduced = self.__dict__.get("_reduced")
        if reduced is not None and reduced[0] is not None:
            reduced[0].wait()  # never leave a collective dangling
        self._reduced: tuple[Any, torch.Tensor, list[float]] | None = None
        # (scale, num_gradients_to_accumulate, smoothing) when the step's last backward pass
        # ended: the gradients were produced at these settings, so a set_scale() or
        # set_num_gradients_to_accumulate() before step() applies from the next step (as in
        # fairscale, which takes the sample at the end of that backward pass).
        self._sample_cfg: tuple[float, int, float] | None = None
        self._est_cache: GNSEstimate | None = None
        self._avg_cache: tuple[float | None, Any] | None = None

    # ------------------------------------------------------------------ hooks
    def _params(self) -> list[tuple[int, int, torch.Tensor]]:
        out = []
        i = 0
        for g_idx, group in enumerate(self._optimizer.param_groups):
            for p in group["params"]:
                out.append((i, g_idx, p))
                i += 1
        return out

    def _hook(self) -> None:
        if self._hook_handles:
            raise RuntimeError("AdaScale hooks are already registered: call unhook() first")
        self._param_list = self._params()
        self._probe_idx: dict[int, tuple[int, torch.Tensor]] = {}  # param: (numel, indices)
        self._group_of = {i: g for i, g, _ in self._param_list}
        for i, _, p in self._param_list:
            if not p.requires_grad:
                continue
            self._hook_handles.append(p.register_hook(self._make_grad_hook(i, p)))
            self._hook_handles.append(
                p.register_post_accumulate_grad_hook(self._make_commit_hook(i))
            )

    def _make_grad_hook(self, i: int, p: torch.Tensor) -> Callable[[torch.Tensor], None]:
        # The hook is owned by the parameter (it only runs while the parameter lives) and
        # holds the wrapper weakly, so neither keeps the other alive.
        sref = weakref.ref(self)

        def hook(grad: torch.Tensor) -> None:
            self_ = sref()
            if self_ is None:
                return
            armed = self_._armed
            # not in a backward pass yet, or the one marked as running raised (_aborted())
            if not self_._in_backward or armed is None or armed() is None:
                self_._begin_backward()
            self_._pending[i] = self_._sqr(grad)

        return hook

    def _make_commit_hook(self, i: int) -> Callable[[torch.Tensor], None]:
        sref = weakref.ref(self)

        def hook(param: torch.Tensor) -> None:
            self_ = sref()
            if self_ is None:
                return
            value = self_._pending.pop(i, None)
            if value is not None:
                self_._bw_sqr[i] = value

        return hook

    def _sqr(self, grad: torch.Tensor) -> torch.Tensor:
        """``|grad|²`` (:func:`_sqr_norm`); a large contiguous CPU gradient is squared into a
        buffer kept between calls, the same numbers without allocating (and page-faulting in)
        a gradient-sized temporary per call: 18 of them per step on a 1.9M-parameter MLP
        accumulating 2 micro-batches. The buffer grows to the largest such gradient, at most
        ``_SCRATCH_MAX`` entries."""
        n = grad.numel()
        if (
            _SCRATCH_MIN <= n <= _SCRATCH_MAX
            and grad.dtype in _PLAIN_DTYPES
            and grad.device.type == "cpu"
            and grad.layout is torch.strided
            and not grad.requires_grad
            and grad.is_contiguous()
        ):
            # taken out while in use: a backward pass in another thread makes its own
            buf = self._scratch.pop(grad.dtype, None)
            if buf is None or buf.numel() < n:
                buf = torch.empty(n, dtype=grad.dtype)
            # x*x is pow(x, 2) exactly, and the sum reduces the same contiguous layout
            out = torch.mul(grad, grad, out=buf[:n].view(grad.shape)).sum()
            self._scratch[grad.dtype] = buf
            return out
        return _sqr_norm(grad)

    def _queue(self, fn: Callable[[], None]) -> None:
        cb = _Callback(fn)
        self._armed = weakref.ref(cb)
        torch.autograd.Variable._execution_engine.queue_callback(cb)

    def _aborted(self) -> bool:
        """The backward pass marked as running raised: the engine dropped its callback."""
        return self._in_backward and (self._armed is None or self._armed() is None)

    def _forget_aborted_backward(self) -> None:
        """Drop what a backward pass that raised had measured (its gradients, partly
        accumulated into ``.grad``, show up as modified at the next backward pass)."""
        logger.warning("AdaScale: a backward pass raised; its gradient statistics are dropped")
        self._in_backward = False
        self._armed = None
        self._pending.clear()
        self._bw_sqr, self._bw_reset = {}, False

    def _begin_backward(self) -> None:
        """First gradient hook of a backward pass: arm the end-of-backward callback, and check
        whether any ``.grad`` was zeroed, replaced or modified in place since the last one.

        The check runs here, once, before this pass accumulates anything: gradients that are
        views of one buffer (DDP's ``gradient_as_bucket_view``, flat gradient buffers) share
        one version counter, which this pass's own accumulation would bump."""
        if self._in_backward:
            self._forget_aborted_backward()
        self._in_backward = True
        params = self._param_list
        for i, (ref, version) in self._grad_record.items():
            cur = params[i][2].grad
            if cur is None or (ref() is cur and cur._version != version):
                self._bw_reset = True  # .grad was zeroed or changed since the last backward
                break
            # Another tensor in its place is taken as moved, not zeroed: DDP's first bucket
            # rebuild copies each .grad into a bucket view (gradient_as_bucket_view=True).
        self._queue(self._queue_final)

    def _queue_final(self) -> None:
        # Runs after the graph; queue the real work behind callbacks queued later in the same
        # backward pass (DistributedDataParallel's gradient synchronisation is one of them).
        self._queue(self._final_callback)

    def _final_callback(self) -> None:
        self._in_backward = False
        self._armed = None
        self._pending.clear()  # gradients that were never accumulated (autograd.grad)
        if not self._bw_sqr:
            self._bw_reset = False
            return
        bw_sqr, reset = self._bw_sqr, self._bw_reset
        if reset:
            self._clear_accumulators()
        self._drop_reduced()
        self._bw_sqr, self._bw_reset = {}, False
        group_of, acc_count = self._group_of, self._acc_count
        self._acc_vals.extend(bw_sqr.values())
        self._acc_groups.extend([group_of[i] for i in bw_sqr])
        for i in bw_sqr:
            acc_count[i] = acc_count.get(i, 0) + 1
        # Remember each .grad as the end of this backward pass left it, to notice zeroing
        # before the next one and in-place rescaling (unscale_, clipping) before step().
        record = {}
        for i, _, p in self._param_list:
            grad = p.grad
            if grad is not None:
                record[i] = (weakref.ref(grad), grad._version)
        self._grad_record = record
        if max(self._acc_count.values()) == self._num_grads_to_accum:
            # The step's last backward pass: start the (asynchronous) all-reduce now, on every
            # replica alike, so that gain() never has to start a collective.
            self._reduced = self._launch_reduce(async_op=True)

    def _launch_reduce(self, async_op: bool) -> tuple[Any, Any, list[float]]:
        """All-reduce ``[Σ_i |g_i|² per group..., backward passes]``; also ``|.grad|²`` now.

        Returns ``(work, numbers, Σ|.grad|² per group)``: ``numbers`` is a list of floats when
        nothing is all-reduced (one process), else the float64 tensor being all-reduced.
        """
        n_groups = len(self._optimizer.param_groups)
        local = [0.0] * n_groups
        values, total, best = self._grad_sqr_sums(self._acc_vals)
        for g_idx, v in zip(self._acc_groups, values):
            local[g_idx] += v
        k_local = max(self._acc_count.values()) if self._acc_count else 0
        self._probe = self._make_probe(best)
        vec: Any = local + [float(k_local)]
        self._sample_cfg = (self._scale, self._num_grads_to_accum, self._smoothing)
        work = None
        if self._world_size > 1:
            if not (dist.is_available() and dist.is_initialized()):
                raise RuntimeError(
                    f"AdaScale(world_size={self._world_size}) needs an initialised process "
                    "group to all-reduce its statistics: call torch.distributed."
                    "init_process_group first, or pass world_size=1 with accumulation"
                )
            vec = torch.tensor(vec, dtype=torch.float64).to(self._comm_device())
            work = dist.all_reduce(vec, async_op=async_op)
            if not async_op:
                work = None
        return work, vec, total

    def _grad_sqr_sums(
        self, extra: list[torch.Tensor] | None = None
    ) -> tuple[list[float], list[float], tuple[int, float] | None]:
        """``(extra as floats, Σ|p.grad|² per group, (param, |p.grad|²) of the largest)``.

        Each ``|p.grad|²`` is a float32 (the gradient's precision) reduction, the group sums
        are float64; ``extra`` (0-d tensors) are read back in the same host transfer.
        """
        grads: list[tuple[int, int]] = []
        norms = list(extra) if extra else []
        n_extra = len(norms)
        for i, g_idx, p in self._param_list:
            grad = p.grad
            if grad is not None:
                grads.append((i, g_idx))
                norms.append(self._sqr(grad))
        values = torch.stack(norms).tolist() if norms else []
        sums = [0.0] * len(self._optimizer.param_groups)
        best = None
        for (i, g_idx), v in zip(grads, values[n_extra:]):
            sums[g_idx] += v
            if v > 0 and (best is None or v > best[1]):
                best = (i, v)
        return values[:n_extra], sums, best

    def _total_if_rescaled(self, total_end: list[float]) -> float | None:
        """``Σ|.grad|²`` now if the gradients were rescaled since the end of backward, else None.

        In-place rescaling is not visible in version counters (``GradScaler.unscale_`` does
        not bump them), so a few entries of the largest gradient of the last backward pass
        are re-read; a change there means a (uniform) rescaling, and the full sum is taken.
        """
        if self._probe is None:
            return None
        i, idx, before = self._probe
        grad = self._param_list[i][2].grad
        # list equality: exact, and a NaN never equals itself (as torch.equal)
        if grad is not None and not grad.is_sparse and torch.take(grad, idx).tolist() == before:
            return None
        return float(sum(self._grad_sqr_sums()[1]))

    def _make_probe(self, best: tuple[int, float] | None) -> tuple[int, Any, list[Any]] | None:
        if best is None:
            return None
        i = best[0]
        grad = self._param_list[i][2].grad
        if grad is None or grad.is_sparse:
            return None
        n = grad.numel()
        cached = self._probe_idx.get(i)
        if cached is not None and cached[0] == n and cached[1].device == grad.device:
            idx = cached[1]  # the indices depend on the size only: made once
        else:
            k = min(16, n)
            idx = torch.arange(k, device=grad.device) * (n - 1) // max(k - 1, 1)  # spread, exact
            self._probe_idx[i] = (n, idx)
        values = torch.take(grad, idx).tolist()  # grad.reshape(-1)[idx]
        if values.count(0) == len(values):  # (a NaN is not 0)
            # every probed entry is 0: probe the entry of largest magnitude instead
            idx = grad.abs().argmax().reshape(1)  # an index into grad.reshape(-1)
            values = torch.take(grad, idx).tolist()
        return i, idx, values

    def __del__(self) -> None:
        self.unhook()

    def unhook(self) -> None:
        """Remove the gradient hooks (call it to let the parameters be freed)."""
        for h in self.__dict__.get("_hook_handles", []):
            h.remove()
        self._hook_handles = []

    # ------------------------------------------------------------------ public API
    @property
    def scale(self) -> float:
        """Batch size over the base batch size (``S``)."""
        return self._scale

    @property
    def smoothing(self) -> float:
        """Moving-average constant θ of the gradient statistics."""
        return self._smoothing

    @property
    def num_gradients_to_accumulate(self) -> int:
        """Backward passes per replica between two steps."""
        return self._num_grads_to_accum

    def set_scale(self, scale: float, update_estimate: bool = True) -> None:
        """Set ``S``, the batch size over the base batch size, to match the batch size in use.

        The averages are kept in base-batch units (``sqr ≈ |∇F|²``, ``var ≈ tr(Σ)/B0``: each
        sample is multiplied by ``S`` over the micro-batch count), which do not depend on
        ``S``, so they stay valid at the new scale and are not changed. Called between the
        step's last backward pass and ``step()``, the new scale sets the gain of that step,
        while its sample keeps the scale its gradients were computed at (as in fairscale).

        Args:
            scale: the new ``S`` (at least 1).
            update_estimate: accepted for fairscale compatibility; it has no effect.
                fairscale multiplies its variance average by ``S_old / S_new`` here, which
                leaves it wrong by that factor when the scale follows the batch size (the use
                it documents): doubling the batch halved the variance and inflated the gain
                until the average recovered.
        """
        self._check_not_in_backward("set_scale")
        self._scale = self._checked_scale(scale)

    @staticmethod
    def _checked_scale(scale: Any) -> float:
        if not _is_number(scale):
            raise ValueError(f"scale={scale!r} must be a number ≥ 1 (batch size / base batch size)")
        if not (math.isfinite(scale) and scale >= 1):
            raise ValueError(
                f"scale={scale!r} must be a finite number ≥ 1 (batch size / base batch size)"
            )
        return float(scale)

    def set_num_gradients_to_accumulate(
        self, num_gradients_to_accumulate: int, update_smoothing: bool = True
    ) -> None:
        """Set the backward passes per step; by default also the default smoothing for it.

        Called between the step's last backward pass and ``step()``, it applies from the next
        step: the pending sample keeps the count and smoothing of the passes that made it.
        """
        self._check_not_in_backward("set_num_gradients_to_accumulate")
        n = num_gradients_to_accumulate
        if not _is_number(n) or not math.isfinite(n) or int(n) != n or n < 1:
            raise ValueError(f"num_gradients_to_accumulate={n!r} must be an integer ≥ 1")
        if (
            self.__dict__.get("_state_ready", False)
            and self._world_size * num_gradients_to_accumulate <= 1
        ):
            raise RuntimeError(
                "num_gradients_to_accumulate=1 with world_size=1 leaves nothing to estimate the "
                "gradient noise from: keep accumulating (≥ 2)"
            )
        self._num_grads_to_accum = int(num_gradients_to_accumulate)
        self._state_ready = True
        if update_smoothing:
            self._smoothing = max(1 - self._world_size * self._num_grads_to_accum / 1000, 0)

    def _sqr_var(self, pg_idx: int | None) -> tuple[float, float]:
        sqr: list[float] | None = None
        if self._reduced is not None:  # this step's gradients are in: include them
            pending = self._pending_averages()
            if pending is not None:
                sqr, var = pending[1]
        if sqr is None:
            sqr, var = self._read("grad_sqr_avg"), self._read("grad_var_avg")
        if pg_idx is None:
            return float(sum(sqr)), float(sum(var))
        return float(sqr[pg_idx]), float(var[pg_idx])

    def gain(self, pg_idx: int | None = None) -> float:
        """The gain ``r_t``: statistical progress of the step, in base-batch steps.

        Called after the step's backward passes and before ``step()``, it already includes
        their statistics (as fairscale's does) and equals what ``step()`` will apply, provided
        the gradients are not rescaled in between (with a ``GradScaler``, call
        ``scaler.unscale_(optim)`` first); after ``step()`` it is the gain that step used.

        Args:
            pg_idx: a parameter group; None sums ``sqr`` and ``var`` over all groups first.
        """
        sqr, var = self._sqr_var(pg_idx)
        return float(_gain(sqr, var, self._scale))

    def lr_factor(self, pg_idx: int | None = None) -> float:
        """What ``step()`` multiplies the learning rate by: ``gain`` or ``sqrt(gain)``."""
        g = self.gain(pg_idx)
        return math.sqrt(g) if self._sqrt_lr else g

    def scale_grad_by_num_grads_to_accum(self) -> None:
        """Divide the accumulated gradients by the accumulation count (unscaled losses)."""
        self._check_not_in_backward("scale_grad_by_num_grads_to_accum")
        if self._num_grads_to_accum <= 1:
            raise RuntimeError(
                "scale_grad_by_num_grads_to_accum needs num_gradients_to_accumulate > 1"
            )
        if self._is_scaled_loss:
            raise RuntimeError(
                "scale_grad_by_num_grads_to_accum is for unscaled losses: construct AdaScale "
                "with is_scaled_loss=False, or keep dividing the loss instead"
            )
        with torch.no_grad():
            for _, _, p in self._param_list:
                if p.grad is not None:
                    p.grad.div_(self._num_grads_to_accum)
        self._grads_divided = True

    def _check_not_in_backward(self, what: str) -> None:
        if self.__dict__.get("_in_backward", False):
            if self._aborted():
                self._forget_aborted_backward()
                return
            raise RuntimeError(f"{what}() called during a backward pass; call it after backward")

    # ------------------------------------------------------------------ the estimate
    def _wait_reduced(self) -> tuple[list[float], list[float]]:
        assert self._reduced is not None
        work, vec, total = self._reduced
        if work is not None or isinstance(vec, torch.Tensor):
            if work is not None:
                work.wait()
            vec = vec.cpu().tolist()
            self._reduced = (None, vec, total)
        return vec, total

    def _sample(
        self, reduced: tuple[list[float], list[float]]
    ) -> tuple[GNSEstimate | None, float | None]:
        """One ``(sqr, var)`` sample per group (lists of floats) from the all-reduced
        statistics of this step.

        Returns ``(None, None)`` when no backward pass happened since the last step, and
        with the sample the measured ``Σ|.grad|²`` if the gradients were rescaled, else None.
        """
        vec, total_end = reduced
        cached = self._est_cache
        est = cached if cached is not None else self._raw_sample(vec, total_end)
        self._est_cache = est
        if est is None:
            return None, None
        assert self._sample_cfg is not None
        c = self._sample_cfg[1]
        now = self._total_if_rescaled(total_end)
        key = now
        sqr, var = est.sqr, est.var
        if now is not None:
            # Gradients rescaled in place after backward (GradScaler.unscale_, clipping,
            # scale_grad_by_num_grads_to_accum): express the sample in the optimizer's units.
            if self._grads_divided:
                now *= c**2
            end = float(sum(total_end))
            if end > 0 and math.isfinite(end):
                ratio = now / end
                if not math.isfinite(ratio):
                    ratio = math.nan  # a broken rescaling: the sample is skipped
                sqr = [x * ratio for x in sqr]
                var = [x * ratio for x in var]
        # fairscale's per-sample clipping, in the units the optimizer steps with (clipping
        # before the rescaling would leave the floor at 1e-6 / loss_scale² under a GradScaler)
        return GNSEstimate(_floor_list(sqr, 0.0), _floor_list(var, _VAR_FLOOR)), key

    def _raw_sample(self, vec: list[float], total_end: list[float]) -> GNSEstimate | None:
        """The unclipped sample in the units of the backward passes (fairscale's computation),
        at the settings of the backward passes that produced it: per-group lists of floats."""
        k = int(round(float(vec[-1])))
        if k == 0:
            return None
        assert self._sample_cfg is not None
        scale, c, _ = self._sample_cfg
        expected = self._world_size * c
        if k != expected:
            raise RuntimeError(
                f"AdaScale saw {k} backward passes in this step across replicas but expects "
                f"world_size × num_gradients_to_accumulate = {self._world_size} × {c} = "
                f"{expected}: call set_num_gradients_to_accumulate() when the loop changes, and "
                "zero the gradients after any backward pass that is not part of the step"
            )
        local_sum = [float(x) for x in vec[:-1]]
        total = [float(x) for x in total_end]
        if c > 1:
            if self._is_scaled_loss:
                local_sum = [x * c**2 for x in local_sum]  # each pass saw grad/c
            else:
                total = [x / c**2 for x in total]  # .grad held the sum of c passes
        # fairscale's Appendix-B.3 sample, with var = tr(Σ)/B0 at base batch B = B0·S:
        # micro-batch / base batch = S/K.
        per_group = [
            unbiased_estimate(loc / k, tot, k, scale / k) for loc, tot in zip(local_sum, total)
        ]
        return GNSEstimate([e.sqr for e in per_group], [e.var for e in per_group])

    def _pending_averages(
        self,
    ) -> tuple[list[Any], tuple[list[float], list[float]]] | None:
        """The averages with this step's sample folded in: ``(new states, (sqr, var))``.

        Cached between ``gain()`` and ``step()`` while the gradients are not rescaled.
        """
        est, key = self._sample(self._wait_reduced())
        if est is None:
            return None
        cache = self._avg_cache
        if cache is not None and cache[0] == key:
            return cache[1]
        states, values = [], []
        assert self._sample_cfg is not None
        smoothing = self._sample_cfg[2]
        for name, value in (("grad_sqr_avg", est.sqr), ("grad_var_avg", est.var)):
            # ema_update/b3_update per group on floats; a non-finite sample in any group
            # leaves every group unchanged (as the update of the whole vector did)
            if self._debias_ewma:
                old = self._ema(name)
                if _all_finite(value):
                    ups = [
                        ema_update(EMAState(b, w, old.count), v, smoothing)
                        for b, w, v in zip(old.biased, old.weight, value)
                    ]
                    st = EMAState([u.biased for u in ups], [u.weight for u in ups], old.count + 1)
                else:
                    st = old
                if st.count > 0:  # ema_value per group
                    values.append([b / w for b, w in zip(st.biased, st.weight)])
                else:
                    values.append(self._read(name))
            else:
                old_b3 = self._b3(name)
                if _all_finite(value):
                    ups_b3 = [
                        b3_update(B3State(a, t, old_b3.count), v, smoothing)
                        for a, t, v in zip(old_b3.value, old_b3.total, value)
                    ]
                    st = B3State(
                        [u.value for u in ups_b3], [u.total for u in ups_b3], old_b3.count + 1
                    )
                else:
                    st = old_b3
                values.append(b3_value(st))
            states.append(st)
        result = (states, (values[0], values[1]))
        self._avg_cache = (key, result)
        return result

    def _update_estimate(self) -> None:
        """Fold this step's sample into the averages and start afresh."""
        if self._reduced is None:
            # The count never reached num_gradients_to_accumulate (no backward, or a wrong
            # count): agree on it across replicas so that all of them return or raise alike.
            self._reduced = self._launch_reduce(async_op=False)
        try:
            pending = self._pending_averages()
            if pending is not None:
                for name, st in zip(("grad_sqr_avg", "grad_var_avg"), pending[0]):
                    if self._debias_ewma:
                        self._store_ema(name, st)
                    else:
                        self._store_b3(name, st)
        finally:
            self._clear_accumulators()

    def _comm_device(self) -> torch.device:
        if dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def step(self, *args: Any, **kwargs: Any) -> Any:
        """Update the gradient statistics, then step the wrapped optimizer with a scaled LR.

        Each group's ``lr`` is multiplied by :meth:`lr_factor` for the step and restored after.
        A closure (positional or ``closure=``) is evaluated once before the statistics are
        taken; the wrapped optimizer reuses that first evaluation and any re-evaluation it
        makes (L-BFGS line search) is not counted in the statistics.
        """
        self._check_not_in_backward("step")
        closure = kwargs.pop("closure", None)
        if closure is None and args and callable(args[0]):
            closure, args = args[0], args[1:]
        first: list[Any] = []
        if closure is not None:
            with torch.enable_grad():
                first.append(closure())
        self._update_estimate()
        original = [group["lr"] for group in self._optimizer.param_groups]
        for idx, group in enumerate(self._optimizer.param_groups):
            group["lr"] = group["lr"] * self.lr_factor(idx)
        try:
            if closure is None:
                return self._optimizer.step(*args, **kwargs)

            def once() -> Any:
                if first:
                    return first.pop()
                with torch.enable_grad():
                    return closure()

            result = self._optimizer.step(once, *args, **kwargs)
            self._clear_accumulators()
            return result
        finally:
            for lr, group in zip(original, self._optimizer.param_groups):
                group["lr"] = lr

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the wrapped optimizer's gradients and forget the statistics gathered since."""
        self._check_not_in_backward("zero_grad")
        self._clear_accumulators()
        self._grads_divided = False
        self._optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(
        self, pg: dict[str, Any] | None = None, *, param_group: dict[str, Any] | None = None
    ) -> None:
        """Add a parameter group to the wrapped optimizer; its statistics start empty.

        The group is ``pg`` (fairscale's name) or ``param_group`` (torch's), by keyword or
        position.
        """
        param_group = _one_argument("add_param_group", pg=pg, param_group=param_group)
        self._check_not_in_backward("add_param_group")
        self._optimizer.add_param_group(param_group)
        self.unhook()
        self._clear_accumulators()
        self._hook()
        s = self._state
        for key in list(s):
            if key.endswith("_count"):
                continue
            fill = 1.0 if key == "grad_sqr_avg" else 0.0
            s[key] = torch.cat([s[key], torch.tensor([fill], dtype=s[key].dtype)])

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict; the AdaScale averages ride in its ``state``.

        The entry also records ``scale``, ``smoothing``, ``num_gradients_to_accumulate`` and
        ``world_size`` (0-d tensors), which :meth:`load_state_dict` restores. Take it between
        steps: statistics of a half-accumulated step are not saved.
        """
        self._check_not_in_backward("state_dict")
        sd = self._optimizer.state_dict()
        sd["state"] = dict(sd["state"])
        entry = {k: v.clone() for k, v in self._state.items()}
        entry["scale"] = torch.tensor(self._scale, dtype=torch.float64)
        entry["smoothing"] = torch.tensor(self._smoothing, dtype=torch.float64)
        entry["num_gradients_to_accumulate"] = torch.tensor(self._num_grads_to_accum)
        entry["world_size"] = torch.tensor(self._world_size)
        sd["state"]["adascale"] = entry
        return sd

    def load_state_dict(
        self, data: dict[str, Any] | None = None, *, state_dict: dict[str, Any] | None = None
    ) -> None:
        """Load a state dict from :meth:`state_dict` (or from fairscale's AdaScale), given as
        ``data`` (fairscale's name) or ``state_dict`` (torch's), by keyword or position.

        Like ``torch.optim``'s hyperparameters, the saved ``scale``, ``smoothing`` and
        ``num_gradients_to_accumulate`` replace the current ones, provided the state was saved
        at this ``world_size``; from another world size (an elastic restart) the values this
        wrapper was built with stay, and the averages, in base-batch units, carry over.
        """
        state_dict = _one_argument("load_state_dict", data=data, state_dict=state_dict)
        self._check_not_in_backward("load_state_dict")
        sd = dict(state_dict)
        sd["state"] = dict(sd["state"])
        ours = sd["state"].pop("adascale", None)
        config = {}
        if ours is not None:
            ours = dict(ours)
            config = {k: ours.pop(k) for k in _CONFIG_KEYS if k in ours}
        self._optimizer.load_state_dict(sd)
        n = len(self._optimizer.param_groups)
        self._optimizer.state["adascale"] = (
            self._fresh_state(n) if ours is None else self._normalize_state(ours, n)
        )
        self.param_groups = self._optimizer.param_groups
        self._clear_accumulators()
        if "world_size" in config:
            saved_ws = int(config["world_size"])
            if saved_ws == self._world_size:
                self.set_num_gradients_to_accumulate(
                    int(config["num_gradients_to_accumulate"]), update_smoothing=False
                )
                self._smoothing = float(config["smoothing"])
                self.set_scale(float(config["scale"]))
            else:
                logger.info(
                    "AdaScale: state saved at world_size=%d loaded at world_size=%d; keeping "
                    "scale=%g, smoothing=%g, num_gradients_to_accumulate=%d",
                    saved_ws,
                    self._world_size,
                    self._scale,
                    self._smoothing,
                    self._num_grads_to_accum,
                )

    def __repr__(self) -> str:
        return (
            f"AdaScale(scale={self._scale}, smoothing={self._smoothing}, "
            f"num_gradients_to_accumulate={self._num_grads_to_accum}, "
            f"world_size={self._world_size}, optimizer={self._optimizer!r})"
        )

    def __getattr__(self, name: str) -> Any:
        """Forward unknown attributes to the wrapped optimizer (as fairscale does)."""
        if name.startswith("__") or "_optimizer" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["_optimizer"], name)
