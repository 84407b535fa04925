"""Scaling rules: golden factors, default choice, bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from adaptrain.torch.gradient_noise_scale import GradientNoiseScale
from adaptrain.torch.scaling_rules import (
    AdamScale,
    AdaScale,
    LEGWScale,
    LinearScale,
    ScalingRuleBase,
    SqrtScale,
    default_scaling_rule,
)


class _Owner:
    """The two things a rule reads from its AdaptiveDataParallel: the GNS and B0."""

    def __init__(self, sqr: float, var: float, progress: float = 0.0, init_bsz: int = 100):
        self.gns = GradientNoiseScale(num_replicas=2)
        state = self.gns.state_dict()
        state.update(sqr=(sqr, 1.0, 1), var=(var, 1.0, 1), progress=progress)
        self.gns.load_state_dict(state)
        self._bsz = init_bsz

    def _init_batch_size(self):
        return self._bsz


def _bind(rule: ScalingRuleBase, owner: _Owner) -> ScalingRuleBase:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    rule.initialize(owner, opt)
    return rule


@pytest.mark.parametrize(
    "rule, scale, expected",
    [
        (AdaScale(), 4.0, (4.0 + 1.0) / (4.0 / 4.0 + 1.0)),  # 2.5
        (AdaScale(), 1.0, 1.0),
        (AdamScale(), 4.0, math.sqrt(2.5)),
        (LinearScale(), 4.0, 4.0),
        (SqrtScale(), 9.0, 3.0),
    ],
)
def test_golden_factors(rule, scale, expected):
    assert _bind(rule, _Owner(sqr=1.0, var=4.0)).scale_lr(scale) == pytest.approx(expected, 1e-12)


def test_adamscale_power_as_in_adaptdl():
    # AdaptDL's AdamScale.scale_lr(scale, power=0.5): r ** power, r the AdaScale gain (2.5 here)
    rule = _bind(AdamScale(), _Owner(sqr=1.0, var=4.0))
    assert rule.scale_lr(4.0, power=0.5) == rule.scale_lr(4.0)
    assert rule.scale_lr(4.0, power=1.0) == pytest.approx(2.5, 1e-12)
    assert rule.scale_lr(4.0, power=0.25) == pytest.approx(2.5**0.25, 1e-12)
    assert rule.scale_lr(4.0, power=0.0) == 1.0
    for bad in (-0.5, math.nan, math.inf):
        with pytest.raises(ValueError, match="power="):
            rule.scale_lr(4.0, power=bad)


def test_adascale_is_linear_when_noise_dominates_and_one_without_noise():
    assert _bind(AdaScale(), _Owner(sqr=0.0, var=1.0)).scale_lr(8.0) == pytest.approx(8.0)
    assert _bind(AdaScale(), _Owner(sqr=1.0, var=0.0)).scale_lr(8.0) == pytest.approx(1.0)


def test_legw_warms_up_in_progress_then_plateaus():
    # data 1000, B0 100 -> 10 steps/epoch; 2 warm-up epochs at scale 4 -> 80 progress steps.
    def factor(progress):
        return _bind(LEGWScale(2, 1000), _Owner(1.0, 1.0, progress=progress)).scale_lr(4.0)

    assert factor(0.0) == 0.0
    assert factor(20.0) == pytest.approx(2.0 * 20 / 80)
    assert factor(80.0) == pytest.approx(2.0)
    assert factor(500.0) == pytest.approx(2.0)


def test_default_rule_by_optimizer():
    p = [torch.nn.Parameter(torch.zeros(1))]
    assert type(default_scaling_rule(torch.optim.SGD(p, lr=0.1))) is AdaScale
    for cls in (torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop):
        assert type(default_scaling_rule(cls(p, lr=0.1))) is AdamScale


def test_bad_input():
    with pytest.raises(ValueError, match="not set"):
        AdaScale().step()
    with pytest.raises(ValueError, match="base_warmup_epochs"):
        LEGWScale(-1, 100)
    with pytest.raises(ValueError, match="data_size"):
        LEGWScale(1, 0)
    with pytest.raises(ValueError, match="base_warmup_epochs=nan"):
        LEGWScale(math.nan, 100)
    with pytest.raises(ValueError, match="data_size=nan"):
        LEGWScale(1, math.nan)
    with pytest.raises(ValueError, match="scale"):
        _bind(LinearScale(), _Owner(1.0, 1.0)).scale_lr(0.0)
    rule = _bind(AdaScale(), _Owner(1.0, 1.0))
    with pytest.raises(NotImplementedError):
        ScalingRuleBase().scale_lr(2.0)
    assert rule.adp is not None


class _Stepper(_Owner):
    """Adds what the step hooks call on their AdaptiveDataParallel."""

    def __init__(self, scale: float, **kw):
        super().__init__(sqr=1.0, var=4.0, **kw)
        self.scale, self.sync, self.ended = scale, True, []

    def _begin_optimizer_step(self):
        return self.sync

    def _step_scale(self):
        return self.scale

    def _end_optimizer_step(self, scale, factor):
        self.ended.append((scale, factor))


def _hooked(scale: float):
    owner = _Stepper(scale)
    p = torch.nn.Parameter(torch.zeros(1))
    p.grad = torch.ones(1)
    opt = torch.optim.SGD([p], lr=0.1)
    AdaScale().initialize(owner, opt, patch_optimizer=True)
    seen = []

    def closure():  # runs inside step(), after the pre-hook
        seen.append(opt.param_groups[0]["lr"])

    return owner, opt, seen, closure


def test_step_hooks_scale_then_restore_the_lr():
    owner, opt, seen, closure = _hooked(4.0)
    opt.step(closure)
    assert seen == [pytest.approx(0.25)] and opt.param_groups[0]["lr"] == 0.1  # 0.1 x 2.5
    assert owner.ended == [(4.0, pytest.approx(2.5))]
    owner.sync = False  # an accumulation micro-batch: no scaling, no end-of-step
    opt.step(closure)
    assert seen[-1] == 0.1 and len(owner.ended) == 1
    owner2, opt2, seen2, closure2 = _hooked(1.0)  # factor 1: lr untouched, step still ends
    opt2.step(closure2)
    assert seen2 == [0.1] and owner2.ended == [(1.0, 1.0)]


class _PerGroup(ScalingRuleBase):
    """A user's rule with one factor per param group (AdaptDL's rules may return an array)."""

    def scale_lr(self, scale: float):
        return np.array([scale, 1.0, 0.5])


def test_a_rule_may_scale_each_param_group_by_its_own_factor():
    owner = _Stepper(4.0)
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in range(3)]
    for q in params:
        q.grad = torch.ones(1)
    opt = torch.optim.SGD([{"params": [q], "lr": lr} for q, lr in zip(params, (0.1, 0.2, 0.4))])
    _PerGroup().initialize(owner, opt, patch_optimizer=True)
    seen = []
    opt.step(lambda: seen.append([g["lr"] for g in opt.param_groups]))
    assert seen == [[pytest.approx(0.4), 0.2, 0.2]]  # 0.1 x 4, 0.2 x 1, 0.4 x 0.5
    assert [q.item() for q in params] == pytest.approx([-0.4, -0.2, -0.2])  # float32 steps
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.2, 0.4]  # restored after the step
    assert owner.ended == [(4.0, pytest.approx((4.0 + 1.0 + 0.5) / 3))]  # the mean factor


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_a_step_that_raises_does_not_leave_the_lr_scaled():
    owner, opt, seen, closure = _hooked(4.0)

    def failing():
        closure()
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        opt.step(failing)  # torch skips the post-hook; the guarded closure restored the lr
    assert opt.param_groups[0]["lr"] == 0.1 and owner.ended == []
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)
    sched.step()  # a scheduler stepped after the failure decays the unscaled lr
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
    opt.step(closure=closure)  # keyword closure, scaled again from the decayed value
    assert seen == [pytest.approx(0.25), pytest.approx(0.125)]
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05) and len(owner.ended) == 1


class _FailingSGD(torch.optim.SGD):
    """An optimizer whose own update raises (no closure involved)."""

    @torch.no_grad()
    def step(self, closure=None):
        self.seen = self.param_groups[0]["lr"]
        raise FloatingPointError("update failed")


def test_state_dict_and_restore_lr_after_an_update_that_raised():
    owner = _Stepper(4.0)
    p = torch.nn.Parameter(torch.zeros(1))
    p.grad = torch.ones(1)
    opt = _FailingSGD([p], lr=0.1)
    rule = AdaScale()
    rule.initialize(owner, opt, patch_optimizer=True)
    with pytest.raises(FloatingPointError):
        opt.step()
    assert opt.seen == pytest.approx(0.25)
    # A checkpoint taken now sees the unscaled lr; restore_lr puts it back in the groups.
    assert opt.state_dict()["param_groups"][0]["lr"] == 0.1
    rule.restore_lr()
    assert opt.param_groups[0]["lr"] == 0.1
    with pytest.raises(FloatingPointError):
        rule.step()  # AdaptDL's explicit form restores at once
    assert opt.param_groups[0]["lr"] == 0.1 and owner.ended == []


def test_detaching_after_an_update_that_raised_restores_the_lr():
    # A step that raised leaves the lr scaled until this rule restores it; a rule detached
    # in between (replaced by a new AdaptiveDataParallel's) never would, and the new rule
    # would take the scaled value as the base lr.
    owner = _Stepper(4.0)
    p = torch.nn.Parameter(torch.zeros(1))
    p.grad = torch.ones(1)
    opt = _FailingSGD([p], lr=0.1)
    AdaScale().initialize(owner, opt, patch_optimizer=True)
    with pytest.raises(FloatingPointError):
        opt.step()
    second = AdaScale()
    with pytest.warns(UserWarning, match="detached"):
        second.initialize(_Stepper(4.0), opt, patch_optimizer=True)
    assert opt.param_groups[0]["lr"] == 0.1
    with pytest.raises(FloatingPointError):
        opt.step()
    assert opt.seen == pytest.approx(0.25)  # 0.1 x 2.5, not 0.25 x 2.5


def test_a_second_rule_on_the_same_optimizer_replaces_the_first():
    owner, opt, seen, closure = _hooked(4.0)
    first = next(iter(opt._optimizer_step_pre_hooks.values())).__self__
    owner2 = _Stepper(4.0)
    second = AdaScale()
    with pytest.warns(UserWarning, match="detached"):
        second.initialize(owner2, opt, patch_optimizer=True)
    assert first._handles == [] and len(opt._optimizer_step_pre_hooks) == 1
    opt.step(closure)
    assert seen == [pytest.approx(0.25)]  # scaled once, not twice
    assert owner.ended == [] and len(owner2.ended) == 1


def test_a_closure_step_takes_the_scale_of_its_own_forward():
    # LBFGS-style: the closure runs the step's forward after the pre-step hook, and the
    # optimizer reads the lr before calling it. The hook asks the owner to refresh the step's
    # scale from the loader first, instead of using the previous forward's.
    class _Refreshing(_Stepper):
        def _refresh_step_scale(self):
            self.scale = self.loader_scale

    owner = _Refreshing(1.0)  # the previous forward ran at scale 1
    owner.loader_scale = 2.0  # the loader's batch size has doubled since
    p = torch.nn.Parameter(torch.zeros(1))
    p.grad = torch.ones(1)
    opt = torch.optim.SGD([p], lr=0.1)
    LinearScale().initialize(owner, opt, patch_optimizer=True)
    seen = []
    opt.step(lambda: seen.append(opt.param_groups[0]["lr"]))
    assert seen == [pytest.approx(0.2)] and owner.ended == [(2.0, 2.0)]
    assert opt.param_groups[0]["lr"] == 0.1
    opt.step()  # no closure: the forward already ran, nothing refreshed
    assert owner.ended[-1] == (2.0, 2.0)
