"""The cluster's job arrival rate, estimated from the jobs a policy has seen.

A policy sees each job in the rounds it is active; :class:`ArrivalRate` keeps each job's
creation timestamp once (by job key) and estimates the rate of arrivals per GPU-hour over a
sliding ``window``: with ``n`` jobs created in ``(now - window, now]``, the first at ``t_1``
and the last at ``t_n``,

    rate = (n - 1) / (t_n - t_1) / gpus      (per GPU-hour, times in hours),

``None`` while the arrivals seen span less than ``min_span`` (too few to tell). The span is
from the first to the last arrival, not to ``now``: the estimate does not decay while no job
arrives (e.g. once a trace has stopped submitting), so a quiet spell after busy hours still
reads as busy hours until a new arrival is seen.
"""

from __future__ import annotations

import math

__all__ = ["ArrivalRate"]

#: the default ``min_span``: an hour of arrivals before the rate is read
DEFAULT_MIN_SPAN = 3600.0


class ArrivalRate:
    """Arrivals per GPU-hour over the last ``window`` seconds (see the module docstring)."""

    def __init__(self, window: float = 24 * 3600.0, min_span: float = DEFAULT_MIN_SPAN) -> None:
        if not (math.isfinite(window) and window > 0):
            raise ValueError(f"window={window} must be a finite number of seconds > 0")
        if not (math.isfinite(min_span) and 0 < min_span <= window):
            raise ValueError(f"min_span={min_span} must be > 0 seconds and at most window={window}")
        self.window = float(window)
        self.min_span = float(min_span)
        self._created: dict[str, float] = {}

    def observe(self, key: str, creation_timestamp: float) -> None:
        """Note job ``key`` (once: later sightings of the same key are ignored)."""
        if key not in self._created:
            self._created[key] = float(creation_timestamp)

    def rate(self, now: float, gpus: int) -> float | None:
        """Arrivals per GPU-hour over ``(now - window, now]``, or ``None`` (too few seen, or
        no GPUs). Forgets the jobs created before the window."""
        start = now - self.window
        self._created = {k: t for k, t in self._created.items() if t > start}
        times = [t for t in self._created.values() if t <= now]
        if gpus <= 0 or len(times) < 2:
            return None
        span = max(times) - min(times)
        if span < self.min_span:
            return None
        return (len(times) - 1) / (span / 3600.0) / gpus

    def state_dict(self) -> dict:
        """The jobs seen: ``{"keys": [...], "times": [...]}`` (creation timestamps)."""
        return {"keys": list(self._created), "times": list(self._created.values())}

    def load_state_dict(self, state: dict) -> None:
        keys, times = state["keys"], state["times"]
        if len(keys) != len(times):
            raise ValueError(
                f"state holds {len(keys)} keys and {len(times)} times: expected one time per key"
            )
        self._created = {str(k): float(t) for k, t in zip(keys, times, strict=True)}
