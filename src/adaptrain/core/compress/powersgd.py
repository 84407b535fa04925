"""PowerSGD low-rank gradient compression with error feedback (Vogels, Karimireddy & Jaggi, 2019,
"PowerSGD: Practical Low-Rank Gradient Compression for Distributed Optimization").

For each gradient tensor reshaped to an ``n × m`` matrix ``M_w = G_w + E_w`` (gradient plus
error memory) on worker ``w``, with a query ``Q`` (``m × r``) shared by all workers::

    P  = mean_w(M_w Q)            # all-reduce n·r numbers
    P  = orthogonalize(P)         # identical on every worker
    Q' = mean_w(M_wᵀ P)           # all-reduce m·r numbers
    out = P Q'ᵀ                   # ≈ mean_w(M_w), rank r
    E_w ← M_w − out               # error feedback: what the approximation dropped

One update makes two all-reduces whatever the number of tensors: the uncompressed tensors
travel with all ``P`` factors, then all ``Q'`` factors. The factors are computed and sent
transposed (``Pᵀ = Qᵀ M_wᵀ``, ``Q'ᵀ = Pᵀ M_w``: the same numbers; CPU BLAS multiplies a matrix
by a thin one several times faster in this orientation), and the ``P`` of equal shape are
orthogonalised as one batch (Gram–Schmidt for ``r ≤ 2``, as torch's hook, QR above).

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
the step, and the *previous* state unchanged (memories, queries and step); this is decided once
per update, after both all-reduces (one host-device synchronisation on a GPU). Torch's
``powerSGD_hook`` folds the ``inf``/``NaN`` into its error memory, and every later output is
``NaN``.

State is a :class:`PowerSGDState` of tensors and ints; :func:`powersgd_update` is pure apart
from the communicator's collectives.
"""

from __future__ import annotations

import functools
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
        qs: current query per tensor, ``m × r`` (``0 × 0`` for tensors sent uncompressed);
            :func:`powersgd_init` and :func:`powersgd_update` give the transpose of a contiguous
            ``r × m`` block (any layout is accepted).
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


def _query_seed(seed: int, step: int, index: int) -> int:
    return (((seed * 1_000_003) + step) * 10_007 + index) % (2**63 - 1)


def _queries(
    specs: Sequence[tuple[int, int, int]], seed: int, step: int, dtype, device
) -> list[torch.Tensor]:
    """The ``m × r`` query of each ``(m, r, index)`` in ``specs``, drawn from ``(seed, step,
    index)``: one CPU generator re-seeded per query (the same values as a fresh generator per
    query) and one transfer to ``device`` for all of them. Each query is the transpose of a
    contiguous ``r × m`` block (``Qᵀ`` is what :func:`powersgd_update` multiplies with)."""
    g = torch.Generator(device="cpu")
    pieces = []
    for m, r, index in specs:
        g.manual_seed(_query_seed(seed, step, index))
        q = torch.randn(m, r, generator=g, dtype=torch.float32)
        pieces.append(q.t().reshape(-1))
    if not pieces:
        return []
    flat = torch.cat(pieces).to(dtype=dtype, device=device)
    sizes = [m * r for m, r, _ in specs]
    return [qt.view(r, m).t() for qt, (m, r, _) in zip(flat.split(sizes), specs)]


_SUBNORMAL = {
    dt: math.ulp(0.0) if dt == torch.float64 else 2.0**-149 for dt in (torch.float32, torch.float64)
}


@functools.lru_cache(maxsize=256)
def _fallback_rows(r: int, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Unit rows that stand in for zero columns of ``P`` (``r ≤ 2``): the constant vector
    and the alternating-sign one, ``(1, 1, …)/√n`` and ``(1, −1, 1, …)/√n``; exact in every
    floating-point type, so every worker uses the same ones."""
    f = torch.ones(r, n, dtype=torch.float64)
    if r > 1:
        f[1, 1::2] = -1.0
    return (f / math.sqrt(n)).to(dtype=dtype, device=device)


def _normalize_rows_(x: torch.Tensor, fallback: torch.Tensor) -> None:
    """Divide each row of ``x`` (``… × n``, any scale) by its 2-norm, in place; a zero row
    becomes the matching row of ``fallback``.

    The norm is accumulated in float64 (the squares of float32, float16 or bfloat16 values
    cannot overflow) and divided by in ``x``'s dtype, clamped below at its smallest subnormal
    number: a finite row stays finite (one whose norm overflows ``x``'s dtype becomes zero); a
    row holding NaN or inf gives NaN (nothing is masked).
    """
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float64)
    zero = norm == 0
    x.div_(norm.to(x.dtype).clamp_min_(_SUBNORMAL[x.dtype]))
    torch.where(zero, fallback, x, out=x)


def _renormalize_row_(v: torch.Tensor, tol: float) -> None:
    """Divide each row of ``v`` (norm at most about 2: no float64 needed) by its 2-norm in
    place, or set it to zero when that norm is at most ``tol`` (NaN stays NaN)."""
    norm = torch.linalg.vector_norm(v, dim=-1, keepdim=True)
    v.mul_(norm.reciprocal().masked_fill_(norm <= tol, 0.0))


def _gram_schmidt_rows_(x: torch.Tensor) -> None:
    """Orthonormalise the (at most two) rows of each matrix of ``x`` (``B × r × n``) in place.

    A zero row is first replaced by a fixed direction (:func:`_fallback_rows`): with warm
    start, a zero column of ``P`` gives a zero column of ``Q'`` and hence of the next ``P``, so
    a column left at zero (a layer whose gradient was zero once) would never come back; QR
    picked such a direction too. Both rows are normalised (so the projection cannot overflow),
    then the second is projected off the first and normalised, twice (classical Gram–Schmidt
    with re-orthogonalisation, "twice is enough"). When the rows are parallel to rounding
    (``P`` of a numerically rank-1 matrix at rank 2), the projection leaves only rounding
    noise, which normalising would turn into a second copy of the first row (``P Pᵀ M`` would
    count ``M`` twice): a residual of at most ``16·√n·ε`` after the first projection (above
    the rounding error of the projection, about ``√n·ε``) sets the second row to zero
    instead. That column of ``P`` is then zero for this step; under warm start the next
    step's zero column takes the fallback direction. A residual above it is mostly signal
    (rounding at most 1/16 of it), so the second projection leaves a norm near 1.
    """
    r, n = x.shape[-2], x.shape[-1]
    _normalize_rows_(x, _fallback_rows(r, n, x.dtype, x.device))
    if r < 2:
        return
    v0, v1 = x[..., 0:1, :], x[..., 1:2, :]
    for tol in (16.0 * math.sqrt(n) * torch.finfo(x.dtype).eps, 0.0):
        dot = torch.linalg.vecdot(v0, v1, dim=-1).unsqueeze(-1)
        v1.addcmul_(v0, dot, value=-1)
        _renormalize_row_(v1, tol)  # second pass: v1 was unit and all but orthogonal, or zero


def _orthogonalize_rows_(pt: torch.Tensor) -> None:
    """Orthonormalise, in place, the columns of every ``P`` of a batch stored transposed:
    ``pt`` is ``B × r × n`` (``Pᵀ``, ``r ≤ n``). Gram–Schmidt for ``r ≤ 2``, one batched
    reduced QR of ``P`` otherwise; float16/bfloat16 are worked in float32."""
    x = pt if pt.dtype in (torch.float32, torch.float64) else pt.float()
    if pt.shape[-2] <= 2:
        _gram_schmidt_rows_(x)
    else:
        x = torch.linalg.qr(x.transpose(-2, -1), mode="reduced")[0].transpose(-2, -1)
    if x is not pt:
        pt.copy_(x)


def orthogonalize(p: torch.Tensor) -> torch.Tensor:
    """Orthonormal basis (columns) of ``p``'s column space; a new ``n × r`` tensor.

    ``p`` is ``n × r`` (``r ≤ n``; a wider ``p`` gets reduced QR's ``n × n`` result). For
    ``r ≤ 2``: Gram–Schmidt, as torch's ``powerSGD_hook`` does (cheaper than QR on a GPU):
    each column divided by its norm, the second projected off the first and normalised (with
    one re-orthogonalisation pass); for ``r > 2``: reduced QR (``torch.linalg.qr``). Either way
    the first ``k`` output columns span the first ``k`` input columns; column signs may differ
    from QR's, which changes nothing in ``P Pᵀ M`` (Vogels et al., 2019, arXiv:1905.13727,
    Algorithm 1, "orthogonalize").

    Degenerate input stays finite. Gram–Schmidt path: a zero column is replaced by a fixed
    direction first (the constant vector for the first column, the alternating-sign one for
    the second; a zero ``p`` gives those two, orthonormalised), because under warm start a
    zero column of ``P`` would otherwise stay zero in every later step; a second column
    parallel to the first to rounding (the projection leaves less than ``16·√n·ε`` of it)
    comes out as zero rather than as normalised rounding noise, so ``P Pᵀ M`` neither counts
    the first direction twice nor leaves out anything ``p`` spans. Norms are accumulated in
    float64: large finite float32 values do not overflow. QR path: the output is orthonormal
    (LAPACK picks the missing directions). NaN or inf in ``p`` gives NaN. Deterministic for
    equal inputs, so all workers obtain the same basis from the same ``P``.
    """
    if p.ndim != 2:
        raise ValueError(f"orthogonalize expects a 2-D matrix, got shape {tuple(p.shape)}")
    n, r = p.shape
    if r > n:
        x = p if p.dtype in (torch.float32, torch.float64) else p.float()  # QR needs fp32/fp64
        return torch.linalg.qr(x, mode="reduced")[0].to(p.dtype)
    pt = p.t().clone(memory_format=torch.contiguous_format).unsqueeze(0)  # never p itself
    _orthogonalize_rows_(pt)
    return pt[0].t()


def _finite(t: torch.Tensor) -> torch.Tensor:
    """Whether every value of ``t`` is finite, as a 0-d bool tensor (no host sync). Below
    float64 the float64 sum decides (NaN and inf propagate; finite values cannot overflow it):
    one reduction instead of ``isfinite`` and ``all``."""
    if t.dtype == torch.float64 or not t.is_floating_point():
        return torch.isfinite(t).all()
    return torch.isfinite(t.sum(dtype=torch.float64))


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
    qs: list[torch.Tensor | None] = []
    specs, where = [], []
    for j, (i, s) in enumerate(zip(idx, shapes)):
        fs = _factor_shape(s, rank, min_compression_rate)
        if fs is None:
            qs.append(torch.zeros(0, 0, dtype=dtype, device=device))
        else:
            qs.append(None)
            specs.append((fs[1], fs[2], i))
            where.append(j)
    for j, q in zip(where, _queries(specs, int(seed), 0, dtype, device)):
        qs[j] = q
    return PowerSGDState(memories, tuple(qs), 0, int(seed), int(rank))  # type: ignore[arg-type]


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

    The update rule is the module's (Vogels et al., 2019, arXiv:1905.13727, Algorithm 1 with
    error feedback): ``P = mean_w(M_w Q)``, ``P ← orthogonalize(P)``, ``Q' = mean_w(M_wᵀ P)``,
    output ``P Q'ᵀ``, memory ``M_w − P Q'ᵀ``. Inputs are not modified. Two all-reduces per call:
    the first carries the uncompressed tensors and all ``P`` factors (packed together), the
    second all ``Q'`` factors. ``P`` factors of equal shape are orthogonalised as one batch.
    ``query_indices`` (default: positions) and ``min_compression_rate`` are as in
    :func:`powersgd_init`.

    If an all-reduced ``P``, ``Q'`` or uncompressed value is not finite (an overflowing
    backward on any worker), the output is non-finite (a ``GradScaler`` then skips the step)
    and the returned state is ``state`` itself: memories, queries and step stay as they were,
    so the next finite step continues as if the bad one never happened. The non-finite values
    reach the outputs of the tensors they came from (a non-finite ``P`` makes its matrix's
    output ``NaN``, a non-finite ``Q'`` makes it non-finite); the other outputs are computed as
    usual. Finiteness is decided once, after both rounds, with one host-device
    synchronisation per call: the ``Q`` round now runs even when ``P`` is already non-finite
    (formerly skipped, with every matrix output set to ``NaN``, at the cost of a second
    synchronisation in every step). All workers see the same all-reduced values, so they take
    the same branch.
    """
    if len(grads) != len(state.memories):
        raise ValueError(
            f"got {len(grads)} gradients but the state was initialised for {len(state.memories)}"
        )
    qidx = _query_indices(query_indices, len(grads))
    grads = list(grads)
    if not grads:
        return PowerSGDResult([], [], [], 0, 0), state._replace(step=state.step + 1)
    for i, (g, mem) in enumerate(zip(grads, state.memories)):
        if g.shape != mem.shape:
            raise ValueError(
                f"gradient {i} has shape {tuple(g.shape)}, state expects {tuple(mem.shape)}"
            )
    if error_feedback:
        inputs = torch._foreach_add(grads, list(state.memories))
    else:
        inputs = grads  # read only: nothing below writes into the inputs
    flat_idx: list[int] = []
    mats: list[tuple[int, torch.Tensor, int]] = []  # (index, n×m matrix M_w, rank r)
    groups: dict[tuple[int, int], list[int]] = {}  # (n, r) of P → positions in mats
    for i, x in enumerate(inputs):
        fs = _factor_shape(x.shape, state.rank, min_compression_rate)
        if fs is None:
            flat_idx.append(i)
        else:
            groups.setdefault((fs[0], fs[2]), []).append(len(mats))
            mats.append((i, x.reshape(fs[0], fs[1]), fs[2]))
    order = [k for ks in groups.values() for k in ks]  # P of equal shape adjacent

    itemsize = grads[0].element_size()
    dense_bytes = sum(g.numel() for g in grads) * itemsize
    outs: list[torch.Tensor] = list(inputs)  # replaced below, every entry
    new_qs = list(state.qs)
    ps: list[torch.Tensor] = [torch.empty(0)] * len(mats)
    qs: list[torch.Tensor] = [torch.empty(0)] * len(mats)

    if mats:
        if reuse_query and state.step > 0:
            queries = []
            for i, m, r in mats:
                q = state.qs[i]
                if q.ndim != 2 or q.shape[0] != m.shape[1] or q.shape[1] == 0:
                    raise ValueError(
                        f"query {i} has shape {tuple(q.shape)}, expected {(m.shape[1], r)}: was "
                        "the state initialised with another min_compression_rate?"
                    )
                queries.append(q)
        else:
            m0 = mats[0][1]
            specs = [(m.shape[1], r, qidx[i]) for i, m, r in mats]
            queries = _queries(specs, state.seed, state.step, m0.dtype, m0.device)
        # Pᵀ = Qᵀ M_wᵀ (r × n): on CPU BLAS this is several times faster than M_w Q for r ≥ 2
        local_pts = [torch.mm(queries[k].t().contiguous(), mats[k][1].t()) for k in order]
    else:
        local_pts = []

    # round 1: the uncompressed tensors and every Pᵀ, in one all-reduce
    first = torch.cat(
        [inputs[i].reshape(-1) for i in flat_idx] + [pt.reshape(-1) for pt in local_pts]
    )
    sent = first.numel() * first.element_size()
    first = comm.all_reduce_mean(first) if first.numel() else first
    finite = _finite(first)  # a tensor: no host sync yet
    off = 0
    for i in flat_idx:
        n = inputs[i].numel()
        outs[i] = first[off : off + n].view(inputs[i].shape)
        off += n
    pts: list[torch.Tensor] = [torch.empty(0)] * len(mats)
    for (n, r), ks in groups.items():
        slab = first[off : off + len(ks) * r * n].view(len(ks), r, n)
        off += len(ks) * r * n
        _orthogonalize_rows_(slab)  # identical on every worker: same input, same ops
        for b, k in enumerate(ks):
            pts[k] = slab[b]
            ps[k] = slab[b].t()

    # round 2: every Q'ᵀ = Pᵀ M_w (r × m), in one all-reduce
    if mats:
        second = torch.cat([torch.mm(pts[k], mats[k][1]).reshape(-1) for k in order])
        sent += second.numel() * second.element_size()
        second = comm.all_reduce_mean(second)
        finite = finite & _finite(second)
        off = 0
        for k in order:
            i, m, r = mats[k]
            qt = second[off : off + r * m.shape[1]].view(r, m.shape[1])
            off += r * m.shape[1]
            outs[i] = torch.mm(pts[k].t(), qt).view(inputs[i].shape)  # P Q'ᵀ
            new_qs[i] = qs[k] = qt.t()

    result = PowerSGDResult(outs, ps, qs, sent, dense_bytes)
    if not bool(finite):  # the one host sync: the output carries the inf/NaN
        return result, state  # and the state stays as it was
    if error_feedback:
        new_mem = torch._foreach_sub(inputs, outs)
        if flat_idx:  # sent exactly: nothing dropped
            torch._foreach_zero_([new_mem[i] for i in flat_idx])
        memories = tuple(new_mem)
    else:
        memories = state.memories
    new_state = PowerSGDState(memories, tuple(new_qs), state.step + 1, state.seed, state.rank)
    return result, new_state
