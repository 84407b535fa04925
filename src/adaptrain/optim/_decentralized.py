"""Decentralised SGD with gossip averaging (Lian et al., 2017), API-compatible with
mlbench-core's ``DecentralizedSGD``.

Each step: a local SGD step, then one gossip round over the graph: every worker exchanges its
(flattened, or per-layer) parameters with its ``neighbors`` and sets
``x_i ← (x_i + Σ_{j∈N(i)} x_j) / (|N(i)|+1)`` (:func:`adaptrain.core.compress.gossip_mix`).
The neighbour relation must be symmetric (if ``j ∈ N(i)`` then ``i ∈ N(j)``). Unlike
mlbench-core 3.0.0, rank 0 is accepted, and with a process group the constructor is collective:
the workers exchange their ``(rank, neighbors)`` once (one ``all_gather_object``) and all raise
the same :class:`ValueError` for a wrong rank, a neighbour out of range or an asymmetric relation
(or a rank or neighbour that is not an integer), instead of hanging in the first exchange until
the process-group timeout. In a process group of one worker, ``neighbors=[]``
(``ring_neighbors(0, 1)``) is accepted: the gossip round is the identity, plain SGD.
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


def _as_int(x: Any) -> int | None:
    """``x`` as an integer rank, or None where it is not one (None, a string, 1.5, a bool)."""
    if x is None or isinstance(x, (bool, str, bytes)):
        return None
    try:
        i = int(x)
    except (TypeError, ValueError):
        return None
    return i if i == x else None


def _check_graph(rank, neighbors, problems: list[str], group: Any) -> list[str]:
    """Exchange every worker's ``(rank, neighbors, problems)`` and return all problems found,
    each naming the worker: its own argument errors, ``rank`` differing from its rank in the
    group, neighbours outside ``[0, world size)``, and neighbour pairs listed on one side only.
    Every worker gets the same list, so all raise together."""
    world = dist.get_world_size(group)
    try:
        mine = [int(n) for n in neighbors or []]
    except (TypeError, ValueError):
        mine = []
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (rank, mine, problems), group=group)
    out = []
    for i, (r, nbrs, probs) in enumerate(gathered):
        out.extend(f"on rank {i}: {p}" for p in probs)
        if probs:
            continue
        if int(r) != i:
            out.append(
                f"on rank {i}: rank={r} but this worker's rank in the process group is {i}: "
                "pass rank=torch.distributed.get_rank(group)"
            )
        bad = [n for n in nbrs if not 0 <= n < world]
        if bad:
            out.append(f"on rank {i}: neighbors {bad} out of range: ranks go from 0 to {world - 1}")
    for i, (_, nbrs, probs) in enumerate(gathered):
        for j in sorted(set(nbrs)):
            if probs or not 0 <= j < world or gathered[j][2]:
                continue  # already reported
            if i not in gathered[j][1]:
                out.append(
                    f"rank {i} lists neighbour {j} but rank {j} does not list {i}: the neighbour "
                    f"relation must be symmetric (add {i} to rank {j}'s neighbors or remove {j} "
                    f"from rank {i}'s)"
                )
    return out


class DecentralizedSGD(SGD):
    """SGD followed by one gossip averaging round with the graph neighbours.

    Args:
        rank: this worker's rank in the process group (0 allowed).
        neighbors: ranks (in the process group) of this worker's neighbours (symmetric
            relation, without ``rank``).
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
        problems = []  # collected first: with a process group every worker must reach the gather
        distributed = dist.is_available() and dist.is_initialized()
        rank_i = _as_int(rank)
        if rank_i is None or rank_i < 0:
            problems.append(f"rank={rank!r}: pass this worker's rank (0, 1, ...)")
        try:
            nbrs = [_as_int(n) for n in neighbors] if neighbors is not None else []
        except TypeError:  # not iterable
            nbrs = [None]
        alone = distributed and dist.get_world_size(process_group) == 1
        if None in nbrs:
            problems.append(
                f"neighbors={neighbors!r}: pass a list of integer ranks (this worker's neighbours)"
            )
        elif not nbrs and not alone:  # a world of one worker has no neighbours
            problems.append(f"neighbors={neighbors!r}: pass the ranks of this worker's neighbours")
        elif rank_i is not None and rank_i in nbrs:
            problems.append(f"rank {rank} is in its own neighbors {list(neighbors)}: remove it")
        if model is None:
            problems.append("model=None: pass the nn.Module to optimize")
        if not average_world:
            problems.append("average_world=False is not supported: gossip averages the models")
        if lr is required:
            problems.append("lr is required: pass the learning rate, e.g. lr=0.1")
        if distributed:
            problems = _check_graph(rank_i, nbrs, problems, process_group)
        if problems:
            raise ValueError("; ".join(problems))
        super().__init__(
            model.parameters(),
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
        )
        self.rank = rank_i
        self.neighbors = sorted(set(nbrs))
        self.model = model
        self.by_layer = by_layer
        self.process_group = process_group
        # isend/irecv take global ranks; the neighbours are ranks in the group
        self._peers = {
            n: n if process_group is None else dist.get_global_rank(process_group, n)
            for n in self.neighbors
        }

    def _exchange(self, t: torch.Tensor) -> list[torch.Tensor]:
        t = t.contiguous()
        bufs = {n: torch.empty_like(t) for n in self.neighbors}
        reqs = []
        for n in self.neighbors:
            peer = self._peers[n]
            reqs.append(dist.isend(t, dst=peer, group=self.process_group))
            reqs.append(dist.irecv(bufs[n], src=peer, group=self.process_group))
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
