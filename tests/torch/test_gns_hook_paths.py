"""The noise-scale hook's fast paths on 2-process gloo groups: carrying bucket, deferred norm."""

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


def _accum_scaling(rank, ws, steps, flush_every):
    from sklearn.datasets import load_digits

    from adaptrain.torch.gradient_noise_scale import GradientNoiseScale

    torch.set_num_threads(1)
    X, y = load_digits(return_X_y=True)
    X, y = torch.tensor(X / 16.0, dtype=torch.float32), torch.tensor(y)
    g = torch.Generator().manual_seed(3)
    runs = {}
    for accum in (1, 2):  # the hook divides by R·accum: statistics scale by 1/accum²
        ddp = DistributedDataParallel(_model(), bucket_cap_mb=0.1)
        gns = GradientNoiseScale(num_replicas=ws)
        gns.register(ddp)
        g.manual_seed(3)
        for t in range(steps):
            idx = torch.randint(0, len(y), (ws, 16), generator=g)[rank]
            ddp.zero_grad()
            gns.begin_step(accum_steps=accum)
            F.cross_entropy(ddp(X[idx]), y[idx]).backward()  # lr 0: weights never change
            buckets = gns._hook_state.num_buckets_seen
            gns.finish_step(1.0)
            if flush_every and t % flush_every == 0:
                gns.flush()  # fold now: the carried norm of this step is reduced explicitly
        gns.flush()
        runs[accum] = (gns.raw_sqr_avg[0], gns.raw_var_avg[0], gns.num_updates)
    hs = gns._hook_state
    return runs, sum(idx == hs.carry_idx for idx, _ in hs.send), buckets


def test_statistics_scale_with_accumulation_divisor_across_buckets():
    out = spawn(_accum_scaling, 2, args=(6, 0), timeout=TIMEOUT)
    for runs, n_send, buckets in out:
        (s1, v1, n1), (s2, v2, n2) = runs[1], runs[2]
        assert n1 == n2 == 6
        assert buckets >= 2  # carrying and non-carrying buckets both ran
        assert n_send == 2  # the carrying bucket's send buffers, used in turn
        assert math.isclose(s2, s1 / 4, rel_tol=1e-5) and math.isclose(v2, v1 / 4, rel_tol=1e-5)
        assert v1 > 0
    assert out[0][0] == out[1][0]  # identical on every replica


def test_flushing_every_step_gives_the_same_statistics():
    # flush() takes the deferred norm and reduces the carry itself; the steady path takes them
    # in the next step's hook: both must fold the same samples.
    steady = spawn(_accum_scaling, 2, args=(5, 0), timeout=TIMEOUT)
    flushed = spawn(_accum_scaling, 2, args=(5, 1), timeout=TIMEOUT)
    for (a, _, _), (b, _, _) in zip(steady, flushed):
        for k in (1, 2):
            assert a[k][2] == b[k][2] == 5
            assert math.isclose(a[k][0], b[k][0], rel_tol=1e-6)
            assert math.isclose(a[k][1], b[k][1], rel_tol=1e-6)
