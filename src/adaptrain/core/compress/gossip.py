"""Gossip averaging for decentralised SGD (Lian et al., 2017, "Can decentralized algorithms
outperform centralized algorithms?").

One gossip round replaces a worker's vector by the uniform average over its closed neighbourhood:
``x_i ← (x_i + Σ_{j∈N(i)} x_j) / (|N(i)| + 1)``. On a regular graph (e.g. a ring) the mixing
matrix is doubly stochastic, so repeated rounds converge to the mean of the initial vectors.
It is computed as ``x_i + Σ_j (x_j − x_i) / (|N(i)| + 1)``, which leaves identical replicas
exactly unchanged (the plain average rounds, so a converged model would drift).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["gossip_mix"]


def gossip_mix(own: torch.Tensor, neighbours: Sequence[torch.Tensor]) -> torch.Tensor:
    """Uniform gossip average of ``own`` with the ``neighbours``' tensors (a new tensor)."""
    delta = torch.zeros_like(own)
    for t in neighbours:
        if t.shape != own.shape:
            raise ValueError(
                f"neighbour tensor of shape {tuple(t.shape)} != own {tuple(own.shape)}"
            )
        delta.add_(t - own)
    return delta.div_(len(neighbours) + 1).add_(own)
