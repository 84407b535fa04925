"""DDP communication hooks over the pure compressors, on 2 gloo processes."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.testing import assert_close

from adaptrain.dist.hooks import (
    PowerSGDHookState,
    SignHookState,
    SparseHookState,
    TorchCommunicator,
    powersgd_hook,
    sign_hook,
    topk_hook,
)
from adaptrain.dist.spawn import spawn


def _np(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().numpy().copy()
    if isinstance(obj, dict):
        return {k: _np(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_np(v) for v in obj)
    return obj


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))


def _make_state(kind: str, model: torch.nn.Module):
    ps = list(model.parameters())
    if kind == "powersgd_full":
        return PowerSGDHookState(rank=8, params=ps), powersgd_hook
    if kind == "powersgd":
        return PowerSGDHookState(rank=1, reuse_query=False, params=ps), powersgd_hook
    if kind == "powersgd_by_bucket":  # no params: keyed by bucket index, re-init on rebuild
        return PowerSGDHookState(rank=1, reuse_query=True), powersgd_hook
    if kind == "topk_all":
        return SparseHookState(ratio=1.0, params=ps), topk_hook
    if kind == "topk":
        return SparseHookState(ratio=0.1, params=ps), topk_hook
    if kind == "randomk":
        return SparseHookState(ratio=0.2, method="randomk", seed=1, params=ps), topk_hook
    if kind == "sign_ef":
        return SignHookState(error_feedback=True, params=ps), sign_hook
    if kind == "sign_mv":
        return SignHookState(majority_vote=True, params=ps), sign_hook  # EF off by default
    return None, None


def _run(ddp, opt, rank, steps, start=0):
    g = torch.Generator().manual_seed(1234)
    xs = torch.randn(steps + start, 2, 6, 12, generator=g)
    ys = torch.randn(steps + start, 2, 6, 4, generator=g)
    for s in range(start, start + steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(xs[s, rank]), ys[s, rank]).backward()
        opt.step()


def _hook_worker(rank, ws, kinds):
    out = {}
    for kind in kinds:
        model = _model()
        ddp = DDP(model)
        state, hook = _make_state(kind, model)
        if hook is not None:
            ddp.register_comm_hook(state, hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        _run(ddp, opt, rank, 2)
        replay = None
        if state is not None:
            saved = (
                copy.deepcopy(model.state_dict()),
                copy.deepcopy(opt.state_dict()),
                copy.deepcopy(state.state_dict()),
            )
            _run(ddp, opt, rank, 2, start=2)
            first = [p.detach().clone() for p in model.parameters()]
            model2 = _model()
            model2.load_state_dict(saved[0])
            ddp2 = DDP(model2)
            state2, _ = _make_state(kind, model2)
            state2.load_state_dict(saved[2])
            ddp2.register_comm_hook(state2, hook)
            opt2 = torch.optim.SGD(ddp2.parameters(), lr=0.1, momentum=0.9)
            opt2.load_state_dict(saved[1])
            _run(ddp2, opt2, rank, 2, start=2)
            replay = all(torch.equal(a, b) for a, b in zip(first, model2.parameters()))
        else:
            _run(ddp, opt, rank, 2, start=2)
        out[kind] = ([p.detach().clone() for p in model.parameters()], replay)
    return _np(out)


KINDS = [
    "allreduce",
    "powersgd_full",
    "powersgd",
    "powersgd_by_bucket",
    "topk_all",
    "topk",
    "randomk",
    "sign_ef",
    "sign_mv",
]


def test_hooks_under_ddp():
    res = spawn(_hook_worker, 2, args=(KINDS,), timeout=300)
    base = [torch.from_numpy(a) for a in res[0]["allreduce"][0]]
    for kind in KINDS:
        p0 = [torch.from_numpy(a) for a in res[0][kind][0]]
        p1 = [torch.from_numpy(a) for a in res[1][kind][0]]
        for a, b in zip(p0, p1):
            assert torch.equal(a, b), kind  # replicas stay identical
        if kind not in ("allreduce", "powersgd_by_bucket"):
            assert res[0][kind][1] is True, kind  # state_dict → load → replay is exact
        if kind in ("powersgd_full", "topk_all"):  # lossless settings equal plain all-reduce
            for a, b in zip(p0, base):
                assert_close(a, b, rtol=1e-4, atol=1e-6, msg=kind)
        elif kind != "allreduce":
            assert any(not torch.allclose(a, b, atol=1e-4) for a, b in zip(p0, base)), kind


class _Shuffled(torch.nn.Module):
    """Registered a, b, c; used b → c → a: DDP's rebuilt buckets (gradient-ready order, small
    cap) group the parameters differently from the first iteration's."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(12, 16)
        self.c = torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.a(self.c(self.b(x).relu()).relu())


def _shuffled_ddp():
    torch.manual_seed(0)
    model = _Shuffled().double()
    return model, DDP(model, bucket_cap_mb=0.002)


class _Recorder:
    """Wraps a comm hook: sums each parameter's local gradients and hook outputs over the
    iterations, and records each iteration's bucket layouts (parameter indices)."""

    def __init__(self, hook, params):
        self.hook = hook
        self.idx = {id(p): i for i, p in enumerate(params)}
        self.outs = [torch.zeros_like(p) for p in params]
        self.grads = [torch.zeros_like(p) for p in params]
        self.layouts: list[list[list[int]]] = []

    def record(self, st, bucket):
        idx = self.idx
        for p, g in zip(bucket.parameters(), bucket.gradients()):
            self.grads[idx[id(p)]] += g
        fut = self.hook(st, bucket)
        buf, off = fut.value(), 0
        if bucket.index() == 0:
            self.layouts.append([])
        self.layouts[-1].append(sorted(idx[id(p)] for p in bucket.parameters()))
        for p in bucket.parameters():
            self.outs[idx[id(p)]] += buf[off : off + p.numel()].view_as(p)
            off += p.numel()
        return fut


def _rebuild_residual_worker(rank, ws):
    model, ddp = _shuffled_ddp()
    ps = list(model.parameters())
    state = PowerSGDHookState(rank=1, params=ps)
    rec = _Recorder(powersgd_hook, ps)
    ddp.register_comm_hook(state, rec.record)
    x = torch.randn(1, 12, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
    for it in range(3):  # a rank-2 mean gradient, then zero gradients
        ddp.zero_grad()
        (ddp(x).pow(2).sum() * (1.0 if it == 0 else 0.0)).backward()
    outs, grads, layouts = rec.outs, rec.grads, rec.layouts
    model2, ddp2 = _shuffled_ddp()  # without params: slots of the current buckets only
    by_bucket = PowerSGDHookState(rank=1)
    ddp2.register_comm_hook(by_bucket, powersgd_hook)
    for _ in range(3):
        ddp2(x).pow(2).sum().backward()
    return _np((outs, grads, layouts, state.state_dict(), by_bucket.state_dict()))


def test_powersgd_hook_keeps_error_memory_across_bucket_rebuild():
    """Rank 1 on a mean gradient of rank 2 drops a rank-1 residual, which the next iteration
    sends exactly (zero gradients then): the outputs sum to the mean gradient, although DDP
    regroups the parameters into other buckets after the first iteration."""
    res = spawn(_rebuild_residual_worker, 2, timeout=120)
    layouts = res[0][2]
    assert len(layouts[0]) == 1 and len(layouts[1]) > 1  # the buckets were rebuilt
    mean_g0 = [
        (torch.from_numpy(a) + torch.from_numpy(b)) / 2 for a, b in zip(res[0][1], res[1][1])
    ]
    for r in range(2):
        for i, (o, g) in enumerate(zip(res[r][0], mean_g0)):
            assert_close(torch.from_numpy(o), g, rtol=1e-9, atol=1e-12, msg=f"parameter {i}")
        sd = res[r][3]  # one entry per parameter, none orphaned, and one step counter
        assert sorted(sd["memories"], key=int) == sorted(sd["qs"], key=int) == list("012345")
        assert sd["step"] == 3 and sd["memories"]["0"].shape == (16, 16)
        sizes = [len(b) for b in layouts[-1]]
        slots = [f"b{i}.{j}" for i, n in enumerate(sizes) for j in range(n)]
        assert sorted(res[r][4]["memories"]) == sorted(res[r][4]["qs"]) == slots


def _flat_rebuild_worker(rank, ws, kind):
    model, ddp = _shuffled_ddp()
    ps = list(model.parameters())
    if kind == "sign_ef":
        state, hook = SignHookState(error_feedback=True, params=ps), sign_hook
    else:
        state, hook = SparseHookState(ratio=0.05, method=kind, params=ps), topk_hook
    rec = _Recorder(hook, ps)
    ddp.register_comm_hook(state, rec.record)
    xs = torch.randn(3, 2, 12, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
    for x in xs:
        ddp.zero_grad()
        ddp(x).pow(2).sum().backward()
    memories = [state.memories[str(i)].clone() for i in range(len(ps))]
    return _np((rec.outs, rec.grads, memories, rec.layouts, sorted(state.memories, key=int)))


@pytest.mark.parametrize("kind", ["topk", "randomk", "sign_ef"])
def test_flat_hooks_keep_error_memory_across_bucket_rebuild(kind):
    """Error feedback loses nothing: the outputs summed over the iterations plus the replicas'
    mean error memory equal the mean gradients summed, although DDP regroups the parameters
    into other buckets after the first iteration (per-bucket memory lost the first one's)."""
    res = spawn(_flat_rebuild_worker, 2, args=(kind,), timeout=120)
    assert len(res[0][3][0]) == 1 and len(res[0][3][1]) > 1  # the buckets were rebuilt
    for i in range(6):
        mean_g = (torch.from_numpy(res[0][1][i]) + torch.from_numpy(res[1][1][i])) / 2
        mean_e = (torch.from_numpy(res[0][2][i]) + torch.from_numpy(res[1][2][i])) / 2
        for r in range(2):
            total = torch.from_numpy(res[r][0][i]) + mean_e
            assert_close(total, mean_g, rtol=1e-9, atol=1e-12, msg=f"{kind} parameter {i}")
    assert res[0][4] == list("012345")  # one memory per parameter, none orphaned


def _rebuild_replay_worker(rank, ws, reuse):
    def make():
        model, ddp = _shuffled_ddp()
        state = PowerSGDHookState(rank=2, reuse_query=reuse, params=list(model.parameters()))
        ddp.register_comm_hook(state, powersgd_hook)
        return model, ddp, state, torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)

    g = torch.Generator().manual_seed(rank)
    xs = torch.randn(4, 3, 12, generator=g, dtype=torch.float64)

    def run(ddp, opt, steps):
        for s in steps:
            opt.zero_grad()
            ddp(xs[s]).pow(2).mean().backward()
            opt.step()

    model, ddp, state, opt = make()
    run(ddp, opt, range(2))  # iteration 0 in one bucket, iteration 1 in the rebuilt ones
    saved = copy.deepcopy((model.state_dict(), opt.state_dict(), state.state_dict()))
    run(ddp, opt, range(2, 4))
    model2, ddp2, state2, opt2 = make()  # a fresh DDP: first bucket layout again, then rebuilt
    model2.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    state2.load_state_dict(saved[2])
    run(ddp2, opt2, range(2, 4))
    return all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))


@pytest.mark.parametrize("reuse", [True, False])
def test_powersgd_hook_replays_across_bucket_rebuild(reuse):
    assert spawn(_rebuild_replay_worker, 2, args=(reuse,), timeout=120) == [True, True]


def test_powersgd_hook_loads_the_per_bucket_format():
    """The former state_dict (one PowerSGDState per bucket key) loads: each parameter takes
    the entry of the latest step, the entries orphaned by DDP's bucket rebuild are dropped."""

    def st(shapes, fill, step):
        mem = tuple(torch.full(s, fill) for s in shapes)
        qs = tuple(torch.full((s[1], 1), fill) if len(s) > 1 else torch.zeros(0, 0) for s in shapes)
        return (mem, qs, step, 0, 1)

    old = {
        "states": {
            "0,1,2,3": st([(4, 3), (4,), (2, 4), (2,)], 1.0, 1),  # iteration 0's bucket
            "2,3": st([(2, 4), (2,)], 2.0, 3),
            "0,1": st([(4, 3), (4,)], 3.0, 3),
        }
    }
    hs = PowerSGDHookState(rank=1)
    hs.load_state_dict(old)
    assert hs.step == 3 and sorted(hs.memories) == ["0", "1", "2", "3"]
    assert [float(hs.memories[k].view(-1)[0]) for k in "0123"] == [3.0, 3.0, 2.0, 2.0]
    assert torch.equal(hs.qs["2"], torch.full((4, 1), 2.0))
    hs2 = PowerSGDHookState(rank=1)
    hs2.load_state_dict(copy.deepcopy(hs.state_dict()))
    assert hs2.step == 3 and all(torch.equal(hs2.memories[k], hs.memories[k]) for k in "0123")
    by_bucket = PowerSGDHookState(rank=1)
    by_bucket.load_state_dict({"states": {"b0": st([(4, 3), (4,)], 5.0, 2)}})
    assert sorted(by_bucket.memories) == ["b0.0", "b0.1"] and by_bucket.step == 2


def _nonfinite_worker(rank, ws, reuse):
    g = torch.Generator().manual_seed(rank)
    xs, ys = torch.randn(6, 5, 12, generator=g), torch.randn(6, 5, 4, generator=g)
    out = {}
    for run in ("overflow", "without", "scaler"):
        model = _model()
        ddp = DDP(model)
        state = PowerSGDHookState(rank=1, reuse_query=reuse, params=list(model.parameters()))
        ddp.register_comm_hook(state, powersgd_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if run == "scaler" else None
        finite = []
        for s in range(6):
            if s == 2 and run == "without":
                continue
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(ddp(xs[s]), ys[s])
            if s == 2:
                loss = loss * float("inf")  # an overflowing backward on every worker
            (loss if scaler is None else scaler.scale(loss)).backward()
            finite.append(all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()))
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            elif finite[-1]:
                opt.step()
        out[run] = ([p.detach().clone() for p in model.parameters()], finite, state.state_dict())
        if scaler is not None:
            out[run] += (scaler.get_scale(),)
    return _np(out)


@pytest.mark.parametrize("reuse", [True, False])
def test_powersgd_hook_overflow_skips_one_step_only(reuse):
    """An overflowing step gives non-finite gradients (the step is skipped) and leaves the hook
    state as it was: later steps are finite and equal to a run without that step."""
    res = spawn(_nonfinite_worker, 2, args=(reuse,), timeout=120)
    for r in res:
        params, finite, sd = r["overflow"]
        assert finite == [True, True, False, True, True, True]
        for a, b in zip(params, r["without"][0]):
            assert_close(torch.from_numpy(a), torch.from_numpy(b), rtol=0, atol=0)
        assert r["scaler"][1] == finite and r["scaler"][3] == 2.0**7  # halved once, not forever
        assert sd["step"] == r["without"][2]["step"] == 5  # the skipped iteration is not counted


def _dense_small_worker(rank, ws, rate):
    torch.manual_seed(0)
    model = torch.nn.Linear(10, 10, bias=False)
    ddp = DDP(model)
    kw = {} if rate is None else {"min_compression_rate": rate}  # default: 1
    state = PowerSGDHookState(rank=8, params=list(model.parameters()), **kw)
    ddp.register_comm_hook(state, powersgd_hook)
    x = torch.randn(16, 10, generator=torch.Generator().manual_seed(rank))
    model(x).pow(2).sum().backward()  # the local gradient, without DDP
    local = model.weight.grad.clone()
    model.weight.grad = None
    ddp(x).pow(2).sum().backward()
    torch.distributed.all_reduce(local)
    return _np((model.weight.grad, local / ws, state.state_dict()))


def test_powersgd_hook_sends_costly_matrices_uncompressed():
    """A 10×10 gradient at rank 8 would cost 160 numbers compressed: it is sent as it is (the
    exact mean); with min_compression_rate=0 it is compressed, and lossy."""
    out, mean, sd = spawn(_dense_small_worker, 2, args=(None,), timeout=120)[0]
    assert_close(torch.from_numpy(out), torch.from_numpy(mean), rtol=1e-6, atol=1e-7)
    assert sd["qs"]["0"].shape == (0, 0) and not sd["memories"]["0"].any()
    out, mean, sd = spawn(_dense_small_worker, 2, args=(0.0,), timeout=120)[0]
    assert not torch.allclose(torch.from_numpy(out), torch.from_numpy(mean), atol=1e-4)
    assert sd["qs"]["0"].shape == (10, 8)


def _comm_worker(rank, ws):
    comm = TorchCommunicator()
    m = comm.all_reduce_mean(torch.tensor([float(rank), 2.0 * rank]))
    g = comm.all_gather(torch.tensor([rank], dtype=torch.uint8))
    return m.tolist(), [int(t) for t in g], comm.sent_bytes, comm.world_size


def test_torch_communicator():
    res = spawn(_comm_worker, 3, timeout=120)
    for m, g, sent, ws in res:
        assert m == [1.0, 2.0] and g == [0, 1, 2] and sent == 8 + 1 and ws == 3


def test_sign_hook_state_options():
    assert SignHookState().error_feedback is True  # EF-SignSGD unless majority vote is asked
    mv = SignHookState(majority_vote=True)
    assert mv.majority_vote is True and mv.error_feedback is False
    with pytest.raises(ValueError, match="alternatives"):
        SignHookState(error_feedback=True, majority_vote=True)
