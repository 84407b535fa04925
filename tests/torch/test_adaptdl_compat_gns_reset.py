"""GradientNoiseScale.reset_accumulation resets "accumulation calculations and gradients" (the
AdaptDL API's words): a step with non-finite gradients is discarded, not accumulated into the
next ones."""

from __future__ import annotations

import math
import random

import numpy as np
import torch

from adaptrain.dist.spawn import spawn
from adaptrain.torch.gradient_noise_scale import GradientNoiseScale


def test_reset_discards_a_nan_step_with_an_optimizer():
    """AdaptDL's own test: SGD on (x − target)², the target NaN on about half the steps (whose
    update is skipped); resetting before each step keeps the NaN gradients out."""
    rng = random.Random(0)
    param = torch.tensor([1.0], requires_grad=True)
    sgd = torch.optim.SGD([param], lr=0.1)
    gns = GradientNoiseScale(None, sgd, accum_scale=1.0, num_replicas=1)
    for _ in range(100):
        gns.reset_accumulation()
        assert param.grad is None or not param.grad.any()
        target = float("nan") if rng.random() > 0.5 else 4.0
        loss = (param - target) ** 2
        loss.backward()
        gns.count_micro_batch()
        if np.all(np.isfinite(loss.detach().numpy())):
            sgd.step()
        if param.allclose(torch.tensor([4.0]), atol=0.01):
            break
    else:
        raise AssertionError(f"did not converge: {param}")
    assert gns.accum_count == 1
    gns.reset_accumulation()
    assert gns.accum_count == 0 and gns.should_zero_grad
    assert math.isfinite(gns.sqr_avg()) and math.isfinite(gns.var_avg())


def _registered_without_optimizer(rank: int, world_size: int) -> tuple:
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    ddp = DistributedDataParallel(torch.nn.Linear(4, 2))
    gns = GradientNoiseScale(num_replicas=1, max_interval=1)
    gns.register(ddp)
    x = torch.randn(8, 4)

    def backward(factor: float) -> None:
        gns.count_micro_batch()
        gns.begin_step(scale=1.0)
        (ddp(x).pow(2).sum() * factor).backward()

    backward(float("nan"))  # a step whose gradients are NaN: discarded
    nan_grads = all(torch.isnan(p.grad).all() for p in ddp.parameters())
    gns.reset_accumulation()
    cleared = all(p.grad is None for p in ddp.parameters()) and gns.accum_count == 0
    for factor in (1.0, 2.0):  # two good steps: one replica pairs consecutive steps
        backward(factor)
        gns.finish_step(1.0)
        for p in ddp.parameters():
            p.grad = None
    folded = gns.flush()
    return nan_grads, cleared, folded, gns.sqr_avg(), gns.var_avg()


def test_reset_discards_a_nan_step_of_a_registered_model():
    nan_grads, cleared, folded, sqr, var = spawn(_registered_without_optimizer, 1, timeout=120)[0]
    assert nan_grads and cleared
    assert folded and math.isfinite(sqr) and math.isfinite(var) and sqr > 0
