"""The scheduler service: many elastic training jobs on one shared cluster.

``adaptrain server`` runs it (:mod:`adaptrain.service.server`); the CLI's job commands talk to
it over HTTP (:mod:`adaptrain.service.client`). The policies are :mod:`adaptrain.sched`'s, fed
with what the jobs report (:mod:`adaptrain.service.reports`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .client import Client, ServiceError
    from .config import ServerConfig
    from .models import Hints, JobSpec

__all__ = ["Client", "Hints", "JobSpec", "ServerConfig", "ServiceError"]

#: where each name lives, imported on first use: a replica's launcher
#: (``python -m adaptrain.service.launcher``) then starts without httpx and pydantic
_LAZY = {
    "Client": ".client",
    "ServiceError": ".client",
    "ServerConfig": ".config",
    "Hints": ".models",
    "JobSpec": ".models",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
