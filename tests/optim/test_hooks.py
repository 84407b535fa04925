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
