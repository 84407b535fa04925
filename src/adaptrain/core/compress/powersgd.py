"""PowerSGD low-rank gradient compression with error feedback (Vogels, Karimireddy & Jaggi, 2019,
"PowerSGD: Practical Low-Rank Gradient Compression for Distributed Optimization").

For each gradient tensor reshaped to an ``n × m`` matrix ``M_w = G_w + E_w`` (gradient plus
error memory) on worker ``w``, with a query ``Q`` (``m × r``) shared by all workers::

    P  = mean_w(M_w Q)            # all-reduce n·r numbers
    P  = orthogonalize(P)         # identical on every worker
    Q' = mean_w(M_wᵀ P)           # all-reduce m·r numbers
    out = P Q'ᵀ                   # ≈ mean_w(M_w), rank r
    E_w ← M_w − out               # error feedback: what the approximation dropped

Tensors with fewer than two dimensions are averaged uncompressed, and so are matrices for which
``(n + m) · r · min_compression_rate ≥ n · m`` (torch's rule; the default rate 0 compresses
every matrix, rate 1 sends a matrix uncompressed when ``P`` and ``Q`` would not be smaller, e.g.
a ``10 × 10`` matrix at rank 8: 160 numbers instead of 100, and lossy).

``Q`` is drawn from a generator seeded by ``(seed, step, index)``, so every worker draws the
same query without communication; with ``reuse_query`` (warm start) the previous ``Q'`` is used
instead. ``index`` is the tensor's position unless ``query_indices`` names it otherwise (the DDP
hook passes parameter indices, so the queries do not depend on how DDP buckets the parameters).

Non-finite values (an fp16 overflow under AMP) do not poison the state: when the all-reduced
``P``, ``Q'`` or uncompressed values are not finite (every worker sees the same all-reduced
values, so all agree), the update returns a non-finite output, so that a ``GradScaler`` skips
the step, and the *previous* state unchanged (memories, queries and step). Torch's
``powerSGD_hook`` folds the ``inf``/``NaN`` into its error memory, and every later output is
``NaN``.

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


def _factor_shape(
    shape: Sequence[int], rank: int, min_compression_rate: float = 0.0
) -> tuple[int, int, int] | None:
    """``(n, m, r)`` of a tensor that is compressed; ``None`` for one averaged uncompressed."""
    nm = _matrix_shape(shape)
    if nm is None:
        return None
    n, m = nm
    r = min(n, m, int(rank))
    if (n + m) * r * min_compression_rate >= n * m:
        return None
    return n, m, r


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


def _query_indices(query_indices: Sequence[int] | None, n: int) -> list[int]:
    if query_indices is None:
        return list(range(n))
    idx = [int(i) for i in query_indices]
    if len(idx) != n:
        raise ValueError(f"got {len(idx)} query_indices for {n} tensors")
    return idx


def powersgd_init(
    shapes: Sequence[Sequence[int]],
    rank: int = 1,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    *,
    query_indices: Sequence[int] | None = None,
    min_compression_rate: float = 0.0,
) -> PowerSGDState:
    """Zero error memories and step-0 queries for tensors of the given ``shapes``.

    ``query_indices`` (default ``0 … len(shapes)-1``) identify the tensors in the query
    generator; pass the same ones, and the same ``min_compression_rate``, to
    :func:`powersgd_update`.
    """
    if int(rank) < 1:
        raise ValueError(f"PowerSGD rank={rank} must be a positive integer (e.g. rank=1)")
    shapes = [tuple(int(d) for d in s) for s in shapes]
    idx = _query_indices(query_indices, len(shapes))
    memories = tuple(torch.zeros(s, dtype=dtype, device=device) for s in shapes)
    qs = []
    for i, s in zip(idx, shapes):
        fs = _factor_shape(s, rank, min_compression_rate)
        if fs is None:
            qs.append(torch.zeros(0, 0, dtype=dtype, device=device))
        else:
            qs.append(_query(fs[1], fs[2], seed, 0, i, dtype, device))
    return PowerSGDState(memories, tuple(qs), 0, int(seed), int(rank))


def powersgd_update(
    grads: Sequence[torch.Tensor],
    state: PowerSGDState,
    comm: Communicator = LOCAL,
    *,
    reuse_query: bool = False,
    error_feedback: bool = True,
    query_indices: Sequence[int] | None = None,
    min_compression_rate: float = 0.0,
) -> tuple[PowerSGDResult, PowerSGDState]:
    """One PowerSGD round over ``grads``; returns the averaged approximations and the new state.

    Inputs are not modified. Two all-reduces carry all ``P`` factors and all ``Q`` factors
    (packed), one more carries the uncompressed tensors. ``query_indices`` (default: positions)
    and ``min_compression_rate`` are as in :func:`powersgd_init`.

    If an all-reduced ``P``, ``Q'`` or uncompressed value is not finite (an overflowing
    backward on any worker), the output is non-finite (a ``GradScaler`` then skips the step),
    the ``Q`` round is skipped when ``P`` is already non-finite (matrix outputs are ``NaN``),
    and the returned state is ``state`` itself: memories, queries and step stay as they were,
    so the next finite step continues as if the bad one never happened. All workers see the
    same all-reduced values, so they take the same branch.
    """
    if len(grads) != len(state.memories):
        raise ValueError(
            f"got {len(grads)} gradients but the state was initialised for {len(state.memories)}"
        )
    qidx = _query_indices(query_indices, len(grads))
    mats: list[tuple[int, torch.Tensor, int]] = []  # (index, n×m matrix M_w, rank r)
    flat_idx: list[int] = []
    inputs: list[torch.Tensor] = []
    for i, (g, mem) in enumerate(zip(grads, state.memories)):
        if g.shape != mem.shape:
            raise ValueError(
                f"gradient {i} has shape {tuple(g.shape)}, state expects {tuple(mem.shape)}"
            )
        x = g + mem if error_feedback else g.clone()
        inputs.append(x)
        fs = _factor_shape(x.shape, state.rank, min_compression_rate)
        if fs is None:
            flat_idx.append(i)
        else:
            mats.append((i, x.reshape(fs[0], fs[1]), fs[2]))

    itemsize = grads[0].element_size() if grads else 4
    dense_bytes = sum(g.numel() for g in grads) * itemsize
    sent = 0
    outs: list[torch.Tensor | None] = [None] * len(grads)
    new_qs = list(state.qs)
    finite = True  # all-reduced values, hence the same verdict on every worker

    # uncompressed small tensors: one packed all-reduce
    if flat_idx:
        packed = torch.cat([inputs[i].reshape(-1) for i in flat_idx])
        sent += packed.numel() * packed.element_size()
        packed = comm.all_reduce_mean(packed)
        finite = bool(torch.isfinite(packed).all())
        off = 0
        for i in flat_idx:
            n = inputs[i].numel()
            outs[i] = packed[off : off + n].reshape(inputs[i].shape).clone()
            off += n

    ps_out: list[torch.Tensor] = []
    qs_out: list[torch.Tensor] = []
    if mats:
        queries = []
        for i, m, r in mats:
            if reuse_query and state.step > 0:
                q = state.qs[i]
                if q.ndim != 2 or q.shape[0] != m.shape[1] or q.shape[1] == 0:
                    raise ValueError(
                        f"query {i} has shape {tuple(q.shape)}, expected {(m.shape[1], r)}: was "
                        "the state initialised with another min_compression_rate?"
                    )
            else:
                q = _query(m.shape[1], r, state.seed, state.step, qidx[i], m.dtype, m.device)
            queries.append(q)
        p_flat = torch.cat([(m @ q).reshape(-1) for (_, m, _), q in zip(mats, queries)])
        sent += p_flat.numel() * p_flat.element_size()
        p_flat = comm.all_reduce_mean(p_flat)
        if not bool(torch.isfinite(p_flat).all()):  # skip the Q round: nothing to orthogonalize
            for i, _, _ in mats:
                outs[i] = torch.full_like(inputs[i], float("nan"))
            result = PowerSGDResult(outs, [], [], sent, dense_bytes)  # type: ignore[arg-type]
            return result, state
        ps, off = [], 0
        for (_, m, _), q in zip(mats, queries):
            k = m.shape[0] * q.shape[1]
            ps.append(orthogonalize(p_flat[off : off + k].reshape(m.shape[0], q.shape[1])))
            off += k
        q_flat = torch.cat([(m.t() @ p).reshape(-1) for (_, m, _), p in zip(mats, ps)])
        sent += q_flat.numel() * q_flat.element_size()
        q_flat = comm.all_reduce_mean(q_flat)
        finite = finite and bool(torch.isfinite(q_flat).all())
        off = 0
        for (i, m, _), p in zip(mats, ps):
            k = m.shape[1] * p.shape[1]
            q = q_flat[off : off + k].reshape(m.shape[1], p.shape[1]).clone()
            off += k
            outs[i] = (p @ q.t()).reshape(inputs[i].shape)
            new_qs[i] = q
            ps_out.append(p)
            qs_out.append(q)

    if not finite:  # the output carries the inf/NaN; the state stays as it was
        return PowerSGDResult(outs, ps_out, qs_out, sent, dense_bytes), state  # type: ignore[arg-type]
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
