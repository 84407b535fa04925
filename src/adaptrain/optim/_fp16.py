"""Mixed-precision optimizer with fp32 master weights and dynamic loss scaling, API-compatible
with mlbench-core's ``FP16Optimizer`` (Micikevicius et al., 2018, "Mixed Precision Training").

Per step, with loss scale ``S``::

    backward_loss(loss):  (S · loss).backward()            # fp16 gradients
    step():  g = mean_workers(fp16 grads) → fp32 flat / (S · multiplier)
             n = ‖g‖₂ (clipped to grad_clip)
             if n is inf/NaN: skip, S ← S / scale_factor   (RuntimeError once S ≤ min_scale)
             else: inner optimizer steps the fp32 master copy, copied back into the fp16 model;
                   after scale_window consecutive good steps S ← min(S · scale_factor, max_scale)

As in mlbench, the master copy is one flat fp32 tensor and the inner optimizer steps it whole.
A parameter that got no gradient on any worker is left as ``torch.optim`` leaves it (mlbench's
flat step moved it by weight decay and momentum): its slice of the master weights, and of
every optimizer state tensor shaped like them (momentum, Adam's moments), is put back after
the step (zeroed where the step created the state). Scalar state shared by the whole flat
tensor (Adam's step count) still advances.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch.nn.utils import clip_grad_norm_
from torch.optim import Optimizer

from adaptrain.optim._centralized import (
    AVG_CUSTOM,
    AVG_WORLD,
    AllReduceAggregator,
    call_tracker,
    group_world_size,
)

logger = logging.getLogger(__name__)

__all__ = ["DynamicLossScaler", "FP16Optimizer"]


class DynamicLossScaler:
    """Loss scale that backs off on overflow and grows after ``scale_window`` clean steps.

    ``init_scale`` above ``max_scale`` starts at ``max_scale``.
    """

    def __init__(
        self,
        init_scale: float = 2.0**15,
        scale_factor: float = 2.0,
        scale_window: int = 2000,
        max_scale: float | None = None,
    ) -> None:
        if not (init_scale > 0 and math.isfinite(init_scale)) or not (
            scale_factor > 1 and math.isfinite(scale_factor)
        ):
            raise ValueError(
                f"init_scale={init_scale} must be finite and > 0, scale_factor={scale_factor} "
                "finite and > 1"
            )
        if scale_window < 1:
            raise ValueError(f"scale_window={scale_window} must be >= 1")
        if max_scale is not None:
            if not max_scale > 0:
                raise ValueError(f"max_scale={max_scale} must be > 0 (or None for no maximum)")
            init_scale = min(init_scale, max_scale)
        self.loss_scale = float(init_scale)
        self.scale_factor = float(scale_factor)
        self.scale_window = int(scale_window)
        self.max_scale = max_scale
        self.good_steps = 0

    def update_scale(self, overflow: bool) -> None:
        if overflow:
            self.loss_scale /= self.scale_factor
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps >= self.scale_window:
            self.loss_scale *= self.scale_factor
            if self.max_scale is not None:
                self.loss_scale = min(self.loss_scale, float(self.max_scale))
            self.good_steps = 0

    @staticmethod
    def has_overflow(grad_norm: Any) -> bool:
        return not math.isfinite(float(grad_norm))

    def state_dict(self) -> dict[str, Any]:
        return {"loss_scale": self.loss_scale, "good_steps": self.good_steps}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.loss_scale = float(sd["loss_scale"])
        self.good_steps = int(sd["good_steps"])


class FP16Optimizer:
    """fp16 model + flat fp32 master weights + dynamic loss scale (see module docstring).

    Call :meth:`set_optimizer` with an optimizer over ``[self.fp32_params]`` before stepping; a
    :meth:`load_state_dict` before it keeps the optimizer's saved state and loads it into the
    optimizer that :meth:`set_optimizer` receives. ``init_scale`` is clamped to ``max_scale``;
    ``min_scale`` must lie in ``[0, init_scale)``; ``grad_clip`` must be ``> 0`` (``inf`` or
    ``None``: no clipping).
    ``use_horovod`` is not supported (raises). Exactly one of ``average_world`` /
    ``average_custom`` must be set.
    """

    def __init__(
        self,
        fp16_model: torch.nn.Module,
        world_size: int,
        use_cuda: bool = False,
        use_horovod: bool = False,
        by_layer: bool = False,
        grad_clip: float = float("inf"),
        init_scale: float = 1024,
        scale_factor: float = 2,
        scale_window: int = 128,
        max_scale: float | None = None,
        min_scale: float = 1e-4,
        average_world: bool = False,
        average_custom: bool = False,
        divide_before: bool = False,
        *,
        process_group: Any = None,
    ) -> None:
        if use_horovod:
            raise ValueError("use_horovod=True is not supported: use torch.distributed (default)")
        if average_world == average_custom:
            raise ValueError(
                f"average_world={average_world}, average_custom={average_custom}: set exactly one"
            )
        if grad_clip is not None and not float(grad_clip) > 0:
            # clip_grad_norm_ would scale the gradients by max_norm / norm: a negative max_norm
            # reverses them (gradient ascent), 0 zeroes them, NaN poisons them, all silently
            raise ValueError(
                f"grad_clip={grad_clip} must be > 0 (the largest gradient L2 norm); pass "
                "float('inf') or None for no clipping"
            )
        self.fp16_model = fp16_model
        self.world_size = group_world_size(world_size, process_group)
        self.loss_scaler = DynamicLossScaler(init_scale, scale_factor, scale_window, max_scale)
        if not (0 <= min_scale < self.loss_scaler.loss_scale):
            raise ValueError(
                f"min_scale={min_scale} must be >= 0 and below the initial loss scale "
                f"{self.loss_scaler.loss_scale} (init_scale, clamped to max_scale)"
            )
        self.fp32_params = self.initialize_flat_fp32_weight()
        self.min_scale = float(min_scale)
        self.grad_clip = float("inf") if grad_clip is None else float(grad_clip)
        self.optimizer: Optimizer | None = None
        self.agg = AllReduceAggregator(
            self.world_size, divide_before, by_layer, use_cuda, process_group
        )
        self.agg_mode = AVG_WORLD if average_world else AVG_CUSTOM
        self.skipped_steps = 0
        self._pending_optimizer_state: dict[str, Any] | None = None

    def set_optimizer(self, optimizer: Optimizer) -> None:
        """Set the optimizer of the fp32 master weights (built over ``[self.fp32_params]``).

        If :meth:`load_state_dict` ran before, the optimizer state it held is loaded now.
        """
        if self._pending_optimizer_state is not None:
            optimizer.load_state_dict(self._pending_optimizer_state)
            self._pending_optimizer_state = None
        self.optimizer = optimizer

    def _fp16_params(self) -> list[torch.nn.Parameter]:
        return [p for p in self.fp16_model.parameters() if p.requires_grad]

    def initialize_flat_fp32_weight(self) -> torch.nn.Parameter:
        """A flat fp32 copy of the model's trainable parameters, as a Parameter with a grad."""
        params = self._fp16_params()
        if not params:
            raise ValueError("fp16_model has no trainable parameters")
        flat = torch.cat([p.detach().reshape(-1).float() for p in params])
        master = torch.nn.Parameter(flat, requires_grad=True)
        master.grad = torch.zeros_like(flat)
        return master

    @staticmethod
    def fp16_to_fp32_flat_grad(fp32_params: torch.Tensor, fp16_model: torch.nn.Module) -> None:
        """Copy the fp16 model's gradients into ``fp32_params.grad`` (flat, fp32)."""
        grads = [
            (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
            for p in fp16_model.parameters()
            if p.requires_grad
        ]
        fp32_params.grad = torch.cat(grads).to(torch.float32)

    @staticmethod
    @torch.no_grad()
    def fp32_to_fp16_weights(fp16_model: torch.nn.Module, fp32_params: torch.Tensor) -> None:
        """Copy the fp32 master weights back into the fp16 model, in place."""
        off = 0
        for p in fp16_model.parameters():
            if not p.requires_grad:
                continue
            n = p.numel()
            p.copy_(fp32_params.detach()[off : off + n].view_as(p))
            off += n

    def backward_loss(self, loss: torch.Tensor) -> None:
        """Backward of ``loss`` multiplied by the current loss scale."""
        (loss * self.loss_scaler.loss_scale).backward()

    def step(self, closure=None, tracker=None, multiplier: float = 1, denom=None) -> bool:
        """Aggregate, unscale, clip and step; returns ``False`` if the step was skipped."""
        if self.optimizer is None:
            raise RuntimeError("FP16Optimizer has no optimizer: call set_optimizer(opt) first")
        scaling = self.loss_scaler.loss_scale * multiplier
        self.agg.grads_(self._fp16_params(), self.agg_mode, denom)
        call_tracker(tracker, "record_batch_agg")
        self.fp16_to_fp32_flat_grad(self.fp32_params, self.fp16_model)
        if scaling != 1.0:
            self.fp32_params.grad.div_(scaling)
        norm = clip_grad_norm_([self.fp32_params], self.grad_clip)
        overflow = self.loss_scaler.has_overflow(norm)
        self.loss_scaler.update_scale(overflow)
        if overflow:
            self.skipped_steps += 1
            if self.loss_scaler.loss_scale <= self.min_scale:
                raise RuntimeError(
                    f"minimum loss scale ({self.min_scale}) reached: gradients keep overflowing; "
                    "lower the learning rate or check the model for inf/NaN"
                )
            logger.info("skipped step (overflow), new loss scale %s", self.loss_scaler.loss_scale)
            updated = False
        else:
            frozen = self._without_grad()
            kept = self._slices(frozen) if frozen else None
            self.optimizer.step(closure=closure)
            if kept is not None:
                self._put_back(frozen, kept)
            self.fp32_to_fp16_weights(self.fp16_model, self.fp32_params)
            updated = True
        call_tracker(tracker, "record_batch_opt_step")
        return updated

    def _without_grad(self) -> list[tuple[int, int]]:
        """``(start, end)`` in the flat master weights of each parameter with no gradient
        (after the aggregation: no gradient on any worker, the same on every worker)."""
        spans, off = [], 0
        for p in self._fp16_params():
            n = p.numel()
            if p.grad is None:
                spans.append((off, off + n))
            off += n
        return spans

    def _flat_tensors(self) -> dict[str | None, torch.Tensor]:
        """The flat master weights (key None) and the optimizer's state tensors shaped like
        them (by their state key)."""
        master = self.fp32_params.detach()
        state = self.optimizer.state.get(self.fp32_params, {})
        return {
            None: master,
            **{k: v for k, v in state.items() if torch.is_tensor(v) and v.shape == master.shape},
        }

    def _slices(self, spans: list[tuple[int, int]]) -> dict[str | None, list[torch.Tensor]]:
        """Copies of the ``spans`` of every tensor of :meth:`_flat_tensors`."""
        return {k: [t[a:b].clone() for a, b in spans] for k, t in self._flat_tensors().items()}

    @torch.no_grad()
    def _put_back(
        self, spans: list[tuple[int, int]], kept: dict[str | None, list[torch.Tensor]]
    ) -> None:
        for key, t in self._flat_tensors().items():
            old = kept.get(key)
            for i, (a, b) in enumerate(spans):
                if old is None:  # created by this step: a parameter's state before its first
                    t[a:b].zero_()
                else:
                    t[a:b].copy_(old[i])

    def zero_grad(self) -> None:
        """Reset the gradients of the master weights and of the fp16 model."""
        if self.optimizer is not None:
            self.optimizer.zero_grad()
        self.fp16_model.zero_grad()

    def state_dict(self) -> dict[str, Any]:
        return {
            "fp32_params": self.fp32_params.detach().clone(),
            "loss_scaler": self.loss_scaler.state_dict(),
            "optimizer": (
                self.optimizer.state_dict()
                if self.optimizer is not None
                else self._pending_optimizer_state
            ),
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        with torch.no_grad():
            self.fp32_params.copy_(sd["fp32_params"])
        self.fp32_to_fp16_weights(self.fp16_model, self.fp32_params)
        self.loss_scaler.load_state_dict(sd["loss_scaler"])
        if sd.get("optimizer") is not None:
            if self.optimizer is not None:
                self.optimizer.load_state_dict(sd["optimizer"])
            else:  # loaded by set_optimizer
                self._pending_optimizer_state = sd["optimizer"]
        self.skipped_steps = int(sd.get("skipped_steps", 0))
