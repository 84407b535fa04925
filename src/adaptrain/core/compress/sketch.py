"""Count sketch: a linear, unbiased compression of a vector's squared norm.

Charikar, Chen & Farach-Colton (2002), "Finding Frequent Items in Data Streams". A seed draws a
hash ``h: [d] → [k]`` and signs ``s: [d] → {±1}``; the sketch of ``x`` is

    (S x)_j = Σ_{i : h(i) = j} s_i x_i,            j = 1..k.

It is linear (``S(x + y) = S x + S y`` for one seed, so workers that sketch with a shared seed
can sum their sketches in one all-reduce of ``k`` values), and ``|S x|²`` estimates ``|x|²``
without bias over the draw of ``(h, s)``: the cross terms ``s_i s_i' x_i x_i'`` of colliding
coordinates average to zero. Its variance is below ``2 |x|⁴ / k``. The noise-scale statistics
use it to measure the mean gradient's norm under a compressing communication hook.
"""

from __future__ import annotations

import torch

__all__ = ["count_sketch"]


def count_sketch(x: torch.Tensor, size: int, seed: int) -> torch.Tensor:
    """The ``size``-bucket count sketch of the flattened ``x`` under the hash drawn by ``seed``.

    Returns a 1-D tensor of ``size`` entries, in ``x``'s dtype promoted to at least float32.
    Same ``seed`` and ``x.numel()`` on every worker: the same hash.
    """
    if int(size) < 1:
        raise ValueError(f"size={size} must be ≥ 1 bucket")
    flat = x.reshape(-1)
    dtype = torch.promote_types(flat.dtype, torch.float32)
    gen = torch.Generator(device=flat.device)
    gen.manual_seed(int(seed))
    n = flat.numel()
    buckets = torch.randint(0, int(size), (n,), generator=gen, device=flat.device)
    signs = torch.randint(0, 2, (n,), generator=gen, device=flat.device).to(dtype).mul_(2).sub_(1)
    out = torch.zeros(int(size), dtype=dtype, device=flat.device)
    return out.index_add_(0, buckets, flat.to(dtype) * signs)
