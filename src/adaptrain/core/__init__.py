"""Pure math layer: goodput model, noise-scale estimators, scaling rules, compressors.

Modules here use numpy, scipy and torch tensors only: no ``torch.distributed``, no environment,
no I/O. Higher layers (``adaptrain.dist``, ``adaptrain.torch``, ``adaptrain.optim``,
``adaptrain.sched``) import from here, never the other way round.
"""

from adaptrain.core.gns import (
    B3State,
    EMAState,
    GNSEstimate,
    b3_init,
    b3_rescale,
    b3_update,
    b3_value,
    clip_estimate,
    ema_init,
    ema_rescale,
    ema_update,
    ema_value,
    gain,
    is_finite,
    sqrt_gain,
    unbiased_estimate,
)
from adaptrain.core.goodput import (
    GoodputFunction,
    GradParams,
    PerfParams,
    fit_perf_params,
    predict_accum_time,
    predict_log_optim_time,
    predict_network_time,
    predict_step_times,
)
from adaptrain.core.scaling import (
    adascale_factor,
    legw_factor,
    linear_factor,
    sqrt_adascale_factor,
    sqrt_factor,
)

__all__ = [
    "B3State",
    "EMAState",
    "GNSEstimate",
    "b3_init",
    "b3_rescale",
    "b3_update",
    "b3_value",
    "clip_estimate",
    "ema_init",
    "ema_rescale",
    "ema_update",
    "ema_value",
    "gain",
    "is_finite",
    "sqrt_gain",
    "unbiased_estimate",
    "GoodputFunction",
    "GradParams",
    "PerfParams",
    "fit_perf_params",
    "predict_accum_time",
    "predict_log_optim_time",
    "predict_network_time",
    "predict_step_times",
    "adascale_factor",
    "legw_factor",
    "linear_factor",
    "sqrt_adascale_factor",
    "sqrt_factor",
]
