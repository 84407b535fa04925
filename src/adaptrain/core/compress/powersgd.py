"""PowerSGD low-rank gradient compression with error feedback (Vogels, Karimireddy & Jaggi, 2019,
"PowerSGD: Practical Low-Rank Gradient Compression for Distributed Optimization").

For each gradient tensor reshaped to an ``n × m`` matrix ``M_w = G_w + E_w`` (gradient plus
error memory) on worker ``w``, with a query ``Q`` (``m × r``) shared by all workers::

    P  = mean_w(M_w Q)            # all-reduce n·r numbers
    P  = orthogonalize(P)         # identical on every worker
    Q' = mean_w(M_wᵀ P)           # all-reduce m·r numbers
    out = P Q'ᵀ                   # ≈ mean_w(M_w), rank r
    E_w ← M_w − out               # error feedback: what the approximation dropped

Tensors with fewer than two dimensions are averaged uncompressed. ``Q`` is drawn from a
generator seeded by ``(seed, step, index)``, so every worker draws the same query without
communication; with ``reuse_query`` (warm start) the previous ``Q'`` is used instead.

State is a :class:`PowerSGDState` of tensors and ints; :func:`powersgd_update` is pure apart
from the communicator's collectives.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from adaptrain.core.compress._comm import LOCAL, Communicator

__all__ = ["PowerSGDState", "PowerSGDResult", "orthogonalize", "powersgd_init", "powersgd_update"]


class PowerSGDState(NamedTuple):
    """Explicit PowerSGD state for a list of tensors.

    Attributes:
        memories: error-feedback memory per tensor (same shapes as the gradients).
        qs: current query per tensor, ``m × r`` (``0 × 0`` for tensors sent uncompressed).
        step: number of updates done.
        seed: seed of the query generator (must be equal on all workers).
        rank: target rank ``r`` of the approximation.
    """

    memories: tuple[torch.Tensor, ...]
    qs: tuple[torch.Tensor, ...]
    step: int
    seed: int
    rank: int


class PowerSGDResult(NamedTuple):
    """Outcome of one update: averaged approximate gradients, the factors and the traffic."""

    grads: list[torch.Tensor]
    ps: list[torch.Tensor]
    qs: list[torch.Tensor]
    sent_bytes: int
    dense_bytes: int


def _matrix_shape(shape: Sequence[int]) -> tuple[int, int] | None:
    if len(shape) < 2:
        return None
    return int(shape[0]), int(math.prod(shape[1:]))


def _eff_rank(shape: Sequence[int], rank: int) -> int:
    nm = _matrix_shape(shape)
    return 0 if nm is None else min(nm[0], nm[1], rank)


def _query(m: int, r: int, seed: int, step: int, index: int, dtype, device) -> torch.Tensor:
    g = torch.Generator(device="cpu")
    g.manual_seed((((seed * 1_000_003) + step) * 10_007 + index) % (2**63 - 1))
    return torch.randn(m, r, generator=g, dtype=torch.float32).to(dtype=dtype, device=device)


def orthogonalize(p: torch.Tensor) -> torch.Tensor:
    """Orthonormal basis (columns) of ``p``'s column space via reduced QR; a new tensor.

    Deterministic for equal inputs, so all workers obtain the same basis from the same ``P``.
    """
    if p.ndim != 2:
        raise ValueError(f"orthogonalize expects a 2-D matrix, got shape {tuple(p.shape)}")
    x = p if p.dtype in (torch.float32, torch.float64) else p.float()  # QR needs fp32/fp64
    q, _ = torch.linalg.qr(x, mode="reduced")
    return q.to(p.dtype)


def powersgd_init(
    shapes: Sequence[Sequence[int]],
    rank: int = 1,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> PowerSGDState:
    """Zero error memories and step-0 queries for tensors of the given ``shapes``."""
    if int(rank) < 1:
        raise ValueError(f"PowerSGD rank={rank} must be a positive integer (e.g. rank=1)")
    shapes = [tuple(int(d) for d in s) for s in shapes]
    memories = tuple(torch.zeros(s, dtype=dtype, device=device) for s in shapes)
    qs = []
    for i, s in enumerate(shapes):
        nm = _matrix_shape(s)
        if nm is None:
            qs.append(torch.zeros(0, 0, dtype=dtype, device=device))
        else:
            qs.append(_query(nm[1], _eff_rank(s, rank), seed, 0, i, dtype, device))
    return PowerSGDState(memories, tuple(qs), 0, int(seed), int(rank))


def powersgd_update(
    grads: Sequence[torch.Tensor],
    state: PowerSGDState,
    comm: Communicator = LOCAL,
    *,
    reuse_query: bool = False,
    error_feedback: bool = True,
) -> tuple[PowerSGDResult, PowerSGDState]:
    """One PowerSGD round over ``grads``; returns the averaged approximations and the new state.

    Inputs are not modified. Two all-reduces carry all ``P`` factors and all ``Q`` factors
    (packed), one more carries the uncompressed (≤1-D) tensors.
    """
    if len(grads) != len(state.memories):
        raise ValueError(
            f"got {len(grads)} gradients but the state was initialised for {len(state.memories)}"
        )
    mats: list[tuple[int, torch.Tensor]] = []  # (index, n×m matrix M_w)
    flat_idx: list[int] = []
    inputs: list[torch.Tensor] = []
    for i, (g, mem) in enumerate(zip(grads, state.memories)):
        if g.shape != mem.shape:
            raise ValueError(
                f"gradient {i} has shape {tuple(g.shape)}, state expects {tuple(mem.shape)}"
            )
        x = g + mem if error_feedback else g.clone()
        inputs.append(x)
        nm = _matrix_shape(x.shape)
        if nm is None:
            flat_idx.append(i)
        else:
            mats.append((i, x.reshape(nm)))

    itemsize = grads[0].element_size() if grads else 4
    dense_bytes = sum(g.numel() for g in grads) * itemsize
    sent = 0
    outs: list[torch.Tensor | None] = [None] * len(grads)
    new_qs = list(state.qs)

    # uncompressed small tensors: one packed all-reduce
    if flat_idx:
        packed = torch.cat([inputs[i].reshape(-1) for i in flat_idx])
        sent += packed.numel() * packed.element_size()
        packed = comm.all_reduce_mean(packed)
        off = 0
        for i in flat_idx:
            n = inputs[i].numel()
            outs[i] = packed[off : off + n].reshape(inputs[i].shape).clone()
            off += n

    ps_out: list[torch.Tensor] = []
    qs_out: list[torch.Tensor] = []
    if mats:
        queries = []
        for i, m in mats:
            r = _eff_rank(inputs[i].shape, state.rank)
            if reuse_query and state.step > 0:
                q = state.qs[i]
            else:
                q = _query(m.shape[1], r, state.seed, state.step, i, m.dtype, m.device)
            queries.append(q)
        p_flat = torch.cat([(m @ q).reshape(-1) for (_, m), q in zip(mats, queries)])
        sent += p_flat.numel() * p_flat.element_size()
        p_flat = comm.all_reduce_mean(p_flat)
        ps, off = [], 0
        for (_, m), q in zip(mats, queries):
            k = m.shape[0] * q.shape[1]
            ps.append(orthogonalize(p_flat[off : off + k].reshape(m.shape[0], q.shape[1])))
            off += k
        q_flat = torch.cat([(m.t() @ p).reshape(-1) for (_, m), p in zip(mats, ps)])
        sent += q_flat.numel() * q_flat.element_size()
        q_flat = comm.all_reduce_mean(q_flat)
        off = 0
        for (i, m), p in zip(mats, ps):
            k = m.shape[1] * p.shape[1]
            q = q_flat[off : off + k].reshape(m.shape[1], p.shape[1]).clone()
            off += k
            outs[i] = (p @ q.t()).reshape(inputs[i].shape)
            new_qs[i] = q
            ps_out.append(p)
            qs_out.append(q)

    if error_feedback:
        new_mem = tuple(
            torch.zeros_like(x) if j in flat_idx else x - o
            for j, (x, o) in enumerate(zip(inputs, outs))
        )
    else:
        new_mem = state.memories
    new_state = PowerSGDState(new_mem, tuple(new_qs), state.step + 1, state.seed, state.rank)
    result = PowerSGDResult([o for o in outs], ps_out, qs_out, sent, dense_bytes)  # type: ignore[misc]
    return result, new_state
