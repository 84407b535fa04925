"""Centralised (synchronous, all-reduce) optimizers, API-compatible with
``mlbench_core.optim.pytorch.centralized``: :class:`GenericCentralizedOptimizer`,
:class:`CentralizedSGD`, :class:`CentralizedAdam`, :class:`CustomCentralizedOptimizer`.

Update rule (``agg_grad=True``): every worker all-reduces its gradients, divides by the world
size (or a custom denominator), optionally clips, then runs the wrapped optimizer, so all
replicas apply the same update — mini-batch SGD on the union of the workers' batches
(Goyal et al., 2017, "Accurate, Large Minibatch SGD"). With ``agg_grad=False`` each worker
steps locally, then the weights are averaged (model averaging).

Fixes over mlbench-core 3.0.0: ``CentralizedSGD``/``CentralizedAdam`` construct (their
``super()`` call was broken); a closure is evaluated *before* aggregation (so it cannot
overwrite the averaged gradients); a parameter without a gradient on *any* worker keeps
``grad=None`` (the wrapped optimizer skips it, as ``torch.optim`` does in one process), while one
with a gradient on some worker takes part as zeros on the others; the parameters aggregated are
the model's trainable ones plus every parameter of the wrapped optimizer's groups (including
groups added later with ``add_param_group``); ``world_size=None`` means the process group's size;
step and state-dict hooks registered on the wrapper fire; sparse gradients
(``nn.Embedding(sparse=True)``) are densified before the all-reduce (mlbench failed on them).
"""

from __future__ import annotations

import functools
import logging
import math
from collections import OrderedDict
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.utils import clip_grad_norm_
from torch.optim import SGD, Adam, Optimizer
from torch.optim.optimizer import required

logger = logging.getLogger(__name__)

__all__ = [
    "AVG_WORLD",
    "AVG_CUSTOM",
    "AllReduceAggregator",
    "GenericCentralizedOptimizer",
    "CentralizedSGD",
    "CentralizedAdam",
    "CustomCentralizedOptimizer",
    "call_tracker",
]

AVG_WORLD = "avg_world"
AVG_CUSTOM = "avg_custom"


def call_tracker(tracker: Any, name: str) -> None:
    """Call ``tracker.<name>()`` if the tracker exists and has that hook (any object works)."""
    fn = getattr(tracker, name, None) if tracker is not None else None
    if callable(fn):
        fn()


def group_world_size(world_size: int | None, group: Any = None) -> int:
    """Check ``world_size`` against the process group (if any) and return the effective size.

    ``None`` means the process group's size (1 without a process group).
    """
    if world_size is not None and (isinstance(world_size, bool) or int(world_size) < 1):
        raise ValueError(
            f"world_size={world_size!r}: pass the number of workers (>= 1), or None for the "
            "process group's size"
        )
    if dist.is_available() and dist.is_initialized():
        actual = dist.get_world_size(group)
        if world_size is not None and int(world_size) != actual:
            raise ValueError(
                f"world_size={world_size} but the process group has {actual} workers: "
                f"pass world_size={actual} (or None)"
            )
        return actual
    if world_size is not None and int(world_size) > 1:
        raise RuntimeError(
            f"world_size={world_size} needs an initialised process group: call "
            "torch.distributed.init_process_group first"
        )
    return 1


class AllReduceAggregator:
    """All-reduce of gradients or weights, packed into one buffer or layer by layer.

    ``mode`` is ``"avg_world"`` (divide by the world size) or ``"avg_custom"`` (divide by
    ``denom``); ``divide_before`` divides before the reduction (avoids fp16 overflow).
    """

    def __init__(
        self,
        world_size: int,
        divide_before: bool = False,
        by_layer: bool = False,
        use_cuda: bool = False,
        group: Any = None,
    ) -> None:
        if use_cuda and not torch.cuda.is_available():
            raise ValueError("use_cuda=True but CUDA is not available: pass use_cuda=False")
        self.world_size = int(world_size)
        self.divide_before = divide_before
        self.by_layer = by_layer
        self.device = torch.device("cuda") if use_cuda else None
        self.group = group
        self.sent_bytes = 0

    def _divide(self, t: torch.Tensor, mode: str, denom: Any) -> None:
        if mode == AVG_WORLD:
            t.div_(self.world_size)
        elif mode == AVG_CUSTOM:
            if denom is None or float(denom) == 0:
                raise ValueError(f"mode 'avg_custom' needs a non-zero denom, got {denom!r}")
            t.div_(denom)
        else:
            raise ValueError(f"aggregation mode {mode!r}; choose 'avg_world' or 'avg_custom'")

    def _agg(
        self, t: torch.Tensor, mode: str, denom: Any, n_div: int | None = None
    ) -> torch.Tensor:
        """Sum ``t`` over the workers in place; divide its first ``n_div`` elements (all)."""
        part = t if n_div is None else t[:n_div]
        if self.divide_before:
            self._divide(part, mode, denom)
        self.sent_bytes += t.numel() * t.element_size()
        if self.world_size > 1:
            dist.all_reduce(t, group=self.group)
        if not self.divide_before:
            self._divide(part, mode, denom)
        return t

    def _reduce_flat(
        self,
        tensors: list[torch.Tensor],
        mode: str,
        denom: Any,
        extra: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """One packed all-reduce of ``tensors`` (averaged, written back in place) followed by
        ``extra`` (summed, not divided); returns the summed ``extra``."""
        dtype = functools.reduce(torch.promote_types, [t.dtype for t in tensors])
        parts = [t.reshape(-1) for t in tensors]
        n_div = sum(t.numel() for t in parts)
        if extra is not None:
            parts.append(extra.to(device=parts[0].device, dtype=dtype))
        flat = torch.cat(parts)
        if self.device is not None:
            flat = flat.to(self.device)
        flat = self._agg(flat, mode, denom, n_div)
        off = 0
        for t in tensors:
            n = t.numel()
            t.copy_(flat[off : off + n].view_as(t))
            off += n
        return flat[n_div:] if extra is not None else None

    def reduce_(
        self, tensors: list[torch.Tensor], mode: str = AVG_WORLD, denom: Any = None
    ) -> None:
        """Aggregate ``tensors`` (dense) in place."""
        if not tensors:
            return
        for i, t in enumerate(tensors):
            if t.layout != torch.strided:
                raise ValueError(
                    f"tensor {i} is sparse ({t.layout}): reduce_ aggregates dense tensors in "
                    "place; pass t.to_dense() (grads_ densifies sparse gradients itself)"
                )
        if self.by_layer:
            for t in tensors:
                buf = t if self.device is None else t.to(self.device)
                out = self._agg(buf, mode, denom)
                if out is not t:
                    t.copy_(out)
            return
        self._reduce_flat(tensors, mode, denom)

    def grads_(
        self, params: list[torch.nn.Parameter], mode: str = AVG_WORLD, denom: Any = None
    ) -> None:
        """Aggregate the gradients of ``params`` in place.

        Rule for missing gradients: every worker also contributes a per-parameter "has a
        gradient" flag, summed over the workers. A parameter with a gradient on no worker keeps
        ``grad=None``, so the wrapped optimizer skips it (no weight decay, momentum or Adam
        step), as ``torch.optim`` does in one process; one with a gradient on at least one worker
        counts as zeros on the workers without one, and every worker gets the average. The
        flags travel in the packed buffer (one extra element per parameter, no extra
        collective); with ``by_layer`` they take one small all-reduce first, and parameters
        without a gradient anywhere are not sent at all. The same holds at world size 1.

        Sparse gradients (``nn.Embedding(sparse=True)``) are densified first: ``p.grad``
        becomes the dense average, which the wrapped optimizer then gets (at any world size).
        """
        if not params:
            return
        for p in params:
            if p.grad is not None and p.grad.layout != torch.strided:
                p.grad = p.grad.to_dense()
        flags = torch.tensor([float(p.grad is not None) for p in params])
        if self.by_layer:
            if self.world_size > 1:
                flags = flags.to(self.device or params[0].device)
                self.sent_bytes += flags.numel() * flags.element_size()
                dist.all_reduce(flags, group=self.group)
            live = [p for p, c in zip(params, flags.tolist()) if c > 0]
            for p in live:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            self.reduce_([p.grad for p in live], mode, denom)
            return
        bufs = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        counts = self._reduce_flat(bufs, mode, denom, extra=flags)
        for p, buf, c in zip(params, bufs, counts.tolist()):
            if c > 0 and p.grad is None:
                p.grad = buf

    @torch.no_grad()
    def weights_(self, params: list[torch.nn.Parameter]) -> None:
        """Average the parameters themselves over the workers, in place."""
        self.reduce_([p.data for p in params], AVG_WORLD)


def _with_step_hooks(step):
    """Run the hooks registered with the wrapper's ``register_step_pre_hook`` /
    ``register_step_post_hook`` around ``step``, with the wrapper as their first argument and
    the same contract as ``torch.optim.Optimizer`` (a pre-hook may return new
    ``(args, kwargs)``). The global hooks (``register_optimizer_step_pre_hook`` ...) are not
    run here: they fire once per step, around the wrapped optimizer's own step (so they see the
    wrapped optimizer, after the aggregation)."""

    @functools.wraps(step)
    def wrapper(*args, **kwargs):
        self = args[0]
        for hook in list(self._optimizer_step_pre_hooks.values()):
            result = hook(self, args, kwargs)
            if result is not None:
                if not (isinstance(result, tuple) and len(result) == 2):
                    raise RuntimeError(
                        f"a step pre-hook must return None or (new_args, new_kwargs), got "
                        f"{result!r}"
                    )
                args, kwargs = result
        out = step(*args, **kwargs)
        for hook in list(self._optimizer_step_post_hooks.values()):
            hook(self, args, kwargs)
        return out

    return wrapper


class _WrappedOptimizer(Optimizer):
    """A ``torch.optim.Optimizer`` that delegates param groups and state to ``self.optimizer``.

    Hooks registered on the wrapper (``register_step_pre_hook``/``post_hook``,
    ``register_state_dict_pre_hook``/``post_hook``,
    ``register_load_state_dict_pre_hook``/``post_hook``) fire around the wrapper's own
    ``step`` / ``state_dict`` / ``load_state_dict`` with the wrapper as argument; hooks
    registered on the wrapped optimizer, and the global step hooks, fire around its calls.
    """

    def _init_wrapper(self, optimizer: Optimizer | None) -> None:
        # Optimizer.__init__ is not called: the wrapped optimizer owns groups and state.
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._zero_grad_profile_name = f"Optimizer.zero_grad#{type(self).__name__}.zero_grad"
        self.optimizer = optimizer

    def _inner(self) -> Optimizer:
        if self.optimizer is None:
            raise RuntimeError(
                f"{type(self).__name__} has no optimizer: use CentralizedSGD/CentralizedAdam or "
                "CustomCentralizedOptimizer(model, world_size, optimizer=...)"
            )
        return self.optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self._inner().param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self._inner().param_groups = value

    @property
    def state(self):  # type: ignore[override]
        return self._inner().state

    @state.setter
    def state(self, value) -> None:
        self._inner().state = value

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self._inner().defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self._inner().defaults = value

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._inner().zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self._inner().add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        for hook in list(self._optimizer_state_dict_pre_hooks.values()):
            hook(self)
        state_dict = self._inner().state_dict()
        for hook in list(self._optimizer_state_dict_post_hooks.values()):
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = state_dict.copy()
        for hook in list(self._optimizer_load_state_dict_pre_hooks.values()):
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        self._inner().load_state_dict(state_dict)
        for hook in list(self._optimizer_load_state_dict_post_hooks.values()):
            hook(self)

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.optimizer!r})"


class GenericCentralizedOptimizer(_WrappedOptimizer):
    """Synchronous all-reduce optimizer around ``self.optimizer`` (set by subclasses).

    The parameters aggregated are the model's trainable parameters followed by every other
    parameter of the wrapped optimizer's groups (deduplicated, in that fixed order), so groups
    added with :meth:`add_param_group` stay identical on all workers.

    With ``agg_grad=True``, sparse gradients (e.g. ``nn.Embedding(sparse=True)``) are densified
    before the all-reduce: after :meth:`step`, ``p.grad`` is the dense average, and the wrapped
    optimizer steps on it exactly as on the gradient of a ``sparse=False`` model (so
    ``torch.optim.Adam`` works, and ``SparseAdam``, which takes sparse gradients only, cannot be
    wrapped). The dense buffer is the full size of the parameter, as the all-reduce needs it.

    Args:
        world_size: number of workers (must match the process group; 1 without one); ``None``:
            the process group's size.
        model: the module whose parameters are aggregated.
        use_cuda: aggregate in CUDA buffers.
        by_layer: one all-reduce per parameter instead of one packed buffer.
        divide_before: divide by the world size before the reduction.
        agg_grad: aggregate gradients before the step (``True``) or weights after it.
        optimizer: the wrapped optimizer (keyword extension; subclasses set it).
        process_group: ``torch.distributed`` group (keyword extension; default: world).
    """

    def __init__(
        self,
        world_size: int,
        model: torch.nn.Module,
        use_cuda: bool = False,
        by_layer: bool = False,
        divide_before: bool = False,
        agg_grad: bool = True,
        *,
        optimizer: Optimizer | None = None,
        process_group: Any = None,
    ) -> None:
        if model is None:
            raise ValueError("model=None: pass the nn.Module to optimize")
        self._init_wrapper(optimizer)
        self.model = model
        self.world_size = group_world_size(world_size, process_group)
        self.agg_grad = agg_grad
        self.agg_mode = AVG_WORLD
        self.agg = AllReduceAggregator(
            self.world_size, divide_before, by_layer, use_cuda, process_group
        )
        if not agg_grad:
            self.agg.weights_(self._params())  # start from identical replicas

    def _params(self) -> list[torch.nn.Parameter]:
        """The model's trainable parameters, then the wrapped optimizer's other parameters."""
        candidates = [p for p in self.model.parameters() if p.requires_grad]
        if self.optimizer is not None:
            candidates.extend(p for g in self.optimizer.param_groups for p in g["params"])
        out, seen = [], set()
        for p in candidates:
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
        return out

    def _closure_loss(self, closure):
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    @_with_step_hooks
    def step(self, closure=None, tracker=None):  # type: ignore[override]
        """Evaluate ``closure`` (if any), aggregate, step; returns the closure's loss."""
        loss = self._closure_loss(closure)
        opt = self._inner()
        if self.agg_grad:
            self.agg.grads_(self._params(), self.agg_mode)
            call_tracker(tracker, "record_batch_agg")
            opt.step()
            call_tracker(tracker, "record_batch_opt_step")
        else:
            opt.step()
            call_tracker(tracker, "record_batch_opt_step")
            self.agg.weights_(self._params())
            call_tracker(tracker, "record_batch_agg")
        return loss


class CentralizedSGD(GenericCentralizedOptimizer):
    """All-reduce SGD (optionally momentum/Nesterov); same arguments as mlbench-core's."""

    def __init__(
        self,
        world_size=None,
        model=None,
        lr=required,
        momentum=0,
        dampening=0,
        weight_decay=0,
        nesterov=False,
        use_cuda=False,
        by_layer=False,
        agg_grad=True,
        *,
        process_group: Any = None,
    ) -> None:
        if model is None:
            raise ValueError("model=None: pass the nn.Module to optimize")
        if lr is required:
            raise ValueError("lr is required: pass the learning rate, e.g. lr=0.1")
        inner = SGD(
            model.parameters(),
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
        )
        super().__init__(
            world_size,
            model,
            use_cuda,
            by_layer,
            False,
            agg_grad,
            optimizer=inner,
            process_group=process_group,
        )


class CentralizedAdam(GenericCentralizedOptimizer):
    """All-reduce Adam/AMSGrad (Kingma & Ba, 2015; Reddi et al., 2018)."""

    def __init__(
        self,
        world_size=None,
        model=None,
        lr=required,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0,
        amsgrad=False,
        use_cuda=False,
        by_layer=False,
        agg_grad=True,
        *,
        process_group: Any = None,
    ) -> None:
        if model is None:
            raise ValueError("model=None: pass the nn.Module to optimize")
        if lr is required:
            lr = 1e-3
        inner = Adam(
            model.parameters(),
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
        )
        super().__init__(
            world_size,
            model,
            use_cuda,
            by_layer,
            False,
            agg_grad,
            optimizer=inner,
            process_group=process_group,
        )


class CustomCentralizedOptimizer(GenericCentralizedOptimizer):
    """Wrap any optimizer: aggregate (world or custom average), clip by global L2 norm, step.

    Exactly one of ``average_world`` / ``average_custom`` must be set; with ``average_custom``
    pass ``denom`` (e.g. the all-reduced token count) to :meth:`step`. Weight averaging
    (``agg_grad=False``) always divides by the world size.
    """

    def __init__(
        self,
        model,
        world_size,
        optimizer,
        use_cuda=False,
        by_layer=False,
        agg_grad=True,
        grad_clip=float("inf"),
        average_world=False,
        average_custom=False,
        divide_before=False,
        *,
        process_group: Any = None,
    ) -> None:
        if average_world == average_custom:
            raise ValueError(
                f"average_world={average_world}, average_custom={average_custom}: set exactly one "
                "to True"
            )
        if not (grad_clip > 0):
            raise ValueError(f"grad_clip={grad_clip} must be positive (float('inf') disables)")
        super().__init__(
            world_size,
            model,
            use_cuda,
            by_layer,
            divide_before,
            agg_grad,
            optimizer=optimizer,
            process_group=process_group,
        )
        self.grad_clip = float(grad_clip)
        self.agg_mode = AVG_WORLD if average_world else AVG_CUSTOM

    @_with_step_hooks
    def step(self, closure=None, tracker=None, denom=None):  # type: ignore[override]
        """Aggregate (dividing by ``denom`` under ``average_custom``), clip, step; returns True."""
        self._closure_loss(closure)
        opt = self._inner()
        if self.agg_grad:
            self.agg.grads_(self._params(), self.agg_mode, denom)
            call_tracker(tracker, "record_batch_agg")
            if math.isfinite(self.grad_clip):
                clip_grad_norm_(self._params(), self.grad_clip)
            opt.step()
            call_tracker(tracker, "record_batch_opt_step")
        else:
            if math.isfinite(self.grad_clip):
                clip_grad_norm_(self._params(), self.grad_clip)
            opt.step()
            call_tracker(tracker, "record_batch_opt_step")
            self.agg.weights_(self._params())
            call_tracker(tracker, "record_batch_agg")
        return True
