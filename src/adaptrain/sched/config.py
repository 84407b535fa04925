"""Configuration of the cluster and of the default policy, as validated frozen dataclasses.

:class:`ClusterSpec` holds the facts of the cluster that both a policy and whatever runs it
(the simulator, a service) must agree on: GPUs per node, the length of a scheduling round and
what a restart costs. Give the same one to both; the simulator refuses a policy whose spec
differs from its own.

The other classes group :class:`~adaptrain.sched.WaterfillPolicy`'s options by the rule they
tune (``docs/scheduling.md`` describes each rule and its measured effect). Every default is
the policy's default; ``None`` turns the rule off where the field says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ._arrivals import DEFAULT_MIN_SPAN

__all__ = ["Arrivals", "ClusterSpec", "Exploration", "Growth", "Objective", "Search", "Sharing"]


def _positive(name: str, value: float, unit: str, none_means: str | None = None) -> None:
    if value is None and none_means is not None:
        return
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        tail = f", or None ({none_means})" if none_means else ""
        raise ValueError(f"{name}={value!r} must be a finite number of {unit} > 0{tail}")


@dataclass(frozen=True)
class ClusterSpec:
    """The cluster's facts: ``gpus_per_node`` slots on each node, a scheduling round every
    ``round_seconds``, and ``restart_delay`` seconds lost by a job each time it is moved
    (checkpoint, restart, reload)."""

    gpus_per_node: int = 4
    round_seconds: float = 60.0
    restart_delay: float = 30.0

    def __post_init__(self) -> None:
        if isinstance(self.gpus_per_node, bool) or not isinstance(self.gpus_per_node, int):
            raise ValueError(f"gpus_per_node={self.gpus_per_node!r} must be an int >= 1")
        if self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node={self.gpus_per_node} must be >= 1")
        _positive("round_seconds", self.round_seconds, "seconds")
        if not (math.isfinite(self.restart_delay) and self.restart_delay >= 0):
            raise ValueError(
                f"restart_delay={self.restart_delay} must be a finite number of seconds >= 0 "
                "(0: restarts are free)"
            )


@dataclass(frozen=True)
class Objective:
    """What the policy maximises: the sum over jobs of ``w * s ** p / p`` (``log s`` at
    ``p = 0``), ``s`` a job's speedup, ``w = 1 / (1 + remaining_work / theta)`` (shortest
    remaining work first, ``theta`` seconds of one-GPU work halving a job's weight), divided by
    ``s_future ** future_gamma``, the job's speed at its fair share (``None``: not divided)."""

    theta: float = 16 * 3600.0
    p: float = 1.0
    future_gamma: float | None = 0.5

    def __post_init__(self) -> None:
        _positive("theta", self.theta, "seconds")
        if not math.isfinite(self.p):
            raise ValueError(f"p={self.p} must be a finite exponent (1: goodput, 0: log)")
        if self.future_gamma is not None and not self.future_gamma >= 0.0:
            raise ValueError(
                f"future_gamma={self.future_gamma} must be >= 0, or None (weights not divided "
                "by a job's later speed)"
            )


@dataclass(frozen=True)
class Exploration:
    """How far beyond the sizes it has run a job may be offered, and how it is valued there.

    ``beta``: a long job's speedup beyond its largest tried size ``r0`` is at least
    ``s(r0) (r / r0) ** beta`` (``None``: no exploration), for jobs with more than ``horizon``
    seconds of work left at ``s(r0)``; ``observed`` caps the exponent by the job's scaling so
    far. ``growth``: a job may get up to ``growth x r0`` replicas (``None``: AdaptDL's cap of
    ``2 x r0``). ``first_replicas``: a job never run starts on up to that many (``None``: one),
    valued at ``r ** first_beta``. ``ramp_credit``: credit for the steps of a job's growth, over
    ``ramp_doublings`` doublings (``None``: no credit).
    """

    beta: float | None = 0.5
    horizon: float = 3600.0
    observed: bool = True
    growth: float | None = 4.0
    first_replicas: int | None = 4
    first_beta: float = 0.5
    ramp_credit: float | None = 1.0
    ramp_doublings: int = 3

    def __post_init__(self) -> None:
        if self.beta is not None and not 0.0 <= self.beta <= 1.0:
            raise ValueError(f"beta={self.beta} must lie in [0, 1], or be None (no exploration)")
        if not (math.isfinite(self.horizon) and self.horizon >= 0):
            raise ValueError(f"horizon={self.horizon} must be a finite number of seconds >= 0")
        if self.growth is not None and not self.growth >= 1.0:
            raise ValueError(f"growth={self.growth} must be >= 1, or None (the allocator's cap)")
        if self.first_replicas is not None and self.first_replicas < 1:
            raise ValueError(
                f"first_replicas={self.first_replicas} must be >= 1, or None (the allocator's "
                "1 GPU)"
            )
        if not 0.0 <= self.first_beta <= 1.0:
            raise ValueError(f"first_beta={self.first_beta} must lie in [0, 1]")
        if self.ramp_credit is not None and not self.ramp_credit >= 0.0:
            raise ValueError(
                f"ramp_credit={self.ramp_credit} must be >= 0, or None (no ramp credit)"
            )
        if self.ramp_doublings < 1:
            raise ValueError(f"ramp_doublings={self.ramp_doublings} must be >= 1")


@dataclass(frozen=True)
class Growth:
    """What a running job pays to grow: at least ``restart_delay / (payback x round)`` of its
    new speed, the restart repaid within ``payback`` rounds (``None``: priced by the restart
    penalty alone); with ``payback_remaining``, a job about to end repays it before its end."""

    payback: float | None = 3.0
    payback_remaining: bool = True

    def __post_init__(self) -> None:
        _positive("payback", self.payback, "rounds", "growth priced by the restart penalty")


@dataclass(frozen=True)
class Arrivals:
    """While jobs arrive at under ``sparse_rate`` per GPU-hour (measured over ``rate_window``
    seconds), the policy values work with ``sparse_theta`` instead of ``Objective.theta``, takes
    ``sparse_payback`` rounds instead of ``Growth.payback``, and gives a job never run the work
    prior ``sparse_work`` (each ``None``: the same as at any rate)."""

    sparse_rate: float = 0.21
    rate_window: float = 24 * 3600.0
    sparse_theta: float | None = 48 * 3600.0
    sparse_payback: float | None = 4.5
    sparse_work: bool | None = False

    def __post_init__(self) -> None:
        if not (math.isfinite(self.sparse_rate) and self.sparse_rate >= 0):
            raise ValueError(f"sparse_rate={self.sparse_rate} must be >= 0 arrivals per GPU-hour")
        if not (math.isfinite(self.rate_window) and self.rate_window >= DEFAULT_MIN_SPAN):
            raise ValueError(
                f"rate_window={self.rate_window} must be a finite number of seconds >= "
                f"{DEFAULT_MIN_SPAN:g} (the arrival rate needs an hour of arrivals)"
            )
        _positive("sparse_theta", self.sparse_theta, "seconds", "theta whatever the rate")
        _positive("sparse_payback", self.sparse_payback, "rounds", "payback whatever the rate")

    @property
    def gated(self) -> bool:
        """Whether any setting depends on the arrival rate."""
        return (
            self.sparse_theta is not None
            or self.sparse_payback is not None
            or self.sparse_work is not None
        )


@dataclass(frozen=True)
class Sharing:
    """What jobs of one application share. ``profiles``: one throughput fit per application
    (pooled over the fits of its ``pool`` largest jobs; ``None``: the largest job's fit);
    ``work``: a job never run takes the largest remaining work of its application as its prior;
    ``calibrate``: each model is corrected where the application's jobs measured step times."""

    profiles: bool = True
    work: bool = True
    pool: int | None = 16
    calibrate: bool = True

    def __post_init__(self) -> None:
        if self.pool is not None and self.pool < 1:
            raise ValueError(f"pool={self.pool} must be >= 1 jobs, or None (the largest job's fit)")


@dataclass(frozen=True)
class Search:
    """How the allocation is searched: ``method="genetic"`` refines the warm-started local
    search with a genetic search of ``pop_size`` candidates over ``generations``; ``"local"``
    keeps the local search's answer. ``min_nodes`` spreads a multi-node job over at least that
    many nodes where enough are free (2: pack them)."""

    method: str = "genetic"
    pop_size: int = 50
    generations: int = 50
    min_nodes: int = 2

    def __post_init__(self) -> None:
        if self.method not in ("genetic", "local"):
            raise ValueError(f"method={self.method!r} must be 'genetic' or 'local'")
        if self.pop_size < 2 or self.generations < 1:
            raise ValueError(
                f"pop_size={self.pop_size} must be >= 2 and generations={self.generations} >= 1"
            )
        if isinstance(self.min_nodes, bool) or not isinstance(self.min_nodes, int):
            raise ValueError(f"min_nodes={self.min_nodes!r} must be an int >= 2")
        if self.min_nodes < 2:
            raise ValueError(f"min_nodes={self.min_nodes} must be >= 2 (2: pack multi-node jobs)")
