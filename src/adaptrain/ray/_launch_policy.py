"""How many replicas ``adaptrain ray submit`` runs, and on which Ray nodes.

One job has the cluster to itself, so the question Pollux answers for many jobs (who gets the
GPUs) becomes: how far is it worth growing this one? The speedup per replica rule answers it
with the job's own goodput model (rank 0's hints: ``perfParams``, ``gradParams`` and the batch
limits, the service's :func:`~adaptrain.service.reports.speedup_from_hints`):

* The **target** is the replica count of best speedup ``s(n, r)`` (goodput at ``r`` replicas on
  ``n`` nodes over goodput on one, ``n`` the nodes ``r`` packed replicas need) among the
  counts whose speedup per replica ``s / r`` is at least ``min_efficiency`` (default 0.5:
  every replica must still bring half of what a lone one does, or the cloud bill outgrows the
  speedup). The smallest count within 1% of that best speedup is the target: a replica that
  adds a rounding error's worth is not worth its cost.
* The model has seen no more than ``maxProfiledReplicas``: the target is capped at twice that
  (AdaptDL's exploration rule), so the job grows by doubling and measures each size before
  trusting the next. Without a model (no hints yet) the job explores the same way.
* A **margin** keeps it from flapping on a noisy model: it grows only when the new count's
  speedup beats the current one's by ``margin`` (10%), and shrinks only when that holds or the
  current count's speedup per replica fell below ``min_efficiency * (1 - margin)``. Every
  rescale costs a checkpoint-restart, which a few percent of speedup does not repay.

Placement packs replicas onto as few nodes as possible (a node's GPUs synchronise faster than
the network), nodes the job already runs on first, keyed by Ray node ID (never by IP: nodes
of one machine, or behind NAT, share one).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["ScalingRule", "plan_placement", "replica_capacity"]


class ScalingRule:
    """The replica-count rule (see the module docstring).

    Args:
        max_replicas: the most replicas the job may run (``-m``).
        min_efficiency: the least speedup per replica a count may have to be a target.
        margin: relative speedup a rescale must gain (and the slack before shrinking).
    """

    #: Speedups within this fraction of the best count as ties (the fewest replicas win).
    TIE = 0.01

    def __init__(self, max_replicas: int, min_efficiency: float = 0.5, margin: float = 0.1):
        if max_replicas < 1:
            raise ValueError(f"max_replicas={max_replicas} must be at least 1")
        if not 0.0 <= min_efficiency <= 1.0:
            raise ValueError(f"min_efficiency={min_efficiency} must lie in [0, 1]")
        if not 0.0 <= margin < 1.0:
            raise ValueError(f"margin={margin} must lie in [0, 1)")
        self.max_replicas = int(max_replicas)
        self.min_efficiency = float(min_efficiency)
        self.margin = float(margin)
        self._memo: tuple[Any, int, Any] | None = None  # (hints, per_node, their speedup)

    def speedup(
        self, hints: Mapping[str, Any] | None, per_node: int
    ) -> Callable[[int], float] | None:
        """``r -> s(ceil(r / per_node), r)`` from the job's goodput model, or None without one."""
        if not hints:
            return None
        per_node = max(1, int(per_node))
        if self._memo is not None and self._memo[0] is hints and self._memo[1] == per_node:
            return self._memo[2]
        from adaptrain.service.reports import speedup_from_hints  # numpy/scipy: only when used

        fn = speedup_from_hints(dict(hints), self.max_replicas, self.max_replicas)
        out = None
        if fn is not None:

            def out(r: int, fn=fn, per_node=per_node) -> float:
                return float(fn(min(r, -(-r // per_node)), r))

        self._memo = (hints, per_node, out)
        return out

    def cap(self, hints: Mapping[str, Any] | None, current: int) -> int:
        """The most replicas worth trying now: twice the largest count measured."""
        profiled = int((hints or {}).get("maxProfiledReplicas") or 0)
        return min(self.max_replicas, 2 * max(1, profiled, current))

    def target(self, hints: Mapping[str, Any] | None, current: int, per_node: int = 1) -> int:
        """The replica count the job wants, whatever the cluster has."""
        cap = self.cap(hints, current)
        s = self.speedup(hints, per_node)
        if s is None:
            return cap
        speedups = {1: s(1)}
        for r in range(2, cap + 1):
            sr = s(r)
            if sr / r >= self.min_efficiency:
                speedups[r] = sr
        best = max(speedups.values())
        # the fewest replicas within 1% of the best: no replica for a rounding error's gain
        return min(r for r, sr in speedups.items() if sr * (1.0 + self.TIE) >= best)

    def worth(
        self, hints: Mapping[str, Any] | None, current: int, candidate: int, per_node: int = 1
    ) -> bool:
        """Whether moving from ``current`` to ``candidate`` replicas pays for its restart."""
        if candidate == current or candidate < 1:
            return False
        if current < 1:
            return True
        s = self.speedup(hints, per_node)
        if s is None:
            return candidate > current  # exploring: grow, never shrink on no evidence
        s_cur, s_new = s(current), s(candidate)
        if s_new >= (1.0 + self.margin) * s_cur:
            return True
        if candidate < current:
            return s_cur / current < self.min_efficiency * (1.0 - self.margin)
        return False


def replica_capacity(resources: Mapping[str, float], cpus: float, gpus: float) -> int:
    """How many replicas of ``cpus`` CPUs and ``gpus`` GPUs fit in a node's ``resources``."""
    fits = []
    if cpus > 0:
        fits.append(math.floor(float(resources.get("CPU", 0.0)) / cpus + 1e-9))
    if gpus > 0:
        fits.append(math.floor(float(resources.get("GPU", 0.0)) / gpus + 1e-9))
    if not fits:
        raise ValueError("a replica needs some CPUs or GPUs (cpus > 0 or gpus > 0)")
    return max(0, min(fits))


def plan_placement(
    capacity: Mapping[str, int], count: int, prefer: Mapping[str, int] | None = None
) -> dict[str, int]:
    """``{node_id: replicas}`` for ``count`` replicas on nodes of ``capacity`` (node ID → how many
    fit), packed: nodes in ``prefer`` (node ID → replicas it ran) first, then the roomiest;
    ties by node ID so that the plan is deterministic. Fewer than ``count`` if they do not fit.
    The first node of the result (the one with most replicas) hosts rank 0."""
    prefer = prefer or {}
    order = sorted(
        (n for n, k in capacity.items() if k > 0),
        key=lambda n: (-prefer.get(n, 0), -capacity[n], n),
    )
    plan: dict[str, int] = {}
    left = max(0, int(count))
    for n in order:
        if left == 0:
            break
        k = min(int(capacity[n]), left)
        plan[n] = k
        left -= k
    # rank 0 on the node with the most replicas (a stable sort keeps the preference order)
    return dict(sorted(plan.items(), key=lambda kv: -kv[1]))
