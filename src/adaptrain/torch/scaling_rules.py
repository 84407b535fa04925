"""Learning-rate scaling rules for :class:`~adaptrain.torch.AdaptiveDataParallel`.

API of ``adaptdl.torch.scaling_rules``: each rule's ``scale_lr(scale)`` returns the factor that
multiplies every param group's ``lr`` for a step at batch-size scale ``S = B/B0``; the factors
themselves are the pure functions of :mod:`adaptrain.core.scaling`:

* :class:`AdaScale` — ``r = (var + sqr)/(var/S + sqr)`` (Johnson et al., 2020, arXiv:2007.05105);
* :class:`AdamScale` — ``sqrt(r)``, AdaptDL's variant for Adam/AdamW/RMSprop;
* :class:`LinearScale` — ``S`` (Goyal et al., 2017); :class:`SqrtScale` — ``sqrt(S)``;
* :class:`LEGWScale` — ``sqrt(S)`` after a warm-up of ``S·base_warmup_epochs`` epochs measured
  in progress (You et al., 2019, arXiv:1901.08256).

How the factor is applied. :meth:`ScalingRuleBase.initialize` registers
``optimizer.register_step_pre_hook``/``register_step_post_hook`` (torch's sanctioned mechanism;
``optimizer.step`` itself is never replaced): before the step every ``lr`` is multiplied by the
factor, after it the original values are restored, so schedulers and checkpoints only ever see
the unscaled ``lr``. :meth:`ScalingRuleBase.step` is AdaptDL's explicit form (it just calls
``optimizer.step`` when the hooks are installed).

A step that raises skips torch's post-step hooks. The unscaled values still come back: a
closure passed to ``step`` is wrapped so that its exception restores them at once; otherwise
they are restored at the next forward of ``AdaptiveDataParallel``, the next step, or
:meth:`ScalingRuleBase.restore_lr`; and ``optimizer.state_dict()`` (hence every checkpoint)
reports the unscaled values even in between (a state-dict post-hook). A scheduler stepped right
after an exception raised by the optimizer's own update, before any of these, would see the
scaled value.
"""

from __future__ import annotations

import math
import warnings
import weakref
from typing import Any

import numpy as np
import torch

from adaptrain.core import scaling as _scaling

__all__ = ["ScalingRuleBase", "AdaScale", "AdamScale", "LinearScale", "SqrtScale", "LEGWScale"]

#: optimizer → the rule whose step hooks it carries (one per optimizer)
_ATTACHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class ScalingRuleBase:
    """Base class: scales the learning rate of an optimizer used with AdaptiveDataParallel.

    .. code-block:: python

        optim = torch.optim.SGD(model.parameters(), lr=0.001)
        adascale = AdaScale()
        model = AdaptiveDataParallel(model, optim, scaling_rule=adascale)
        for batch in loader:
            optim.zero_grad()
            loss = ...
            loss.backward()
            adascale.step()          # or optim.step(): the same thing
    """

    def __init__(self) -> None:
        self.adp: Any = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._handles: list[Any] = []
        self._saved_lr: list[Any] | None = None
        self._in_step = False  # between a real step's pre and post hooks
        self._in_closure = 0  # inside the closure of a step (which may run forward passes)
        self._step_scale = 1.0
        self.last_factor = 1.0

    def scale_lr(self, scale: float) -> Any:
        """Factor (a float, or one per param group) for a step at batch-size scale ``scale``."""
        raise NotImplementedError

    # ----- wiring ------------------------------------------------------------------------------
    def initialize(self, adp: Any, optimizer: torch.optim.Optimizer, patch_optimizer: bool = False):
        """Bind to ``adp`` and ``optimizer``; with ``patch_optimizer`` install the step hooks.

        (The name is AdaptDL's; nothing is patched: torch's step pre/post hooks are used.)
        """
        if self._handles:
            raise RuntimeError(
                f"{type(self).__name__} is already attached to an optimizer; create one scaling "
                "rule per AdaptiveDataParallel"
            )
        self.adp = adp
        self._optimizer = optimizer
        if patch_optimizer:
            prev = _ATTACHED.get(optimizer)
            if prev is not None and prev is not self and prev._handles:
                # Two sets of hooks would scale the lr twice and count progress twice.
                warnings.warn(
                    f"this optimizer's lr was already scaled by a {type(prev).__name__} of "
                    "another AdaptiveDataParallel; that one is detached (one "
                    "AdaptiveDataParallel per optimizer)",
                    stacklevel=3,
                )
                prev.detach()
            _ATTACHED[optimizer] = self
            self._handles = [
                optimizer.register_step_pre_hook(self._pre_step_hook),
                optimizer.register_step_post_hook(self._post_step_hook),
                optimizer.register_state_dict_post_hook(self._state_dict_hook),
            ]

    def detach(self) -> None:
        """Remove the step hooks, first putting back the unscaled ``lr`` values if a step that
        raised left them scaled (nothing would restore them once the hooks are gone)."""
        if self._optimizer is not None and self._handles and not self._in_closure:
            self._in_step = False
            self._restore_lr(self._optimizer)
        for h in self._handles:
            h.remove()
        self._handles = []

    def _pre_step_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        # Runs on every optimizer step: the common case (no closure, nothing left scaled)
        # takes no call beyond the owner's and the rule's own.
        adp = self.adp
        if adp is None:
            raise ValueError("AdaptiveDataParallel instance is not set!")
        if self._saved_lr is not None:
            self._restore_lr(optimizer)  # the last step raised before its post hook
        self._in_step = False
        # (``args[0]`` is the optimizer: a closure comes as a second argument or a keyword)
        if (len(args) > 1 or kwargs) and _closure_of(args, kwargs) is not None:
            # The closure runs the step's forward after this hook: take the step's batch-size
            # scale now (LBFGS reads the lr before calling it), not the previous forward's.
            refresh = getattr(adp, "_refresh_step_scale", None)
            if refresh is not None:
                refresh()
        if not adp._begin_optimizer_step():
            return  # an accumulation micro-batch: the optimizer sees no gradient
        self._in_step = True
        scale = adp._step_scale()
        self._step_scale = scale
        factor = self.scale_lr(scale)
        groups = optimizer.param_groups
        if isinstance(factor, (int, float)):
            self.last_factor = factor = float(factor)
            if factor == 1.0:
                return  # every lr unchanged: nothing to scale or restore
            factors = [factor] * len(groups)
        else:  # one factor per param group
            factors = np.broadcast_to(np.asarray(factor, dtype=np.float64), (len(groups),))
            self.last_factor = float(np.mean(factors))
        self._saved_lr = [pg["lr"] for pg in groups]
        for f, pg in zip(factors, groups):
            pg["lr"] = pg["lr"] * float(f)
        return self._guard_closure(optimizer, args, kwargs)

    def _guard_closure(self, optimizer: Any, args: Any, kwargs: Any) -> Any:
        """Wrap a closure passed to ``step`` so that its exception restores the ``lr`` values
        (torch runs no post-step hook after an exception). ``args[0]`` is the optimizer."""
        closure = _closure_of(args, kwargs)
        if closure is None:
            return None

        def guarded(*a: Any, **k: Any) -> Any:
            self._in_closure += 1
            try:
                return closure(*a, **k)
            except BaseException:
                self._in_step = False
                self._restore_lr(optimizer)
                raise
            finally:
                self._in_closure -= 1

        if len(args) > 1:
            return (args[0], guarded, *args[2:]), kwargs
        return args, {**kwargs, "closure": guarded}

    def _state_dict_hook(self, optimizer: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
        """``optimizer.state_dict()`` reports the unscaled ``lr`` even inside a step."""
        if self._saved_lr is not None:
            for lr, pg in zip(self._saved_lr, state_dict["param_groups"]):
                pg["lr"] = lr
        return state_dict

    def _post_step_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self._in_step:
            return
        self._in_step = False
        if self._saved_lr is not None:
            self._restore_lr(optimizer)
        self.adp._end_optimizer_step(self._step_scale, self.last_factor)

    def restore_lr(self) -> None:
        """Put back the unscaled ``lr`` values if a step that raised left them scaled (a no-op
        otherwise, and inside a step's closure)."""
        if self._optimizer is not None and not self._in_closure:
            self._in_step = False
            self._restore_lr(self._optimizer)

    def _restore_lr(self, optimizer: Any) -> None:
        """Put back the unscaled ``lr`` values saved by the pre-step hook, if any."""
        if self._saved_lr is not None:
            for lr, pg in zip(self._saved_lr, optimizer.param_groups):
                pg["lr"] = lr
            self._saved_lr = None

    # ----- AdaptDL's explicit API --------------------------------------------------------------
    def step(self, *args: Any, **kwargs: Any) -> Any:
        """Run one optimizer step with the scaled learning rate (``optimizer.step(*args)``)."""
        if self.adp is None or self._optimizer is None:
            raise ValueError("AdaptiveDataParallel instance is not set!")
        hooked = bool(self._handles)
        if not hooked:  # run the hooks' work around the step here
            guarded = self._pre_step_hook(self._optimizer, (self._optimizer, *args), kwargs)
            if guarded is not None:
                args, kwargs = tuple(guarded[0][1:]), guarded[1]
        try:
            out = self._optimizer.step(*args, **kwargs)
        except BaseException:
            self.restore_lr()
            raise
        if not hooked:
            self._post_step_hook(self._optimizer, args, kwargs)
        return out

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        """``optimizer.zero_grad``; a no-op in the middle of gradient accumulation (as
        ``AdaptiveDataParallel.zero_grad``), so AdaptDL's per-micro-batch loop keeps the
        micro-batches accumulated so far."""
        if self._optimizer is None:
            raise ValueError("AdaptiveDataParallel instance is not set!")
        skip = getattr(self.adp, "_skip_zero_grad", None)
        if skip is None or not skip():
            self._optimizer.zero_grad(*args, **kwargs)

    # ----- helpers ------------------------------------------------------------------------------
    def _stats(self) -> tuple[float, float, float]:
        gns = self.adp.gns
        return gns.sqr_avg(), gns.var_avg(), gns.get_progress()


def _closure_of(args: Any, kwargs: Any) -> Any:
    """The closure passed to ``optimizer.step`` as seen by a step hook (``args[0]`` is the
    optimizer), or None."""
    if len(args) > 1 and callable(args[1]):
        return args[1]
    closure = kwargs.get("closure")
    return closure if callable(closure) else None


class AdaScale(ScalingRuleBase):
    """AdaScale: ``lr · r`` with ``r = (var + sqr)/(var/S + sqr)`` from the GNS estimate."""

    def scale_lr(self, scale: float) -> float:
        if scale == 1.0:
            return 1.0  # gain(1) = 1 exactly; skips the numpy round trip on the common path
        sqr, var, progress = self._stats()
        return _scaling.adascale_factor(scale, sqr, var, progress)


class AdamScale(AdaScale):
    """Square-root AdaScale ``lr · r ** power`` (``power`` 0.5: ``sqrt(r)``) for Adam, AdamW and
    RMSprop (AdaptDL's variant, with its ``power`` argument)."""

    def scale_lr(self, scale: float, power: float = 0.5) -> float:
        if not (math.isfinite(power) and power >= 0):
            raise ValueError(
                f"power={power} must be finite and >= 0 (0.5: square-root AdaScale, 1: AdaScale)"
            )
        if scale == 1.0:
            return 1.0
        sqr, var, progress = self._stats()
        return _scaling.adascale_factor(scale, sqr, var, progress) ** power


class LinearScale(ScalingRuleBase):
    """Linear scaling ``lr · S`` (Goyal et al., 2017)."""

    def scale_lr(self, scale: float) -> float:
        return _scaling.linear_factor(scale)


class SqrtScale(ScalingRuleBase):
    """Square-root scaling ``lr · sqrt(S)`` (Krizhevsky, 2014)."""

    def scale_lr(self, scale: float) -> float:
        return _scaling.sqrt_factor(scale)


class LEGWScale(ScalingRuleBase):
    """LEGW: ``lr · sqrt(S) · min(1, progress / (S · base_warmup_epochs · steps_per_epoch))``.

    ``progress`` is AdaptDL's effective (scale-invariant) steps, ``steps_per_epoch`` is
    ``data_size / B0`` with ``B0`` the loader's initial batch size.

    Args:
        base_warmup_epochs: warm-up length in epochs at the initial batch size.
        data_size: number of samples in the dataset.
    """

    def __init__(self, base_warmup_epochs: float, data_size: int) -> None:
        super().__init__()
        if not 0 <= base_warmup_epochs < math.inf:
            raise ValueError(f"base_warmup_epochs={base_warmup_epochs} must be finite and ≥ 0")
        if not 0 < data_size < math.inf:
            raise ValueError(f"data_size={data_size} must be positive and finite")
        self._base_warmup_epochs = base_warmup_epochs
        self._data_size = data_size

    def scale_lr(self, scale: float) -> float:
        init_bsz = self.adp._init_batch_size() if self.adp is not None else None
        if not init_bsz:
            init_bsz = 1
        progress = self.adp.gns.get_progress()
        return _scaling.legw_factor(
            scale, progress, self._base_warmup_epochs, self._data_size / init_bsz
        )


def default_scaling_rule(optimizer: torch.optim.Optimizer) -> ScalingRuleBase:
    """AdamScale for Adam/AdamW/RMSprop (and their subclasses), AdaScale otherwise."""
    adaptive = (torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop)
    return AdamScale() if isinstance(optimizer, adaptive) else AdaScale()
