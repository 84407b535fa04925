"""The service's wire format: pydantic models of job specs, hints and views (OpenAPI for free).

Every field is validated where it enters: names are DNS labels, replica bounds are ordered,
numbers are finite, lists and strings are bounded. A bad request gets a 422 naming the field.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator, model_validator

__all__ = [
    "PHASES",
    "GradParamsModel",
    "Hints",
    "JobDetail",
    "JobEvent",
    "JobSpec",
    "JobView",
    "PerfParamsModel",
    "ProfileEntry",
    "Progress",
    "check_name",
]

#: A job's phases, as AdaptDL's controller names them, plus Cancelled.
PHASES = ("Pending", "Starting", "Running", "Stopping", "Succeeded", "Failed", "Cancelled")
Phase = Literal["Pending", "Starting", "Running", "Stopping", "Succeeded", "Failed", "Cancelled"]

_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")

Finite = Annotated[float, Field(allow_inf_nan=False)]
NonNegative = Annotated[float, Field(ge=0, allow_inf_nan=False)]


def check_name(name: str) -> str:
    """``name`` if it is a DNS label (lowercase letters, digits and ``-``, at most 63, starting
    and ending with a letter or digit), else ``ValueError`` naming the rule."""
    if not isinstance(name, str) or not _NAME.match(name):
        shown = name if not isinstance(name, str) or len(name) <= 80 else name[:80] + "..."
        raise ValueError(
            f"job name {shown!r} must be a DNS label: 1-63 lowercase letters, digits or '-', "
            "starting and ending with a letter or digit (e.g. 'mnist-1')"
        )
    return name


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class JobSpec(_Strict):
    """What ``adaptrain submit`` asks for: AdaptDL's job spec plus a restart budget."""

    name: str | None = Field(None, description="DNS label; generated from the command if absent")
    command: list[Annotated[str, Field(max_length=4096)]] = Field(min_length=1, max_length=256)
    min_replicas: int = Field(0, ge=0, le=4096)
    max_replicas: int = Field(1, ge=1, le=4096)
    preemptible: StrictBool = True
    max_restarts: int = Field(3, ge=0, le=1000)
    env: dict[str, Annotated[str, Field(max_length=4096)]] = Field(default_factory=dict)
    #: the submit directory as a gzip'd tar, base64 (``adaptrain submit`` makes it)
    workdir: str | None = Field(None, max_length=96 * 1024 * 1024)

    @field_validator("name")
    @classmethod
    def _name(cls, value: str | None) -> str | None:
        return None if value is None else check_name(value)

    @field_validator("command")
    @classmethod
    def _command(cls, value: list[str]) -> list[str]:
        for i, arg in enumerate(value):
            if "\x00" in arg:
                raise ValueError(f"command[{i}] holds a NUL character, which no process takes")
        return value

    @field_validator("env")
    @classmethod
    def _env(cls, value: dict[str, str]) -> dict[str, str]:
        if len(value) > 256:
            raise ValueError(f"env has {len(value)} variables; at most 256")
        for key in value:
            if not re.match(r"^[A-Za-z_][A-Za-z0-9_]{0,255}$", key):
                raise ValueError(f"env variable name {key!r} is not a valid name")
            if key.startswith("ADAPTRAIN_"):
                raise ValueError(f"env variable {key!r}: ADAPTRAIN_* are set by the server")
            if "\x00" in value[key]:
                raise ValueError(f"env variable {key!r} holds a NUL character")
        return value

    @model_validator(mode="after")
    def _bounds(self) -> JobSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"min_replicas={self.min_replicas} must be <= max_replicas={self.max_replicas}"
            )
        return self


class GradParamsModel(_Strict):
    norm: NonNegative
    var: NonNegative


class PerfParamsModel(_Strict):
    alpha_c: NonNegative
    beta_c: NonNegative
    alpha_n: NonNegative
    beta_n: NonNegative
    alpha_r: NonNegative
    beta_r: NonNegative
    gamma: Annotated[float, Field(ge=1.0, le=10.0, allow_inf_nan=False)]


class ProfileEntry(_Strict):
    numNodes: int = Field(ge=1, le=4096)
    numReplicas: int = Field(ge=1, le=4096)
    atomicBsz: int = Field(ge=1, le=1 << 24)
    stepTime: Annotated[float, Field(gt=0, allow_inf_nan=False)]
    syncTime: NonNegative
    count: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _nodes(self) -> ProfileEntry:
        if self.numNodes > self.numReplicas:
            raise ValueError(f"numNodes={self.numNodes} must be <= numReplicas={self.numReplicas}")
        return self


class Progress(_Strict):
    epoch: int = Field(0, ge=0)
    samples: int = Field(0, ge=0)
    progress: NonNegative = 0.0


class Hints(_Strict):
    """What rank 0 posts (AdaptDL's ``sched_hints`` plus the measured profile and progress)."""

    initBatchSize: int = Field(ge=1, le=1 << 24)
    maxBatchSize: int | None = Field(None, ge=1, le=1 << 30)
    localBszBounds: tuple[int, int] | None = None
    maxProfiledReplicas: int = Field(0, ge=0, le=4096)
    gradientAccumulation: StrictBool = False
    gradParams: GradParamsModel | None = None
    perfParams: PerfParamsModel | None = None
    profile: list[ProfileEntry] = Field(default_factory=list, max_length=4096)
    progress: Progress | None = None
    batchSize: int | None = Field(None, ge=1)
    atomicBsz: int | None = Field(None, ge=1)
    accumSteps: int | None = Field(None, ge=0)
    gain: NonNegative | None = None
    goodput: NonNegative | None = None
    throughput: NonNegative | None = None

    @model_validator(mode="after")
    def _consistent(self) -> Hints:
        if self.maxBatchSize is not None and self.maxBatchSize < self.initBatchSize:
            raise ValueError(
                f"maxBatchSize={self.maxBatchSize} must be >= initBatchSize={self.initBatchSize}"
            )
        if self.localBszBounds is not None:
            lo, hi = self.localBszBounds
            if not 1 <= lo <= hi:
                raise ValueError(
                    f"localBszBounds={list(self.localBszBounds)} must be 1 <= lo <= hi"
                )
        return self


class JobEvent(BaseModel):
    time: float
    kind: str
    message: str


class JobView(BaseModel):
    """A row of ``adaptrain ls``."""

    name: str
    status: Phase
    reason: str | None = None
    submitted: float
    started: float | None = None
    finished: float | None = None
    runtime: float = 0.0
    replicas: int = 0
    restarts: int = 0
    failures: int = 0
    batch_size: int | None = None
    speedup: float | None = None
    goodput: float | None = None
    gain: float | None = None

    @field_validator("speedup", "goodput", "gain")
    @classmethod
    def _finite(cls, value: float | None) -> float | None:
        return value if value is None or math.isfinite(value) else None


class JobDetail(JobView):
    """``adaptrain describe``: the spec, the allocation, the events and, while pending, why."""

    command: list[str]
    min_replicas: int
    max_replicas: int
    preemptible: bool
    max_restarts: int
    allocation: list[str] = Field(default_factory=list)
    pending_reason: str | None = None
    events: list[JobEvent] = Field(default_factory=list)
    hints: dict | None = None
