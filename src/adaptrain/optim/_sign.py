"""SignSGD (Bernstein et al., 2018), API-compatible with mlbench-core's ``SignSGD``, plus the
majority-vote form (Bernstein et al., 2019) and error feedback (EF-SignSGD, Karimireddy et
al., 2019) as options.

Per parameter, with ``d = grad + weight_decay·p`` and SGD momentum ``b ← μ b + (1−τ) d``
(``u = b``, or ``d + μ b`` with Nesterov; ``u = d`` without momentum):

* default (mlbench behaviour, no communication): ``p ← p − lr · sign(u)``;
* ``majority_vote=True``: ``p ← p − lr · sign(Σ_workers sign(u))`` (1 bit/coordinate sent);
* ``error_feedback=True``: ``q = lr·u + e``, ``c = (‖q‖₁/dim)·sign(q)``, ``e ← q − c``,
  ``p ← p − mean_workers(c)``.

With ``momentum=0`` the error-feedback form is exactly Algorithm 1 (EF-SIGNSGD) of Karimireddy
et al.; with momentum, the momentum buffer is compressed (as in the authors' reference code).
Each worker keeps its own residual ``e``; error feedback sends 1 bit per coordinate
(``sign(0)`` as ``+1``, which the residual corrects on later steps), majority vote 2 bits (the
ternary sign, so an exactly-zero coordinate casts no vote). A parameter without a gradient on
this worker casts no vote and gets neither weight decay nor a momentum update (as in
``torch.optim.SGD``, which skips it); with error feedback it sends a zero scale and keeps its
residual for its next gradient, so a parameter without a gradient on any worker does not move.
It joins the collective all the same, so the workers need not agree on which parameters have
gradients. On sklearn digits (``benchmarks/bench_convergence.py``)
the momentum-free form tracks momentum SGD within 0.01 nats from 8 epochs on, while momentum
0.9 needs about twice the steps (see ``benchmarks/results/compression.md``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim import SGD
from torch.optim.optimizer import required

from adaptrain.core.compress import SignState, sign_update
from adaptrain.dist.hooks import default_communicator

__all__ = ["SignSGD"]


class SignSGD(SGD):
    """Sign stochastic gradient descent (optionally momentum, majority vote, error feedback)."""

    def __init__(
        self,
        params,
        lr=required,
        momentum=0,
        weight_decay=0,
        dampening=0,
        nesterov=False,
        *,
        majority_vote: bool = False,
        error_feedback: bool = False,
        process_group: Any = None,
    ) -> None:
        if majority_vote and error_feedback:
            raise ValueError(
                "majority_vote=True and error_feedback=True are alternatives: pick one"
            )
        super().__init__(
            params,
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
        )
        self.majority_vote = majority_vote
        self.error_feedback = error_feedback
        self.process_group = process_group

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        """Performs a single optimization step; returns the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        comm = None
        if self.majority_vote or self.error_feedback:
            comm = default_communicator(self.process_group)
        for group in self.param_groups:
            wd, mom = group["weight_decay"], group["momentum"]
            damp, nest, lr = group["dampening"], group["nesterov"], group["lr"]
            for p in group["params"]:
                if p.grad is None:
                    if comm is None:
                        continue
                    d = torch.zeros_like(p)  # no vote, but every worker joins the collective
                else:
                    d = p.grad
                    if wd != 0:
                        d = d.add(p, alpha=wd)
                if mom != 0 and p.grad is not None:
                    st = self.state[p]
                    if "momentum_buffer" not in st:
                        buf = st["momentum_buffer"] = d.clone()
                    else:
                        buf = st["momentum_buffer"]
                        buf.mul_(mom).add_(d, alpha=1 - damp)
                    d = d.add(buf, alpha=mom) if nest else buf
                if comm is None:
                    p.add_(torch.sign(d), alpha=-lr)
                elif self.majority_vote:
                    res, _ = sign_update(d, SignState(torch.zeros_like(d)), comm, majority=True)
                    p.add_(res.update, alpha=-lr)
                elif p.grad is None:
                    # no vote: a zero scale, the residual kept for the next gradient (sending
                    # q = e would move a parameter that has no gradient on any worker)
                    zero = SignState(torch.zeros_like(d))
                    res, _ = sign_update(d, zero, comm, error_feedback=True)
                    p.sub_(res.update)  # the other workers' votes
                else:
                    st = self.state[p]
                    mem = st.get("ef_memory")
                    if mem is None:
                        mem = torch.zeros_like(p)
                    res, new = sign_update(d * lr, SignState(mem), comm, error_feedback=True)
                    st["ef_memory"] = new.memory
                    p.sub_(res.update)
        return loss
