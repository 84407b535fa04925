"""Sampled noise-scale statistics on 2-process gloo groups: schedule, accumulation, flush, hooks."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from adaptrain.dist.spawn import spawn

TIMEOUT = 180


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(  # 301k parameters: 2 buckets with bucket_cap_mb=0.1
        torch.nn.Linear(64, 512),
        torch.nn.Tanh(),
        torch.nn.Linear(512, 512),
        torch.nn.Tanh(),
        torch.nn.Linear(512, 10),
    )


def _digits():
    from sklearn.datasets import load_digits

    X, y = load_digits(return_X_y=True)
    return torch.tensor(X / 16.0, dtype=torch.float32), torch.tensor(y)


def _accum_scaling(rank, ws, steps, flush_every):
    from adaptrain.torch.gradient_noise_scale import GradientNoiseScale

    torch.set_num_threads(1)
    X, y = _digits()
    g = torch.Generator().manual_seed(3)
    runs, grads = {}, {}
    for accum in (1, 2):  # gradients divided by accum after DDP's mean: statistics by accum²
        ddp = DistributedDataParallel(_model(), bucket_cap_mb=0.1)
        gns = GradientNoiseScale(num_replicas=ws)
        gns.register(ddp)
        g.manual_seed(3)
        for t in range(steps):
            idx = torch.randint(0, len(y), (ws, 16), generator=g)[rank]
            ddp.zero_grad()
            gns.begin_step(accum_steps=accum)
            F.cross_entropy(ddp(X[idx]), y[idx]).backward()  # no optimizer: fixed weights
            gns.finish_step(1.0)
            if flush_every and t % flush_every == 0:
                gns.flush()
        gns.flush()
        runs[accum] = (gns.raw_sqr_avg[0], gns.raw_var_avg[0], gns.num_updates)
        grads[accum] = [p.grad.clone() for p in ddp.parameters()]
    exact = all(torch.equal(a / 2, b) for a, b in zip(grads[1], grads[2]))
    return runs, exact


def test_statistics_and_gradients_scale_with_accumulation():
    out = spawn(_accum_scaling, 2, args=(6, 0), timeout=TIMEOUT)
    for runs, exact in out:
        (s1, v1, n1), (s2, v2, n2) = runs[1], runs[2]
        assert n1 == n2 == 6
        assert exact  # the mean over 2 micro-batches: DDP's average divided by 2
        assert math.isclose(s2, s1 / 4, rel_tol=1e-5) and math.isclose(v2, v1 / 4, rel_tol=1e-5)
        assert v1 > 0
    assert out[0][0] == out[1][0]  # identical on every replica


def test_flushing_every_step_gives_the_same_statistics():
    # flush() waits for the step's all-reduce at once; the steady path one step later
    steady = spawn(_accum_scaling, 2, args=(5, 0), timeout=TIMEOUT)
    flushed = spawn(_accum_scaling, 2, args=(5, 1), timeout=TIMEOUT)
    for (a, _), (b, _) in zip(steady, flushed):
        for k in (1, 2):
            assert a[k][2] == b[k][2] == 5
            assert math.isclose(a[k][0], b[k][0], rel_tol=1e-12)
            assert math.isclose(a[k][1], b[k][1], rel_tol=1e-12)


def _schedule(rank, ws, steps):
    from adaptrain.torch.parallel import AdaptiveDataParallel

    X, y = _digits()
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    adp = AdaptiveDataParallel(m, opt, max_stats_interval=4, bucket_cap_mb=0.1)
    armed, timed, updates = [], [], []
    g = torch.Generator().manual_seed(5)
    for _ in range(steps):
        idx = torch.randint(0, len(y), (ws, 16), generator=g)[rank]
        opt.zero_grad()
        out = adp(X[idx])
        armed.append(len(adp.gns._collector.handles))  # hooks exist on sampled steps only
        F.cross_entropy(out, y[idx]).backward()
        assert not adp.gns._collector.handles  # removed at the end of the backward pass
        timed.append(adp.gns.last_sync_time > 0 if adp.gns._collector.sync_time else False)
        opt.step()
        updates.append(adp.gns.num_updates)
    return armed, timed, updates, adp.gns.sample_interval()


def _expected_sampled_steps(steps: int, max_interval: int) -> list[int]:
    """The schedule by hand: before step n the history is n steps (scale 1), the memory
    1 + 0.25·n steps; 16 samples per memory: interval floor((1 + 0.25·n)/16) in [1, max]."""
    sampled, since = [], 0
    for n in range(steps):
        k = min(max_interval, max(1, math.floor((1 + 0.25 * n) / 16)))
        if since + 1 >= k:
            sampled.append(n)
            since = 0
        else:
            since += 1
    return sampled


def test_only_sampled_steps_carry_hooks_and_the_interval_grows():
    out = spawn(_schedule, 2, args=(300,), timeout=TIMEOUT)
    expected = _expected_sampled_steps(300, 4)
    for armed, timed, updates, interval in out:
        assert armed[:64] == [1] * 64  # one hook, on the output, on every early step
        gaps = [i for i, a in enumerate(armed) if a]
        assert gaps == expected
        spacing = [b - a for a, b in zip(gaps, gaps[1:])]
        assert spacing[:100] == [1] * 100 and spacing[-1] == 4
        assert [bool(a) for a in armed] == timed  # the sync wait is measured where sampled
        # one sample per sampled step, folded at the next step
        assert updates == [sum(g < n for g in gaps) for n in range(len(armed))]
        assert interval == 4
        assert len(gaps) < 0.7 * len(armed)
    assert out[0] == out[1]


def _with_powersgd(rank, ws, steps):
    from adaptrain.dist.hooks import PowerSGDHookState, powersgd_hook
    from adaptrain.torch.parallel import AdaptiveDataParallel

    X, y = _digits()
    results = []
    for adaptive in (False, True):
        m = _model()
        opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
        model = AdaptiveDataParallel(m, opt) if adaptive else DistributedDataParallel(m)
        state = PowerSGDHookState(rank=2, params=m.parameters())
        model.register_comm_hook(state, powersgd_hook)  # ADP installs no hook of its own
        g = torch.Generator().manual_seed(9)
        for _ in range(steps):
            idx = torch.randint(0, len(y), (ws, 16), generator=g)[rank]
            opt.zero_grad()
            F.cross_entropy(model(X[idx]), y[idx]).backward()
            opt.step()
        results.append([p.detach().numpy().copy() for p in m.parameters()])
        if adaptive:
            model.gns.flush()
            results.append((model.gns.num_updates, model.gns.sqr_avg(), model.gns.var_avg()))
    return results


def test_a_compression_hook_can_be_registered():
    out = spawn(_with_powersgd, 2, args=(5,), timeout=TIMEOUT)
    for ddp_params, adp_params, (n, sqr, var) in out:
        for a, b in zip(ddp_params, adp_params):
            torch.testing.assert_close(b, a, rtol=0, atol=0)  # PowerSGD's update, bit for bit
        assert n == 5 and sqr > 0 and var >= 0


class _Aux(torch.nn.Module):
    """Returns ``(argmax, logits)`` (the first output needs no gradient) and keeps a penalty
    as an attribute, a loss term that does not go through the output."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Parameter(torch.randn(17, 64) * 0.1)
        self.body = _model()
        self.penalty = None

    def forward(self, x):
        h = F.embedding(x[:, 0].long() % 17, self.emb) + x
        logits = self.body(h)
        self.penalty = self.body(h).pow(2).mean()  # a second pass, not the output
        return logits.argmax(dim=1), logits


def _hooks(rank, ws, mode, steps):
    """Statistics of one ADP run. ``mode``: 'output' (the default: one hook on the output),
    'params' (every parameter hooked), 'aux' (the loss skips the output: the first sampled
    step is missed, then the parameters are hooked)."""
    from adaptrain.torch.parallel import AdaptiveDataParallel

    torch.set_num_threads(1)
    X, y = _digits()
    m = _Aux()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    adp = AdaptiveDataParallel(m, opt, max_stats_interval=1)
    if mode == "params":
        adp.gns._output_hook_ok = False
    hooks = []
    g = torch.Generator().manual_seed(7)
    for _ in range(steps):
        idx = torch.randint(0, len(y), (ws, 16), generator=g)[rank]
        opt.zero_grad()
        _, logits = adp(X[idx])
        hooks.append(len(adp.gns._collector.handles))
        loss = m.penalty if mode == "aux" else F.cross_entropy(logits, y[idx])
        loss.backward()
        opt.step()
    adp.gns.flush()
    params = [p.detach().clone() for p in m.parameters()]
    return adp.gns.sqr_avg(), adp.gns.var_avg(), adp.gns.num_updates, hooks, params


def test_one_hook_on_the_output_gives_the_per_parameter_statistics():
    # The step's callback queued by a hook on the forward's output (1 hook) or by the
    # parameters' hooks (7): the same statistics and weights, bit for bit.
    by_output = spawn(_hooks, 2, args=("output", 6), timeout=TIMEOUT)
    by_params = spawn(_hooks, 2, args=("params", 6), timeout=TIMEOUT)
    for a, b in zip(by_output, by_params):
        assert a[3] == [1] * 6 and b[3] == [7] * 6
        assert a[2] == b[2] == 6 and a[1] > 0
        assert (a[0], a[1]) == (b[0], b[1])
        for p, q in zip(a[4], b[4]):
            assert torch.equal(p, q)


def test_a_loss_that_misses_the_output_falls_back_to_parameter_hooks():
    # The penalty does not depend on the output: the first sampled step's callback never
    # runs (one sample lost); from the next step on every parameter is hooked.
    aux = spawn(_hooks, 2, args=("aux", 6), timeout=TIMEOUT)
    for sqr, var, updates, hooks, _ in aux:
        assert hooks == [1] + [7] * 5
        assert updates == 5 and sqr > 0 and var > 0
