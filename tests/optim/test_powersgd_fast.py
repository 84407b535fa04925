"""The faster PowerSGD compressor: batched Gram–Schmidt / QR orthogonalisation, one
host sync and two all-reduces per update, the transposed factor layout; against a plain
per-matrix reference and against ``torch.linalg.qr``."""

from __future__ import annotations

import copy

import pytest
import torch
from _threadcomm import run_workers
from torch.testing import assert_close

from adaptrain.core.compress import LocalCommunicator, orthogonalize, powersgd_init, powersgd_update
from adaptrain.core.compress.powersgd import _factor_shape, _queries

# equal P shapes (n, r) with different m, a 1-D and a 4-D tensor, a matrix thinner than rank 4
SHAPES = [(12, 7), (12, 9), (5,), (6, 2, 2), (12, 7), (3, 30), (30, 1, 3, 1)]


def _grads(seed: int, shapes=SHAPES, dtype=torch.float64) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=dtype) for s in shapes]


def _qr_projection(p: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    q, _ = torch.linalg.qr(p, mode="reduced")
    return q @ (q.t() @ m)


def _reference_step(grads, memories, queries, rank):
    """Per-matrix PowerSGD with torch.linalg.qr (the former implementation's algorithm), one
    worker: outputs, new memories and new queries."""
    outs, mems, qs = [], [], []
    for g, e, q in zip(grads, memories, queries):
        x = g + e
        if x.ndim < 2:
            outs.append(x.clone())
            mems.append(torch.zeros_like(x))
            qs.append(q)
            continue
        m = x.reshape(x.shape[0], -1)
        p, _ = torch.linalg.qr(m @ q, mode="reduced")
        qn = m.t() @ p
        o = (p @ qn.t()).reshape(x.shape)
        outs.append(o)
        mems.append(x - o)
        qs.append(qn)
    return outs, mems, qs


# ---------------------------------------------------------------- orthogonalize


@pytest.mark.parametrize("r", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_orthogonalize_spans_what_qr_spans(r, dtype):
    """Gram–Schmidt (r ≤ 2) and batched QR (r > 2) give an orthonormal basis whose projection
    P Pᵀ M equals the one of torch.linalg.qr's basis, on well-conditioned random input."""
    g = torch.Generator().manual_seed(r)
    p = torch.randn(40, r, generator=g, dtype=dtype)
    m = torch.randn(40, 25, generator=g, dtype=dtype)
    q = orthogonalize(p)
    assert q.shape == (40, r) and q.dtype == dtype
    tol = {"rtol": 1e-10, "atol": 1e-10} if dtype == torch.float64 else {"rtol": 1e-4, "atol": 1e-5}
    assert_close(q.t() @ q, torch.eye(r, dtype=dtype), **tol)
    assert_close(q @ (q.t() @ m), _qr_projection(p, m), **tol)
    assert torch.equal(
        p, torch.randn(40, r, generator=torch.Generator().manual_seed(r), dtype=dtype)
    )


def test_orthogonalize_zero_columns_stay_finite_and_orthonormal():
    """A zero column (a layer whose projected gradient vanished) gives a finite, orthonormal
    basis that still spans p: on the Gram–Schmidt path the zero column is replaced by a fixed
    direction (torch's Gram–Schmidt without epsilon divides by zero here)."""
    g = torch.Generator().manual_seed(0)
    v = torch.randn(6, generator=g, dtype=torch.float64)
    for p in (torch.stack([torch.zeros(6, dtype=torch.float64), v], 1), torch.stack([v, 0 * v], 1)):
        q = orthogonalize(p)
        assert torch.isfinite(q).all()
        assert_close(q.t() @ q, torch.eye(2, dtype=torch.float64))
        assert_close(q @ (q.t() @ p), p)  # p's column space is kept
    assert_close(orthogonalize(torch.stack([v, 0 * v], 1))[:, 0].abs(), (v / v.norm()).abs())
    for r in (1, 2, 3):  # a zero P: a finite orthonormal basis on both paths
        z = orthogonalize(torch.zeros(5, r))
        assert torch.isfinite(z).all()
        assert_close(z.t() @ z, torch.eye(r))
    assert_close(orthogonalize(torch.zeros(4, 1)), torch.full((4, 1), 0.5))


def test_warm_start_recovers_after_a_zero_gradient():
    """A matrix whose gradient is zero in one step makes P and Q' zero; with warm start the
    next P = M·0 is zero again. Leaving zero columns at zero would keep the output at zero
    from then on (only the error memory would grow); the fixed fallback direction lets the
    power iteration restart, as QR's arbitrary basis did."""
    shapes = [(8, 6), (8, 5)]
    for rank in (1, 2):
        state = powersgd_init(shapes, rank, 0, torch.float64)
        zeros = [torch.zeros(s, dtype=torch.float64) for s in shapes]
        res, state = powersgd_update(zeros, state, reuse_query=True)
        for o in res.grads:
            assert torch.equal(o, torch.zeros_like(o))
        assert all(not q.any() for q in state.qs)  # Q' = Mᵀ P = 0
        for step in range(1, 4):
            res, state = powersgd_update(_grads(step, shapes), state, reuse_query=True)
            assert all(torch.isfinite(o).all() and o.abs().max() > 0.1 for o in res.grads)
        # a fixed matrix (singular values 10, 5, 1, …): warm start finds its top directions
        u, _ = torch.linalg.qr(_grads(9, [(8, 8)])[0])
        vh, _ = torch.linalg.qr(_grads(10, [(6, 6)])[0])
        m = u[:, :6] @ torch.diag(torch.tensor([10.0, 5, 1, 1, 1, 1], dtype=torch.float64)) @ vh
        for _ in range(30):
            res, state = powersgd_update(
                [m, zeros[1]], state, reuse_query=True, error_feedback=False
            )
        uu, ss, vv = torch.linalg.svd(m)
        best = (uu[:, :rank] * ss[:rank]) @ vv[:rank]
        assert_close(res.grads[0], best, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_orthogonalize_parallel_columns_do_not_double_count(dtype):
    """Rank 2 on a rank-1 matrix (a batch-size-1 gradient): P = M Q has parallel columns. Plain
    Gram–Schmidt normalises the rounding noise of the projection into a second copy of the
    first column (for [u, u] it returned q1 = ±q0 in 1 of 5 draws), and P Pᵀ M counts M twice
    or not at all. The second column comes out zero or orthogonal, and P Pᵀ M = M."""
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        u = torch.randn(30, 1, generator=g, dtype=dtype)
        v = torch.randn(1, 20, generator=g, dtype=dtype)
        m = u @ v
        for p in (m @ torch.randn(20, 2, generator=g, dtype=dtype), torch.cat([u, u], 1)):
            q = orthogonalize(p)
            assert torch.isfinite(q).all()
            assert_close(q[:, 0] * q[0, 0].sign(), u[:, 0] / u.norm() * u[0, 0].sign())
            norm = float(q[:, 1].norm())  # zero, or (a residual above rounding) unit ⊥ q0
            assert norm == 0 or abs(norm - 1) < 1e-5
            if p[:, 1].equal(p[:, 0]):  # parallel to the last bit
                assert torch.equal(q[:, 1], torch.zeros(30, dtype=dtype))
            assert abs(float(q[:, 0] @ q[:, 1])) < 1e-5
            assert_close(q @ (q.t() @ m), m, rtol=1e-4, atol=1e-4)  # not 2·m, not 0
    # nearly parallel but distinct columns keep their second direction, orthonormal
    w = torch.randn(30, 1, generator=g, dtype=dtype)
    p = torch.cat([u, u + 1e-3 * w], 1)
    q = orthogonalize(p)
    assert_close(q.t() @ q, torch.eye(2, dtype=dtype), rtol=1e-5, atol=1e-5)
    assert_close(q @ (q.t() @ p), p, rtol=1e-5, atol=1e-5)


def test_orthogonalize_large_small_half_and_nonfinite():
    big = torch.tensor([[3e30, 1e30], [4e30, -1e30], [0.0, 2e30]])  # squares overflow fp32
    q = orthogonalize(big)
    assert torch.isfinite(q).all()
    assert_close(q.t() @ q, torch.eye(2), rtol=1e-5, atol=1e-6)
    tiny = torch.tensor([[3e-40], [4e-40]])  # subnormal float32
    assert_close(orthogonalize(tiny).abs(), torch.tensor([[0.6], [0.8]]), rtol=1e-3, atol=1e-6)
    h = torch.randn(16, 2, generator=torch.Generator().manual_seed(1)).half()
    qh = orthogonalize(h)
    assert qh.dtype == torch.float16 and torch.isfinite(qh).all()
    assert_close(qh.float(), orthogonalize(h.float()), rtol=2e-3, atol=2e-3)
    for r in (1, 2, 3):
        bad = torch.randn(5, r)
        bad[2, 0] = float("nan")
        assert torch.isnan(orthogonalize(bad)).any()
        bad[2, 0] = float("inf")
        assert torch.isnan(orthogonalize(bad)).any()


# ---------------------------------------------------------------- the update


@pytest.mark.parametrize("rank", [1, 2, 3, 4])
@pytest.mark.parametrize("reuse", [False, True])
def test_update_matches_per_matrix_qr_reference(rank, reuse):
    """Three steps of the batched update equal the per-matrix QR algorithm (same queries,
    same error feedback) to float64 rounding, matrices of equal P shape included."""
    state = powersgd_init(SHAPES, rank=rank, seed=4, dtype=torch.float64)
    mems = list(state.memories)
    queries = [q.clone() for q in state.qs]
    for step in range(3):
        g = _grads(step)
        if not reuse and step > 0:
            queries = [
                _queries([(fs[1], fs[2], i)], 4, step, torch.float64, "cpu")[0]
                if (fs := _factor_shape(s, rank)) is not None
                else torch.zeros(0, 0, dtype=torch.float64)
                for i, s in enumerate(SHAPES)
            ]
        outs, mems, qs = _reference_step(g, mems, queries, rank)
        res, state = powersgd_update(g, state, reuse_query=reuse)
        for a, b in zip(res.grads, outs):
            assert_close(a, b, rtol=1e-9, atol=1e-10)
        for a, b in zip(state.memories, mems):
            assert_close(a, b, rtol=1e-9, atol=1e-10)
        if reuse:
            queries = qs
    assert state.step == 3


def test_queries_are_the_former_draws():
    """The queries are still drawn from a generator seeded by (seed, step, index), value for
    value (a saved state or a replay from before this change gives the same queries)."""

    def former(m, r, seed, step, index):
        g = torch.Generator(device="cpu")
        g.manual_seed((((seed * 1_000_003) + step) * 10_007 + index) % (2**63 - 1))
        return torch.randn(m, r, generator=g, dtype=torch.float32)

    st = powersgd_init(SHAPES, rank=3, seed=11, query_indices=[7, 3, 1, 0, 9, 2, 5])
    for q, s, i in zip(st.qs, SHAPES, [7, 3, 1, 0, 9, 2, 5]):
        if len(s) < 2:
            assert q.shape == (0, 0)
            continue
        m = int(torch.tensor(s[1:]).prod())
        assert torch.equal(q, former(m, min(3, s[0], m), 11, 0, i))


class _Counting(LocalCommunicator):
    def __init__(self) -> None:
        self.calls: list[int] = []

    def all_reduce_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        self.calls.append(tensor.numel())
        return tensor


def _count_syncs(monkeypatch) -> list[str]:
    """Record every Tensor → Python value conversion (a host-device sync on a GPU)."""
    seen: list[str] = []
    for name in ("__bool__", "item", "tolist", "__float__", "__int__"):
        orig = getattr(torch.Tensor, name)

        def wrapped(self, *a, _orig=orig, _name=name, **k):
            seen.append(_name)
            return _orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, wrapped)
    return seen


@pytest.mark.parametrize("reuse", [False, True])
def test_one_host_sync_and_two_all_reduces_per_update(monkeypatch, reuse):
    """The uncompressed tensors travel with the P factors (the former code made a third
    all-reduce for them), and finiteness is read once per update (formerly up to three
    times: after the uncompressed, the P and the Q all-reduce)."""
    state = powersgd_init(SHAPES, rank=2, seed=1, dtype=torch.float64)
    _, state = powersgd_update(_grads(0), state, reuse_query=reuse)
    comm = _Counting()
    seen = _count_syncs(monkeypatch)
    res, new = powersgd_update(_grads(1), state, comm, reuse_query=reuse)
    assert len(seen) == 1
    # [the 1-D tensor (5) + every P: 24 + 24 + 12 + 24 + 6 + 60], [every Q': 14 + 18 + 8 + 14
    # + 60 + 6]; the former code sent [5], [150], [120]
    assert comm.calls == [155, 120]
    assert res.sent_bytes == (155 + 120) * 8
    assert new.step == state.step + 1


def test_nonfinite_p_runs_the_q_round_and_keeps_the_state():
    """A non-finite P no longer skips the Q round (its check would be a second host sync): the
    two all-reduces happen on every worker alike, the bad matrix's output is NaN, the others
    are computed, and the state returned is the old one."""

    def work(r, comm):
        calls = []
        inner = comm.all_reduce_mean

        def counted(t):
            calls.append(t.numel())
            return inner(t)

        comm.all_reduce_mean = counted
        state = powersgd_init(SHAPES, rank=1, seed=2, dtype=torch.float64)
        _, state = powersgd_update(_grads(r), state, comm)
        before = copy.deepcopy(state)
        g = _grads(10 + r)
        if r == 1:
            g[1][3, 4] = float("inf")
        calls.clear()
        res, new = powersgd_update(g, state, comm)
        return calls, res, new, before, state

    for calls, res, new, before, state in run_workers(2, work):
        assert len(calls) == 2
        assert new is state
        for a, b in zip(new.memories + new.qs, before.memories + before.qs):
            assert torch.equal(a, b)
        assert torch.isnan(res.grads[1]).all()
        assert torch.isfinite(res.grads[0]).all() and torch.isfinite(res.grads[2]).all()


def test_workers_agree_bit_for_bit_and_replay():
    """Three workers, rank 2, warm start: every worker gets the same outputs and queries, bit
    for bit, and a deep-copied state replays the same steps exactly."""

    def work(r, comm):
        state = powersgd_init(SHAPES, rank=2, seed=9, dtype=torch.float32)
        outs = []
        for step in range(3):
            res, state = powersgd_update(_grads(10 * step + r, dtype=torch.float32), state, comm)
            outs.append(res.grads)
        return outs, state.qs

    res = run_workers(3, work)
    for outs, qs in res[1:]:
        for a_step, b_step in zip(outs, res[0][0]):
            for a, b in zip(a_step, b_step):
                assert torch.equal(a, b)
        for a, b in zip(qs, res[0][1]):
            assert torch.equal(a, b)
    state = powersgd_init(SHAPES, rank=2, seed=9)
    for step in range(2):
        _, state = powersgd_update(_grads(step, dtype=torch.float32), state, reuse_query=True)
    saved = copy.deepcopy(state)
    a, b = state, saved
    for step in range(2, 4):
        ra, a = powersgd_update(_grads(step, dtype=torch.float32), a, reuse_query=True)
        rb, b = powersgd_update(_grads(step, dtype=torch.float32), b, reuse_query=True)
        for x, y in zip(ra.grads + list(a.memories), rb.grads + list(b.memories)):
            assert torch.equal(x, y)


def test_half_precision_update_is_finite_and_close():
    shapes = [(32, 24), (16, 8, 3), (7,)]
    g32 = _grads(3, shapes, torch.float32)
    g16 = [g.half() for g in g32]
    for rank in (1, 2, 4):
        r16, s16 = powersgd_update(g16, powersgd_init(shapes, rank, 0, torch.float16))
        r32, _ = powersgd_update(g32, powersgd_init(shapes, rank, 0, torch.float32))
        for a, b in zip(r16.grads, r32.grads):
            assert a.dtype == torch.float16 and torch.isfinite(a).all()
            assert_close(a.float(), b, rtol=2e-2, atol=2e-2)
        assert all(m.dtype == torch.float16 for m in s16.memories)
