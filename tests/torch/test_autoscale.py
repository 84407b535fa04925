"""AdaptiveDataParallel driven by the AdaptiveDataLoader: accumulation, scale, metrics feed."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from adaptrain.dist.spawn import spawn

TIMEOUT = 180


def _dataset(n: int = 512):
    from sklearn.datasets import load_digits

    X, y = load_digits(return_X_y=True)
    X = torch.tensor(X[:n] / 16.0, dtype=torch.float32)
    return torch.utils.data.TensorDataset(X, torch.tensor(y[:n]))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 10))


def _loader_accumulation(rank, ws):
    from adaptrain.torch import _metrics
    from adaptrain.torch.data import AdaptiveDataLoader, current_dataloader
    from adaptrain.torch.parallel import AdaptiveDataParallel

    m_adp, m_ref = _model(), _model()
    opt = torch.optim.SGD(m_adp.parameters(), lr=0.1, momentum=0.9)
    adp = AdaptiveDataParallel(m_adp, opt)
    loader = AdaptiveDataLoader(_dataset(), batch_size=64, shuffle=True)
    # 64 global on 2 replicas with at most 16 per micro-batch: 2 micro-batches of 16 per step.
    loader.autoscale_batch_size(64, local_bsz_bounds=(None, 16), gradient_accumulation=True)
    seen, scales, lrs = [], [], []
    for x, y in loader:
        helper = current_dataloader()
        seen.append((x, y, helper.is_optim_step(), helper.accumulation_steps))
        opt.zero_grad()  # AdaptDL's loop: every call on every micro-batch
        F.cross_entropy(adp(x), y).backward()
        opt.step()
        scales.append(adp._step_scale())
        lrs.append(opt.param_groups[0]["lr"])
    adp.gns.flush()
    # Reference: plain DDP, mean of the micro-batch gradients, stepping once per group.
    ddp = DistributedDataParallel(m_ref)
    opt_ref = torch.optim.SGD(m_ref.parameters(), lr=0.1, momentum=0.9)
    group = []
    for x, y, optim_step, _accum in seen:
        group.append((x, y))
        if not optim_step:
            continue
        opt_ref.zero_grad()
        for k, (xb, yb) in enumerate(group):
            loss = F.cross_entropy(ddp(xb), yb) / len(group)
            if k < len(group) - 1:
                with ddp.no_sync():
                    loss.backward()
            else:
                loss.backward()
        opt_ref.step()
        group = []
    params = [p.detach().numpy().copy() for p in m_adp.parameters()]
    ref = [p.detach().numpy().copy() for p in m_ref.parameters()]
    flags = [(s[2], s[3], len(s[1])) for s in seen]
    profiled = sum(v["optim_count"] for v in _metrics._state().profile.values())
    return params, ref, flags, adp.gns.num_updates, scales, lrs, _metrics.get_progress(), profiled


def test_loader_driven_accumulation_matches_ddp_mean_gradient():
    for params, ref, flags, updates, scales, lrs, progress, profiled in spawn(
        _loader_accumulation, 2, timeout=TIMEOUT
    ):
        assert flags[:4] == [(False, 2, 16), (True, 2, 16), (False, 2, 16), (True, 2, 16)]
        optim_steps = sum(f[0] for f in flags)
        assert optim_steps == 512 // 64 and updates == optim_steps
        assert set(scales) == {1.0} and set(lrs) == {0.1}
        assert progress == float(optim_steps)  # gain 1 per step at scale 1
        assert profiled >= optim_steps - 1  # the loader timed the optimizer steps for _metrics
        for a, b in zip(params, ref):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
