"""``AdaptiveDataParallel``: DistributedDataParallel with adaptive batch size and checkpointing.

Drop-in for ``adaptdl.torch.AdaptiveDataParallel``. On top of DDP it

* samples the gradient noise scale (:class:`~adaptrain.torch.gradient_noise_scale.GradientNoiseScale`):
  every step early in training, then one step in up to 64 (62 at the initial batch size); the
  other steps run DDP's own C++ all-reduce untouched (no communication hook), so a compression
  hook can still be registered;
* scales every param group's ``lr`` by the scaling rule's factor around ``optimizer.step()`` via
  ``optimizer.register_step_pre_hook``/``register_step_post_hook`` (no monkey-patching), then
  restores it and advances the progress by the gain ``r_t``;
* follows the :class:`~adaptrain.torch.data.AdaptiveDataLoader`'s gradient accumulation: on
  accumulation micro-batches ``forward`` runs under ``no_sync()``; calling ``optimizer.step()``
  there does not update anything (the accumulated gradients are set aside and handed back to
  the parameters at the next ``forward``), so AdaptDL's loop
  ``zero_grad(); loss.backward(); step()`` on every micro-batch stays correct. The synchronising
  hook divides by ``replicas × accumulation steps`` so the update uses the mean gradient;
* saves and restores model, optimizer, LR scheduler, GradScaler and noise-scale state as the
  checkpoint State ``name``;
* under ``torch.no_grad()``/``inference_mode()`` runs the wrapped module directly, with no
  collective: an evaluation pass may leave a replica without a sample (the loader never pads),
  and DDP's first forward after a training step broadcasts the buffers, which would hang the
  other replicas. Each replica then evaluates with its own buffers (BatchNorm statistics
  differ from rank 0's by the replica's last training batch); the next training forward
  broadcasts them again.

With a ``torch.amp.GradScaler`` pass it as ``mp_scaler``: the statistics are divided by the
loss scale². Under gradient accumulation call ``scaler.step``/``scaler.update`` only when
``current_dataloader().is_optim_step()`` (as torch's AMP notes recommend), because ``unscale_``
works in place on the partial sums.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

import adaptrain.checkpoint as _checkpoint
from adaptrain.core import gns as _gns
from adaptrain.torch import _metrics
from adaptrain.torch.data import current_dataloader
from adaptrain.torch.gradient_noise_scale import GradientNoiseScale
from adaptrain.torch.scaling_rules import ScalingRuleBase, default_scaling_rule

__all__ = ["AdaptiveDataParallel"]

logger = logging.getLogger(__name__)


class AdaptiveDataParallel(DistributedDataParallel):
    """DistributedDataParallel with noise-scale tracking, LR scaling and checkpoint-restart.

    Args:
        model: the module to replicate.
        optimizer: the optimizer of ``model``'s parameters; its ``lr`` is scaled by
            ``scaling_rule`` during each ``step()`` (hooks, not patching).
        lr_scheduler: optional LR scheduler, checkpointed with the model.
        mp_scaler: optional ``torch.amp.GradScaler`` used for the loss.
        scaling_rule: a :class:`~adaptrain.torch.scaling_rules.ScalingRuleBase`; default
            ``AdamScale`` for Adam/AdamW/RMSprop, ``AdaScale`` otherwise.
        name: unique checkpoint name of this instance.
        max_stats_interval: at most this many optimizer steps between two noise-scale samples
            (default 64; 1 samples every step, as AdaptDL). The schedule keeps at least 16
            samples within the average's memory whatever this cap is (at the initial batch
            size, one sample in 62 steps of a ~1000-step memory once training is past its
            first ~4000 steps; fewer steps apart at larger scales); the cap bounds how stale
            the statistics get, and a sample costs a few hundred microseconds on CPU.
        window_fraction: the noise-scale average remembers this fraction of the history seen so
            far (capped at 1000 steps at the initial batch size); None for AdaptDL's fixed
            1000-step memory from the first step.
        stats_sketch_size: with a communication hook registered, sampled steps all-reduce a
            count sketch of this many values instead of the dense gradients (less traffic,
            noisier statistics; see :mod:`adaptrain.torch.gradient_noise_scale`). None
            (default): dense, exact.
        **kwargs: passed to ``DistributedDataParallel``.

    Raises:
        RuntimeError: ``torch.distributed`` is not initialised
            (call :func:`adaptrain.torch.init_process_group` first).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        lr_scheduler: Any = None,
        mp_scaler: Any = None,
        scaling_rule: ScalingRuleBase | None = None,
        name: str = "adaptdl-dataparallel",
        max_stats_interval: int = 64,
        window_fraction: float | None = 0.25,
        stats_sketch_size: int | None = None,
        **kwargs: Any,
    ) -> None:
        if not torch.distributed.is_initialized():
            raise RuntimeError(
                "AdaptiveDataParallel needs torch.distributed: call "
                "adaptrain.torch.init_process_group('gloo' or 'nccl') before creating it"
            )
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"optimizer={optimizer!r} must be a torch.optim.Optimizer")
        super().__init__(model, **kwargs)
        self._key = id(self)
        self._optimizer = optimizer
        self._mp_scaler = mp_scaler
        self.gns = GradientNoiseScale(
            self,
            optimizer,
            mp_scaler=mp_scaler,
            max_interval=max_stats_interval,
            window_fraction=window_fraction,
            sketch_size=stats_sketch_size,
        )
        self.gns.register(self)
        self.scaling_rule = (
            scaling_rule if scaling_rule is not None else (default_scaling_rule(optimizer))
        )
        self.scaling_rule.initialize(self, optimizer, patch_optimizer=True)
        # Per-step bookkeeping in a plain slotted object: assigning attributes of an
        # nn.Module goes through Module.__setattr__ (~1 µs each, several per step).
        self._rt = _StepState()
        self._state = _AdaptiveDataParallelState(
            model, optimizer, lr_scheduler, mp_scaler, self.gns, name
        )
        _checkpoint.load_state(self._state)

    # ----- forward / accumulation --------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            # No backward can follow: run the module itself, with no collective. DDP's first
            # forward after a training step broadcasts the buffers (BatchNorm statistics), and
            # an evaluation pass can leave a replica without a sample (the loader never pads),
            # whose missing forward would hang the others. The next training forward
            # broadcasts them as usual.
            return self.module(*args, **kwargs)
        if not self.training:
            return super().forward(*args, **kwargs)
        # Every training forward runs this: plain attribute reads and a few cheap calls.
        rt = self._rt
        self._restore_grads()  # gradients set aside by accumulation micro-batches, if any
        rule = self.scaling_rule
        if rule._saved_lr is not None:
            rule.restore_lr()  # a step raised after scaling the lr (else a no-op)
        sync, accum = self._step_from_loader(current_dataloader())
        gns = self.gns
        gns.count_micro_batch()
        rt.last_sync = sync
        if sync:
            watch = gns.begin_step(
                accum_steps=accum, enabled=rt.full, scale=rt.scale, output_hook=True
            )
            out = super().forward(*args, **kwargs)
            if watch:
                gns.watch_output(out)
            return out
        gns.begin_accumulation()
        with self.no_sync():
            return super().forward(*args, **kwargs)

    def _step_from_loader(self, loader: Any) -> tuple[bool, int]:
        """Set this micro-batch's batch-size scale from the loader being iterated (made the
        training loader if there is none yet); returns whether it synchronises (ends an
        optimizer step) and the micro-batches of its step."""
        rt = self._rt
        rt.full = True
        if loader is not None and not loader.training:
            loader.train()  # the loader we backpropagate from is the training loader
        if loader is None or not loader.training:
            rt.scale = 1.0
            return bool(self.require_backward_grad_sync), 1
        sync = bool(loader.is_optim_step())
        accum = max(int(loader.accumulation_steps), 1)
        init_bsz = getattr(loader, "batch_size", None) or loader.current_batch_size
        rt.init_bsz = int(init_bsz)
        scale = float(loader.current_batch_size) / float(init_bsz)
        num_replicas = self.gns._num_replicas
        planned = loader.current_local_bsz * num_replicas  # read once (a property)
        if sync:
            # The last step of a pass may hold fewer micro-batches than planned, and its last
            # micro-batch fewer samples (or up to R - 1 more): average by the micro-batches it
            # ran, and scale the lr and the progress by the samples it holds. Its statistics
            # are not sampled (the replicas' local batches differ in size).
            ran = min(int(loader._accum_count) + 1, accum) if accum > 1 else 1
            mb = loader._mb
            if mb is not None and mb.size != planned:
                scale = ((ran - 1) * planned + mb.size) / float(init_bsz)
                rt.full = False
            elif ran < accum:
                scale *= ran / accum
            accum = ran
        rt.scale = scale
        self.gns.set_accum_scale(planned / float(init_bsz))
        return sync, accum

    def _refresh_step_scale(self) -> None:
        """Before a step whose closure runs the forward pass (LBFGS): take the step's scale
        from the loader now, as that forward will, instead of the previous forward's."""
        loader = current_dataloader()
        if loader is not None and loader.training:
            self._step_from_loader(loader)

    def _stash_grads(self) -> None:
        for group in self._optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._rt.stash.append((p, p.grad))
                    p.grad = None

    def _restore_grads(self) -> None:
        if not self._rt.stash:
            return
        for p, g in self._rt.stash:
            if p.grad is None:
                p.grad = g
            else:
                p.grad.add_(g)
        self._rt.stash = []

    # ----- called by the scaling rule's step hooks ---------------------------------------------
    def _begin_optimizer_step(self) -> bool:
        """Pre-step: False on an accumulation micro-batch (gradients set aside), else True."""
        rt = self._rt
        if not rt.last_sync:
            self._stash_grads()
            return False
        gns = self.gns
        sync_time = gns.take_sync_time()
        if sync_time is not None:  # measured on sampled steps only
            _metrics.profile_sync_time(sync_time)
        gns.finish_step(rt.scale)
        return True

    def _step_scale(self) -> float:
        return self._rt.scale

    def _init_batch_size(self) -> int | None:
        return self._rt.init_bsz

    def _end_optimizer_step(self, scale: float, lr_factor: float) -> None:
        gns = self.gns
        averages = gns.averages()  # (sqr, var) as Python floats, cached between samples
        # at scale 1 the gain is exactly 1.0 ((v + s)/(v/1 + s) with identical operands)
        gain = 1.0 if scale == 1.0 else _gns.gain(averages[0], averages[1], float(scale))
        progress = gns.advance_progress(gain)
        state = self._state
        state.gain = gain
        state.lr_factor = lr_factor
        _metrics.update_step(progress, averages)  # update_progress + update_grad_params

    def _skip_zero_grad(self) -> bool:
        """In the middle of a gradient accumulation (a ``zero_grad`` now would drop the
        micro-batches so far): warn, and True."""
        if self._rt.stash or not self._rt.last_sync:
            warnings.warn("zero_grad skipped: gradients are being accumulated", stacklevel=3)
            return True
        return False

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients, except in the middle of a gradient accumulation (then a no-op)."""
        if not self._skip_zero_grad():
            super().zero_grad(set_to_none=set_to_none)

    # ----- reporting ---------------------------------------------------------------------------
    @property
    def gain(self) -> float:
        """Current estimate of the AdaScale gain ``r_t`` of the last optimizer step."""
        return self._state.gain

    def to_tensorboard(self, writer: Any, global_step: int, tag_prefix: str = "") -> None:
        """Write gradient statistics, gain, LR factor and progress to a ``SummaryWriter``."""
        if tag_prefix and not tag_prefix.endswith("/"):
            tag_prefix += "/"
        writer.add_scalar(tag_prefix + "Gradient_Norm_Sqr", self.gns.sqr_avg(), global_step)
        writer.add_scalar(tag_prefix + "Gradient_Variance", self.gns.var_avg(), global_step)
        writer.add_scalar(tag_prefix + "Gain", self._state.gain, global_step)
        writer.add_scalar(tag_prefix + "Learning_Rate_Factor", self._state.lr_factor, global_step)
        writer.add_scalar(tag_prefix + "Accum_Scale", self.gns.accum_scale, global_step)
        writer.add_scalar(tag_prefix + "Progress", self.gns.get_progress(), global_step)


class _StepState:
    """Per-step state of an AdaptiveDataParallel (not checkpointed)."""

    __slots__ = ("last_sync", "stash", "scale", "init_bsz", "full")

    def __init__(self) -> None:
        self.last_sync = True  # the last forward synchronises gradients (an optimizer step)
        self.stash: list[tuple[torch.Tensor, torch.Tensor]] = []  # set-aside accumulated grads
        self.scale = 1.0  # batch-size scale S = B/B0 of the current step
        self.init_bsz: int | None = None
        self.full = True  # the step holds its planned samples (else its statistics are skipped)


class _AdaptiveDataParallelState(_checkpoint.State):
    """Model, optimizer, scheduler, scaler, noise-scale state, gain and LR factor."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        lr_scheduler: Any,
        mp_scaler: Any,
        gns: GradientNoiseScale,
        name: str,
    ) -> None:
        super().__init__(name)
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.mp_scaler = mp_scaler
        self.gns = gns
        self.gain = 1.0
        self.lr_factor = 1.0

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "lr_scheduler": None if self.lr_scheduler is None else self.lr_scheduler.state_dict(),
            "mp_scaler": None if self.mp_scaler is None else self.mp_scaler.state_dict(),
            "gns": self.gns.state_dict(),
            "gain": self.gain,
            "lr_factor": self.lr_factor,
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.model.load_state_dict(sd["model"])
        self.optimizer.load_state_dict(sd["optimizer"])
        if sd["lr_scheduler"] is not None and self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(sd["lr_scheduler"])
        if sd["mp_scaler"] is not None and self.mp_scaler is not None:
            self.mp_scaler.load_state_dict(sd["mp_scaler"])
        self.gns.load_state_dict(sd["gns"])
        self.gain = float(sd["gain"])
        self.lr_factor = float(sd["lr_factor"])
        _metrics.update_progress(self.gns.get_progress())

    def sync(self) -> None:
        # Every replica, before rank 0 saves: fold the pending step (a collective).
        self.gns.flush()

    def save(self, fileobj: Any) -> None:
        torch.save(self.state_dict(), fileobj)

    def load(self, fileobj: Any) -> None:
        # On the CPU first: a checkpoint written by a GPU job must load where there is no GPU
        # (or another one); the model, optimizer and scaler move it to their own devices.
        self.load_state_dict(torch.load(fileobj, weights_only=True, map_location="cpu"))
