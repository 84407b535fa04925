"""Pure tests of adaptrain.core.compress (no process group; threads simulate workers)."""

from __future__ import annotations

import copy

import pytest
import torch
from _threadcomm import run_workers
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from adaptrain.core.compress import (
    LocalCommunicator,
    block_indices,
    count_sketch,
    gossip_mix,
    majority_vote,
    orthogonalize,
    pack_signs,
    pack_ternary,
    powersgd_init,
    powersgd_update,
    randomk_indices,
    sign_init,
    sign_update,
    signs,
    sparse_init,
    sparse_update,
    topk_indices,
    unpack_signs,
    unpack_ternary,
)
from adaptrain.core.compress.sparsify import cyclic_block_indices

SHAPES = [(6, 4), (5,), (3, 2, 2, 2), (4, 7)]


def _grads(seed: int, shapes=SHAPES, scale: float = 1.0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [scale * torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]


def _full_rank(shapes) -> int:
    return max(min(s[0], int(torch.tensor(s[1:]).prod())) for s in shapes if len(s) > 1)


# ---------------------------------------------------------------- PowerSGD


def test_orthogonalize_gives_orthonormal_columns():
    p = torch.randn(9, 3, dtype=torch.float64)
    q = orthogonalize(p)
    assert_close(q.t() @ q, torch.eye(3, dtype=torch.float64))
    # same column space: projecting p onto span(q) returns p
    assert_close(q @ (q.t() @ p), p)


@pytest.mark.parametrize("workers", [1, 3])
def test_powersgd_full_rank_equals_mean(workers):
    rank = _full_rank(SHAPES)

    def work(r, comm):
        state = powersgd_init(SHAPES, rank=rank, seed=5, dtype=torch.float64)
        res, _ = powersgd_update(_grads(r), state, comm)
        return res.grads

    outs = run_workers(workers, work)
    expected = [torch.stack(t).mean(0) for t in zip(*[_grads(r) for r in range(workers)])]
    for out in outs:  # every worker gets the same, exact mean
        for o, e in zip(out, expected):
            assert_close(o, e)


def test_powersgd_rank_one_matrix_is_exact_at_rank_one():
    u, v = torch.randn(8, 1, dtype=torch.float64), torch.randn(1, 5, dtype=torch.float64)
    state = powersgd_init([(8, 5)], rank=1, dtype=torch.float64)
    res, _ = powersgd_update([u @ v], state)
    assert_close(res.grads[0], u @ v)
    assert res.sent_bytes == (8 + 5) * 8 and res.dense_bytes == 40 * 8


@pytest.mark.parametrize("workers", [1, 2])
def test_powersgd_memory_is_what_compression_dropped(workers):
    def work(r, comm):
        state = powersgd_init(SHAPES, rank=1, seed=0, dtype=torch.float64)
        sent_sum = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
        grad_sum = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
        for step in range(4):
            g = _grads(10 * step + r)
            old = [m.clone() for m in state.memories]
            res, state = powersgd_update(g, state, comm)
            for i, (gi, mo, mn, o) in enumerate(zip(g, old, state.memories, res.grads)):
                if len(gi.shape) > 1:  # one step: memory = (grad + old memory) − output
                    assert_close(mn, gi + mo - o)
                sent_sum[i] += o
                grad_sum[i] += gi
        return sent_sum, grad_sum, state.memories

    outs = run_workers(workers, work)
    # telescoping: Σ outputs + mean memory = mean Σ gradients (nothing is lost)
    for i in range(len(SHAPES)):
        mean_grads = sum(o[1][i] for o in outs) / workers
        mean_mem = sum(o[2][i] for o in outs) / workers
        assert_close(outs[0][0][i] + mean_mem, mean_grads)


def test_powersgd_warm_start_converges_to_best_rank_one():
    torch.manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(20, 12, dtype=torch.float64))
    vh, _ = torch.linalg.qr(torch.randn(12, 12, dtype=torch.float64))
    s = torch.tensor([10.0, 5.0] + [1.0] * 10, dtype=torch.float64)
    m = u @ torch.diag(s) @ vh
    best = s[0] * torch.outer(u[:, 0], vh[0])

    def err_after(reuse, steps=30):
        state = powersgd_init([m.shape], rank=1, seed=3, dtype=torch.float64)
        for _ in range(steps):
            res, state = powersgd_update([m], state, reuse_query=reuse, error_feedback=False)
        return float((res.grads[0] - best).norm() / best.norm())

    assert err_after(True) < 1e-3  # power iteration on a fixed matrix finds the top direction
    assert err_after(False) > 10 * err_after(True)


def test_powersgd_seeded_and_replayable():
    state = powersgd_init(SHAPES, rank=2, seed=7, dtype=torch.float64)
    for step in range(3):
        _, state = powersgd_update(_grads(step), state, reuse_query=True)
    saved = copy.deepcopy(state)
    a, b = state, saved
    for step in range(3, 6):
        ra, a = powersgd_update(_grads(step), a, reuse_query=True)
        rb, b = powersgd_update(_grads(step), b, reuse_query=True)
        for x, y in zip(ra.grads, rb.grads):
            assert torch.equal(x, y)
    other = powersgd_init(SHAPES, rank=2, seed=8, dtype=torch.float64)
    assert not torch.equal(other.qs[0], powersgd_init(SHAPES, 2, 7, torch.float64).qs[0])


@pytest.mark.parametrize("reuse", [True, False])
@pytest.mark.parametrize("bad", [(0, float("inf")), (1, float("nan"))])  # a matrix, a 1-D tensor
def test_powersgd_nonfinite_step_keeps_state(bad, reuse):
    """An overflowing gradient on one worker: every worker gets a non-finite output (so a
    GradScaler skips the step) and keeps its state; the next finite step is the one of a run
    that never saw the bad step."""
    index, value = bad

    def work(r, comm):
        def run(with_bad_step):
            state = powersgd_init(SHAPES, rank=1, seed=2, dtype=torch.float64)
            outs = []
            for step in range(4):
                g = _grads(10 * step + r)
                if step == 2:
                    if not with_bad_step:
                        continue
                    if r == 1:
                        g[index].view(-1)[3] = value
                    before = state
                    res, state = powersgd_update(g, state, comm, reuse_query=reuse)
                    assert not all(torch.isfinite(o).all() for o in res.grads)
                    assert state.step == before.step
                    for a, b in zip(state.memories + state.qs, before.memories + before.qs):
                        assert torch.equal(a, b)
                    continue
                res, state = powersgd_update(g, state, comm, reuse_query=reuse)
                outs.append(res.grads)
            return outs, state

        return run(True), run(False)

    for (outs, state), (ref_outs, ref_state) in run_workers(2, work):
        assert state.step == ref_state.step == 3
        for a, b in zip(state.memories + state.qs, ref_state.memories + ref_state.qs):
            assert torch.isfinite(a).all()
            assert torch.equal(a, b)
        for o, ro in zip(outs, ref_outs):
            for a, b in zip(o, ro):
                assert torch.equal(a, b)


def test_powersgd_query_indices_name_the_tensors():
    """The query of a tensor depends on its query index, not on its position in the list."""
    shapes = [(6, 4), (4, 7)]
    a = powersgd_init(shapes, rank=2, seed=3, dtype=torch.float64, query_indices=[5, 9])
    b = powersgd_init(shapes[::-1], rank=2, seed=3, dtype=torch.float64, query_indices=[9, 5])
    assert torch.equal(a.qs[0], b.qs[1]) and torch.equal(a.qs[1], b.qs[0])
    ga, gb = _grads(1, shapes), _grads(1, shapes)[::-1]
    ra, _ = powersgd_update(ga, a, query_indices=[5, 9])
    rb, _ = powersgd_update(gb, b, query_indices=[9, 5])
    assert torch.equal(ra.grads[0], rb.grads[1]) and torch.equal(ra.grads[1], rb.grads[0])
    with pytest.raises(ValueError, match="query_indices"):
        powersgd_update(ga, a, query_indices=[5])


@pytest.mark.parametrize("workers", [1, 2])
def test_powersgd_min_compression_rate_sends_costly_matrices_dense(workers):
    """At rate 1 a 10×10 matrix at rank 8 (P + Q: 160 numbers) is averaged exactly and
    uncompressed, a 40×30 one (560 of 1200) is compressed; rate 0 compresses both."""
    shapes = [(10, 10), (40, 30)]

    def work(r, comm):
        out = {}
        for rate in (1.0, 0.0):
            st = powersgd_init(shapes, 8, 1, torch.float64, min_compression_rate=rate)
            kw = {"min_compression_rate": rate, "reuse_query": True}
            for step in range(2):
                res, st = powersgd_update(_grads(10 * step + r, shapes), st, comm, **kw)
            out[rate] = (res, st)
        return out

    outs = run_workers(workers, work)
    mean = [torch.stack(t).mean(0) for t in zip(*[_grads(10 + r, shapes) for r in range(workers)])]
    res, st = outs[0][1.0]
    assert res.sent_bytes == (100 + 40 * 8 + 30 * 8) * 8
    assert st.qs[0].shape == (0, 0) and st.qs[1].shape == (30, 8)
    assert_close(res.grads[0], mean[0])  # exact mean, nothing left in the memory
    assert torch.equal(st.memories[0], torch.zeros(10, 10, dtype=torch.float64))
    res0, st0 = outs[0][0.0]
    assert res0.sent_bytes == (10 * 8 + 10 * 8 + 40 * 8 + 30 * 8) * 8
    assert st0.qs[0].shape == (10, 8) and float(st0.memories[0].abs().max()) > 1e-3
    with pytest.raises(ValueError, match="min_compression_rate"):  # a state of the other rule
        powersgd_update(_grads(0, shapes), st, reuse_query=True)


def test_powersgd_bad_input():
    with pytest.raises(ValueError, match="rank=0"):
        powersgd_init([(3, 3)], rank=0)
    state = powersgd_init([(3, 3)], rank=1)
    with pytest.raises(ValueError, match="shape"):
        powersgd_update([torch.zeros(3, 4)], state)


# ---------------------------------------------------------------- sparsification


def test_selection_functions():
    x = torch.tensor([0.1, -5.0, 0.2, 3.0, -0.05, 4.0])
    assert topk_indices(x, 3).tolist() == [1, 3, 5]
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    assert torch.equal(randomk_indices(100, 7, g1), randomk_indices(100, 7, g2))
    assert len(set(randomk_indices(100, 7, g1).tolist())) == 7
    b = block_indices(23, 5, torch.Generator().manual_seed(0))
    assert b[0] % 5 == 0 and torch.equal(b, torch.arange(b[0], min(b[0] + 5, 23)))
    with pytest.raises(ValueError, match="k=0"):
        topk_indices(x, 0)
    assert topk_indices(x, 100).numel() == 6  # k is clipped to numel


def test_cyclic_block_indices_visit_every_block_once_per_round():
    numel, k = 23, 5  # 5 blocks, the last one of 3 coordinates
    for seed in (0, 1):
        rounds = []
        for r in range(3):
            starts = [int(cyclic_block_indices(numel, k, seed, 5 * r + i)[0]) for i in range(5)]
            assert sorted(starts) == [0, 5, 10, 15, 20]
            rounds.append(starts)
        assert len({tuple(x) for x in rounds}) > 1  # the order is redrawn each round
        assert torch.equal(
            cyclic_block_indices(numel, k, seed, 7), cyclic_block_indices(23, 5, seed, 7)
        )
    assert cyclic_block_indices(numel, k, 0, 4).numel() in (3, 5)
    # the largest gap between two turns of the same block is below 2·(number of blocks)
    turns = [int(cyclic_block_indices(numel, k, 3, t)[0]) // k for t in range(60)]
    for b in range(5):
        at = [t for t, x in enumerate(turns) if x == b]
        assert max(j - i for i, j in zip(at, at[1:])) <= 2 * 5 - 1
    with pytest.raises(ValueError, match="step=-1"):
        cyclic_block_indices(numel, k, 0, -1)


@pytest.mark.parametrize("method", ["topk", "randomk", "block", "cyclic_block"])
@pytest.mark.parametrize("workers", [1, 3])
def test_sparse_memory_keeps_exactly_what_was_not_sent(method, workers):
    shape = (7, 5)

    def work(r, comm):
        state = sparse_init(shape, seed=4, dtype=torch.float64)
        total_in = torch.zeros(shape, dtype=torch.float64)
        total_out = torch.zeros(shape, dtype=torch.float64)
        for step in range(5):
            x = _grads(100 * step + r, [shape])[0]
            old = state.memory.clone()
            res, state = sparse_update(x, state, comm, k=6, method=method)
            sent = torch.zeros(35, dtype=torch.float64)
            sent[res.indices] = res.values
            assert_close(state.memory, old + x - sent.reshape(shape))
            assert int((state.memory.reshape(-1)[res.indices] != 0).sum()) == 0
            total_in += x
            total_out += res.update
        return total_in, total_out, state.memory, res.sent_bytes

    outs = run_workers(workers, work)
    mean_in = sum(o[0] for o in outs) / workers
    mean_mem = sum(o[2] for o in outs) / workers
    assert_close(outs[0][1] + mean_mem, mean_in)  # telescoping, nothing lost
    for o in outs[1:]:
        assert torch.equal(o[1], outs[0][1])  # all workers apply the same update
    assert outs[0][3] == (6 * 8 + 6 * 4 if method == "topk" else 6 * 8)


def test_sparse_update_is_mean_of_selected_values_and_seeded():
    def work(r, comm):
        x = _grads(r, [(50,)])[0]
        res, _ = sparse_update(x, sparse_init((50,), 9, torch.float64), comm, k=5, method="randomk")
        return x, res

    outs = run_workers(2, work)
    assert torch.equal(outs[0][1].indices, outs[1][1].indices)  # shared seed → same indices
    idx = outs[0][1].indices
    expected = torch.zeros(50, dtype=torch.float64)
    expected[idx] = (outs[0][0][idx] + outs[1][0][idx]) / 2
    assert_close(outs[0][1].update, expected)


def test_sparse_replay_from_saved_state():
    state = sparse_init((30,), seed=2)
    for _ in range(3):
        _, state = sparse_update(torch.randn(30), state, k=4, method="block")
    saved = copy.deepcopy(state)
    xs = [torch.randn(30) for _ in range(3)]
    a = b = None
    sa, sb = state, saved
    for x in xs:
        a, sa = sparse_update(x, sa, k=4, method="block")
        b, sb = sparse_update(x, sb, k=4, method="block")
        assert torch.equal(a.update, b.update)
    assert torch.equal(sa.memory, sb.memory)
    with pytest.raises(ValueError, match="method"):
        sparse_update(xs[0], state, k=3, method="nope")


# ---------------------------------------------------------------- sign


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-10, 10, allow_nan=False), min_size=1, max_size=40))
def test_pack_unpack_roundtrip(values):
    x = torch.tensor(values)
    packed = pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.numel() == -(-x.numel() // 8)
    assert torch.equal(unpack_signs(packed, x.numel()), signs(x))


def test_majority_vote_and_ties():
    votes = [
        torch.tensor([1.0, 1.0, -1.0]),
        torch.tensor([1.0, -1.0, -1.0]),
        torch.tensor([-1.0, -1.0, -1.0]),
    ]
    assert majority_vote(votes).tolist() == [1.0, -1.0, -1.0]
    assert majority_vote(votes[:2]).tolist() == [1.0, 0.0, -1.0]


def test_sign_majority_vote_across_workers():
    def work(r, comm):
        x = _grads(r, [(40,)])[0]
        res, _ = sign_update(x, sign_init((40,), torch.float64), comm, majority=True)
        return x, res

    outs = run_workers(3, work)
    expected = torch.sign(sum(torch.sign(o[0]) for o in outs))
    for _, res in outs:
        assert torch.equal(res.update, expected)
        assert res.sent_bytes == 10 and res.dense_bytes == 40 * 8  # 2 bits per coordinate


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from([-2.5, -1.0, 0.0, -0.0, 0.5, 3.0]), min_size=1, max_size=40))
def test_pack_unpack_ternary_roundtrip(values):
    x = torch.tensor(values)
    packed = pack_ternary(x)
    assert packed.dtype == torch.uint8 and packed.numel() == 2 * -(-x.numel() // 8)
    assert torch.equal(unpack_ternary(packed, x.numel()), torch.sign(x))


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_sign_majority_vote_leaves_zero_gradients_still(workers):
    # A coordinate with a zero gradient on every worker (dead unit, unused row) casts no vote
    # and gets no update; with one worker the vote is plain sign().
    def work(r, comm):
        x = _grads(r, [(12,)])[0]
        x[3:6] = 0.0
        res, _ = sign_update(x, sign_init((12,), torch.float64), comm, majority=True)
        plain, _ = sign_update(x, sign_init((12,), torch.float64), comm)
        return x, res.update, plain.update

    outs = run_workers(workers, work)
    votes = sum(torch.sign(o[0]) for o in outs)
    for x, update, plain in outs:
        assert torch.equal(update, torch.sign(votes))
        assert torch.equal(update[3:6], torch.zeros(3, dtype=torch.float64))
        assert_close(plain, votes / workers)
        if workers == 1:
            assert torch.equal(update, torch.sign(x))


def test_sign_error_feedback_scale_is_finite_in_fp16():
    # The L1 sum of this fp16 input (1e5) exceeds fp16's range; its mean (0.5) does not.
    x = torch.full((200_000,), 0.5, dtype=torch.float16)
    res, state = sign_update(x, sign_init(x.shape, torch.float16), error_feedback=True)
    assert res.update.dtype == torch.float16
    assert torch.equal(res.update, x)
    assert torch.equal(state.memory, torch.zeros_like(x))


@pytest.mark.parametrize("workers", [1, 2])
def test_sign_error_feedback_accumulates_what_was_dropped(workers):
    def work(r, comm):
        state = sign_init((13,), torch.float64)
        tin = torch.zeros(13, dtype=torch.float64)
        tout = torch.zeros(13, dtype=torch.float64)
        for step in range(6):
            x = _grads(7 * step + r, [(13,)])[0]
            p = x + state.memory
            res, state = sign_update(x, state, comm, error_feedback=True)
            c = p.abs().mean() * signs(p)
            assert_close(state.memory, p - c)
            tin += x
            tout += res.update
        return tin, tout, state.memory

    outs = run_workers(workers, work)
    mean_in = sum(o[0] for o in outs) / workers
    mean_mem = sum(o[2] for o in outs) / workers
    assert_close(outs[0][1] + mean_mem, mean_in)


def test_sign_options_are_exclusive():
    with pytest.raises(ValueError, match="alternatives"):
        sign_update(torch.ones(3), sign_init((3,)), error_feedback=True, majority=True)
    res, _ = sign_update(torch.tensor([-2.0, 0.0, 3.0]), sign_init((3,)), LocalCommunicator())
    assert res.update.tolist() == [-1.0, 0.0, 1.0]


# ---------------------------------------------------------------- gossip


def test_gossip_on_a_ring_reaches_consensus():
    n = 6
    torch.manual_seed(0)
    xs = [torch.randn(4, dtype=torch.float64) for _ in range(n)]
    mean = torch.stack(xs).mean(0)
    for _ in range(200):
        xs = [gossip_mix(xs[i], [xs[(i - 1) % n], xs[(i + 1) % n]]) for i in range(n)]
    for x in xs:
        assert_close(x, mean)
    with pytest.raises(ValueError, match="shape"):
        gossip_mix(torch.zeros(2), [torch.zeros(3)])


# ---------------------------------------------------------------- count sketch


def test_count_sketch_is_linear_and_unbiased():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(3000, generator=g), torch.randn(3000, generator=g)
    # One seed, one hash: workers' sketches sum to the sketch of the sum.
    assert_close(count_sketch(x + y, 128, 7), count_sketch(x, 128, 7) + count_sketch(y, 128, 7))
    assert not torch.equal(count_sketch(x, 128, 7), count_sketch(x, 128, 8))
    # |S x|² estimates |x|² without bias; one draw's relative spread is about sqrt(2 / k).
    est = torch.stack([count_sketch(x, 128, s).square().sum() for s in range(600)])
    norm = x.square().sum()
    assert abs(float(est.mean() / norm) - 1.0) < 0.02
    assert 0.08 < float(est.std() / norm) < 0.16  # sqrt(2/128) = 0.125
    half = count_sketch(x.half(), 64, 1)
    assert half.dtype == torch.float32 and half.shape == (64,)
    with pytest.raises(ValueError, match="size"):
        count_sketch(x, 0, 1)


# ---------------------------------------------------------------- top-k ties


def test_topk_indices_break_ties_by_lowest_index():
    # Documented: ties go to the lowest index. torch.topk picks an arbitrary tied entry
    # (ones(10), k=3 gave [6, 7, 8]), so workers could not reproduce a selection.
    assert topk_indices(torch.ones(10), 3).tolist() == [0, 1, 2]
    assert topk_indices(torch.ones(5000), 4).tolist() == [0, 1, 2, 3]
    x = torch.tensor([1.0, 2.0, -2.0, 2.0, 2.0, 2.0, 0.0, 2.0])
    assert topk_indices(x, 2).tolist() == [1, 2]
    assert topk_indices(x, 4).tolist() == [1, 2, 3, 4]
    y = torch.tensor([0.5, -3.0, 0.5, 0.5, 3.0, 0.1], dtype=torch.float16)
    assert topk_indices(y, 3).tolist() == [0, 1, 4]  # the two 3s, then the first 0.5
    z = torch.tensor([1.0, float("nan"), 5.0, 1.0])
    assert topk_indices(z, 2).tolist() == [1, 2]  # NaN still counts as the largest
    assert topk_indices(torch.tensor([1.0, -1.0]), 5).tolist() == [0, 1]
