"""The server's settings, validated once: what ``adaptrain server``'s flags set."""

from __future__ import annotations

import ipaddress
import math
from dataclasses import dataclass

__all__ = ["ServerConfig", "is_loopback"]


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (127.0.0.0/8, ::1, or ``localhost``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class ServerConfig:
    """``interval``: seconds between policy rounds; ``rescale_rounds``: a job moved in a round
    keeps its allocation for that many rounds; ``grace``: seconds a stopping replica gets to
    checkpoint before SIGKILL; ``restart_delay``: the seconds of training a job is taken to lose
    each time it is moved (stop, checkpoint, restart), which the policy weighs against what a
    rescale gains (a growth must repay it within a few rounds, so with a short ``interval`` a
    long delay rules growth out); ``checkpoint_interval`` / ``hints_interval``: seconds, passed
    to the replicas; ``orphan_timeout``: a replica whose server is gone that long stops;
    ``max_body``: the largest request accepted, bytes; ``policy_in_process``: the policy's
    rounds run in the server's process rather than in a worker process of their own (see
    :mod:`adaptrain.service.policy_process`)."""

    host: str = "127.0.0.1"
    port: int = 8765
    state_dir: str = "adaptrain-state"
    interval: float = 60.0
    policy: str = "waterfill"
    token: str | None = None
    rescale_rounds: int = 1
    grace: float = 60.0
    restart_delay: float = 30.0
    max_restarts: int = 3
    checkpoint_interval: float = 600.0
    hints_interval: float = 30.0
    orphan_timeout: float = 600.0
    max_body: int = 128 * 1024 * 1024
    tick: float = 0.5
    policy_in_process: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port {self.port} must lie in 0..65535 (0: any free port)")
        for name in ("interval", "grace", "orphan_timeout", "tick", "hints_interval"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name}={value} must be a finite number of seconds > 0")
        if not (math.isfinite(self.restart_delay) and self.restart_delay >= 0):
            raise ValueError(
                f"restart_delay={self.restart_delay} must be >= 0 seconds (0: restarts are free)"
            )
        if not (math.isfinite(self.checkpoint_interval) and self.checkpoint_interval >= 0):
            raise ValueError(
                f"checkpoint_interval={self.checkpoint_interval} must be >= 0 seconds (0: off)"
            )
        if self.policy not in ("waterfill", "pollux", "fifo"):
            raise ValueError(f"--policy {self.policy!r} must be 'waterfill', 'pollux' or 'fifo'")
        if self.rescale_rounds < 0 or self.max_restarts < 0:
            raise ValueError("rescale_rounds and max_restarts must be >= 0")
        if not is_loopback(self.host) and not self.token:
            raise ValueError(
                f"--host {self.host} is not a loopback address: give a --token-file, so that "
                "no one else on the network can submit jobs or steer the scheduler"
            )
        if self.token is not None and len(self.token) < 16:
            raise ValueError(
                "the token must be at least 16 characters (e.g. `openssl rand -hex 16`)"
            )
