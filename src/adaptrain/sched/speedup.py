"""Speedup functions: a job's best goodput on (nodes, replicas) over its best on a base allocation.

``speedup(n, r) = max_{bsz} goodput(n, r, bsz) / max_{bsz} goodput(base)`` with the batch size
(and gradient accumulation) chosen by :meth:`adaptrain.core.goodput.GoodputFunction.optimize`,
as in Pollux (Qiao et al., OSDI'21, Sec. 4.1). The base defaults to one GPU ``(1, 1)``; Pollux's
policy rebases to a fair share. Values are memoised in a dense table so that a genetic search
evaluating thousands of allocations per round costs one table lookup each.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["ExploringSpeedup", "LinearSpeedup", "PowerSpeedup", "RampSpeedup", "SpeedupFunction"]


class LinearSpeedup:
    """``r / scale``: the speedup assumed for a job that has no goodput model yet."""

    def __init__(self, scale: float = 1.0) -> None:
        self.scale = float(scale)

    def rebased(self, num_nodes: int, num_replicas: int) -> LinearSpeedup:
        return LinearSpeedup(float(num_replicas))

    def __call__(self, num_nodes: Any, num_replicas: Any) -> Any:
        out = np.asarray(num_replicas, dtype=np.float64) / self.scale
        return float(out) if out.ndim == 0 else out


class PowerSpeedup:
    """``r ** beta``: a cautious prior for a job whose scaling nothing has measured yet (no
    goodput model): sub-linear, so that its unknown speedup neither wins GPUs from measured
    jobs on the strength of ``r`` alone nor leaves free GPUs idle."""

    def __init__(self, beta: float = 0.5) -> None:
        if not 0.0 <= beta <= 1.0:
            raise ValueError(f"beta={beta} must lie in [0, 1]")
        self.beta = float(beta)

    def __call__(self, num_nodes: Any, num_replicas: Any) -> Any:
        r = np.asarray(num_replicas, dtype=np.float64)
        out = np.where(r > 0, np.maximum(r, 1e-12) ** self.beta, 0.0)
        return float(out) if out.ndim == 0 else out


class SpeedupFunction:
    """Memoised, numpy-vectorised speedup of one job from its goodput function."""

    def __init__(
        self,
        goodput_fn,
        max_batch_size: float | None = None,
        atomic_bsz_range: tuple[int | None, int | None] | None = None,
        accumulation: bool = False,
        max_nodes: int = 64,
        max_replicas: int = 256,
    ) -> None:
        self._goodput_fn = goodput_fn
        self._max_batch_size = max_batch_size
        self._atomic_bsz_range = atomic_bsz_range
        self._accumulation = accumulation
        self._table = np.full((max_nodes + 1, max_replicas + 1), -1.0)
        self._table[0, 0] = 0.0
        self.base_goodput = float(self.goodput(1, 1))
        if not self.base_goodput > 0:
            raise RuntimeError("goodput on one GPU is not positive; check the goodput model")

    @property
    def goodput_fn(self) -> Any:
        """The goodput function this speedup is computed from."""
        return self._goodput_fn

    def limits(self) -> dict[str, Any]:
        """The constructor's arguments other than the goodput function: the batch-size limits
        and the table's size."""
        return {
            "max_batch_size": self._max_batch_size,
            "atomic_bsz_range": self._atomic_bsz_range,
            "accumulation": self._accumulation,
            "max_nodes": self._table.shape[0] - 1,
            "max_replicas": self._table.shape[1] - 1,
        }

    def goodput(self, num_nodes: Any, num_replicas: Any) -> Any:
        """Best goodput at each (num_nodes, num_replicas); 0 for (0, 0)."""
        n = np.asarray(num_nodes, dtype=np.int64)
        r = np.asarray(num_replicas, dtype=np.int64)
        shape = np.broadcast(n, r).shape
        n = np.broadcast_to(n, shape).ravel()
        r = np.broadcast_to(r, shape).ravel()
        if np.any(n < 0) or np.any(n > r) or np.any((n == 0) != (r == 0)):
            raise ValueError("need 0 <= num_nodes <= num_replicas, both zero or both positive")
        if n.size and (n.max() >= self._table.shape[0] or r.max() >= self._table.shape[1]):
            raise ValueError(
                f"allocation beyond table {self._table.shape}; raise max_nodes/max_replicas"
            )
        out = self._table[n, r]
        missing = out < 0
        if np.any(missing):
            pairs = np.unique(np.stack([n[missing], r[missing]]), axis=1)
            g, _, _ = self._goodput_fn.optimize(
                pairs[0],
                pairs[1],
                max_batch_size=self._max_batch_size,
                atomic_bsz_range=self._atomic_bsz_range,
                accumulation=self._accumulation,
                round_past_max=True,  # the artifact's (AdaptDL's) rule, for fidelity
            )
            self._table[pairs[0], pairs[1]] = np.asarray(g, dtype=np.float64)
            out = self._table[n, r]
        out = out.reshape(shape)
        return float(out) if shape == () else out

    def rebased(self, num_nodes: int, num_replicas: int) -> SpeedupFunction:
        """The same function relative to the goodput at (num_nodes, num_replicas) (shares memo)."""
        other = object.__new__(SpeedupFunction)
        other.__dict__.update(self.__dict__)
        base = float(self.goodput(num_nodes, num_replicas))
        other.base_goodput = base if base > 0 else self.base_goodput
        return other

    def __call__(self, num_nodes: Any, num_replicas: Any) -> Any:
        g = self.goodput(num_nodes, num_replicas)
        return g / self.base_goodput


class ExploringSpeedup:
    """A speedup function made optimistic beyond the largest size the job has run on.

    ``s'(n, r) = s(n, r)`` for ``r <= r0`` and ``max(s(n, r), s(n0, r0) * (r / r0) ** beta)``
    for ``r > r0``, with ``r0`` the largest replica count the job has run on and ``n0`` its
    packed node count (``ceil(r0 / gpus_per_node)``). The learned goodput model has no data
    beyond ``r0``: without a multi-node observation, AdaptDL's fit assumes inter-node
    synchronisation 1.1x the intra-node one, and the curve often dips at the node boundary,
    where a goodput maximiser never steps. The lower bound ``s(r0) (r / r0) ** beta`` (a
    power-law continuation, ``beta < 1``: sub-linear) values a measurement there: "optimism in
    the face of uncertainty". After one round at the larger size the job's model has the data
    and the bound moves with ``r0``.

    With ``observed=True`` the exponent is at most the job's own scaling so far,
    ``log s(n0, r0) / log r0`` (for ``r0 > 1``): a job whose goodput barely grew from one GPU to
    ``r0`` (early in training, when its gradient noise is small and larger batches gain
    little: yolov3's model reads s(4) = 1.14 in its first epoch) is not presumed to scale on
    beyond ``r0`` at ``beta``. Its bound rises again as its model does.
    """

    def __init__(
        self,
        fn: Any,
        max_profiled_replicas: int,
        beta: float = 0.5,
        gpus_per_node: int = 4,
        observed: bool = False,
    ) -> None:
        if max_profiled_replicas < 1:
            raise ValueError(
                f"max_profiled_replicas={max_profiled_replicas} must be >= 1 (a size the job "
                "has run on)"
            )
        if not 0.0 <= beta <= 1.0:
            raise ValueError(f"beta={beta} must lie in [0, 1] (0: flat, 1: linear)")
        self._fn = fn
        self.r0 = int(max_profiled_replicas)
        self.beta = float(beta)
        n0 = -(-self.r0 // int(gpus_per_node))
        self.s0 = float(fn(n0, self.r0))
        if observed and self.r0 > 1:  # the exponent of s(r0) = r0 ** e, floored at 0
            e = math.log(max(self.s0, 1e-9)) / math.log(self.r0)
            self.beta = min(self.beta, max(e, 0.0))

    def __call__(self, num_nodes: Any, num_replicas: Any) -> Any:
        s = np.asarray(self._fn(num_nodes, num_replicas), dtype=np.float64)
        r = np.asarray(num_replicas, dtype=np.float64)
        bound = self.s0 * (r / self.r0) ** self.beta
        out = np.where(r > self.r0, np.maximum(s, bound), s)
        return float(out) if out.ndim == 0 else out


class RampSpeedup:
    """A speedup function credited with what growing to the exploration cap unlocks.

    ``s'(n, r) = s(n, r) + bonus * min(1, (r - r0) / (cap - r0))`` for ``r > r0`` and ``s(n, r)``
    otherwise, with ``r0`` the largest size the job has run on and ``cap`` the most it may get
    this round (twice ``r0`` under AdaptDL's exploration rule). A job that wants to be much
    larger than its cap reaches its size by doubling, one round per step: held back one round
    now, its whole ramp (``cap``, ``2 cap``, ... up to the size ``r_far`` it would reach) comes
    one round later, which costs about one round at ``s(r_far)`` rather than at ``s(cap)`` (the
    rounds of a doubling ramp telescope). A policy that judges the step to the cap by
    ``s(cap)`` alone keeps a young job at 1 GPU behind any donor's restart penalty; ``bonus``
    values the ramp instead (:class:`~adaptrain.sched.WaterfillPolicy` sets it to
    ``ramp_credit * rate * (s(r_far) - s(cap))``, ``rate`` one round over the job's restart
    horizon).
    """

    def __init__(self, fn: Any, max_profiled_replicas: int, cap: int, bonus: float) -> None:
        if not 1 <= max_profiled_replicas < cap:
            raise ValueError(
                f"need 1 <= max_profiled_replicas={max_profiled_replicas} < cap={cap}: a ramp "
                "starts at a size the job has run on and ends above it"
            )
        if not bonus >= 0:
            raise ValueError(f"bonus={bonus} must be >= 0")
        self._fn = fn
        self.r0 = int(max_profiled_replicas)
        self.cap = int(cap)
        self.bonus = float(bonus)

    def __call__(self, num_nodes: Any, num_replicas: Any) -> Any:
        s = np.asarray(self._fn(num_nodes, num_replicas), dtype=np.float64)
        r = np.asarray(num_replicas, dtype=np.float64)
        frac = np.clip((r - self.r0) / (self.cap - self.r0), 0.0, 1.0)
        out = s + self.bonus * frac
        return float(out) if out.ndim == 0 else out
