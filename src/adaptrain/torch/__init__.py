"""``adaptdl.torch``-compatible API: ``import adaptdl.torch`` → ``import adaptrain.torch``."""

from adaptrain.torch import gradient_noise_scale, scaling_rules
from adaptrain.torch._process_group import init_process_group
from adaptrain.torch.accumulator import Accumulator
from adaptrain.torch.data import (
    AdaptiveDataLoader,
    AdaptiveDataLoaderHelper,
    AdaptiveDataLoaderMixin,
    ElasticSampler,
    current_dataloader,
)
from adaptrain.torch.epoch import current_epoch, finished_epochs, remaining_epochs_until
from adaptrain.torch.parallel import AdaptiveDataParallel

__all__ = [
    "init_process_group",
    "AdaptiveDataParallel",
    "AdaptiveDataLoader",
    "AdaptiveDataLoaderHelper",
    "AdaptiveDataLoaderMixin",
    "ElasticSampler",
    "Accumulator",
    "current_dataloader",
    "current_epoch",
    "finished_epochs",
    "remaining_epochs_until",
    "gradient_noise_scale",
    "scaling_rules",
]
