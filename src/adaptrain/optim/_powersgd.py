"""PowerSGD optimizer (Vogels et al., 2019), API-compatible with mlbench-core's ``PowerSGD``.

Each step: gradients ``G`` are compressed by :func:`adaptrain.core.compress.powersgd_update`
(rank-``r`` power iteration with error feedback, optional warm start), the decompressed mean
replaces ``p.grad``, then plain SGD (momentum, weight decay, Nesterov) applies it. Error memory
and queries live in ``self.state[p]`` and round-trip through ``state_dict()``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.optim import SGD
from torch.optim.optimizer import required

from adaptrain.core.compress import PowerSGDState, powersgd_init, powersgd_update
from adaptrain.dist.hooks import default_communicator
from adaptrain.optim._centralized import call_tracker, group_world_size

logger = logging.getLogger(__name__)

__all__ = ["PowerSGD"]


class PowerSGD(SGD):
    """SGD on PowerSGD-compressed, all-reduced gradients.

    Args:
        model: module whose parameters are optimized.
        lr, momentum, weight_decay, dampening, nesterov: as :class:`torch.optim.SGD`.
        average_world: use the mean of the workers' gradients (``False``: their sum).
        use_cuda: kept for compatibility; tensors stay on the parameters' device.
        by_layer: compress and communicate each parameter separately (default: all at once).
        reuse_query: warm start: reuse the previous step's ``Q`` as the power-iteration query.
        world_size: number of workers (checked against the process group).
        rank: rank ``r`` of the low-rank approximation (≥ 1).
        error_feedback: keep and re-inject what the approximation dropped (keyword extension).
        seed: query-generator seed, equal on all workers (keyword extension).
        process_group: ``torch.distributed`` group (keyword extension).
    """

    def __init__(
        self,
        model=None,
        lr=required,
        momentum=0,
        weight_decay=0,
        dampening=0,
        nesterov=False,
        average_world=True,
        use_cuda=False,
        by_layer=False,
        reuse_query=False,
        world_size=1,
        rank=1,
        *,
        error_feedback: bool = True,
        seed: int = 0,
        process_group: Any = None,
    ) -> None:
        if model is None:
            raise ValueError("model=None: pass the nn.Module to optimize")
        if int(rank) < 1:
            raise ValueError(f"rank={rank} must be a positive integer (the approximation rank)")
        super().__init__(
            model.parameters(),
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
        )
        self.model = model
        self.average_world = average_world
        self.by_layer = by_layer
        self.reuse_query = reuse_query
        self.rank = int(rank)
        self.error_feedback = error_feedback
        self.seed = int(seed)
        self.process_group = process_group
        if world_size != 1:
            group_world_size(world_size, process_group)
        self.sent_bytes = 0
        self.dense_bytes = 0

    def _params(self) -> list[torch.nn.Parameter]:
        return [p for g in self.param_groups for p in g["params"] if p.requires_grad]

    def _compress(self, params: list[torch.nn.Parameter], first_index: int, comm) -> None:
        grads = [p.grad for p in params]
        sts = [self.state[p] for p in params]
        if any("powersgd_memory" not in s for s in sts):
            st = powersgd_init(
                [g.shape for g in grads],
                self.rank,
                self.seed + first_index,
                grads[0].dtype,
                grads[0].device,
            )
        else:
            st = PowerSGDState(
                tuple(s["powersgd_memory"] for s in sts),
                tuple(s["powersgd_q"] for s in sts),
                int(sts[0]["powersgd_step"]),
                self.seed + first_index,
                self.rank,
            )
        res, st = powersgd_update(
            grads, st, comm, reuse_query=self.reuse_query, error_feedback=self.error_feedback
        )
        scale = 1.0 if self.average_world else float(comm.world_size)
        for p, s, g, mem, q in zip(params, sts, res.grads, st.memories, st.qs):
            p.grad.copy_(g.mul_(scale) if scale != 1.0 else g)
            s["powersgd_memory"] = mem
            s["powersgd_q"] = q
            s["powersgd_step"] = st.step
        self.sent_bytes += res.sent_bytes
        self.dense_bytes += res.dense_bytes

    @torch.no_grad()
    def aggregate(self) -> None:
        """Replace every gradient by the PowerSGD-compressed mean over the workers."""
        params = self._params()
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        comm = default_communicator(self.process_group)
        if self.by_layer:
            for i, p in enumerate(params):
                self._compress([p], i, comm)
        elif params:
            self._compress(params, 0, comm)

    def step(self, closure=None, tracker=None):  # type: ignore[override]
        """Evaluate ``closure`` (if any), aggregate compressed gradients, then take an SGD step."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.aggregate()
        call_tracker(tracker, "record_batch_agg")
        super().step()
        call_tracker(tracker, "record_batch_opt_step")
        return loss
