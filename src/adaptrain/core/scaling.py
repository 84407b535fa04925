"""Learning-rate scaling rules as pure factor functions (pure math).

Each rule maps the batch-size scale ``S = B / B0`` (and, for some, the gradient statistics and
the training progress) to the factor that multiplies the base learning rate. The training layer
(``adaptrain.torch.scaling_rules``) wraps these in AdaptDL's classes; nothing here touches
torch.distributed, the environment or files.

* AdaScale (Johnson et al., 2020, arXiv:2007.05105): ``r = (var + sqr)/(var/S + sqr)``.
* Square-root AdaScale, for Adam/AdamW/RMSprop as AdaptDL does: ``sqrt(r)``.
* Linear scaling (Goyal et al., 2017, arXiv:1706.02677): ``S``.
* Square-root scaling (Krizhevsky, 2014, arXiv:1404.5997): ``sqrt(S)``.
* LEGW, linear-epoch gradual warm-up (You et al., 2019, arXiv:1901.08256): ``sqrt(S)`` after a
  warm-up of ``base_warmup_epochs · S`` epochs, ramping linearly in the progress before it.
"""

from __future__ import annotations

import math

from adaptrain.core.gns import gain, sqrt_gain

__all__ = [
    "adascale_factor",
    "sqrt_adascale_factor",
    "linear_factor",
    "sqrt_factor",
    "legw_factor",
]


def _check_scale(scale: float) -> None:
    if not (scale > 0 and math.isfinite(scale)):
        raise ValueError(
            f"scale={scale} must be positive and finite (batch size over base batch size)"
        )


def adascale_factor(scale: float, sqr: float, var: float, progress: float = 0.0) -> float:
    """AdaScale: the gain ``r = (var + sqr)/(var/scale + sqr)``, in ``[1, scale]``."""
    _check_scale(scale)
    return float(gain(sqr, var, scale))


def sqrt_adascale_factor(scale: float, sqr: float, var: float, progress: float = 0.0) -> float:
    """Square-root AdaScale ``sqrt(r)`` for adaptive optimizers (Adam, AdamW, RMSprop)."""
    _check_scale(scale)
    return float(sqrt_gain(sqr, var, scale))


def linear_factor(scale: float, sqr: float = 0.0, var: float = 0.0, progress: float = 0.0) -> float:
    """Linear scaling rule: ``scale``."""
    _check_scale(scale)
    return float(scale)


def sqrt_factor(scale: float, sqr: float = 0.0, var: float = 0.0, progress: float = 0.0) -> float:
    """Square-root scaling rule: ``sqrt(scale)``."""
    _check_scale(scale)
    return math.sqrt(scale)


def legw_factor(
    scale: float,
    progress: float,
    base_warmup_epochs: float,
    steps_per_epoch: float,
) -> float:
    """LEGW: ``sqrt(scale) · min(1, progress / (scale · base_warmup_epochs · steps_per_epoch))``.

    Args:
        scale: batch size over base batch size.
        progress: statistical progress in base-batch-size steps (AdaptDL's effective steps).
        base_warmup_epochs: warm-up length in epochs at the base batch size.
        steps_per_epoch: steps per epoch at the base batch size (``data_size / B0``).

    Raises:
        ValueError: for a scale that is not positive and finite, a ``base_warmup_epochs`` that
            is not finite and ≥ 0, a ``steps_per_epoch`` that is not finite and > 0, or a NaN
            ``progress`` (each would give a NaN factor, or 0 for ever).
    """
    _check_scale(scale)
    if not (0 <= base_warmup_epochs < math.inf and 0 < steps_per_epoch < math.inf):
        raise ValueError(
            f"base_warmup_epochs={base_warmup_epochs} must be finite and ≥ 0 and "
            f"steps_per_epoch={steps_per_epoch} finite and > 0"
        )
    if math.isnan(progress):
        raise ValueError(f"progress={progress} must be a number (effective steps), not NaN")
    warmup_steps = scale * base_warmup_epochs * steps_per_epoch
    peak = math.sqrt(scale)
    if warmup_steps <= 0 or progress >= warmup_steps:
        return peak
    return peak * max(progress, 0.0) / warmup_steps
