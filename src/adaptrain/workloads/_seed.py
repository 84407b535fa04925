"""Seeded construction of workload models."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["seeded"]


@contextlib.contextmanager
def seeded(seed: int | None) -> Iterator[None]:
    """Inside, torch's CPU RNG starts from ``seed``; outside, its state is as before.

    ``seed=None`` does nothing (the global RNG is used and advanced as usual).
    """
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield
