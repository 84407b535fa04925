"""Goodput model (``adaptdl.goodput`` compatible): performance fit × statistical efficiency.

See :mod:`adaptrain.core.goodput` for the model and the fit.
"""

from adaptrain.core.goodput import GoodputFunction, GradParams, PerfParams, fit_perf_params

__all__ = ["PerfParams", "GradParams", "GoodputFunction", "fit_perf_params"]
