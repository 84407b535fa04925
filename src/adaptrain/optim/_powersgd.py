"""PowerSGD optimizer (Vogels et al., 2019, arXiv:1905.13727), API-compatible with mlbench-core's
``PowerSGD``.

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


def _copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``d.copy_(s)`` for each pair, in one call where torch has ``_foreach_copy_``."""
    if hasattr(torch, "_foreach_copy_"):
        torch._foreach_copy_(dst, src)
    else:  # torch < 2.1
        for d, s in zip(dst, src):
            d.copy_(s)


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

    def _state(
        self, params: list[torch.nn.Parameter], indices: list[int], seed: int, scope
    ) -> PowerSGDState:
        """The :class:`PowerSGDState` of ``params`` from ``self.state``.

        A parameter without PowerSGD state yet (a new group from :meth:`add_param_group`) gets
        what :func:`powersgd_init` gives it (zero memory, the step-0 query of its index); the
        others keep theirs. The step is the largest one stored for the parameters of ``scope``
        (those that share the query generator), so the counter never goes back.
        """
        sts = [self.state[p] for p in params]
        missing = [j for j, s in enumerate(sts) if "powersgd_memory" not in s]
        fresh = {}
        for j in missing:
            g = params[j].grad
            init = powersgd_init(
                [g.shape], self.rank, seed, g.dtype, g.device, query_indices=[indices[j]]
            )
            fresh[j] = (init.memories[0], init.qs[0])
        steps = [
            int(self.state[p]["powersgd_step"]) for p in scope if "powersgd_step" in self.state[p]
        ]
        return PowerSGDState(
            tuple(fresh[j][0] if j in fresh else s["powersgd_memory"] for j, s in enumerate(sts)),
            tuple(fresh[j][1] if j in fresh else s["powersgd_q"] for j, s in enumerate(sts)),
            max(steps, default=0),
            seed,
            self.rank,
        )

    def _compress(
        self, params: list[torch.nn.Parameter], indices: list[int], seed: int, comm, scope
    ) -> None:
        """Compress and average the gradients of ``params`` (query indices ``indices``) and
        write the result and the new state back; ``scope``: see :meth:`_state`."""
        st = self._state(params, indices, seed, scope)
        res, st = powersgd_update(
            [p.grad for p in params],
            st,
            comm,
            reuse_query=self.reuse_query,
            error_feedback=self.error_feedback,
            query_indices=indices,
        )
        outs = res.grads
        if not self.average_world and comm.world_size != 1:  # the sum over the workers
            outs = torch._foreach_mul(outs, float(comm.world_size))
        _copy_all([p.grad for p in params], outs)
        for p, mem, q in zip(params, st.memories, st.qs):
            s = self.state[p]
            s["powersgd_memory"] = mem
            s["powersgd_q"] = q
            s["powersgd_step"] = st.step
        self.sent_bytes += res.sent_bytes
        self.dense_bytes += res.dense_bytes

    def _has_grad_anywhere(self, params: list[torch.nn.Parameter], comm) -> list[bool]:
        """Whether each parameter has a gradient on at least one worker (one small all-reduce
        of a flag per parameter; the same answer on every worker)."""
        local = [p.grad is not None for p in params]
        if comm.world_size == 1:
            return local
        flags = torch.tensor(local, dtype=torch.float32, device=params[0].device)
        self.sent_bytes += flags.numel() * flags.element_size()
        return [bool(c > 0) for c in comm.all_reduce_mean(flags).tolist()]

    @torch.no_grad()
    def aggregate(self) -> None:
        """Replace every gradient by the PowerSGD-compressed mean over the workers.

        A parameter with a gradient on some workers counts as zeros on the others. One with a
        gradient on no worker keeps ``grad=None`` and is not compressed: SGD then skips it (no
        weight decay or momentum), as ``torch.optim.SGD`` does, and its error memory, query
        and step stay as they were. Queries are indexed by the parameter's position among all
        trainable parameters, whichever take part.
        """
        params = self._params()
        if not params:
            return
        comm = default_communicator(self.process_group)
        live = [i for i, ok in enumerate(self._has_grad_anywhere(params, comm)) if ok]
        for i in live:
            if params[i].grad is None:
                params[i].grad = torch.zeros_like(params[i])
        if self.by_layer:
            for i in live:
                self._compress([params[i]], [0], self.seed + i, comm, [params[i]])
        elif live:
            self._compress([params[i] for i in live], live, self.seed, comm, params)

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
