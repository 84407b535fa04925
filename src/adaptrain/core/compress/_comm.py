"""The communication step, as a parameter of every compressor.

Compressors in :mod:`adaptrain.core.compress` never call ``torch.distributed``: they take a
*communicator*, any object with ``world_size``, ``all_reduce_mean(t)`` and ``all_gather(t)``.
:class:`LocalCommunicator` is the one-worker identity (tests, single process);
``adaptrain.dist.hooks.TorchCommunicator`` wraps a ``torch.distributed`` process group.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

__all__ = ["Communicator", "LocalCommunicator"]


@runtime_checkable
class Communicator(Protocol):
    """What a compressor needs from the network.

    ``all_reduce_mean(t)`` returns the element-wise mean of ``t`` over all workers (it may work
    in place and return ``t``); ``all_gather(t)`` returns the list of every worker's ``t``, by rank
    (all workers pass tensors of the same shape and dtype).
    """

    @property
    def world_size(self) -> int: ...

    def all_reduce_mean(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]: ...


class LocalCommunicator:
    """A world of one worker: the mean is the tensor itself, the gather a one-element list."""

    world_size = 1

    def all_reduce_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return [tensor]


LOCAL = LocalCommunicator()
