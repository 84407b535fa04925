"""Tests of adaptrain.optim.adascale.AdaScale (single process, and 2 gloo processes)."""

from __future__ import annotations

import copy
import faulthandler
import functools
import io
import itertools
import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from adaptrain.dist.spawn import spawn
from adaptrain.optim.adascale import AdaScale


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models: one intra-op thread is faster and kinder to a shared machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@functools.lru_cache(maxsize=1)
def digits() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y)


def make_model(seed: int = 0, hidden: int = 16) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 10)
    )


def batches(seed: int, b: int = 8):
    """An endless, seeded stream of random digits micro-batches."""
    x, y = digits()
    g = torch.Generator().manual_seed(seed)
    while True:
        idx = torch.randint(0, len(x), (b,), generator=g)
        yield x[idx], y[idx]


def loss_of(model, batch):
    return F.cross_entropy(model(batch[0]), batch[1])


def train(
    model,
    opt,
    steps,
    c,
    seed=1,
    scaled=True,
    before_step=None,
    scaler=None,
    skip_steps=(),
    data=None,
):
    """Accumulate ``c`` micro-batches per step (from ``data``, default ``batches(seed)``);
    returns the gains seen before each step."""
    data = batches(seed) if data is None else iter(data)
    gains = []
    for s in range(steps):
        opt.zero_grad()
        for _ in range(c):
            loss = loss_of(model, next(data))
            if scaled:
                loss = loss / c
            if s in skip_steps:
                loss = loss * math.inf
            (scaler.scale(loss) if scaler is not None else loss).backward()
        if before_step is not None:
            before_step(s)
        if scaler is not None:
            scaler.unscale_(opt)
        gains.append(opt.gain())
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
    return gains


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]


def clean_and_custom(steps, micro, before=None, zero=None, params=None):
    """Two identical models, two micro-batches per step: the gains of a clean :func:`train`
    run, and of a loop whose micro-batches run ``micro(model, batch)``, ``before(step)`` first
    and ``zero(opt)`` to zero (default ``opt.zero_grad()``); also both models."""
    m1, m2 = make_model(), make_model()
    o1 = AdaScale(torch.optim.SGD(m1.parameters(), lr=0.1), num_gradients_to_accumulate=2)
    o2 = AdaScale(
        torch.optim.SGD(m2.parameters() if params is None else params(m2), lr=0.1),
        num_gradients_to_accumulate=2,
    )
    g1 = train(m1, o1, steps, 2)
    data, g2 = batches(1), []
    for s in range(steps):
        if before is not None:
            before(s, m2, o2)
        (zero or (lambda o: o.zero_grad()))(o2)
        for _ in range(2):
            micro(m2, next(data))
        g2.append(o2.gain())
        o2.step()
    return g1, g2, m1, m2


def _backward(model, batch):
    (loss_of(model, batch) / 2).backward()


def test_single_process_without_accumulation_is_an_error():
    model = make_model()
    with pytest.raises(RuntimeError, match="at least 2 gradients"):
        AdaScale(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="scale"):
        AdaScale(
            torch.optim.SGD(model.parameters(), lr=0.1), num_gradients_to_accumulate=2, scale=0.5
        )
    with pytest.raises(RuntimeError, match="not initialised"):
        AdaScale(torch.optim.SGD(model.parameters(), lr=0.1), world_size=2)
    with pytest.raises(ValueError, match="smoothing"):
        AdaScale(
            torch.optim.SGD(model.parameters(), lr=0.1),
            num_gradients_to_accumulate=2,
            smoothing=1.0,
        )


def test_world_size_one_with_accumulation_needs_no_process_group():
    assert not dist.is_initialized()
    model = make_model()
    opt = AdaScale(torch.optim.SGD(model.parameters(), lr=0.1), num_gradients_to_accumulate=4)
    assert opt.scale == 4 and opt.smoothing == pytest.approx(0.996)
    x, y = digits()
    before = F.cross_entropy(model(x), y).item()
    gains = train(model, opt, 60, 4)
    assert F.cross_entropy(model(x), y).item() < before
    assert gains[0] > 1.0 and all(1.0 <= g <= 4.0 for g in gains)
    # statistics of this step are in the gain before step(): it changes at every step
    assert len(set(gains)) == len(gains)


def test_effective_lr_is_base_lr_times_gain_and_restored():
    model = make_model()
    opt = AdaScale(torch.optim.SGD(model.parameters(), lr=0.1), num_gradients_to_accumulate=3)
    data = batches(2)
    for _ in range(20):
        opt.zero_grad()
        for _ in range(3):
            (loss_of(model, next(data)) / 3).backward()
        before = params_of(model)
        grads = [p.grad.clone() for p in model.parameters()]
        g = opt.gain()
        assert g == opt.lr_factor() and g > 1.0
        opt.step()
        assert opt.gain() == g  # the gain the step used
        assert opt.param_groups[0]["lr"] == 0.1
        for p0, p1, gr in zip(before, model.parameters(), grads):
            torch.testing.assert_close(p1.detach(), p0 - 0.1 * g * gr, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("sched", ["lambda", "step"])
def test_lr_schedulers_drive_the_base_lr(sched):
    model = make_model()
    opt = AdaScale(torch.optim.SGD(model.parameters(), lr=0.2), num_gradients_to_accumulate=2)
    if sched == "lambda":
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda=lambda e: 0.5**e)
    else:
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.1)
    reference = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.2)
    ref_sched = (
        torch.optim.lr_scheduler.LambdaLR(reference, lr_lambda=lambda e: 0.5**e)
        if sched == "lambda"
        else torch.optim.lr_scheduler.StepLR(reference, step_size=2, gamma=0.1)
    )
    data = batches(3)
    for _ in range(6):
        opt.zero_grad()
        for _ in range(2):
            (loss_of(model, next(data)) / 2).backward()
        before = params_of(model)
        grads = [p.grad.clone() for p in model.parameters()]
        g = opt.gain()
        opt.step()
        base = reference.param_groups[0]["lr"]
        assert opt.param_groups[0]["lr"] == pytest.approx(base)
        for p0, p1, gr in zip(before, model.parameters(), grads):
            torch.testing.assert_close(p1.detach(), p0 - base * g * gr, rtol=1e-5, atol=1e-7)
        scheduler.step()
        reference.step()
        ref_sched.step()
    assert scheduler.get_last_lr() == pytest.approx(ref_sched.get_last_lr())


def test_unscaled_loss_matches_scaled_loss():
    m1, m2 = make_model(), make_model()
    o1 = AdaScale(torch.optim.SGD(m1.parameters(), lr=0.1), num_gradients_to_accumulate=4)
    o2 = AdaScale(
        torch.optim.SGD(m2.parameters(), lr=0.1),
        num_gradients_to_accumulate=4,
        is_scaled_loss=False,
    )
    g1 = train(m1, o1, 30, 4)
    g2 = train(
        m2, o2, 30, 4, scaled=False, before_step=lambda s: o2.scale_grad_by_num_grads_to_accum()
    )
    np.testing.assert_allclose(g1, g2, rtol=1e-6)
    with pytest.raises(RuntimeError, match="unscaled"):
        o1.scale_grad_by_num_grads_to_accum()


def test_grad_scaler_loss_scale_does_not_pollute_the_estimate():
    ref_model, amp_model = make_model(), make_model()
    ref = AdaScale(torch.optim.SGD(ref_model.parameters(), lr=0.1), num_gradients_to_accumulate=4)
    amp = AdaScale(torch.optim.SGD(amp_model.parameters(), lr=0.1), num_gradients_to_accumulate=4)
    # the loss scale doubles every 3 steps: 2^10 ... 2^22 over the run
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    g_ref = train(ref_model, ref, 40, 4)
    g_amp = train(amp_model, amp, 40, 4, scaler=scaler)
    assert scaler.get_scale() > 2.0**20
    np.testing.assert_allclose(g_amp, g_ref, rtol=1e-9)
    np.testing.assert_allclose(amp._state["grad_var_avg"], ref._state["grad_var_avg"], rtol=1e-9)
    for a, b in zip(amp_model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b)


def test_grad_scaler_skipped_step_discards_its_statistics():
    ref_model, amp_model = make_model(), make_model()
    ref = AdaScale(torch.optim.SGD(ref_model.parameters(), lr=0.1), num_gradients_to_accumulate=2)
    amp = AdaScale(torch.optim.SGD(amp_model.parameters(), lr=0.1), num_gradients_to_accumulate=2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    g_amp = train(amp_model, amp, 12, 2, scaler=scaler, skip_steps=(5,))
    assert scaler.get_scale() == 2.0**7  # the overflowing step was skipped and backed off

    def skip_like_scaler(s):
        if s == 5:  # same micro-batches consumed, no update, statistics dropped
            ref.zero_grad()

    g_ref = []
    data = batches(1)
    for s in range(12):
        ref.zero_grad()
        for _ in range(2):
            (loss_of(ref_model, next(data)) / 2).backward()
        skip_like_scaler(s)
        g_ref.append(ref.gain())
        if s != 5:
            ref.step()
    np.testing.assert_allclose(
        [g for s, g in enumerate(g_amp) if s != 5],
        [g for s, g in enumerate(g_ref) if s != 5],
        rtol=1e-9,
    )


def test_var_floor_is_applied_in_the_units_the_optimizer_steps_with():
    # Identical micro-batches: L = T exactly, the raw variance is 0 and is clipped at
    # fairscale's floor 1e-6. Under a GradScaler the floor must hold for the unscaled
    # gradients too (it used to be applied before unscaling: 1e-6 / loss_scale²).
    def run(scaler):
        model = make_model()
        opt = AdaScale(torch.optim.SGD(model.parameters(), lr=0.1), num_gradients_to_accumulate=2)
        twice = (b for batch in itertools.islice(batches(6), 4) for b in (batch, batch))
        return opt, train(model, opt, 4, 2, scaler=scaler, data=twice)

    ref, g_ref = run(None)
    amp, g_amp = run(torch.amp.GradScaler("cpu", init_scale=2.0**12))
    assert float(ref._state["grad_var_avg"][0]) == pytest.approx(1e-6)
    np.testing.assert_allclose(amp._state["grad_var_avg"], ref._state["grad_var_avg"], rtol=1e-9)
    np.testing.assert_allclose(g_amp, g_ref, rtol=1e-9)


def _frozen_run(change, between):
    """lr 0, two micro-batches for 3 steps, then ``change(opt)`` (between the last backward
    pass and ``step()`` of step 3, or after it) and 3 steps of ``opt.num_gradients_to_accumulate``
    micro-batches: the averages after step 3 and every gain seen."""
    model = make_model()
    opt = AdaScale(torch.optim.SGD(model.parameters(), lr=0.0), num_gradients_to_accumulate=2)
    data, gains, after = batches(9), [], None
    for s in range(6):
        c = opt.num_gradients_to_accumulate
        opt.zero_grad()
        for _ in range(c):
            (loss_of(model, next(data)) / c).backward()
        gains.append(opt.gain())
        if s == 2 and between:
            change(opt)
        opt.step()
        if s == 2:
            if not between:
                change(opt)
            after = {k: v.clone() for k, v in opt._state.items()}
    return after, gains


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda o: o.set_scale(4), id="set_scale"),
        pytest.param(lambda o: o.set_num_gradients_to_accumulate(4), id="set_num"),
        pytest.param(lambda o: (o.set_num_gradients_to_accumulate(4), o.set_scale(4)), id="both"),
    ],
)
def test_settings_changed_before_step_apply_from_the_next_step(change):
    # As in fairscale, where the sample is taken at the end of the last backward pass: the
    # gradients already computed were produced at the old scale and accumulation count, so a
    # new setting given between the last backward pass and step() applies from the next step.
    after, gains = _frozen_run(change, between=False)
    after_b, gains_b = _frozen_run(change, between=True)
    for k, v in after.items():
        torch.testing.assert_close(after_b[k], v, rtol=1e-12, atol=0, msg=k)
    assert gains_b == gains


def test_non_finite_gradients_leave_the_statistics_unchanged():
    model = make_model()
    opt = AdaScale(torch.optim.SGD(model.parameters(), lr=0.0), num_gradients_to_accumulate=2)
    train(model, opt, 5, 2)
    state = {k: v.clone() for k, v in opt._state.items()}
    gain = opt.gain()
    for bad in (math.nan, math.inf):
        opt.zero_grad()
        data = batches(7)
        for _ in range(2):
            (loss_of(model, next(data)) * bad).backward()
        opt.step()
        assert opt.gain() == gain
        for k, v in opt._state.items():
            torch.testing.assert_close(v, state[k], msg=k)


def test_gradient_penalty_via_autograd_grad_is_not_counted():
    """A diagnostic autograd.grad before backward: identical statistics to a clean run."""

    def micro(model, batch):
        loss = loss_of(model, batch) / 2
        norms = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
        assert all(torch.isfinite(n).all() for n in norms)
        loss.backward()

    g1, g2, _, _ = clean_and_custom(15, micro)
    np.testing.assert_allclose(g1, g2, rtol=1e-6)


def test_gradient_penalty_in_the_loss_matches_hand_computed_estimate():
    """(loss + λ|∇θ loss|²).backward(): one micro-batch per backward, estimate from its gradient."""
    model = make_model()
    opt = AdaScale(
        torch.optim.SGD(model.parameters(), lr=0.0), num_gradients_to_accumulate=2, smoothing=0.0
    )
    data = batches(4)
    micro = [next(data) for _ in range(2)]
    params = list(model.parameters())

    def penalised(batch):
        loss = loss_of(model, batch)
        grads = torch.autograd.grad(loss, params, create_graph=True)
        return loss + 0.1 * sum(g.pow(2).sum() for g in grads)

    # hand computation from the true micro-batch gradients of the penalised loss
    flat = [
        torch.cat([g.reshape(-1) for g in torch.autograd.grad(penalised(b), params)]) for b in micro
    ]
    local = sum(float(f.double().pow(2).sum()) for f in flat) / 2
    total = float(((flat[0] + flat[1]) / 2).double().pow(2).sum())
    sqr, var = (2 * total - local), (local - total) * 2 * (2 / 2)  # K=2, S=2: micro_scale 1
    opt.zero_grad()
    for b in micro:
        (penalised(b) / 2).backward()
    opt.step()
    assert float(opt._state["grad_sqr_avg"][0]) == pytest.approx(max(sqr, 0.0), rel=1e-5)
    assert float(opt._state["grad_var_avg"][0]) == pytest.approx(max(var, 1e-6), rel=1e-5)


@pytest.mark.parametrize("how", ["model_none", "model_zero", "optim"])
def test_extra_backward_then_zero_grad_is_forgotten(how):
    m1, m2 = make_model(), make_model()
    o1 = AdaScale(torch.optim.SGD(m1.parameters(), lr=0.1), num_gradients_to_accumulate=2)
    o2 = AdaScale(torch.optim.SGD(m2.parameters(), lr=0.1), num_gradients_to_accumulate=2)
    g1 = train(m1, o1, 12, 2)
    data, probe, g2 = batches(1), batches(99), []
    for _ in range(12):
        loss_of(m2, next(probe)).backward()  # e.g. a saliency / diagnostic pass
        if how == "model_none":
            m2.zero_grad(set_to_none=True)
        elif how == "model_zero":
            m2.zero_grad(set_to_none=False)
        else:
            o2.zero_grad()
        for _ in range(2):
            (loss_of(m2, next(data)) / 2).backward()
        g2.append(o2.gain())
        o2.step()
    np.testing.assert_allclose(g1, g2, rtol=1e-12)


def test_wrong_number_of_backward_passes_is_a_clear_error():
    model = make_model()
    opt = AdaScale(torch.optim.SGD(model.parameters(), lr=0.1), num_gradients_to_accumulate=2)
    data = batches(0)
    for _ in range(3):
        loss_of(model, next(data)).backward()
    with pytest.raises(RuntimeError, match="saw 3 backward passes"):
        opt.step()
    opt.zero_grad()
    opt.step()  # no backward at all: nothing to estimate, no error
    assert opt.gain() == 1.0


class _RecordingAdam(torch.optim.Adam):
    def step(self, closure=None):
        self.seen_lr = self.param_groups[0]["lr"]
        return super().step(closure)


class _RecordingAdamW(torch.optim.AdamW):
    def step(self, closure=None):
        self.seen_lr = self.param_groups[0]["lr"]
        return super().step(closure)


@pytest.mark.parametrize("cls", [_RecordingAdam, _RecordingAdamW])
def test_adaptive_optimizers_use_sqrt_gain(cls):
    model = make_model()
    inner = cls(model.parameters(), lr=1e-3)
    opt = AdaScale(inner, num_gradients_to_accumulate=4)
    data = batches(5)
    for _ in range(10):
        opt.zero_grad()
        for _ in range(4):
            (loss_of(model, next(data)) / 4).backward()
        g = opt.gain()
        opt.step()
        assert g > 1.0
        assert inner.seen_lr == pytest.approx(1e-3 * math.sqrt(g), rel=1e-12)
        assert opt.lr_factor() == pytest.approx(math.sqrt(g))
    forced = AdaScale(
        cls(make_model().parameters(), lr=1e-3), num_gradients_to_accumulate=4, sqrt_lr=False
    )
    assert forced.lr_factor() == forced.gain()


def test_save_load_replay_is_identical():
    model = make_model()
    opt = AdaScale(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), num_gradients_to_accumulate=3
    )
    train(model, opt, 10, 3, seed=11)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buf)
    gains_a = train(model, opt, 10, 3, seed=12)
    params_a = params_of(model)

    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    model_b = make_model(seed=123)
    opt_b = AdaScale(
        torch.optim.SGD(model_b.parameters(), lr=0.1, momentum=0.9), num_gradients_to_accumulate=3
    )
    model_b.load_state_dict(ckpt["model"])
    opt_b.load_state_dict(ckpt["optim"])
    gains_b = train(model_b, opt_b, 10, 3, seed=12)
    assert gains_a == gains_b
    for a, b in zip(params_a, model_b.parameters()):
        assert torch.equal(a, b)


def test_state_dict_is_a_snapshot_and_loads_fairscale_numpy_state():
    model = make_model()
    opt = AdaScale(torch.optim.SGD(model.parameters(), lr=0.1), num_gradients_to_accumulate=2)
    train(model, opt, 3, 2)
    sd = opt.state_dict()
    before = sd["state"]["adascale"]["grad_var_avg"].clone()
    train(model, opt, 3, 2)
    assert torch.equal(sd["state"]["adascale"]["grad_var_avg"], before)  # not aliased
    fairscale_like = copy.deepcopy(sd)
    fairscale_like["state"]["adascale"] = {
        "grad_sqr_avg": np.array([2.0]),
        "grad_var_avg": np.array([4.0]),
        "grad_sqr_avg_biased": np.array([0.2]),
        "grad_sqr_avg_unbias": np.array([0.1]),
        "grad_var_avg_biased": np.array([0.4]),
        "grad_var_avg_unbias": np.array([0.1]),
    }
    opt.load_state_dict(fairscale_like)
    assert opt.gain() == pytest.approx((4 + 2) / (4 / 2 + 2))
    with pytest.raises(ValueError, match="unknown AdaScale state"):
        bad = copy.deepcopy(sd)
        bad["state"]["adascale"]["nonsense"] = torch.zeros(1)
        opt.load_state_dict(bad)


def test_set_scale_keeps_the_averages_and_accumulation_setter():
    # The averages are in base-batch units (var ≈ tr(Σ)/B0), independent of S: a new scale
    # changes the gain, not the averages (fairscale rescaled var by S_old/S_new here).
    model = make_model()
    opt = AdaScale(torch.optim.SGD(model.parameters(), lr=0.1), num_gradients_to_accumulate=2)
    train(model, opt, 8, 2)
    var, sqr = float(opt._state["grad_var_avg"][0]), float(opt._state["grad_sqr_avg"][0])
    for update in (True, False):
        opt.set_scale(4, update_estimate=update)
        assert float(opt._state["grad_var_avg"][0]) == var
        assert float(opt._state["grad_sqr_avg"][0]) == sqr
        assert opt.gain() == pytest.approx((var + sqr) / (var / 4 + sqr))
    opt.set_scale(2)
    assert opt.gain() == pytest.approx((var + sqr) / (var / 2 + sqr))
    with pytest.raises(ValueError, match="scale"):
        opt.set_scale(0.5)
    opt.set_num_gradients_to_accumulate(5)
    assert opt.num_gradients_to_accumulate == 5 and opt.smoothing == pytest.approx(0.995)
    opt.set_num_gradients_to_accumulate(3, update_smoothing=False)
    assert opt.smoothing == pytest.approx(0.995)
    with pytest.raises(RuntimeError, match="nothing to estimate"):
        opt.set_num_gradients_to_accumulate(1)
    opt.set_scale(3)
    train(model, opt, 3, 3)  # the loop follows the new count


def test_the_averages_do_not_depend_on_the_scale():
    # Why set_scale leaves the averages alone: at a fixed base batch, the variance average
    # converges to the same value at S = 2 (2 micro-batches) and S = 4 (4 micro-batches).
    # A frozen model (lr 0) makes the gradient distribution stationary.
    out = []
    for c in (2, 4):
        model = make_model()
        opt = AdaScale(
            torch.optim.SGD(model.parameters(), lr=0.0),
            num_gradients_to_accumulate=c,
            smoothing=0.98,
        )
        train(model, opt, 150, c, seed=3)
        out.append((float(opt._state["grad_var_avg"][0]), float(opt._state["grad_sqr_avg"][0])))
    (v2, s2), (v4, s4) = out
    assert v4 == pytest.approx(v2, rel=0.2) and s4 == pytest.approx(s2, rel=0.2)
    assert v4 / 2 != pytest.approx(v2, rel=0.2)  # what fairscale's rescale would assume


@pytest.mark.parametrize(
    "kwargs",
    [
        {"scale": "4"},
        {"scale": math.inf},
        {"scale": 0.5},
        {"world_size": 1.7},
        {"num_gradients_to_accumulate": None},
        {"num_gradients_to_accumulate": "3"},
        {"num_gradients_to_accumulate": 2.5},
        {"smoothing": "0.9"},
        {"smoothing": math.nan},
    ],
)
def test_bad_arguments_are_value_errors_naming_the_value(kwargs):
    args = {"num_gradients_to_accumulate": 2, **kwargs}
    name, value = next(iter(kwargs.items()))
    with pytest.raises(ValueError, match=f"{name}={value!r}".replace("(", r"\(")):
        AdaScale(torch.optim.SGD(make_model().parameters(), lr=0.1), **args)


def test_settings_changed_during_training_survive_save_load_replay():
    def run(mutate, seed_model=0):
        model = make_model(seed_model)
        opt = AdaScale(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            num_gradients_to_accumulate=2,
        )
        return model, opt

    model, opt = run(None)
    train(model, opt, 5, 2, seed=1)
    opt.set_num_gradients_to_accumulate(4)
    opt.set_scale(4)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buf)
    gains_a = train(model, opt, 6, 4, seed=2)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    model_b, opt_b = run(None, seed_model=7)  # built with the original settings
    model_b.load_state_dict(ckpt["model"])
    opt_b.load_state_dict(ckpt["optim"])
    assert (opt_b.scale, opt_b.num_gradients_to_accumulate) == (4.0, 4)
    assert opt_b.smoothing == opt.smoothing
    assert train(model_b, opt_b, 6, 4, seed=2) == gains_a
    for a, b in zip(model.parameters(), model_b.parameters()):
        assert torch.equal(a, b)
    # Saved at another world size (an elastic restart): the constructor's settings stay.
    other = copy.deepcopy(ckpt["optim"])
    other["state"]["adascale"]["world_size"] = torch.tensor(2)
    _, opt_c = run(None)
    opt_c.load_state_dict(other)
    assert (opt_c.scale, opt_c.num_gradients_to_accumulate) == (2.0, 2)
    # An inner optimizer that already carries the saved entry can be wrapped.
    inner = torch.optim.SGD(make_model().parameters(), lr=0.1, momentum=0.9)
    inner.load_state_dict(ckpt["optim"])
    assert AdaScale(inner, num_gradients_to_accumulate=2).scale == 2.0


class _FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("simulated out of memory")


def _failing_backward(model):
    """A backward pass that accumulates the last layer's gradients, then raises before the
    first layer's (as an out-of-memory error would)."""
    x, y = next(batches(50))
    out = model[2](model[1](_FailingBackward.apply(model[0](x))))
    with pytest.raises(RuntimeError, match="simulated"):
        F.cross_entropy(out, y).backward()


@pytest.mark.parametrize("zero_first", [True, False])
def test_a_backward_pass_that_raises_is_forgotten(zero_first):
    # The last layer's gradients are accumulated, then the backward raises before the first
    # layer's: autograd drops the queued end-of-backward callback. The optimizer must stay
    # usable, and a retried step equal a run that never failed.
    def before(s, model, opt):
        if s == 1:
            _failing_backward(model)
            if zero_first:
                opt.state_dict()  # usable at once

    g1, g2, m1, m2 = clean_and_custom(4, _backward, before=before)
    np.testing.assert_allclose(g1, g2, rtol=1e-12)
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(a, b)


def test_a_backward_pass_that_raises_then_a_backward_without_zeroing():
    # No zero_grad after the failure: the next backward pass notices the failed one and drops
    # its statistics; the two good passes make the step (whose .grad keeps what the failed
    # pass accumulated, as in plain torch).
    model = make_model()
    opt = AdaScale(torch.optim.SGD(model.parameters(), lr=0.1), num_gradients_to_accumulate=2)
    train(model, opt, 2, 2)
    _failing_backward(model)
    data = batches(3)
    for _ in range(2):
        _backward(model, next(data))
    assert not opt._in_backward
    opt.step()


def test_gradients_sharing_one_version_counter():
    # .grad tensors that are views of one flat buffer (as DDP's gradient_as_bucket_view)
    # share a version counter: one parameter's accumulation must not read as another's
    # zeroing. Same gains as ordinary gradients.
    flat = []

    def views(model):
        params = list(model.parameters())
        flat.append(torch.zeros(sum(p.numel() for p in params)))
        offset = 0
        for p in params:
            p.grad = flat[0][offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        return params

    g1, g2, _, m2 = clean_and_custom(
        5, _backward, zero=lambda o: o.zero_grad(set_to_none=False), params=views
    )
    np.testing.assert_allclose(g1, g2, rtol=1e-6)
    assert all(p.grad.data_ptr() >= flat[0].data_ptr() for p in m2.parameters())  # the views


def test_reentrant_checkpointing_counts_one_backward_pass():
    # A reentrant checkpoint runs a nested backward inside the outer one: not an aborted pass.
    from torch.utils.checkpoint import checkpoint

    def micro(model, batch):
        x = batch[0].clone().requires_grad_(True)  # reentrant checkpointing needs a grad input
        h = checkpoint(lambda t: model[1](model[0](t)), x, use_reentrant=True)
        (F.cross_entropy(model[2](h), batch[1]) / 2).backward()

    g1, g2, _, _ = clean_and_custom(4, micro)
    np.testing.assert_allclose(g1, g2, rtol=1e-6)


def test_add_param_group_and_per_group_gains():
    base = make_model()
    extra = torch.nn.Linear(10, 10)
    opt = AdaScale(torch.optim.SGD(base.parameters(), lr=0.1), num_gradients_to_accumulate=2)
    train(base, opt, 4, 2)
    opt.add_param_group({"params": extra.parameters(), "lr": 0.01})
    assert opt.gain(1) == 1.0 and opt._state["grad_sqr_avg"].numel() == 2
    data = batches(8)
    for _ in range(5):
        opt.zero_grad()
        for _ in range(2):
            x, y = next(data)
            (F.cross_entropy(extra(base(x)), y) / 2).backward()
        seen = [opt.gain(0), opt.gain(1)]
        before = params_of(extra)
        grads = [p.grad.clone() for p in extra.parameters()]
        opt.step()
        for p0, p1, gr in zip(before, extra.parameters(), grads):
            torch.testing.assert_close(p1.detach(), p0 - 0.01 * seen[1] * gr, rtol=1e-5, atol=1e-8)
    assert opt.gain(1) != 1.0 and 1.0 <= opt.gain() <= 2.0


def test_argument_names_of_fairscale_and_torch():
    """fairscale documents ``add_param_group(pg)`` and ``load_state_dict(data)``, torch names
    them ``param_group`` and ``state_dict``: each name works by keyword, and by position; none
    or both raise a ``TypeError``."""
    base = make_model()
    opt = AdaScale(torch.optim.SGD(base.parameters(), lr=0.1), num_gradients_to_accumulate=2)
    train(base, opt, 2, 2)
    for i, call in enumerate(
        [
            lambda g: opt.add_param_group(pg=g),
            lambda g: opt.add_param_group(param_group=g),
            lambda g: opt.add_param_group(g),
        ]
    ):
        call({"params": torch.nn.Linear(3, 3).parameters(), "lr": 0.01})
        assert len(opt.param_groups) == 2 + i and opt._state["grad_sqr_avg"].numel() == 2 + i
    saved = copy.deepcopy(opt.state_dict())
    for call in (
        lambda: opt.load_state_dict(data=saved),
        lambda: opt.load_state_dict(state_dict=saved),
        lambda: opt.load_state_dict(saved),
    ):
        opt.param_groups[0]["lr"] = 0.5
        call()
        assert opt.param_groups[0]["lr"] == 0.1
        torch.testing.assert_close(
            opt._state["grad_sqr_avg"], saved["state"]["adascale"]["grad_sqr_avg"]
        )
    with pytest.raises(TypeError, match="'pg' or 'param_group'"):
        opt.add_param_group()
    with pytest.raises(TypeError, match="'data' or 'state_dict'; got 2"):
        opt.load_state_dict(saved, state_dict=saved)


def test_closure_equals_explicit_loop():
    m1, m2 = make_model(), make_model()
    o1 = AdaScale(torch.optim.SGD(m1.parameters(), lr=0.1), num_gradients_to_accumulate=2)
    o2 = AdaScale(torch.optim.SGD(m2.parameters(), lr=0.1), num_gradients_to_accumulate=2)
    train(m1, o1, 8, 2)
    data = batches(1)
    for _ in range(8):
        micro = [next(data) for _ in range(2)]

        def closure(micro=micro):
            o2.zero_grad()
            total = 0.0
            for b in micro:
                loss = loss_of(m2, b) / 2
                loss.backward()
                total += loss.item()
            return total

        assert isinstance(o2.step(closure), float)
    assert o1.gain() == o2.gain()
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(a, b)


def test_unhook_stops_the_statistics():
    model = make_model()
    opt = AdaScale(torch.optim.SGD(model.parameters(), lr=0.1), num_gradients_to_accumulate=2)
    train(model, opt, 3, 2)
    g = opt.gain()
    opt.unhook()
    train(model, opt, 3, 2)
    assert opt.gain() == g


# --------------------------------------------------------------------------------------------
# Two gloo processes: both loop styles of the fairscale documentation, identical gains.


def _seed_loops(rank, world_size, max_epochs, steps):
    faulthandler.dump_traceback_later(220, exit=False)  # a hang shows where it is stuck
    torch.manual_seed(0)
    model = DDP(make_model())
    x, y = digits()
    x, y = x[rank::world_size], y[rank::world_size]  # each replica its own shard
    loader = [(x[i : i + 16], y[i : i + 16]) for i in range(0, 16 * 20, 16)]
    out = {}

    # Example 1: LambdaLR stepped by the epoch count of AdaScale's progress
    optim = AdaScale(torch.optim.SGD(model.parameters(), lr=0.05))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optim, lr_lambda=lambda e: 0.5**e)
    last_epoch, done, step, gains, lrs = 0, False, 0.0, [], []
    while not done:
        for batch in loader:
            optim.zero_grad()
            loss = loss_of(model, batch)
            loss.backward()
            step += optim.gain()
            gains.append(optim.gain())
            optim.step()
            epoch = step // len(loader)
            if epoch > last_epoch:
                scheduler.step()
                last_epoch = epoch
            lrs.append(optim.param_groups[0]["lr"])
            if epoch >= max_epochs:
                done = True
                break
    out["ex1"] = (gains, lrs, step)

    # Example 2: a custom update_lr(step)
    def update_lr(progress):
        for group in optim.param_groups:
            group["lr"] = 0.05 / (1.0 + progress / 50.0)

    optim = AdaScale(torch.optim.SGD(model.parameters(), lr=0.05))
    step, gains, lrs = 0.0, [], []
    while step < steps:
        for batch in loader:
            optim.zero_grad()
            loss_of(model, batch).backward()
            step += optim.gain()
            gains.append(optim.gain())
            optim.step()
            update_lr(step)
            lrs.append(optim.param_groups[0]["lr"])
            if step >= steps:
                break
    out["ex2"] = (gains, lrs, step)
    faulthandler.cancel_dump_traceback_later()
    return out


def test_seed_loop_styles_under_ddp_identical_gains_on_all_replicas():
    res = spawn(_seed_loops, 2, args=(3, 60.0), timeout=240)
    for key in ("ex1", "ex2"):
        assert res[0][key] == res[1][key]  # bit-identical gains, lrs and progress
    gains, lrs, step = res[0]["ex1"]
    assert step // 20 >= 3 and all(1.0 <= g <= 2.0 for g in gains) and max(gains) > 1.0
    assert lrs[-1] == pytest.approx(0.05 * 0.5**3)  # three scheduled epochs of progress
    assert len(gains) < 3 * 20  # progress > 1 base step per step: fewer steps than 3 epochs
    gains, lrs, step = res[0]["ex2"]
    assert step >= 60.0 and lrs[-1] == pytest.approx(0.05 / (1 + step / 50))


def _bucket_views(rank, world_size):
    out = {}
    for views in (False, True):
        torch.manual_seed(0)
        model = DDP(make_model(), gradient_as_bucket_view=views)
        opt = AdaScale(torch.optim.SGD(model.parameters(), lr=0.1), num_gradients_to_accumulate=2)
        data, gains = batches(10 + rank), []
        for _ in range(3):
            opt.zero_grad()
            for _ in range(2):  # every micro-batch synchronised (no no_sync)
                (loss_of(model, next(data)) / 2).backward()
            gains.append(opt.gain())
            opt.step()
        out[views] = gains
    return out


def test_ddp_gradient_as_bucket_view_accumulates():
    # DDP's first bucket rebuild puts every .grad into a bucket view (a new tensor, same
    # values) and the views share a version counter: neither reads as zeroing.
    res = spawn(_bucket_views, 2, timeout=120)
    for r in res:
        np.testing.assert_allclose(r[True], r[False], rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_squared_norms_through_the_reused_buffer_are_bitwise_pow_sum(dtype):
    from adaptrain.optim.adascale import _SCRATCH_MAX, _SCRATCH_MIN

    opt = AdaScale(
        torch.optim.SGD(make_model().parameters(), lr=0.1), num_gradients_to_accumulate=2
    )
    g = torch.Generator().manual_seed(0)
    results = []
    for n in (_SCRATCH_MIN - 1, _SCRATCH_MIN, 50_000, 3 * 2**17, _SCRATCH_MAX + 1):
        grad = torch.randn(n, generator=g, dtype=dtype) * 1e-3 + 1e-4
        views = [grad]
        if n % 512 == 0:
            views += [grad.view(-1, 512), grad.view(-1, 512).t()]  # 2-D, non-contiguous
        for v in views:
            got = opt._sqr(v)
            assert got.dtype == dtype and got.shape == ()
            assert torch.equal(got, v.pow(2).sum()), (n, v.shape)
            results.append((got, got.clone()))
    assert opt._scratch, "the buffer path was not taken"
    for got, copy_ in results:  # later calls reuse the buffer, not the results
        assert torch.equal(got, copy_)


@pytest.mark.parametrize("debias", [True, False])
def test_state_edited_in_place_or_replaced_is_what_gain_and_step_read(debias):
    """The averages are read through a cache of the state tensors; an edit must be seen."""

    def make():
        model = make_model()
        opt = AdaScale(
            torch.optim.SGD(model.parameters(), lr=0.1),
            num_gradients_to_accumulate=2,
            debias_ewma=debias,
        )
        train(model, opt, 3, 2)
        opt.gain()  # read (and cache) the state before it is edited
        return model, opt

    (m_in, in_place), (m_new, replaced), (m_ref, ref) = make(), make(), make()
    sqr = float(ref._state["grad_sqr_avg"][0])
    edits = {"grad_var_avg": 3.0 * sqr}
    edits.update(
        {"grad_sqr_avg_biased": 0.5, "grad_var_avg_unbias": 0.25}
        if debias
        else {"grad_sqr_avg_total": 0.5, "grad_var_avg_total": 0.25}
    )
    for key, value in edits.items():
        in_place.state["adascale"][key].fill_(value)
        replaced.state["adascale"][key] = torch.tensor([value], dtype=torch.float64)
    expected = (3 * sqr + sqr) / (3 * sqr / 2 + sqr)  # S = 2
    assert in_place.gain() == replaced.gain() == pytest.approx(expected, rel=1e-12)
    assert ref.gain() != pytest.approx(expected, rel=1e-3)
    # the next step's averages start from the edited state
    gains = [train(m, o, 2, 2, seed=4) for m, o in ((m_in, in_place), (m_new, replaced))]
    assert gains[0] == gains[1] != train(m_ref, ref, 2, 2, seed=4)
    for key, value in in_place._state.items():
        torch.testing.assert_close(value, replaced._state[key], rtol=0, atol=0, msg=key)


@pytest.mark.parametrize("debias", [True, False])
def test_non_finite_gradients_in_one_group_leave_every_group_unchanged(debias):
    """A non-finite sample in one group leaves the averages of every group as they were (the
    averages are updated as one vector; the arithmetic is per group)."""
    model = make_model()
    inner = torch.optim.SGD(
        [{"params": model[0].parameters()}, {"params": model[2].parameters()}], lr=0.0
    )
    opt = AdaScale(inner, num_gradients_to_accumulate=2, debias_ewma=debias)
    train(model, opt, 4, 2)
    state = {k: v.clone() for k, v in opt._state.items()}
    gains = [opt.gain(), opt.gain(0), opt.gain(1)]
    opt.zero_grad()
    data = batches(9)
    for _ in range(2):
        # NaN gradients for model[0].bias (group 0) only
        (loss_of(model, next(data)) / 2 + model[0].bias.sum() * math.nan).backward()
    assert math.isnan(float(model[0].bias.grad.pow(2).sum()))
    assert all(math.isfinite(float(p.grad.pow(2).sum())) for p in model[2].parameters())
    opt.step()
    assert [opt.gain(), opt.gain(0), opt.gain(1)] == gains
    for k, v in opt._state.items():
        torch.testing.assert_close(v, state[k], msg=k)
