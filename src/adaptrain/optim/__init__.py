"""Optimizers: fairscale-compatible AdaScale and mlbench-core-compatible distributed optimizers.

``from fairscale.optim import AdaScale`` → ``from adaptrain.optim import AdaScale``;
``from mlbench_core.optim.pytorch.centralized import PowerSGD`` → ``from adaptrain.optim import PowerSGD``.
"""

from adaptrain.optim._centralized import (
    CentralizedAdam,
    CentralizedSGD,
    CustomCentralizedOptimizer,
    GenericCentralizedOptimizer,
)
from adaptrain.optim._decentralized import DecentralizedSGD
from adaptrain.optim._fp16 import DynamicLossScaler, FP16Optimizer
from adaptrain.optim._powersgd import PowerSGD
from adaptrain.optim._sign import SignSGD
from adaptrain.optim._sparsified import CentralizedSparsifiedSGD, SparsifiedSGD
from adaptrain.optim.adascale import ADAPTIVE_OPTIMIZERS, AdaScale

__all__ = [
    "ADAPTIVE_OPTIMIZERS",
    "AdaScale",
    "CentralizedAdam",
    "CentralizedSGD",
    "CentralizedSparsifiedSGD",
    "CustomCentralizedOptimizer",
    "DecentralizedSGD",
    "DynamicLossScaler",
    "FP16Optimizer",
    "GenericCentralizedOptimizer",
    "PowerSGD",
    "SignSGD",
    "SparsifiedSGD",
]
