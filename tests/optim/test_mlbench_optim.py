"""mlbench-compatible optimizers: multi-process (gloo) equivalence, replay, and seed fixes."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.testing import assert_close

from adaptrain.core.compress import gossip_mix
from adaptrain.dist.spawn import spawn
from adaptrain.optim._centralized import (
    CentralizedAdam,
    CentralizedSGD,
    CustomCentralizedOptimizer,
    GenericCentralizedOptimizer,
)
from adaptrain.optim._decentralized import DecentralizedSGD, ring_neighbors
from adaptrain.optim._fp16 import DynamicLossScaler, FP16Optimizer
from adaptrain.optim._powersgd import PowerSGD
from adaptrain.optim._sign import SignSGD
from adaptrain.optim._sparsified import CentralizedSparsifiedSGD, SparsifiedSGD

BATCH, STEPS = 24, 3


def _np(obj):
    """Tensors → numpy for the trip back from spawned workers (tensors sent through the
    result queue use shared-memory fds and hang once the sender exits)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().numpy().copy()
    if isinstance(obj, dict):
        return {k: _np(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_np(v) for v in obj)
    return obj


def _t(obj):
    """Inverse of :func:`_np` (numpy arrays → tensors)."""
    import numpy as np

    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj)
    if isinstance(obj, dict):
        return {k: _t(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_t(v) for v in obj)
    return obj


def _data():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return torch.tensor(x[: BATCH * STEPS], dtype=torch.float32) / 16, torch.tensor(
        y[: BATCH * STEPS]
    )


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.Tanh(), torch.nn.Linear(16, 10))


def _make(kind: str, model: torch.nn.Module, ws: int):
    if kind == "sgd":
        return CentralizedSGD(ws, model, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3)
    if kind == "sgd_by_layer":
        return CentralizedSGD(ws, model, lr=0.1, momentum=0.9, by_layer=True)
    if kind == "adam":
        return CentralizedAdam(ws, model, lr=0.01, amsgrad=True)
    if kind == "custom":
        inner = torch.optim.SGD(model.parameters(), lr=0.2)
        return CustomCentralizedOptimizer(
            model, ws, inner, grad_clip=0.5, average_world=True, divide_before=True
        )
    if kind == "custom_denom":
        inner = torch.optim.SGD(model.parameters(), lr=0.2)
        return CustomCentralizedOptimizer(model, ws, inner, average_custom=True)
    if kind == "powersgd_full":
        return PowerSGD(model, lr=0.1, momentum=0.9, rank=16, world_size=ws)
    if kind == "sparse_dense":  # k ≥ numel of every parameter: plain SGD on the mean gradient
        return CentralizedSparsifiedSGD(
            model.parameters(), lr=0.1, sparse_grad_size=10_000, world_size=ws
        )
    raise ValueError(kind)


def _reference(kind: str) -> torch.nn.Module:
    """Single process, concatenated batch, the plain torch optimizer."""
    x, y = _data()
    model = _model()
    if kind == "sgd":
        opt = torch.optim.SGD(
            model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3
        )
    elif kind in ("sgd_by_layer", "powersgd_full"):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    elif kind == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=0.01, amsgrad=True)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.2 if kind.startswith("custom") else 0.1)
    for s in range(STEPS):
        xb, yb = x[s * BATCH : (s + 1) * BATCH], y[s * BATCH : (s + 1) * BATCH]
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(xb), yb)
        if kind == "custom_denom":  # workers sum per-sample losses, divide by the global count
            loss = torch.nn.functional.cross_entropy(model(xb), yb, reduction="sum") / BATCH
        loss.backward()
        if kind == "custom":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
    return model


class _Tracker:
    def __init__(self) -> None:
        self.agg = self.opt = 0

    def record_batch_agg(self) -> None:
        self.agg += 1

    def record_batch_opt_step(self) -> None:
        self.opt += 1


def _centralized_worker(rank, ws, kinds):
    x, y = _data()
    per = BATCH // ws
    out = {}
    for kind in kinds:
        model = _model()
        opt = _make(kind, model, ws)
        tracker = _Tracker()
        for s in range(STEPS):
            lo = s * BATCH + rank * per
            xb, yb = x[lo : lo + per], y[lo : lo + per]
            opt.zero_grad()
            if kind == "custom_denom":
                loss = torch.nn.functional.cross_entropy(model(xb), yb, reduction="sum")
                loss.backward()
                opt.step(tracker=tracker, denom=torch.tensor(float(BATCH)))
            else:
                torch.nn.functional.cross_entropy(model(xb), yb).backward()
                if isinstance(opt, (GenericCentralizedOptimizer, PowerSGD)):
                    opt.step(tracker=tracker)
                else:
                    opt.step()
        out[kind] = ([p.detach().clone() for p in model.parameters()], tracker.agg, tracker.opt)
    return _np(out)


KINDS = ["sgd", "sgd_by_layer", "adam", "custom", "custom_denom", "powersgd_full", "sparse_dense"]


@pytest.mark.parametrize("ws", [2, 3])
def test_centralized_match_concatenated_batch_and_stay_identical(ws):
    res = _t(spawn(_centralized_worker, ws, args=(KINDS,), timeout=240))
    for kind in KINDS:
        ref = list(_reference(kind).parameters())
        params0 = res[0][kind][0]
        for r in range(1, ws):  # replicas bit-identical
            for a, b in zip(params0, res[r][kind][0]):
                assert torch.equal(a, b), kind
        for a, b in zip(params0, ref):
            assert_close(a, b.detach(), rtol=1e-4, atol=1e-5, msg=kind)
        if kind not in ("sparse_dense",):
            assert res[0][kind][1:] == (STEPS, STEPS), kind  # tracker hooks called


def _train(opt, model, x, y, steps, start=0, per=8, rank=0):
    for s in range(start, start + steps):
        lo = s * 2 * per + rank * per
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[lo : lo + per]), y[lo : lo + per]).backward()
        opt.step()


def _replay_worker(rank, ws, kinds):
    return _np({kind: _replay_one(rank, ws, kind) for kind in kinds})


def _replay_one(rank, ws, kind):
    """Compressed optimizers: replicas identical; state_dict save → load → replay is exact."""
    x, y = _data()
    model = _model()

    def make(m):
        if kind == "powersgd":
            return PowerSGD(m, lr=0.1, momentum=0.9, rank=2, reuse_query=True, world_size=ws)
        if kind == "sparse":
            return CentralizedSparsifiedSGD(
                m.parameters(),
                lr=0.1,
                sparse_grad_size=7,
                random_sparse=True,
                world_size=ws,
                seed=3,
            )
        if kind == "sparse_cyclic":
            return CentralizedSparsifiedSGD(
                m.parameters(),
                lr=0.1,
                sparse_grad_size=7,
                world_size=ws,
                seed=3,
                cyclic_blocks=True,
            )
        if kind == "sign_mv":
            return SignSGD(m.parameters(), lr=0.01, momentum=0.9, majority_vote=True)
        return SignSGD(m.parameters(), lr=0.01, error_feedback=True)

    opt = make(model)
    _train(opt, model, x, y, 2, rank=rank)
    saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
    _train(opt, model, x, y, 2, start=2, rank=rank)
    first = [p.detach().clone() for p in model.parameters()]
    model2 = _model(seed=99)
    model2.load_state_dict(saved[0])
    opt2 = make(model2)
    opt2.load_state_dict(saved[1])
    _train(opt2, model2, x, y, 2, start=2, rank=rank)
    second = [p.detach().clone() for p in model2.parameters()]
    return first, second, list(_model().parameters())


def test_compressed_optimizers_identical_replicas_and_replay():
    kinds = ["powersgd", "sparse", "sparse_cyclic", "sign_mv", "sign_ef"]
    out = _t(spawn(_replay_worker, 2, args=(kinds,), timeout=240))
    for kind in kinds:
        res = [out[0][kind], out[1][kind]]
        for a, b in zip(res[0][0], res[1][0]):
            assert torch.equal(a, b), kind  # replicas bit-identical
        for a, b in zip(res[0][0], res[0][1]):
            assert torch.equal(a, b), kind  # replay from the saved state is exact
        init = res[0][2]
        assert any(not torch.equal(a, b) for a, b in zip(res[0][0], init)), kind  # it trained


def _sign_vote_worker(rank, ws):
    torch.manual_seed(rank)
    p = torch.nn.Parameter(torch.zeros(11))
    p.grad = torch.randn(11)
    grads = [torch.empty(11) for _ in range(ws)]
    torch.distributed.all_gather(grads, p.grad)
    SignSGD([p], lr=0.5, majority_vote=True).step()
    return _np((p.detach(), torch.stack(grads)))


def test_sign_majority_vote_is_sign_of_summed_signs():
    res = _t(spawn(_sign_vote_worker, 3, timeout=120))
    grads = res[0][1]
    expected = -0.5 * torch.sign(torch.sign(grads).sum(0))
    for p, _ in res:
        assert torch.equal(p, expected)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_sign_majority_vote_skips_zero_and_missing_gradients(momentum):
    # One process: the vote of a single worker is sign(u); zero coordinates and a parameter
    # without a gradient do not move, as with the local rule and torch.optim.SGD.
    used = torch.nn.Parameter(torch.ones(3))
    unused = torch.nn.Parameter(torch.ones(3))
    results = {}
    for vote in (False, True):
        used.data.fill_(1.0)
        unused.data.fill_(1.0)
        opt = SignSGD(
            [used, unused], lr=0.1, momentum=momentum, weight_decay=0.01, majority_vote=vote
        )
        for _ in range(5):
            opt.zero_grad()
            (used * torch.tensor([1.0, 0.0, -1.0])).sum().backward()
            opt.step()
        assert unused.grad is None and "momentum_buffer" not in opt.state[unused]
        assert torch.equal(unused.detach(), torch.ones(3))
        results[vote] = used.detach().clone()
    assert_close(results[True], results[False])
    assert results[True][1] != 1.0  # weight decay alone moves the zero-gradient coordinate


def test_sparsified_sgd_add_param_group():
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(20)), torch.nn.Parameter(torch.randn(20))
    b0 = b.detach().clone()
    opt = SparsifiedSGD([a], lr=0.1, sparse_grad_size=5)
    opt.add_param_group({"params": [b]})
    (a.sum() + 2 * b.sum()).backward()
    opt.step()
    assert int((b.detach() != b0).sum()) == 5  # k coordinates of the new group applied
    assert_close(opt.state[b]["memory"].sum(), torch.tensor(0.2 * 15))  # the rest remembered
    opt.update_estimated_weights(1, 5)
    est = opt.get_estimated_weights()
    assert len(est) == 2 and est[1].shape == b.shape


def _gossip_worker(rank, ws, rounds):
    torch.manual_seed(rank)
    model = torch.nn.Linear(3, 2)
    init = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    opt = DecentralizedSGD(rank, ring_neighbors(rank, ws), model, lr=0.1)
    spread = []
    for _ in range(rounds):
        opt.zero_grad()  # no gradients: pure gossip
        opt.step()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        spread.append(flat)
    return _np((init, spread))


def test_decentralized_gossip_reaches_consensus_on_ring():
    res = _t(spawn(_gossip_worker, 4, args=(40,), timeout=180))
    mean = torch.stack([r[0] for r in res]).mean(0)
    finals = [r[1][-1] for r in res]
    for f in finals:
        assert_close(f, mean, rtol=0, atol=1e-6)
    early = max(float((r[1][0] - mean).abs().max()) for r in res)
    assert early > 1e-3  # not trivially equal after one round


def test_decentralized_accepts_rank_zero_and_validates():
    m = torch.nn.Linear(2, 2)
    assert DecentralizedSGD(0, [1], m, lr=0.1).rank == 0
    with pytest.raises(ValueError, match="rank=None"):
        DecentralizedSGD(None, [1], m, lr=0.1)
    with pytest.raises(ValueError, match="own neighbors"):
        DecentralizedSGD(1, [1, 2], m, lr=0.1)
    with pytest.raises(ValueError, match="neighbors"):
        DecentralizedSGD(0, [], m, lr=0.1)


# ---------------------------------------------------------------- single-process behaviour


def test_centralized_construct_single_process_and_validate():
    m = _model()
    CentralizedSGD(1, m, lr=0.1)
    CentralizedAdam(1, m, lr=0.1)
    with pytest.raises(RuntimeError, match="process group"):
        CentralizedSGD(2, m, lr=0.1)
    with pytest.raises(ValueError, match="exactly one"):
        CustomCentralizedOptimizer(m, 1, torch.optim.SGD(m.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match="no optimizer"):
        GenericCentralizedOptimizer(1, m).step()
    with pytest.raises(ValueError, match="rank=0"):
        PowerSGD(m, lr=0.1, rank=0)
    opt = CentralizedSGD(1, m, lr=0.5)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.1)
    m(torch.ones(1, 64)).sum().backward()
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)


def test_sparsified_sgd_keeps_weights_any_shape_and_is_seeded():
    def run(seed, random_sparse):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Conv2d(1, 3, 3), torch.nn.Flatten(), torch.nn.Linear(48, 4)
        )
        before = [p.detach().clone() for p in model.parameters()]
        opt = SparsifiedSGD(
            model.parameters(), lr=0.1, sparse_grad_size=5, random_sparse=random_sparse, seed=seed
        )
        for p, b in zip(model.parameters(), before):
            assert torch.equal(p, b)  # the constructor does not touch the weights
        xs = torch.randn(4, 1, 6, 6, generator=torch.Generator().manual_seed(1))
        for t in range(3):
            opt.zero_grad()
            model(xs).pow(2).mean().backward()
            opt.step()
            opt.update_estimated_weights(t, 5)
        changed = [int((p.detach() != b).sum()) for p, b in zip(model.parameters(), before)]
        return [p.detach().clone() for p in model.parameters()], changed, opt

    a, changed, opt = run(0, True)
    b, _, _ = run(0, True)
    c, _, _ = run(1, True)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert any(not torch.equal(x, y) for x, y in zip(a, c))
    assert all(0 < n <= 15 for n in changed)  # at most k=5 coordinates per step per parameter
    est = opt.get_estimated_weights()
    assert len(est) == 4 and est[0].shape == (3, 1, 3, 3)
    p = next(iter(opt.param_groups[0]["params"]))
    p.grad = torch.ones_like(p)
    sparse = opt.sparsify_gradients(p, 0.1)
    assert sparse.shape == (2, 5)
    blocky, _, _ = run(0, False)
    assert any(not torch.equal(x, y) for x, y in zip(a, blocky))


def test_sign_sgd_local_matches_seed_rule():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5))
    g1, g2 = torch.randn(5), torch.randn(5)
    opt = SignSGD([p], lr=0.1, momentum=0.9, weight_decay=0.01)
    p0 = p.detach().clone()
    p.grad = g1.clone()
    opt.step()
    buf = g1 + 0.01 * p0
    p1 = p0 - 0.1 * torch.sign(buf)
    assert_close(p.detach(), p1)
    p.grad = g2.clone()
    opt.step()
    buf = 0.9 * buf + (g2 + 0.01 * p1)
    assert_close(p.detach(), p1 - 0.1 * torch.sign(buf))
    with pytest.raises(ValueError, match="pick one"):
        SignSGD([p], lr=0.1, majority_vote=True, error_feedback=True)


def test_ef_sign_sgd_follows_algorithm_1_of_karimireddy():
    """EF-SignSGD: q = lr·g + e, Δ = (‖q‖₁/d)·sign(q), p ← p − Δ, e ← q − Δ (one worker)."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(9))
    opt = SignSGD([p], lr=0.3, error_feedback=True)
    ref, e = p.detach().clone(), torch.zeros(9)
    for _ in range(4):
        g = torch.randn(9)
        p.grad = g.clone()
        opt.step()
        q = 0.3 * g + e
        delta = q.abs().sum() / 9 * torch.where(q >= 0, 1.0, -1.0)
        ref, e = ref - delta, q - delta
        assert_close(p.detach(), ref)
        assert_close(opt.state[p]["ef_memory"], e)


def _digits_final_loss(make, epochs: int = 8, seed: int = 0) -> float:
    from adaptrain.workloads.digits import DigitsNet, digits_datasets

    x, y = digits_datasets(seed=0)[0].tensors
    model = DigitsNet(hidden=64, conv=False, seed=seed)
    opt = make(model.parameters())
    g = torch.Generator().manual_seed(1 + seed)
    for _ in range(epochs):
        perm = torch.randperm(len(y), generator=g)
        for b in range(len(y) // 64):
            idx = perm[b * 64 : (b + 1) * 64]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    with torch.no_grad():
        return float(torch.nn.functional.cross_entropy(model(x), y))


def test_ef_sign_sgd_tracks_sgd_on_digits():
    """Real data: EF-SignSGD (Algorithm 1, one worker) ends within 0.1 nats of SGD at the same lr
    after 8 epochs of the digits MLP (measured: 0.062 vs 0.061)."""
    sgd = _digits_final_loss(lambda p: torch.optim.SGD(p, lr=1.0))
    ef = _digits_final_loss(lambda p: SignSGD(p, lr=1.0, error_feedback=True))
    assert sgd < 0.2 and ef <= sgd + 0.1, (sgd, ef)


def test_cyclic_block_sparsified_sgd_applies_every_block_once_per_round():
    """With a constant gradient, each aligned block is applied exactly once per round of
    ⌈d/k⌉ steps, carrying the memory accumulated since its previous turn."""
    p = torch.nn.Parameter(torch.zeros(10))
    opt = SparsifiedSGD([p], lr=0.5, sparse_grad_size=4, cyclic_blocks=True, seed=5)
    grad = torch.arange(1.0, 11.0)
    turns = []
    for _ in range(6):  # 3 blocks (sizes 4, 4, 2) → two full rounds
        before = p.detach().clone()
        p.grad = grad.clone()
        opt.step()
        changed = (p.detach() != before).nonzero().flatten()
        assert changed.numel() in (2, 4) and int(changed[0]) % 4 == 0
        turns.append(int(changed[0]) // 4)
    assert sorted(turns[:3]) == [0, 1, 2] and sorted(turns[3:]) == [0, 1, 2]
    # after two rounds, every coordinate has applied exactly the steps up to its last turn
    last = {b: 1 + max(i for i, t in enumerate(turns) if t == b) for b in range(3)}
    expected = torch.cat([-0.5 * grad[4 * b : 4 * b + 4] * last[b] for b in range(3)])
    assert_close(p.detach(), expected)
    assert_close(opt.state[p]["memory"], 0.5 * grad * 6 + expected)  # input − applied


def _fp16_setup(**kw):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3).half()
    opt = FP16Optimizer(model, 1, average_world=True, **kw)
    opt.set_optimizer(torch.optim.SGD([opt.fp32_params], lr=0.1))
    x = torch.randn(16, 8).half()
    y = torch.randint(0, 3, (16,))
    return model, opt, x, y


def _fp16_step(model, opt, x, y):
    opt.zero_grad()
    opt.backward_loss(torch.nn.functional.cross_entropy(model(x).float(), y).half())
    return opt.step()


def test_fp16_skips_overflow_and_adjusts_scale():
    model, opt, x, y = _fp16_setup(
        init_scale=2.0**20, scale_factor=2.0**10, scale_window=1, max_scale=2.0**13
    )
    assert opt.loss_scaler.loss_scale == 2.0**13  # init_scale clamped to max_scale
    w0 = model.weight.detach().clone()
    # large inputs: loss · 2^13 overflows fp16, real inf grads
    assert _fp16_step(model, opt, x * 1000, y) is False
    assert torch.equal(model.weight, w0) and opt.loss_scaler.loss_scale == 2.0**3
    assert _fp16_step(model, opt, x, y) is True
    assert not torch.equal(model.weight, w0)
    assert opt.loss_scaler.loss_scale == 2.0**13
    assert _fp16_step(model, opt, x, y) is True  # clean step: grow, clamped at max_scale
    assert opt.loss_scaler.loss_scale == 2.0**13
    assert_close(model.weight.float().reshape(-1), opt.fp32_params.detach()[:24].half().float())


def test_fp16_matches_fp32_sgd_and_replays():
    model, opt, x, y = _fp16_setup(init_scale=128)
    ref = torch.nn.Linear(8, 3)
    with torch.no_grad():
        ref.weight.copy_(model.weight.float())
        ref.bias.copy_(model.bias.float())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(3):
        assert _fp16_step(model, opt, x, y)
        ref_opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(x.float()), y).backward()
        ref_opt.step()
    assert_close(
        opt.fp32_params.detach()[:24], ref.weight.detach().reshape(-1), rtol=1e-2, atol=2e-3
    )
    saved = copy.deepcopy(opt.state_dict())
    _fp16_step(model, opt, x, y)
    after = opt.fp32_params.detach().clone()
    opt.load_state_dict(saved)
    _fp16_step(model, opt, x, y)
    assert torch.equal(opt.fp32_params.detach(), after)


class _TwoHeads(torch.nn.Module):
    """A shared layer and two heads; a step uses one head, the other gets no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(8, 8)
        self.heads = torch.nn.ModuleList([torch.nn.Linear(8, 3), torch.nn.Linear(8, 3)])

    def forward(self, x, head):
        return self.heads[head](torch.relu(self.body(x)))


def _sgd_momentum_wd(ps):
    return torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01)


@pytest.mark.parametrize(
    "make_opt",
    [_sgd_momentum_wd, lambda ps: torch.optim.Adam(ps, lr=0.01, weight_decay=0.01)],
    ids=["sgd-momentum-wd", "adam-wd"],
)
def test_fp16_leaves_a_parameter_without_gradient_as_torch_optim_does(make_opt):
    # mlbench steps the flat master whole: an unused head decayed, and momentum kept moving
    # it. Here it stays put, and its momentum waits for its next gradient, as with torch.optim
    # on the fp32 parameters (the reference below). Head 1 is first used at step 3.
    torch.manual_seed(0)
    ref = _TwoHeads()
    model = copy.deepcopy(ref).half()
    ref.load_state_dict({k: v.half().float() for k, v in ref.state_dict().items()})
    opt = FP16Optimizer(model, 1, average_world=True, init_scale=128)
    opt.set_optimizer(make_opt([opt.fp32_params]))
    ref_opt = make_opt(ref.parameters())
    x = torch.randn(16, 8).half()
    y = torch.randint(0, 3, (16,))
    head1 = torch.cat([p.detach().reshape(-1) for p in ref.heads[1].parameters()])
    start = sum(p.numel() for p in ref.body.parameters()) + 27  # head 1 after body and head 0
    for step, head in enumerate([0, 0, 0, 1, 0, 1]):
        opt.zero_grad()
        opt.backward_loss(torch.nn.functional.cross_entropy(model(x, head).float(), y).half())
        assert opt.step()
        ref_opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(x.float(), head), y).backward()
        ref_opt.step()
        if step < 3:  # head 1 untouched so far, master and fp16 copy alike
            assert torch.equal(opt.fp32_params.detach()[start : start + 27], head1)
            assert torch.equal(model.heads[1].weight.float().reshape(-1), head1[:24].half().float())
    flat_ref = torch.cat([p.detach().reshape(-1) for p in ref.parameters()])
    # Adam's step count is one for the whole flat master: head 1's bias correction starts at
    # step 4, not 1 (documented), so only SGD matches torch.optim on head 1 too.
    end = start + 27 if make_opt is _sgd_momentum_wd else start
    assert_close(opt.fp32_params.detach()[:end], flat_ref[:end], rtol=2e-2, atol=2e-3)


def test_dynamic_loss_scaler_follows_mlbench_rule_and_replays():
    """mlbench's rule: halve on overflow; double on the ``scale_window``-th step (counting
    overflow steps) since the last overflow; ``max_scale`` caps it. Ours counts clean steps
    since the last change, the same trajectory."""
    from adaptrain.optim import DynamicLossScaler as Exported

    assert Exported is DynamicLossScaler

    def reference(flags, init, factor, window, max_scale):  # mlbench-core's update_scale
        scale, it, last, out = init, 0, -1, []
        for overflow in flags:
            if overflow:
                scale, last = scale / factor, it
            elif (it - last) % window == 0:
                scale = scale * factor if max_scale is None else min(scale * factor, max_scale)
            it += 1
            out.append(scale)
        return out

    gen = torch.Generator().manual_seed(0)
    flags = (torch.rand(200, generator=gen) < 0.08).tolist()
    for max_scale in (None, 2.0**16):
        ours = DynamicLossScaler(2.0**15, 2.0, 5, max_scale)
        got = []
        for i, overflow in enumerate(flags):
            ours.update_scale(overflow)
            got.append(ours.loss_scale)
            if i == 99:  # save -> load -> replay the rest
                twin = DynamicLossScaler(2.0**15, 2.0, 5, max_scale)
                twin.load_state_dict(copy.deepcopy(ours.state_dict()))
        replay = []
        for overflow in flags[100:]:
            twin.update_scale(overflow)
            replay.append(twin.loss_scale)
        assert got == reference(flags, 2.0**15, 2.0, 5, max_scale)
        assert replay == got[100:]
    assert DynamicLossScaler.has_overflow(float("inf")) and DynamicLossScaler.has_overflow(
        float("nan")
    )
    assert not DynamicLossScaler.has_overflow(torch.tensor(3.0))


def test_fp16_min_scale_raises():
    model, opt, x, y = _fp16_setup(init_scale=2.0**30, scale_factor=2.0**10, min_scale=2.0**25)
    with pytest.raises(RuntimeError, match="minimum loss scale"):
        _fp16_step(model, opt, x, y)
    with pytest.raises(ValueError, match="horovod"):
        FP16Optimizer(model, 1, use_horovod=True, average_world=True)


def test_sparsify_gradients_indices_are_exact_in_half_precision():
    # 5000 fp16 entries: fp16 holds integers exactly only up to 2048.
    p = torch.nn.Parameter(torch.zeros(5000, dtype=torch.float16))
    opt = SparsifiedSGD([p], lr=1.0, sparse_grad_size=3, random_sparse=True, seed=3)
    p.grad = torch.arange(5000, dtype=torch.float16) / 5000
    sparse = opt.sparsify_gradients(p, 1.0)
    assert sparse.dtype == torch.float32
    idx = sparse[0].long()
    assert torch.equal(sparse[0], idx.float()) and int(idx.max()) < 5000
    torch.testing.assert_close(sparse[1], p.grad[idx].float())  # the values at those indices
    small = SparsifiedSGD([torch.nn.Parameter(torch.zeros(8))], lr=0.1, sparse_grad_size=2)
    q = small.param_groups[0]["params"][0]
    q.grad = torch.ones(8)
    assert small.sparsify_gradients(q, 0.1).dtype == torch.float32  # the parameter's dtype


# ----- parameters without gradient, added groups, hooks, fp16 state, neighbour graphs, sparse


class _Branches(torch.nn.Module):
    """``a`` is used by every worker, ``b`` by rank 0 only, ``c`` by none."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = (torch.nn.Linear(4, 2) for _ in range(3))


def _branch_loss(m, x, y, rank):
    loss = torch.nn.functional.mse_loss(m.a(x), y)
    return loss + m.b(x).pow(2).mean() if rank == 0 else loss


def _branch_data(rank):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(STEPS, 4, 4, generator=g), torch.randn(STEPS, 4, 2, generator=g)


NOGRAD_KINDS = ("sgd", "sgd_by_layer", "adam")


def _nograd_worker(rank, ws):
    out = {}
    for kind in NOGRAD_KINDS:
        m = _Branches()
        if kind == "adam":
            opt = CentralizedAdam(ws, m, lr=0.1, weight_decay=0.1)
        else:
            by_layer = kind == "sgd_by_layer"
            opt = CentralizedSGD(ws, m, lr=0.1, momentum=0.9, weight_decay=0.1, by_layer=by_layer)
        xs, ys = _branch_data(rank)
        for s in range(STEPS):
            opt.zero_grad()
            _branch_loss(m, xs[s], ys[s], rank).backward()
            opt.step()
        c_untouched = m.c.weight.grad is None and not opt.state[m.c.weight]
        out[kind] = ([p.detach().clone() for p in m.parameters()], c_untouched)
    return _np(out)


def _branch_reference(kind, ws):
    """One process: the mean of the workers' losses, the plain torch optimizer."""
    m = _Branches()
    if kind == "adam":
        opt = torch.optim.Adam(m.parameters(), lr=0.1, weight_decay=0.1)
    else:
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    data = [_branch_data(r) for r in range(ws)]
    for s in range(STEPS):
        opt.zero_grad()
        (sum(_branch_loss(m, data[r][0][s], data[r][1][s], r) for r in range(ws)) / ws).backward()
        opt.step()
    return [p.detach() for p in m.parameters()]


def test_centralized_skips_parameters_without_gradient_on_every_worker():
    # c: no gradient anywhere → untouched (no weight decay / momentum / Adam step), as in
    # torch.optim; b: gradient on rank 0 only → zeros on rank 1, the average applied.
    init = [p.detach() for p in _Branches().c.parameters()]
    runs = {2: _t(spawn(_nograd_worker, 2, timeout=120)), 1: [_t(_nograd_worker(0, 1))]}
    for ws, res in runs.items():  # ws=1 runs here, without a process group
        for kind in NOGRAD_KINDS:
            ref = _branch_reference(kind, ws)
            for params, c_untouched in (r[kind] for r in res):
                assert c_untouched, (ws, kind)
                for a, b in zip(params[4:], init):
                    assert torch.equal(a, b), (ws, kind)
                for a, b in zip(params, ref):
                    assert_close(a, b, rtol=1e-4, atol=1e-5, msg=f"{ws} {kind}")


def _sparse_nograd_worker(rank, ws):
    torch.manual_seed(0)
    used, some, unused = (torch.nn.Linear(4, 2) for _ in range(3))
    params = [*used.parameters(), *some.parameters(), *unused.parameters()]
    before = [p.detach().clone() for p in params]
    opt = CentralizedSparsifiedSGD(
        params, lr=0.5, weight_decay=0.5, sparse_grad_size=8, world_size=ws
    )
    g = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        opt.zero_grad()
        x = torch.randn(3, 4, generator=g)
        (used(x).sum() + (some(x).sum() if rank == 0 else 0)).backward()
        opt.step()
    memory = [opt.state[p]["memory"] for p in params]
    return _np(([p.detach().clone() for p in params], before, memory))


def test_centralized_sparsified_skips_parameters_without_gradient_on_every_worker():
    res = _t(spawn(_sparse_nograd_worker, 2, timeout=120))
    for r in range(2):
        after, before, memory = res[r]
        for a, b in zip(after, res[0][0]):
            assert torch.equal(a, b)  # replicas identical
        for a, b, mem in zip(after[4:], before[4:], memory[4:]):
            assert torch.equal(a, b) and not mem.any()  # no gradient anywhere: skipped
        assert not torch.equal(after[2], before[2])  # gradient on rank 0 only: applied
    after, before, memory = _t(_sparse_nograd_worker(0, 1))  # the same rule at world size 1
    assert all(torch.equal(a, b) for a, b in zip(after[4:], before[4:]))


PARAM_GROUP_KINDS = ("add_param_group", "custom", "weights")


def _param_group_run(kind, ws, rank):
    torch.manual_seed(0)
    m = torch.nn.Linear(3, 1)
    extra = torch.nn.Parameter(torch.ones(3))  # not in `model`
    if kind == "custom":
        inner = torch.optim.SGD([*m.parameters(), extra], lr=0.1)
        opt = CustomCentralizedOptimizer(m, ws, inner, average_world=True)
    else:
        opt = CentralizedSGD(None, m, lr=0.1, agg_grad=kind != "weights")
        opt.add_param_group({"params": [extra], "lr": 0.2})
    g = torch.Generator().manual_seed(10 + rank)
    for _ in range(STEPS):
        opt.zero_grad()
        m(torch.randn(4, 3, generator=g) * extra).pow(2).mean().backward()
        opt.step()
    return [p.detach().clone() for p in (*m.parameters(), extra)], opt.world_size


def _param_group_worker(rank, ws):
    return _np({kind: _param_group_run(kind, ws, rank) for kind in PARAM_GROUP_KINDS})


def _param_group_reference(kind, ws):
    torch.manual_seed(0)
    m = torch.nn.Linear(3, 1)
    extra = torch.nn.Parameter(torch.ones(3))
    lr_extra = 0.1 if kind == "custom" else 0.2
    opt = torch.optim.SGD([{"params": m.parameters()}, {"params": [extra], "lr": lr_extra}], lr=0.1)
    gens = [torch.Generator().manual_seed(10 + r) for r in range(ws)]
    for _ in range(STEPS):
        opt.zero_grad()
        xs = [torch.randn(4, 3, generator=g) for g in gens]
        (sum(m(x * extra).pow(2).mean() for x in xs) / ws).backward()
        opt.step()
    return [p.detach() for p in (*m.parameters(), extra)]


def test_centralized_aggregate_added_groups_and_optimizer_params_outside_model():
    res = _t(spawn(_param_group_worker, 2, timeout=120))
    for kind in PARAM_GROUP_KINDS:
        ref = _param_group_reference(kind, 2)
        for r in range(2):
            params, world_size = res[r][kind]
            assert world_size == 2  # world_size=None: the process group's size
            for a, b in zip(params, res[0][kind][0]):
                assert torch.equal(a, b), kind  # replicas identical, `extra` included
            for a, b in zip(params, ref):
                assert_close(a, b, rtol=1e-5, atol=1e-6, msg=kind)


WEIGHT_AVG_KINDS = ("average_world", "average_custom")
WEIGHT_AVG_CLIP, WEIGHT_AVG_LR = 0.05, 0.2


def _weight_avg_worker(rank, ws):
    """CustomCentralizedOptimizer with ``agg_grad=False``: each worker clips its own gradient
    and steps, then the weights are averaged (``denom`` has no say there)."""
    x, y = _data()
    per = BATCH // ws
    out = {}
    for kind in WEIGHT_AVG_KINDS:
        model = _model()
        inner = torch.optim.SGD(model.parameters(), lr=WEIGHT_AVG_LR)
        opt = CustomCentralizedOptimizer(
            model, ws, inner, agg_grad=False, grad_clip=WEIGHT_AVG_CLIP, **{kind: True}
        )
        tracker = _Tracker()
        for s in range(STEPS):
            lo = s * BATCH + rank * per
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[lo : lo + per]), y[lo : lo + per]).backward()
            assert opt.step(tracker=tracker, denom=torch.tensor(1000.0)) is True
        out[kind] = ([p.detach().clone() for p in model.parameters()], tracker.agg, tracker.opt)
    return _np(out)


def _weight_avg_reference(ws):
    """One process: every worker's local clipped SGD step from the shared weights, averaged."""
    x, y = _data()
    per = BATCH // ws
    model = _model()
    for s in range(STEPS):
        stepped = []
        for r in range(ws):
            local = copy.deepcopy(model)
            lo = s * BATCH + r * per
            torch.nn.functional.cross_entropy(local(x[lo : lo + per]), y[lo : lo + per]).backward()
            norm = torch.nn.utils.clip_grad_norm_(local.parameters(), WEIGHT_AVG_CLIP)
            assert norm > WEIGHT_AVG_CLIP  # the clip acts, so the test can tell it from none
            with torch.no_grad():
                for p in local.parameters():
                    p -= WEIGHT_AVG_LR * p.grad
            stepped.append(list(local.parameters()))
        with torch.no_grad():
            for p, *copies in zip(model.parameters(), *stepped):
                p.copy_(sum(copies) / ws)
    return [p.detach() for p in model.parameters()]


def test_custom_centralized_weight_averaging_clips_locally_and_divides_by_world():
    res = _t(spawn(_weight_avg_worker, 2, timeout=120))
    ref = _weight_avg_reference(2)
    for kind in WEIGHT_AVG_KINDS:
        for r in range(2):
            params, n_agg, n_opt = res[r][kind]
            assert (n_agg, n_opt) == (STEPS, STEPS), kind
            for a, b in zip(params, res[0][kind][0]):
                assert torch.equal(a, b), kind  # replicas identical
            for a, b in zip(params, ref):
                assert_close(a, b, rtol=1e-5, atol=1e-6, msg=kind)


def test_centralized_world_size_none_and_missing_lr():
    m = _model()
    assert CentralizedSGD(None, m, lr=0.1).world_size == 1
    assert CentralizedAdam(model=m, lr=0.1).world_size == 1
    with pytest.raises(ValueError, match="world_size=0"):
        CentralizedSGD(0, m, lr=0.1)
    with pytest.raises(ValueError, match="lr is required"):
        CentralizedSGD(1, m)
    with pytest.raises(ValueError, match="lr is required"):
        DecentralizedSGD(0, [1], m)


def _check_wrapper_hooks(opt, m):
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    calls = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append(("pre", o)))
    opt.register_step_post_hook(lambda o, a, k: calls.append(("post", o)))
    handles = [
        register_optimizer_step_pre_hook(lambda o, a, k: calls.append(("global-pre", o))),
        register_optimizer_step_post_hook(lambda o, a, k: calls.append(("global-post", o))),
    ]
    try:
        for _ in range(2):
            opt.zero_grad()
            m(torch.ones(2, 64)).sum().backward()
            opt.step()
    finally:
        for h in handles:
            h.remove()
    assert [c[0] for c in calls] == ["pre", "global-pre", "global-post", "post"] * 2
    # the wrapper's hooks see the wrapper; the global ones fire once, with the wrapped optimizer
    assert all(o is (opt.optimizer if n.startswith("global") else opt) for n, o in calls)
    seen = []
    opt.register_state_dict_pre_hook(lambda o: seen.append(("sd-pre", o)))
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "tag": 1})
    opt.register_load_state_dict_pre_hook(lambda o, sd: seen.append(("load-pre", sd["tag"])))
    opt.register_load_state_dict_post_hook(lambda o: seen.append(("load-post", o)))
    sd = opt.state_dict()
    assert sd["tag"] == 1
    opt.load_state_dict(sd)
    assert seen == [("sd-pre", opt), ("load-pre", 1), ("load-post", opt)]


def test_centralized_wrapper_hooks_fire_once_per_step():
    m = _model()
    _check_wrapper_hooks(CentralizedSGD(1, m, lr=0.1, momentum=0.9), m)
    inner = torch.optim.SGD(m.parameters(), lr=0.1)
    _check_wrapper_hooks(CustomCentralizedOptimizer(m, 1, inner, average_world=True), m)


def test_fp16_load_state_dict_before_set_optimizer_keeps_inner_state():
    model, opt, x, y = _fp16_setup(init_scale=128)
    opt.set_optimizer(torch.optim.SGD([opt.fp32_params], lr=0.1, momentum=0.9))
    for _ in range(2):
        assert _fp16_step(model, opt, x, y)
    saved = copy.deepcopy(opt.state_dict())
    assert _fp16_step(model, opt, x, y)
    model2 = torch.nn.Linear(8, 3).half()
    opt2 = FP16Optimizer(model2, 1, average_world=True, init_scale=128)
    opt2.load_state_dict(saved)  # before set_optimizer
    assert opt2.state_dict()["optimizer"] is not None  # round-trips while pending
    opt2.set_optimizer(torch.optim.SGD([opt2.fp32_params], lr=0.1, momentum=0.9))
    assert "momentum_buffer" in opt2.optimizer.state[opt2.fp32_params]
    assert _fp16_step(model2, opt2, x, y)
    assert torch.equal(opt2.fp32_params.detach(), opt.fp32_params.detach())


def test_fp16_validates_world_size_and_scales():
    model = torch.nn.Linear(2, 2).half()
    with pytest.raises(ValueError, match="world_size=0"):
        FP16Optimizer(model, 0, average_world=True)
    with pytest.raises(ValueError, match="min_scale=-1"):
        FP16Optimizer(model, 1, min_scale=-1, average_world=True)
    with pytest.raises(ValueError, match="min_scale=2048"):
        FP16Optimizer(model, 1, init_scale=1024, min_scale=2048, average_world=True)
    with pytest.raises(ValueError, match="max_scale=0"):
        FP16Optimizer(model, 1, max_scale=0, average_world=True)
    opt = FP16Optimizer(model, 1, init_scale=2.0**20, max_scale=2.0**13, average_world=True)
    assert opt.loss_scaler.loss_scale == 2.0**13


def _construct_each(cases, m):
    """Build a DecentralizedSGD for each case; its ValueError's message, or None."""
    out = {}
    for name, (r, nbrs) in cases.items():
        try:
            DecentralizedSGD(r, nbrs, m, lr=0.1)
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    return out


def _bad_graph_worker(rank, ws):
    m = torch.nn.Linear(2, 2)
    ring = ring_neighbors(rank, ws)
    cases = {
        "asymmetric": (rank, [(rank + 1) % ws]),  # directed ring
        "out_of_range": (rank, ring + [5] if rank == 1 else ring),
        "wrong_rank": (rank + 10 if rank == 2 else rank, ring),
        "one_rank_bad_args": (rank, [] if rank == 1 else ring),
        "ok": (rank, ring),
    }
    return _construct_each(cases, m)


def test_decentralized_rejects_bad_neighbour_graphs_on_every_rank():
    # each bad case used to hang in the first exchange until the process-group timeout
    res = spawn(_bad_graph_worker, 3, timeout=60)
    for out in res:
        assert "rank 0 lists neighbour 1 but rank 1 does not list 0" in out["asymmetric"]
        assert "on rank 1: neighbors [5] out of range" in out["out_of_range"]
        assert "on rank 2: rank=12" in out["wrong_rank"]
        assert "on rank 1: neighbors=[]" in out["one_rank_bad_args"]
        assert out["ok"] is None


def test_gossip_mix_leaves_identical_replicas_unchanged():
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(0))
    assert torch.equal(gossip_mix(x, [x.clone(), x.clone()]), x)
    assert torch.equal(gossip_mix(x, [x.clone() for _ in range(4)]), x)
    assert_close(gossip_mix(x, [x + 3, x - 6]), x - 1)


def _powersgd_add_group_run(add: bool, reuse_query: bool):
    """Two PowerSGD steps, then (``add``) a new group with ``extra``, then two more steps.

    ``extra``'s loss term is separate, so the model's gradients are the same in both runs."""
    x, y = _data()
    model = _model()
    extra = torch.nn.Parameter(torch.linspace(-1, 1, 12).reshape(3, 4))
    opt = PowerSGD(model, lr=0.1, momentum=0.9, rank=1, reuse_query=reuse_query)
    for s in range(4):
        if s == 2 and add:
            opt.add_param_group({"params": [extra], "lr": 0.05})
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(
            model(x[s * 8 : (s + 1) * 8]), y[s * 8 : s * 8 + 8]
        )
        if add and s >= 2:
            loss = loss + extra.pow(2).sum()
        loss.backward()
        opt.step()
    old = list(model.parameters())
    return opt, old, extra


@pytest.mark.parametrize("reuse_query", [False, True])
def test_powersgd_add_param_group_keeps_existing_state(reuse_query):
    # add_param_group used to rebuild the state of every parameter: error memories wiped,
    # queries redrawn and powersgd_step back to 0. The old parameters must go on exactly as
    # in a run without the new group; the new one gets fresh state at the current step.
    opt, old, extra = _powersgd_add_group_run(True, reuse_query)
    ref_opt, ref_old, _ = _powersgd_add_group_run(False, reuse_query)
    for p, q in zip(old, ref_old):
        mem, ref_mem = opt.state[p]["powersgd_memory"], ref_opt.state[q]["powersgd_memory"]
        assert_close(mem, ref_mem, rtol=0, atol=0)
        assert_close(opt.state[p]["powersgd_q"], ref_opt.state[q]["powersgd_q"], rtol=0, atol=0)
        assert_close(p.detach(), q.detach(), rtol=0, atol=0)
        assert opt.state[p]["powersgd_step"] == 4
    assert any(opt.state[p]["powersgd_memory"].any() for p in old)  # rank 1 left a residual
    assert opt.state[extra]["powersgd_step"] == 4  # the counter did not restart
    assert opt.state[extra]["powersgd_memory"].shape == extra.shape
    assert not torch.equal(extra.detach(), torch.linspace(-1, 1, 12).reshape(3, 4))
    sd = copy.deepcopy(opt.state_dict())  # the merged state round-trips
    opt2 = PowerSGD(_model(), lr=0.1, momentum=0.9, rank=1, reuse_query=reuse_query)
    opt2.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3, 4))], "lr": 0.05})
    opt2.load_state_dict(sd)
    for i, st in opt.state_dict()["state"].items():
        st2 = opt2.state_dict()["state"][i]
        assert st2["powersgd_step"] == st["powersgd_step"]
        for key in ("powersgd_memory", "powersgd_q", "momentum_buffer"):
            assert_close(st2[key], st[key], rtol=0, atol=0)


def _powersgd_nograd_worker(rank, ws):
    out = {}
    for by_layer in (False, True):
        m = _Branches()
        # rank 2 = full rank for the 2 × 4 weights: the compression is exact
        opt = PowerSGD(
            m, lr=0.1, momentum=0.9, weight_decay=0.1, rank=2, world_size=ws, by_layer=by_layer
        )
        xs, ys = _branch_data(rank)
        for s in range(STEPS):
            opt.zero_grad()
            _branch_loss(m, xs[s], ys[s], rank).backward()
            opt.step()
        c_untouched = all(
            p.grad is None and "momentum_buffer" not in opt.state[p] for p in m.c.parameters()
        )
        b_live = all(p.grad is not None for p in m.b.parameters())
        out[by_layer] = ([p.detach().clone() for p in m.parameters()], c_untouched, b_live)
    return _np(out)


def test_powersgd_skips_parameters_without_gradient_on_every_worker():
    # c: no gradient anywhere → grad stays None, so weight decay and momentum leave it alone
    # (as torch.optim.SGD does); b: a gradient on rank 0 only → zeros on rank 1, averaged.
    init = [p.detach() for p in _Branches().c.parameters()]
    runs = {2: _t(spawn(_powersgd_nograd_worker, 2, timeout=120))}
    runs[1] = [_t(_powersgd_nograd_worker(0, 1))]  # no process group
    for ws, res in runs.items():
        ref = _branch_reference("sgd", ws)
        for by_layer in (False, True):
            for params, c_untouched, b_live in (r[by_layer] for r in res):
                assert c_untouched and b_live, (ws, by_layer)
                for a, b in zip(params[4:], init):
                    assert torch.equal(a, b), (ws, by_layer)  # bit-exact
                for a, b in zip(params, res[0][by_layer][0]):
                    assert torch.equal(a, b), (ws, by_layer)  # replicas identical
                for a, b in zip(params, ref):
                    assert_close(a, b, rtol=1e-4, atol=1e-5, msg=f"{ws} {by_layer}")


class _SparseEmb(torch.nn.Module):
    def __init__(self, sparse: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(10, 3, sparse=sparse)
        self.out = torch.nn.Linear(3, 1)

    def forward(self, idx):
        return self.out(self.emb(idx)).squeeze(-1)


SPARSE_KINDS = ("sgd", "sgd_by_layer", "adam")


def _sparse_emb_opt(kind, m, ws):
    if kind == "adam":  # torch's Adam rejects sparse gradients: it gets the dense mean
        return CentralizedAdam(ws, m, lr=0.05, weight_decay=0.01)
    return CentralizedSGD(
        ws, m, lr=0.1, momentum=0.9, weight_decay=0.01, by_layer=kind == "sgd_by_layer"
    )


def _sparse_emb_data(rank):
    g = torch.Generator().manual_seed(7 + rank)
    idx = torch.randint(0, 5 + 5 * rank, (STEPS, 4), generator=g)  # rows 5-9: rank ≥ 1 only
    return idx, torch.randn(STEPS, 4, generator=g)


def _sparse_emb_worker(rank, ws):
    out = {}
    idx, y = _sparse_emb_data(rank)
    for kind in SPARSE_KINDS:
        m = _SparseEmb(sparse=True)
        opt = _sparse_emb_opt(kind, m, ws)
        for s in range(STEPS):
            opt.zero_grad()
            torch.nn.functional.mse_loss(m(idx[s]), y[s]).backward()
            assert m.emb.weight.grad.is_sparse
            opt.step()
            assert m.emb.weight.grad.layout == torch.strided  # the dense mean, written back
        out[kind] = [p.detach().clone() for p in m.parameters()]
    return _np(out)


def _sparse_emb_reference(kind, ws):
    """One process, ``sparse=False``, the mean of the workers' losses, torch's optimizer."""
    m = _SparseEmb(sparse=False)
    if kind == "adam":
        opt = torch.optim.Adam(m.parameters(), lr=0.05, weight_decay=0.01)
    else:
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    data = [_sparse_emb_data(r) for r in range(ws)]
    for s in range(STEPS):
        opt.zero_grad()
        losses = [torch.nn.functional.mse_loss(m(i[s]), y[s]) for i, y in data]
        (sum(losses) / ws).backward()
        opt.step()
    return [p.detach() for p in m.parameters()]


def test_centralized_densifies_sparse_gradients():
    # nn.Embedding(sparse=True) used to fail in the packed all-reduce ("reshape is not
    # implemented for sparse tensors"); the gradients are now densified and averaged.
    runs = {2: _t(spawn(_sparse_emb_worker, 2, timeout=120)), 1: [_t(_sparse_emb_worker(0, 1))]}
    for ws, res in runs.items():
        for kind in SPARSE_KINDS:
            ref = _sparse_emb_reference(kind, ws)
            for r in res:
                for a, b in zip(r[kind], res[0][kind]):
                    assert torch.equal(a, b), (ws, kind)  # replicas identical
                for a, b in zip(r[kind], ref):
                    assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"{ws} {kind}")
    agg = CentralizedSGD(1, _SparseEmb(True), lr=0.1).agg
    with pytest.raises(ValueError, match="sparse"):  # reduce_ writes in place: dense only
        agg.reduce_([torch.eye(3).to_sparse()])


# ----- parameters without gradient (EF-sign), argument checks, a decentralized world of one


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_ef_sign_sgd_leaves_a_parameter_without_gradient_still(momentum):
    # As torch.optim.SGD: a parameter without a gradient does not move. With error feedback
    # it used to send its residual (q = 0 + e) and move by it; it now casts no vote and keeps
    # the residual for its next gradient.
    torch.manual_seed(0)
    used, head = torch.nn.Parameter(torch.randn(6)), torch.nn.Parameter(torch.randn(6))
    opt = SignSGD([used, head], lr=0.1, momentum=momentum, weight_decay=0.01, error_feedback=True)
    gs = [torch.randn(6) for _ in range(4)]
    used.grad, head.grad = gs[0].clone(), gs[1].clone()
    opt.step()
    mem = opt.state[head]["ef_memory"].clone()
    assert mem.any()
    before = head.detach().clone()
    for g in gs[2:]:
        opt.zero_grad()
        used.grad = g.clone()
        opt.step()
        assert head.grad is None and torch.equal(head.detach(), before)
        assert torch.equal(opt.state[head]["ef_memory"], mem)
    fresh = torch.nn.Parameter(torch.ones(3))  # never had a gradient: no state at all
    opt.add_param_group({"params": [fresh]})
    opt.step()
    assert torch.equal(fresh.detach(), torch.ones(3)) and not opt.state.get(fresh)


def _ef_sign_nograd_worker(rank, ws):
    # ``b`` has a gradient on rank 0 only, ``c`` on none: c stays put, b moves the same on both
    torch.manual_seed(0)
    a, b, c = (torch.nn.Parameter(torch.randn(5)) for _ in range(3))
    c0 = c.detach().clone()
    opt = SignSGD([a, b, c], lr=0.1, error_feedback=True)
    g = torch.Generator().manual_seed(rank)
    a.grad, b.grad, c.grad = (torch.randn(5, generator=g) for _ in range(3))
    opt.step()  # everybody has every gradient once: c gets a residual
    for _ in range(3):
        opt.zero_grad()
        a.grad = torch.randn(5, generator=g)
        if rank == 0:
            b.grad = torch.randn(5, generator=g)
        c_before = c.detach().clone()
        opt.step()
        assert torch.equal(c.detach(), c_before)
    return _np(([p.detach().clone() for p in (a, b, c)], c0))


def test_ef_sign_sgd_parameter_without_gradient_across_workers():
    res = _t(spawn(_ef_sign_nograd_worker, 2, timeout=120))
    for p, q in zip(res[0][0], res[1][0]):
        assert torch.equal(p, q)  # replicas identical


def test_fp16_rejects_a_grad_clip_that_is_not_positive():
    # clip_grad_norm_ with max_norm < 0 multiplies the gradients by a negative coefficient
    # (gradient ascent), with 0 zeroes them, with NaN poisons them: all silently.
    model = torch.nn.Linear(2, 2).half()
    for bad in (-1.0, 0.0, float("nan")):
        with pytest.raises(ValueError, match="grad_clip"):
            FP16Optimizer(model, 1, grad_clip=bad, average_world=True)
    assert FP16Optimizer(model, 1, grad_clip=None, average_world=True).grad_clip == float("inf")


def test_sparsify_gradients_names_a_parameter_it_does_not_optimize():
    opt = SparsifiedSGD([torch.nn.Parameter(torch.zeros(4))], lr=0.1, sparse_grad_size=2)
    stranger = torch.nn.Parameter(torch.zeros(4))
    stranger.grad = torch.ones(4)
    with pytest.raises(ValueError, match="not optimized by this"):
        opt.sparsify_gradients(stranger, 0.1)


def _decentralized_world_of_one(rank, ws):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    ref = copy.deepcopy(model)
    opt = DecentralizedSGD(rank, ring_neighbors(rank, ws), model, lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(4, 3, generator=g)
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            m(x).pow(2).mean().backward()
            o.step()
    return _np(([p.detach() for p in model.parameters()], [p.detach() for p in ref.parameters()]))


def test_decentralized_world_of_one_is_plain_sgd():
    # ring_neighbors(0, 1) == []: the only graph of one worker, rejected by the constructor
    ((params, ref),) = _t(spawn(_decentralized_world_of_one, 1, timeout=60))
    for a, b in zip(params, ref):
        assert torch.equal(a, b)


def _bad_type_graph_worker(rank, ws):
    m = torch.nn.Linear(2, 2)
    ring = ring_neighbors(rank, ws)
    cases = {
        "neighbour_not_int": (rank, ["x"] if rank == 1 else ring),
        "neighbour_none": (rank, [None] if rank == 1 else ring),
        "neighbors_not_list": (rank, 2 if rank == 1 else ring),
        "rank_not_int": ("one" if rank == 1 else rank, ring),
        "ok": (rank, ring),
    }
    return _construct_each(cases, m)


def test_decentralized_bad_argument_types_raise_on_every_rank():
    # rank 1 used to fail (TypeError / ValueError from int()) before the collective check,
    # leaving the others waiting in it until the process-group timeout
    res = spawn(_bad_type_graph_worker, 3, timeout=60)
    for out in res:
        for name in ("neighbour_not_int", "neighbour_none", "neighbors_not_list"):
            assert "on rank 1: neighbors=" in out[name], (name, out[name])
        assert "on rank 1: rank='one'" in out["rank_not_int"], out["rank_not_int"]
        assert out["ok"] is None
