"""Ray Tune with adaptive trials: every trial is a real data-parallel adaptrain job whose replica
count a scheduling policy re-decides across the trials' goodput (AdaptDL's ``adaptdl_ray.tune``).

A trial's function is written with :mod:`adaptrain.torch` (``AdaptiveDataLoader``,
``AdaptiveDataParallel``, ``remaining_epochs_until``) and reports with :func:`report`.
:func:`AdaptDLTrainableCreator` turns it into a Tune ``Trainable`` that runs it on one process per
replica (torch.distributed over gloo or NCCL), each in its own bundle of the trial's placement
group, so the trial's resources are its replicas. :class:`AdaptiveTrialScheduler` (AdaptDL's
``AdaptDLScheduler``) reads the goodput model each trial's rank 0 posts, asks the policy for
every trial's replica count, and resizes a trial with Tune's own mechanisms: ``PAUSE`` (the
replicas checkpoint at a step boundary and exit), ``Trial.update_resources`` on the paused
trial, and a restart from the checkpoint on the new number of replicas::

    import adaptrain.torch as adl
    from adaptrain.ray.tune import AdaptDLScheduler, AdaptDLTrainableCreator, report

    def train_fn(config):
        ...
        for epoch in adl.remaining_epochs_until(config["epochs"]):
            train(...)
            report(mean_accuracy=test(...))

    tuner = tune.Tuner(
        AdaptDLTrainableCreator(train_fn, num_workers=1),
        tune_config=tune.TuneConfig(scheduler=AdaptDLScheduler(), num_samples=8, ...),
    )

Trial names read ``AdaptDLTrainable_<replicas>_<restarts>_<trial id>`` (AdaptDL's) and every
result carries ``num_replicas``, ``num_nodes`` and ``num_restarts`` (and, for the scheduler,
rank 0's hints as JSON in ``adaptrain_hints``). Every epoch's result reaches Tune exactly once,
pauses included (Tune's callbacks see each one); Ray 2.60's file loggers may still miss, in a
trial's ``result.json``, the result the trial was paused at: they copy the file back from the
experiment's storage when the trial restarts, and that copy can predate the last result.

The scheduler and the trainable are loaded on first use (``ray.tune`` takes seconds to import):
the replica processes only need :func:`report`, which imports neither Ray nor Tune.
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from adaptrain import env

if TYPE_CHECKING:  # pragma: no cover - for type checkers only
    from adaptrain.ray._tune_scheduler import AdaptiveTrialScheduler
    from adaptrain.ray._tune_trainable import (
        AdaptDLTrainableCreator,
        AdaptiveTrainable,
        replica_resources,
    )

    AdaptDLScheduler = AdaptiveTrialScheduler

__all__ = [
    "AdaptDLScheduler",
    "AdaptDLTrainableCreator",
    "AdaptiveTrainable",
    "AdaptiveTrialScheduler",
    "replica_resources",
    "report",
]

logger = logging.getLogger(__name__)

_LAZY = {
    "AdaptiveTrialScheduler": ("adaptrain.ray._tune_scheduler", "AdaptiveTrialScheduler"),
    "AdaptDLScheduler": ("adaptrain.ray._tune_scheduler", "AdaptiveTrialScheduler"),
    "AdaptDLTrainableCreator": ("adaptrain.ray._tune_trainable", "AdaptDLTrainableCreator"),
    "AdaptiveTrainable": ("adaptrain.ray._tune_trainable", "AdaptiveTrainable"),
    "replica_resources": ("adaptrain.ray._tune_trainable", "replica_resources"),
}


def __getattr__(name: str) -> Any:
    """The scheduler and the trainable, imported when first named (they import ``ray.tune``)."""
    if name in _LAZY:
        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


_warned_outside = False


def _jsonable(value: Any) -> Any:
    """A metric as JSON: numbers, strings, lists and dicts of them; tensors and numpy scalars
    through ``.item()``/``.tolist()``; non-finite floats as None (JSON has no NaN)."""
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        return _jsonable(value.item())
    if hasattr(value, "tolist"):
        return _jsonable(value.tolist())
    raise TypeError(
        f"metric value {value!r} of type {type(value).__name__} is not a number, string, list "
        "or dict: report plain values"
    )


def _rank() -> int:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    return env.replica_rank()


def report(metrics: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
    """Report a trial's result to Tune from inside its function (every replica may call it;
    rank 0's report counts).

    Both forms work: ``report({"mean_accuracy": acc})`` (Ray 2's ``tune.report``) and
    ``report(mean_accuracy=acc)`` (the Ray 1 form of AdaptDL's examples). The call returns when
    Tune asks the trial for its next result (as Tune's own function API does), so the trial's
    checkpoint at a pause follows the last result Tune saw.

    Outside a trial started by :func:`AdaptDLTrainableCreator` (no supervisor) it logs a warning
    once and does nothing, so the same function also runs standalone.

    Raises:
        RuntimeError: the trial's supervisor refused or could not be reached (the trial failed).
    """
    global _warned_outside
    values: dict[str, Any] = dict(metrics or {})
    values.update(kwargs)
    if _rank() != 0:
        return
    url, job = env.supervisor_url(), env.job_id()
    if url is None or job is None:
        if not _warned_outside:
            _warned_outside = True
            logger.warning(
                "report() outside an adaptive Tune trial (no ADAPTRAIN_SUPERVISOR_URL): %s not "
                "sent anywhere",
                values,
            )
        return
    body = json.dumps({"metrics": _jsonable(values)}).encode()
    endpoint = f"{url.rstrip('/')}/report/{urllib.parse.quote(job, safe='')}"
    headers = {"Content-Type": "application/json"}
    token = env.job_token()
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(endpoint, data=body, headers=headers, method="POST")
    try:
        # no timeout: the answer comes when Tune takes the next result, which may be long
        with urllib.request.urlopen(request) as response:
            response.read()
    except (urllib.error.URLError, OSError) as exc:
        raise RuntimeError(f"report(): the trial's supervisor {endpoint} failed: {exc}") from exc
