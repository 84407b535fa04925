"""AdaptiveDataParallel on real 2-process gloo groups: exactness vs DDP, statistics, LR, AMP, ckpt."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from adaptrain.core import gns as core_gns
from adaptrain.dist.spawn import spawn

TIMEOUT = 180


def _data():
    from sklearn.datasets import load_digits

    X, y = load_digits(return_X_y=True)
    return torch.tensor(X / 16.0, dtype=torch.float32), torch.tensor(y)


def _model(seed: int = 0, wide: bool = False) -> torch.nn.Module:
    torch.manual_seed(seed)
    if wide:  # 301k parameters: DDP splits them into 2 buckets (after its rebuild)
        return torch.nn.Sequential(
            torch.nn.Linear(64, 512),
            torch.nn.Tanh(),
            torch.nn.Linear(512, 512),
            torch.nn.Tanh(),
            torch.nn.Linear(512, 10),
        )
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 10))


# Several buckets, and gradients that are views of DDP's buckets (all-reduced in place: the
# local norms must be taken before their bucket is launched).
# DDP's static graph and unused-parameter search change when and where it queues its own
# end-of-backward work; the statistics' callbacks must still run around it.
BUCKETS = [
    None,
    {"bucket_cap_mb": 0.1},
    {"bucket_cap_mb": 0.1, "gradient_as_bucket_view": True},
    {"bucket_cap_mb": 0.1, "static_graph": True},
    {"bucket_cap_mb": 0.1, "find_unused_parameters": True},
]
BUCKET_IDS = ["1bucket", "buckets", "views", "static", "unused"]


def _indices(steps: int, ws: int, b: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 1797, (ws, b), generator=g) for _ in range(steps)]


def _params(m: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in m.parameters()]


def _np(m: torch.nn.Module) -> list:
    """Parameters as numpy arrays: tensors must not cross the result queue (shared memory)."""
    return [p.detach().numpy().copy() for p in m.parameters()]


def _flat_grad(m: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in m.parameters()]).double()


# ----------------------------------------------------------------------------------------------
def _match_ddp(rank, ws, steps, ddp_kwargs=None):
    from adaptrain.torch.parallel import AdaptiveDataParallel

    X, y = _data()
    m_ref, m_adp = _model(wide=bool(ddp_kwargs)), _model(wide=bool(ddp_kwargs))
    ddp = DistributedDataParallel(m_ref, **(ddp_kwargs or {}))
    opt_ref = torch.optim.SGD(m_ref.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    opt = torch.optim.SGD(m_adp.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    adp = AdaptiveDataParallel(m_adp, opt, **(ddp_kwargs or {}))
    lrs = []
    for idx in _indices(steps, ws, 16):
        i = idx[rank]
        for model, o in ((ddp, opt_ref), (adp, opt)):
            o.zero_grad()
            F.cross_entropy(model(X[i]), y[i]).backward()
            o.step()
        lrs.append(opt.param_groups[0]["lr"])
    adp.gns.flush()  # the statistics are folded in one step late
    return _np(m_ref), _np(m_adp), adp.gns.num_updates, adp.gain, lrs


@pytest.mark.parametrize("ddp_kwargs", BUCKETS, ids=BUCKET_IDS)
def test_adp_matches_ddp_exactly_at_scale_one(ddp_kwargs):
    out = spawn(_match_ddp, 2, args=(6, ddp_kwargs), timeout=TIMEOUT)
    for ref, got, updates, gain, lrs in out:
        for a, b in zip(ref, got):
            torch.testing.assert_close(b, a, rtol=0, atol=0)
        assert updates == 6  # statistics were collected on every step
        assert gain == 1.0 and lrs == [0.1] * 6  # scale 1: factor 1, lr restored
    torch.testing.assert_close(out[0][1], out[1][1], rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------
def _stats_vs_direct(rank, ws, steps, b, ddp_kwargs=None, interval=1, hook=False):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from adaptrain.torch.parallel import AdaptiveDataParallel

    X, y = _data()
    m_adp, m_copy = _model(wide=bool(ddp_kwargs)), _model(wide=bool(ddp_kwargs))
    opt = torch.optim.SGD(m_adp.parameters(), lr=0.05)
    opt_copy = torch.optim.SGD(m_copy.parameters(), lr=0.05)
    adp = AdaptiveDataParallel(m_adp, opt, max_stats_interval=interval, **(ddp_kwargs or {}))
    adp.gns._samples_per_window = 1e-9  # sample every `interval` steps from the start
    if hook:  # a (lossless) communication hook: the statistics take their own dense all-reduce
        adp.register_comm_hook(None, default_hooks.allreduce_hook)
    ema_s, ema_v = core_gns.ema_init(0.0), core_gns.ema_init(0.0)
    clock = 0.0
    for t, idx in enumerate(_indices(steps, ws, b, seed=7)):
        # Direct: every replica's micro-batch gradient, computed locally from the same weights.
        grads = []
        for r in range(ws):
            m_copy.zero_grad()
            F.cross_entropy(m_copy(X[idx[r]]), y[idx[r]]).backward()
            grads.append(_flat_grad(m_copy))
        local = sum(float(g @ g) for g in grads) / ws
        mean = sum(grads) / ws
        if (t + 1) % interval == 0:  # a sampled step; it stands for the `interval` steps since
            est = core_gns.unbiased_estimate(local, float(mean @ mean), ws, 1.0 / ws)
            theta = min(0.999, 1.0 - 1.0 / (1.0 + 0.25 * clock)) ** interval  # growing window
            clock += interval
            ema_s = core_gns.ema_update(ema_s, est.sqr, theta)
            ema_v = core_gns.ema_update(ema_v, est.var, theta)
        # Reference update of the copy with the averaged gradient.
        with torch.no_grad():
            off = 0
            for p in m_copy.parameters():
                n = p.numel()
                p.grad = mean[off : off + n].reshape(p.shape).float()
                off += n
        opt_copy.step()
        opt.zero_grad()
        F.cross_entropy(adp(X[idx[rank]]), y[idx[rank]]).backward()
        opt.step()
    adp.gns.flush()
    return (
        float(adp.gns.raw_sqr_avg[0]),
        float(adp.gns.raw_var_avg[0]),
        float(core_gns.ema_value(ema_s)),
        float(core_gns.ema_value(ema_v)),
        adp.gns.num_updates,
    )


@pytest.mark.parametrize("ddp_kwargs", BUCKETS, ids=BUCKET_IDS)
def test_statistics_match_direct_computation(ddp_kwargs):
    out = spawn(_stats_vs_direct, 2, args=(5, 8, ddp_kwargs), timeout=TIMEOUT)
    for sqr, var, ref_sqr, ref_var, n in out:
        assert n == 5
        assert abs(sqr - ref_sqr) <= 1e-4 * abs(ref_sqr) + 1e-7
        assert abs(var - ref_var) <= 1e-4 * abs(ref_var) + 1e-7
    assert out[0][:2] == out[1][:2]  # identical on every replica


@pytest.mark.parametrize("ddp_kwargs", BUCKETS[:3], ids=BUCKET_IDS[:3])
def test_statistics_with_a_communication_hook_match_direct_computation(ddp_kwargs):
    out = spawn(_stats_vs_direct, 2, args=(4, 8, ddp_kwargs, 1, True), timeout=TIMEOUT)
    for sqr, var, ref_sqr, ref_var, n in out:
        assert n == 4
        assert abs(sqr - ref_sqr) <= 1e-4 * abs(ref_sqr) + 1e-7
        assert abs(var - ref_var) <= 1e-4 * abs(ref_var) + 1e-7
    assert out[0][:2] == out[1][:2]


def _stats_under_powersgd(rank, ws, steps):
    from adaptrain.dist.hooks import PowerSGDHookState, powersgd_hook
    from adaptrain.torch.parallel import AdaptiveDataParallel

    X, y = _data()
    out = {}
    for kind in ("plain", "powersgd"):
        model = _model(wide=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        adp = AdaptiveDataParallel(model, opt, max_stats_interval=1, name=f"adp-{kind}")
        if kind == "powersgd":  # rank 1 with error feedback: its average is far from the mean
            adp.register_comm_hook(
                PowerSGDHookState(rank=1, params=model.parameters()), powersgd_hook
            )
        first = None
        for t, idx in enumerate(_indices(steps, ws, 16, seed=3)):
            opt.zero_grad()
            F.cross_entropy(adp(X[idx[rank]]), y[idx[rank]]).backward()
            opt.step()
            if t == 1:  # the first step's sample is folded in at the second step
                first = (adp.gns.sqr_avg(), adp.gns.var_avg())
        adp.gns.flush()
        out[kind] = (first, (adp.gns.sqr_avg(), adp.gns.var_avg()))
    return out


def test_statistics_under_a_lossy_hook_are_those_of_the_mean_gradient():
    for res in spawn(_stats_under_powersgd, 2, args=(30,), timeout=TIMEOUT):
        plain, psgd = res["plain"], res["powersgd"]
        # Same weights at the first step: the same sample exactly.
        assert psgd[0] == pytest.approx(plain[0], rel=1e-5)
        # Later the weights differ (compressed updates) but the noise scale stays close; the
        # hook's own average read var 0 and sqr an order of magnitude high.
        assert psgd[1][1] > 0
        ratio = (psgd[1][1] / psgd[1][0]) / (plain[1][1] / plain[1][0])
        assert 0.5 < ratio < 2.0


def _sketch_vs_dense(rank, ws, steps):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from adaptrain.torch.parallel import AdaptiveDataParallel

    X, y = _data()
    out = {}
    for size in (None, 1024):  # 301k parameters: 1024 values sketch them, None all-reduces all
        model = _model(wide=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        adp = AdaptiveDataParallel(
            model, opt, max_stats_interval=1, name=f"adp-{size}", stats_sketch_size=size
        )
        adp.register_comm_hook(None, default_hooks.allreduce_hook)  # lossless: same weights
        for idx in _indices(steps, ws, 16, seed=11):
            opt.zero_grad()
            F.cross_entropy(adp(X[idx[rank]]), y[idx[rank]]).backward()
            opt.step()
        adp.gns.flush()
        out[size] = (adp.gns.sqr_avg(), adp.gns.var_avg(), _np(model))
    return out


def test_statistics_through_a_count_sketch_track_the_dense_ones():
    for res in spawn(_sketch_vs_dense, 2, args=(40,), timeout=TIMEOUT):
        dense, sketch = res[None], res[1024]
        for a, b in zip(dense[2], sketch[2]):  # scale 1: the statistics do not touch the update
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert sketch[:2] != dense[:2]  # the sketch was used
        assert sketch[0] == pytest.approx(dense[0], rel=0.25)
        assert sketch[1] == pytest.approx(dense[1], rel=0.25)


def test_sampled_statistics_match_direct_computation():
    """One step in 3 sampled: the samples of steps 3, 6, 9 only, each standing for 3 steps."""
    out = spawn(_stats_vs_direct, 2, args=(9, 8, {"bucket_cap_mb": 0.1}, 3), timeout=TIMEOUT)
    for sqr, var, ref_sqr, ref_var, n in out:
        assert n == 3
        assert abs(sqr - ref_sqr) <= 1e-4 * abs(ref_sqr) + 1e-7
        assert abs(var - ref_var) <= 1e-4 * abs(ref_var) + 1e-7
    assert out[0][:2] == out[1][:2]  # identical on every replica


def _single_replica(rank, ws, steps):
    from adaptrain.torch.parallel import AdaptiveDataParallel

    X, y = _data()
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.0)  # fixed weights: consecutive grads comparable
    adp = AdaptiveDataParallel(m, opt)
    ema_s, ema_v = core_gns.ema_init(0.0), core_gns.ema_init(0.0)
    prev, clock, span = None, 0.0, 0.0
    for idx in _indices(steps, 1, 16, seed=3):
        opt.zero_grad()
        F.cross_entropy(adp(X[idx[0]]), y[idx[0]]).backward()
        g = _flat_grad(m)
        opt.step()
        span += 1.0  # scale 1 per step
        if prev is not None:  # a pair of consecutive steps: one sample, count 2, scale 2
            local = (float(g @ g) + float(prev @ prev)) / 2
            avg = (g + prev) / 2
            est = core_gns.unbiased_estimate(local, float(avg @ avg), 2, 1.0)
            theta = min(0.999, 1.0 - 1.0 / (1.0 + 0.25 * clock)) ** span
            clock, span = clock + span, 0.0
            ema_s = core_gns.ema_update(ema_s, est.sqr, theta)
            ema_v = core_gns.ema_update(ema_v, est.var, theta)
        prev = g
    adp.gns.flush()
    return (
        float(adp.gns.raw_sqr_avg[0]),
        float(adp.gns.raw_var_avg[0]),
        float(core_gns.ema_value(ema_s)),
        float(core_gns.ema_value(ema_v)),
        adp.gns.num_updates,
    )


def test_single_replica_uses_consecutive_step_estimator():
    ((sqr, var, ref_sqr, ref_var, n),) = spawn(_single_replica, 1, args=(5,), timeout=TIMEOUT)
    assert n == 4
    assert abs(sqr - ref_sqr) <= 1e-4 * abs(ref_sqr) + 1e-7
    assert abs(var - ref_var) <= 1e-4 * abs(ref_var) + 1e-7


# ----------------------------------------------------------------------------------------------
def _lr_scaled(rank, ws):
    from adaptrain.torch.parallel import AdaptiveDataParallel
    from adaptrain.torch.scaling_rules import AdaScale

    class AdaScaleAt4(AdaScale):
        """AdaScale's factor as if the batch were 4× the base (the real gain at scale 4)."""

        def scale_lr(self, scale):
            return super().scale_lr(4.0)

    X, y = _data()
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    adp = AdaptiveDataParallel(m, opt, scaling_rule=AdaScaleAt4())
    seen = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append(o.param_groups[0]["lr"]))
    expected, after = [], []
    for idx in _indices(4, ws, 16):
        opt.zero_grad()
        F.cross_entropy(adp(X[idx[rank]]), y[idx[rank]]).backward()
        before = _params(m)
        grads = [p.grad.clone() for p in m.parameters()]
        opt.step()
        expected.append(0.1 * adp.gns.gain(4.0))  # stats of this step are folded in pre-step
        after.append(opt.param_groups[0]["lr"])
        lr_used = seen[-1]
        for p0, g, p in zip(before, grads, m.parameters()):
            torch.testing.assert_close(p.detach(), p0 - lr_used * g)
    return seen, expected, after


def test_lr_is_scaled_by_gain_and_restored():
    out = spawn(_lr_scaled, 2, timeout=TIMEOUT)
    for seen, expected, after in out:
        assert after == [0.1] * 4
        torch.testing.assert_close(torch.tensor(seen), torch.tensor(expected), rtol=1e-12, atol=0)
        assert max(seen) > 0.1  # the gain at scale 4 is above 1 on this data
    assert out[0][0] == out[1][0]  # the same factor on every replica


# ----------------------------------------------------------------------------------------------
def _accumulation(rank, ws):
    from adaptrain.torch.parallel import AdaptiveDataParallel

    X, y = _data()
    m_ref, m_adp = _model(), _model()
    ddp = DistributedDataParallel(m_ref)
    opt_ref = torch.optim.SGD(m_ref.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(m_adp.parameters(), lr=0.1, momentum=0.9)
    adp = AdaptiveDataParallel(m_adp, opt)
    for idx in _indices(3, ws, 24):
        chunks = idx[rank].split(8)
        # Reference: the standard DDP accumulation loop.
        opt_ref.zero_grad()
        for k, c in enumerate(chunks):
            if k < len(chunks) - 1:
                with ddp.no_sync():
                    F.cross_entropy(ddp(X[c]), y[c]).backward()
            else:
                F.cross_entropy(ddp(X[c]), y[c]).backward()
        opt_ref.step()
        # AdaptDL's loop: zero_grad/backward/step on every micro-batch.
        for k, c in enumerate(chunks):
            opt.zero_grad()
            if k < len(chunks) - 1:
                with adp.no_sync():
                    F.cross_entropy(adp(X[c]), y[c]).backward()
            else:
                F.cross_entropy(adp(X[c]), y[c]).backward()
            opt.step()
    adp.gns.flush()
    return _np(m_ref), _np(m_adp), adp.gns.num_updates


def test_accumulation_with_no_sync_matches_ddp():
    for ref, got, updates in spawn(_accumulation, 2, timeout=TIMEOUT):
        for a, b in zip(ref, got):
            torch.testing.assert_close(b, a, rtol=0, atol=0)
        assert updates == 3


def _replay_on_ddp(model, seen, lr: float) -> list[torch.Tensor]:
    """Plain DDP on the micro-batches ``seen`` as ``(x, y, optim_step)``: each step uses the
    mean gradient of the micro-batches it ran (SGD at ``lr``); returns each step's gradient."""
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    grads, group = [], []
    for xb, yb, optim_step in seen:
        group.append((xb, yb))
        if not optim_step:
            continue
        opt.zero_grad()
        for k, (a, b) in enumerate(group):
            loss = F.cross_entropy(ddp(a), b) / len(group)
            if k < len(group) - 1:
                with ddp.no_sync():
                    loss.backward()
            else:
                loss.backward()
        grads.append(_flat_grad(model))
        opt.step()
        group = []
    return grads


def _accumulating(samples: int):
    """ADP (SGD 0.1) + its reference model + a loader of 64 per step = 2 replicas × 2
    micro-batches × 16, on the first ``samples`` digits."""
    from adaptrain.torch.data import AdaptiveDataLoader
    from adaptrain.torch.parallel import AdaptiveDataParallel

    X, y = _data()
    data = torch.utils.data.TensorDataset(X[:samples], y[:samples])
    m_adp, m_ref = _model(), _model()
    opt = torch.optim.SGD(m_adp.parameters(), lr=0.1)
    adp = AdaptiveDataParallel(m_adp, opt)
    loader = AdaptiveDataLoader(data, batch_size=64, shuffle=False)
    loader.autoscale_batch_size(64, local_bsz_bounds=(None, 16), gradient_accumulation=True)
    return m_adp, m_ref, opt, adp, loader


def _short_last_step(rank, ws):
    from adaptrain.torch.data import current_dataloader

    # 80 samples: the pass's second step has 1 micro-batch.
    m_adp, m_ref, opt, adp, loader = _accumulating(80)
    seen, grads, scales = [], [], []
    for xb, yb in loader:
        optim_step = current_dataloader().is_optim_step()
        seen.append((xb, yb, optim_step))
        opt.zero_grad()
        F.cross_entropy(adp(xb), yb).backward()
        if optim_step:
            grads.append(_flat_grad(m_adp))
            scales.append(adp._step_scale())
        opt.step()
    ref = _replay_on_ddp(m_ref, seen, lr=0.1)  # the first step's lr factor is 1 (scale 1)
    return [len(s[1]) for s in seen], [g.numpy() for g in grads], [g.numpy() for g in ref], scales


def _zero_grad_in_accumulation(rank, ws, via):
    import warnings

    from adaptrain.torch.data import current_dataloader

    m_adp, m_ref, opt, adp, loader = _accumulating(128)
    zero = adp.scaling_rule.zero_grad if via == "rule" else adp.zero_grad
    seen = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for xb, yb in loader:  # the AMP-style loop: step only at the end of a step
            optim_step = current_dataloader().is_optim_step()
            seen.append((xb, yb, optim_step))
            zero()
            F.cross_entropy(adp(xb), yb).backward()
            if optim_step:
                opt.step()
    skipped = sum("zero_grad skipped" in str(w.message) for w in caught)
    _replay_on_ddp(m_ref, seen, lr=0.1)
    return _np(m_adp), _np(m_ref), skipped, len(seen)


@pytest.mark.parametrize("via", ["rule", "adp"])
def test_zero_grad_mid_accumulation_keeps_the_micro_batches(via):
    for got, ref, skipped, micro in spawn(_zero_grad_in_accumulation, 2, args=(via,)):
        assert micro == 4 and skipped == 2  # the second micro-batch of each of 2 steps
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_short_last_step_of_a_pass_averages_the_micro_batches_it_ran():
    for sizes, grads, ref, scales in spawn(_short_last_step, 2, timeout=TIMEOUT):
        assert sizes == [16, 16, 8] and len(grads) == len(ref) == 2
        for a, b in zip(grads, ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
        assert scales == [1.0, 0.25]  # the short step holds 16 of the 64 planned samples


# ----------------------------------------------------------------------------------------------
def _grad_scaler(rank, ws):
    from adaptrain.torch.parallel import AdaptiveDataParallel

    X, y = _data()
    results = {}
    for use_scaler in (False, True):
        m = _model()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12) if use_scaler else None
        adp = AdaptiveDataParallel(m, opt, mp_scaler=scaler, name=f"adp-{use_scaler}")
        trace = []
        for step, idx in enumerate(_indices(4, ws, 16)):
            opt.zero_grad()
            loss = F.cross_entropy(adp(X[idx[rank]]), y[idx[rank]])
            if scaler is None:
                loss.backward()
                opt.step()
            else:
                if step == 2:
                    loss = loss * float("inf")  # an overflowing step: skipped, no statistics
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            adp.gns.flush()  # fold this step's statistics now (they lag one step otherwise)
            trace.append(
                (
                    float(adp.gns.raw_sqr_avg[0]),
                    float(adp.gns.raw_var_avg[0]),
                    adp.gns.num_updates,
                    _np(m),
                )
            )
        results[use_scaler] = (trace, None if scaler is None else scaler.get_scale())
    return results


def test_grad_scaler_statistics_are_unscaled_and_overflow_skipped():
    for res in spawn(_grad_scaler, 2, timeout=TIMEOUT):
        plain, _ = res[False]
        scaled, final_scale = res[True]
        for step in (0, 1):  # identical up to the overflow: the loss scale 2**12 is exact
            assert scaled[step][2] == plain[step][2] == step + 1
            torch.testing.assert_close(scaled[step][0], plain[step][0], rtol=1e-12, atol=0)
            torch.testing.assert_close(scaled[step][1], plain[step][1], rtol=1e-12, atol=0)
            for a, b in zip(scaled[step][3], plain[step][3]):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
        # Step 2 overflowed: the scaler skipped the update and the statistics ignored it.
        assert scaled[2][2] == 2 and scaled[2][:2] == scaled[1][:2]
        for a, b in zip(scaled[2][3], scaled[1][3]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert scaled[3][2] == 3 and final_scale == 2.0**11


# ----------------------------------------------------------------------------------------------
def _checkpoint_phase(rank, ws, phase, steps, interval=1):
    from adaptrain import checkpoint
    from adaptrain.torch.parallel import AdaptiveDataParallel

    X, y = _data()
    m = _model(seed=10 + phase)  # another init after the restart: the checkpoint must win
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    adp = AdaptiveDataParallel(m, opt, sched, max_stats_interval=interval)
    adp.gns._samples_per_window = 1e-9  # sample every `interval` steps from the start
    idxs = _indices(2 * steps, ws, 16)
    todo = idxs[:steps] if phase == 0 else idxs[steps:]
    out = {}
    for k, idx in enumerate(todo):
        opt.zero_grad()
        F.cross_entropy(adp(X[idx[rank]]), y[idx[rank]]).backward()
        opt.step()
        sched.step()
        if phase == 0 and k == steps - 1:
            assert checkpoint.save_all_states()
            out["saved_gns"] = adp.gns.state_dict()
    if phase == 0:  # go on as if never interrupted: the reference for the resumed run
        for idx in idxs[steps:]:
            opt.zero_grad()
            F.cross_entropy(adp(X[idx[rank]]), y[idx[rank]]).backward()
            opt.step()
            sched.step()
    adp.gns.flush()
    out.update(params=_np(m), gns=adp.gns.state_dict(), lr=opt.param_groups[0]["lr"], gain=adp.gain)
    return out


@pytest.mark.parametrize("interval", [1, 2])
def test_checkpoint_round_trip_replays_identically(tmp_path, interval):
    # interval 2 with 3 steps per phase: the checkpoint falls between two samples, and the
    # schedule must resume where it stopped (samples at steps 2, 4, 6)
    env = {"ADAPTRAIN_CHECKPOINT_PATH": str(tmp_path)}
    ref = spawn(_checkpoint_phase, 2, args=(0, 3, interval), env=env, timeout=TIMEOUT)
    resumed = spawn(_checkpoint_phase, 2, args=(1, 3, interval), env=env, timeout=TIMEOUT)
    for a, b in zip(ref, resumed):
        for p, q in zip(a["params"], b["params"]):
            torch.testing.assert_close(q, p, rtol=0, atol=0)
        assert a["lr"] == b["lr"] == 0.1 * 0.5**3
        assert (
            a["gns"] == b["gns"]
        )  # the same samples (no bucket layout in them), the same schedule
        assert a["gns"]["sqr"][2] == b["gns"]["sqr"][2] == 6 // interval
        assert b["gns"]["progress"] == a["gns"]["progress"] == 6.0


def _scaler_phase(rank, ws, phase):
    """Phase 0: three steps under a GradScaler, the first overflowing, then a checkpoint.
    Phase 1: a fresh scaler, restored from that checkpoint by AdaptiveDataParallel."""
    from adaptrain import checkpoint
    from adaptrain.torch.parallel import AdaptiveDataParallel

    X, y = _data()
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=3)
    fresh = scaler.state_dict()
    adp = AdaptiveDataParallel(m, opt, mp_scaler=scaler)
    if phase == 0:
        for step, idx in enumerate(_indices(3, ws, 16)):
            opt.zero_grad()
            loss = F.cross_entropy(adp(X[idx[rank]]), y[idx[rank]])
            if step == 0:
                loss = loss * float("inf")  # halves the scale, resets the growth tracker
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        assert checkpoint.save_all_states()
    return fresh, scaler.state_dict()


def test_checkpoint_restores_the_grad_scaler(tmp_path):
    env = {"ADAPTRAIN_CHECKPOINT_PATH": str(tmp_path)}
    saved = spawn(_scaler_phase, 2, args=(0,), env=env, timeout=TIMEOUT)
    restored = spawn(_scaler_phase, 2, args=(1,), env=env, timeout=TIMEOUT)
    for (fresh, before), (_, after) in zip(saved, restored):
        assert before["scale"] == 2.0**11 and before["_growth_tracker"] == 2
        assert before != fresh  # so the restored state cannot be a fresh scaler's
        assert after == before


# ----------------------------------------------------------------------------------------------
def _sparse_vs_dense(rank, ws):
    from adaptrain.torch.parallel import AdaptiveDataParallel

    out = {}
    for sparse in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.EmbeddingBag(50, 8, sparse=sparse), torch.nn.Linear(8, 1)
        )
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        adp = AdaptiveDataParallel(model, opt, max_stats_interval=1, name=f"adp-{sparse}")
        g = torch.Generator().manual_seed(10 + rank)
        for _ in range(4):
            x = torch.randint(0, 50, (8, 3), generator=g)
            opt.zero_grad()
            adp(x).pow(2).mean().backward()
            opt.step()
        adp.gns.flush()
        out[sparse] = (_np(model), adp.gns.sqr_avg(), adp.gns.var_avg(), adp.gns.num_updates)
    return out


@pytest.mark.parametrize("ws", [1, 2])
def test_sparse_gradients_give_the_dense_statistics(ws):
    # nn.EmbeddingBag(sparse=True) works under DDP; its statistics equal the dense layer's.
    for res in spawn(_sparse_vs_dense, ws, timeout=TIMEOUT):
        dense, sparse = res[False], res[True]
        for a, b in zip(dense[0], sparse[0]):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
        assert sparse[3] == dense[3] > 0
        assert sparse[1] == pytest.approx(dense[1], rel=1e-5)
        assert sparse[2] == pytest.approx(dense[2], rel=1e-5)


def _window(rank, ws):
    from adaptrain.torch.parallel import AdaptiveDataParallel

    fixed = AdaptiveDataParallel(
        _model(), torch.optim.SGD(_model().parameters(), lr=0.1), window_fraction=None, name="fixed"
    )
    default = AdaptiveDataParallel(_model(), torch.optim.SGD(_model().parameters(), lr=0.1))
    return fixed.gns._window_fraction, default.gns._window_fraction


def test_window_fraction_reaches_the_statistics():
    assert spawn(_window, 1, timeout=TIMEOUT) == [(None, 0.25)]  # None: AdaptDL's fixed memory


def _eval_with_fewer_samples_than_replicas(rank, ws):
    from torch.utils.data import TensorDataset

    import adaptrain.torch as adl

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model = adl.AdaptiveDataParallel(net, opt)
    g = torch.Generator().manual_seed(0)
    train = adl.AdaptiveDataLoader(
        TensorDataset(torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g)),
        batch_size=4,
    )
    tiny = adl.AdaptiveDataLoader(TensorDataset(torch.randn(1, 4, generator=g)), batch_size=4)
    acc = adl.Accumulator()
    seen = []
    for _ in adl.remaining_epochs_until(2):
        model.train()
        for x, y in train:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            for (x,) in tiny:  # one replica gets the sample, the other none
                acc["n"] += len(model(x))
        with acc.synchronized():
            seen.append(acc["n"])
    return seen


def test_evaluation_with_fewer_samples_than_replicas_does_not_hang():
    # DDP's first forward after a training step broadcasts the buffers (BatchNorm): a replica
    # left without an evaluation sample never calls it. Under no_grad ADP runs the module alone.
    assert spawn(_eval_with_fewer_samples_than_replicas, 2, timeout=60) == [[1, 2], [1, 2]]


# ----------------------------------------------------------------------------------------------
def _short_last_micro_batch(rank, ws, drop_last):
    """130 digits at batch 64 on 2 replicas: each pass is two 64-sample steps and, without
    ``drop_last``, a 2-sample step (one sample per replica). lr 0: the model stays fixed."""
    from sklearn.datasets import load_digits

    from adaptrain.torch.data import AdaptiveDataLoader
    from adaptrain.torch.parallel import AdaptiveDataParallel

    X, y = load_digits(return_X_y=True)
    data = torch.utils.data.TensorDataset(
        torch.tensor(X[:130] / 16.0, dtype=torch.float32), torch.tensor(y[:130])
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    adp = AdaptiveDataParallel(model, opt, max_stats_interval=1)
    loader = AdaptiveDataLoader(data, batch_size=64, drop_last=drop_last)
    sizes, scales, gains = [], [], []
    for _ in range(6):
        for xb, yb in loader:
            opt.zero_grad()
            F.cross_entropy(adp(xb), yb).backward()
            opt.step()
            sizes.append(len(yb))
            scales.append(adp._step_scale())
            gains.append(adp.gain)
    adp.gns.flush()
    return sizes, scales, gains, adp.gns.get_progress(), adp.gns.averages(), adp.gns.num_updates


def test_a_short_last_step_is_scaled_by_its_samples_and_not_sampled():
    # Before, the 2-sample step of each pass counted as a full 64-sample step: a full gain
    # of progress and lr, and a variance sample ~30x too large at full weight.
    full = spawn(_short_last_micro_batch, 2, args=(True,), timeout=TIMEOUT)[0]
    short = spawn(_short_last_micro_batch, 2, args=(False,), timeout=TIMEOUT)[0]
    sizes, scales, gains, progress, (sqr, var), updates = short
    assert sizes == [32, 32, 1] * 6 and full[0] == [32, 32] * 6
    assert scales == [1.0, 1.0, 2 / 64] * 6
    assert all(g < 1.0 for g in gains[2::3]) and progress == pytest.approx(12 + sum(gains[2::3]))
    assert updates == full[5] == 12  # the short steps are not sampled
    assert var == pytest.approx(full[4][1], rel=0.1) and var > 0  # before: 3.4x
    assert sqr == pytest.approx(full[4][0], rel=0.2)
