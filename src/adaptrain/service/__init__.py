"""The scheduler service: many elastic training jobs on one shared cluster.

``adaptrain server`` runs it (:mod:`adaptrain.service.server`); the CLI's job commands talk to
it over HTTP (:mod:`adaptrain.service.client`). The policies are :mod:`adaptrain.sched`'s, fed
with what the jobs report (:mod:`adaptrain.service.reports`).
"""

from .client import Client, ServiceError
from .config import ServerConfig
from .models import Hints, JobSpec

__all__ = ["Client", "Hints", "JobSpec", "ServerConfig", "ServiceError"]
