"""Decentralised SGD with gossip averaging (Lian et al., 2017), API-compatible with
mlbench-core's ``DecentralizedSGD``.

Each step: a local SGD step, then one gossip round over the graph: every worker exchanges its
(flattened, or per-layer) parameters with its ``neighbors`` and sets
``x_i ← (x_i + Σ_{j∈N(i)} x_j) / (|N(i)|+1)`` (:func:`adaptrain.core.compress.gossip_mix`).
The neighbour relation must be symmetric (if ``j ∈ N(i)`` then ``i ∈ N(j)``). Unlike
mlbench-core 3.0.0, rank 0 is accepted.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.optim import SGD
from torch.optim.optimizer import required

from adaptrain.core.compress import gossip_mix
from adaptrain.optim._centralized import call_tracker

__all__ = ["DecentralizedSGD", "ring_neighbors"]


def ring_neighbors(rank: int, world_size: int) -> list[int]:
    """The (deduplicated) left and right neighbours of ``rank`` on a ring."""
    return sorted({(rank - 1) % world_size, (rank + 1) % world_size} - {rank})


class DecentralizedSGD(SGD):
    """SGD followed by one gossip averaging round with the graph neighbours.

    Args:
        rank: this worker's rank (0 allowed).
        neighbors: ranks of this worker's neighbours (symmetric relation, without ``rank``).
        model: module whose parameters are optimized and gossiped.
        lr, momentum, dampening, weight_decay, nesterov: as :class:`torch.optim.SGD`.
        average_world: must be ``True`` (uniform gossip averaging).
        use_cuda: kept for compatibility; tensors stay on the parameters' device.
        by_layer: exchange each parameter separately instead of one flat buffer.
    """

    def __init__(
        self,
        rank=None,
        neighbors=None,
        model=None,
        lr=required,
        momentum=0,
        dampening=0,
        weight_decay=0,
        nesterov=False,
        average_world=True,
        use_cuda=False,
        by_layer=False,
        *,
        process_group: Any = None,
    ) -> None:
        if rank is None or int(rank) < 0:
            raise ValueError(f"rank={rank!r}: pass this worker's rank (0, 1, ...)")
        if not neighbors:
            raise ValueError(f"neighbors={neighbors!r}: pass the ranks of this worker's neighbours")
        if int(rank) in [int(n) for n in neighbors]:
            raise ValueError(f"rank {rank} is in its own neighbors {list(neighbors)}: remove it")
        if model is None:
            raise ValueError("model=None: pass the nn.Module to optimize")
        if not average_world:
            raise ValueError("average_world=False is not supported: gossip averages the models")
        super().__init__(
            model.parameters(),
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
        )
        self.rank = int(rank)
        self.neighbors = sorted({int(n) for n in neighbors})
        self.model = model
        self.by_layer = by_layer
        self.process_group = process_group

    def _exchange(self, t: torch.Tensor) -> list[torch.Tensor]:
        t = t.contiguous()
        bufs = {n: torch.empty_like(t) for n in self.neighbors}
        reqs = []
        for n in self.neighbors:
            reqs.append(dist.isend(t, dst=n, group=self.process_group))
            reqs.append(dist.irecv(bufs[n], src=n, group=self.process_group))
        for r in reqs:
            r.wait()
        return [bufs[n] for n in self.neighbors]

    @torch.no_grad()
    def gossip(self) -> None:
        """One gossip averaging round of the model's parameters with the neighbours."""
        params = [p for p in self.model.parameters()]
        if self.by_layer:
            for p in params:
                p.copy_(gossip_mix(p.detach(), self._exchange(p.detach())))
            return
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        mixed = gossip_mix(flat, self._exchange(flat))
        off = 0
        for p in params:
            n = p.numel()
            p.copy_(mixed[off : off + n].view_as(p))
            off += n

    def step(self, closure=None, tracker=None):  # type: ignore[override]
        """Local SGD step, then one gossip round; returns the closure's loss."""
        loss = super().step(closure=closure)
        call_tracker(tracker, "record_batch_opt_step")
        self.gossip()
        call_tracker(tracker, "record_batch_agg")
        return loss
