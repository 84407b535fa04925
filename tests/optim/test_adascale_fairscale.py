"""Cross-check of adaptrain's AdaScale against the real fairscale 0.4.13 AdaScale.

Same model, same data order, same seeds: one process with 4 accumulation steps, and 2 DDP gloo
processes (without and with accumulation); the gains must agree to 1e-6 (relative) over 200+
steps and the learning rate the wrapped SGD sees must be base LR × gain.
"""

from __future__ import annotations

import copy
import faulthandler

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from adaptrain.dist.spawn import spawn
from adaptrain.optim.adascale import AdaScale

pytest.importorskip("fairscale")

STEPS = 200


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models: one intra-op thread is faster and kinder to a shared machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


class _RecordingSGD(torch.optim.SGD):
    """Plain SGD that remembers the learning rate it stepped with."""

    def step(self, closure=None):
        self.seen_lr = self.param_groups[0]["lr"]
        return super().step(closure)


def _digits():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 10))


def _run(cls, model, c, steps, seed, scaled=True, debias=True, ddp_rank=None, world_size=1):
    """Train with wrapper ``cls``; return (gains seen before step, lrs seen by SGD, params)."""
    x, y = _digits()
    if ddp_rank is not None:
        x, y = x[ddp_rank::world_size], y[ddp_rank::world_size]
    inner = _RecordingSGD(model.parameters(), lr=0.05, momentum=0.9)
    kwargs = {} if ddp_rank is not None else {"world_size": 1}
    opt = cls(
        inner, num_gradients_to_accumulate=c, is_scaled_loss=scaled, debias_ewma=debias, **kwargs
    )
    g = torch.Generator().manual_seed(seed)
    gains, lrs = [], []
    for _ in range(steps):
        opt.zero_grad()
        for i in range(c):
            idx = torch.randint(0, len(x), (8,), generator=g)
            last = i == c - 1
            ctx = model.no_sync() if isinstance(model, DDP) and not last else _nullcontext()
            with ctx:
                loss = F.cross_entropy(model(x[idx]), y[idx])
                (loss / c if scaled else loss).backward()
        if not scaled and c > 1:
            opt.scale_grad_by_num_grads_to_accum()
        gains.append(float(opt.gain()))
        opt.step()
        lrs.append(inner.seen_lr)
    params = [p.detach().clone() for p in model.parameters()]
    if hasattr(opt, "unhook"):
        opt.unhook()
    return np.array(gains), np.array(lrs), params


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _check(ours, theirs):
    g_ours, lr_ours, p_ours = ours
    g_fs, lr_fs, p_fs = theirs
    assert len(g_ours) >= STEPS
    np.testing.assert_allclose(g_ours, g_fs, rtol=1e-6, atol=0)
    assert g_ours.max() > 1.2  # a non-trivial gain: the check is not comparing ones
    np.testing.assert_allclose(lr_ours, 0.05 * g_ours, rtol=1e-12)  # effective LR = base × gain
    np.testing.assert_allclose(lr_fs, 0.05 * g_fs, rtol=1e-12)
    for a, b in zip(p_ours, p_fs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "scaled,debias", [(True, True), (False, True), (True, False)], ids=["scaled", "unscaled", "b3"]
)
def test_single_process_accumulation_matches_fairscale(scaled, debias):
    from fairscale.optim.adascale import AdaScale as FairscaleAdaScale

    base = _model()
    ours = _run(AdaScale, copy.deepcopy(base), 4, STEPS, 1, scaled, debias)
    theirs = _run(FairscaleAdaScale, copy.deepcopy(base), 4, STEPS, 1, scaled, debias)
    _check(ours, theirs)


def _ddp_pair(rank, world_size, c, steps):
    # a hang shows where it is stuck (stderr of the children reaches pytest's report)
    faulthandler.dump_traceback_later(250, exit=False)
    torch.manual_seed(0)
    from fairscale.optim.adascale import AdaScale as FairscaleAdaScale

    base = _model()
    ours = _run(
        AdaScale,
        DDP(copy.deepcopy(base)),
        c,
        steps,
        10 + rank,
        ddp_rank=rank,
        world_size=world_size,
    )
    theirs = _run(
        FairscaleAdaScale,
        DDP(copy.deepcopy(base)),
        c,
        steps,
        10 + rank,
        ddp_rank=rank,
        world_size=world_size,
    )
    faulthandler.cancel_dump_traceback_later()
    return ours, theirs


@pytest.mark.parametrize("c", [1, 2], ids=["ddp", "ddp_accum2"])
def test_two_ddp_processes_match_fairscale(c):
    res = spawn(_ddp_pair, 2, args=(c, STEPS), timeout=280)
    for ours, theirs in res:
        _check(ours, theirs)
    # identical gains on both replicas
    np.testing.assert_array_equal(res[0][0][0], res[1][0][0])


def _gains_with(cls, steps, diag=False, scaler=None):
    """4-step accumulation; ``diag``: an autograd.grad diagnostic before each backward."""
    x, y = _digits()
    model = _model()
    opt = cls(
        torch.optim.SGD(model.parameters(), lr=0.05), world_size=1, num_gradients_to_accumulate=4
    )
    g = torch.Generator().manual_seed(3)
    gains = []
    for _ in range(steps):
        opt.zero_grad()
        for _ in range(4):
            idx = torch.randint(0, len(x), (8,), generator=g)
            loss = F.cross_entropy(model(x[idx]), y[idx]) / 4
            if diag:
                torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
            (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None:
            scaler.unscale_(opt)
        gains.append(float(opt.gain()))
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
    opt.unhook()
    return np.array(gains)


@pytest.mark.parametrize("case", ["autograd_grad", "grad_scaler"])
def test_where_fairscale_is_polluted_adaptrain_is_not(case):
    """The two fixes of the issue, shown against the reference: same run, clean vs disturbed."""
    from fairscale.optim.adascale import AdaScale as FairscaleAdaScale

    def disturbed(cls):
        if case == "autograd_grad":
            return _gains_with(cls, 20, diag=True)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
        return _gains_with(cls, 20, scaler=scaler)

    clean_fs, clean_ours = _gains_with(FairscaleAdaScale, 20), _gains_with(AdaScale, 20)
    np.testing.assert_allclose(clean_ours, clean_fs, rtol=1e-6)
    assert np.abs(disturbed(FairscaleAdaScale) / clean_fs - 1).max() > 1e-2  # fairscale drifts
    np.testing.assert_allclose(disturbed(AdaScale), clean_ours, rtol=1e-9)


class _RecordingSGDGroups(torch.optim.SGD):
    """Plain SGD that remembers every group's learning rate at each step."""

    def step(self, closure=None):
        self.seen_lrs = [g["lr"] for g in self.param_groups]
        return super().step(closure)


def _wide_model():
    """An MLP whose 256×256 layer (65536 entries) takes the reused-buffer path of the squared
    norms (``_SCRATCH_MIN`` = 32768 entries); the others take the plain one."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 256),
        torch.nn.Tanh(),
        torch.nn.Linear(256, 256),
        torch.nn.Tanh(),
        torch.nn.Linear(256, 10),
    )


def _two_groups_run(cls, model, steps, c=3, scaler=None):
    """Two param groups, ``c``-step accumulation, a LambdaLR stepped every step, optionally a
    GradScaler: (gains [all, group 0, group 1] before each step, lrs the SGD saw, params)."""
    from adaptrain.optim.adascale import _SCRATCH_MIN

    assert max(p.numel() for p in model.parameters()) >= _SCRATCH_MIN
    x, y = _digits()
    inner = _RecordingSGDGroups(
        [
            {"params": list(model[0].parameters())},
            {"params": list(model[2].parameters()) + list(model[4].parameters()), "lr": 0.02},
        ],
        lr=0.05,
        momentum=0.9,
    )
    opt = cls(inner, world_size=1, num_gradients_to_accumulate=c)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda=lambda s: 0.9 ** (s // 5))
    g = torch.Generator().manual_seed(5)
    gains, lrs = [], []
    for _ in range(steps):
        opt.zero_grad()
        for _ in range(c):
            idx = torch.randint(0, len(x), (8,), generator=g)
            loss = F.cross_entropy(model(x[idx]), y[idx]) / c
            (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None:
            scaler.unscale_(opt)
        gains.append([float(opt.gain()), float(opt.gain(0)), float(opt.gain(1))])
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        lrs.append(inner.seen_lrs)
        sched.step()
    if hasattr(opt, "unhook"):
        opt.unhook()
    return np.array(gains), np.array(lrs), [p.detach().clone() for p in model.parameters()]


def test_two_param_groups_scheduler_and_grad_scaler_match_fairscale():
    """Per-group and overall gains and the scheduled, scaled LRs against fairscale, with a
    parameter large enough for the reused squared-norm buffer; under a GradScaler (whose scale
    grows during the run) adaptrain's numbers stay those of the unscaled run."""
    from fairscale.optim.adascale import AdaScale as FairscaleAdaScale

    steps = 40
    base = _wide_model()
    g_fs, lr_fs, p_fs = _two_groups_run(FairscaleAdaScale, copy.deepcopy(base), steps)
    g_ours, lr_ours, p_ours = _two_groups_run(AdaScale, copy.deepcopy(base), steps)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=4)
    g_amp, lr_amp, p_amp = _two_groups_run(AdaScale, copy.deepcopy(base), steps, scaler=scaler)
    assert scaler.get_scale() >= 2.0**18  # the loss scale changed under the statistics
    assert g_ours[:, 1:].max() > 1.2  # non-trivial per-group gains
    np.testing.assert_allclose(g_ours, g_fs, rtol=1e-6, atol=0)
    np.testing.assert_allclose(g_amp, g_ours, rtol=1e-9, atol=0)
    sched = np.array([0.9 ** (s // 5) for s in range(steps)])
    for lr in (lr_ours, lr_amp):  # each group's base LR × schedule × that group's gain
        np.testing.assert_allclose(lr[:, 0], 0.05 * sched * g_ours[:, 1], rtol=1e-9)
        np.testing.assert_allclose(lr[:, 1], 0.02 * sched * g_ours[:, 2], rtol=1e-9)
    np.testing.assert_allclose(lr_fs, lr_ours, rtol=1e-6)
    for a, b, c in zip(p_ours, p_fs, p_amp):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(c, a)
