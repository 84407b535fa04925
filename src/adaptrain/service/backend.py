"""What the controller needs of a backend: where replicas run and how they are started,
signalled, watched and taken over after a server restart.

:class:`~adaptrain.service.local.LocalBackend` runs replicas on this machine;
``adaptrain.ray.RayBackend`` on a Ray cluster's nodes. The controller reads :attr:`nodes` at each
use, so a backend whose cluster changes (nodes joining or leaving) updates that mapping and the
next round sees the change.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from .store import ReplicaRecord

__all__ = ["LOST", "Backend", "Node", "replica_file"]


def replica_file(run_dir: str, job: str, group: int, rank: int, suffix: str) -> str:
    """Where a backend keeps replica ``rank`` of restart ``group``'s ``.log`` or ``.status``
    file (``suffix``) under its ``run_dir``: one layout for every backend."""
    return os.path.join(run_dir, job, f"g{group}-r{rank}{suffix}")


#: exit status of a replica whose launcher vanished without a status (killed with -9, or its
#: node lost)
LOST = -1


@dataclass(frozen=True)
class Node:
    """A node: its name (any sortable key) and its slots, each a GPU index or ``None`` (a CPU
    slot)."""

    name: str
    slots: tuple[int | None, ...]


@runtime_checkable
class Backend(Protocol):
    #: short name shown by ``/cluster``
    name: str
    #: the cluster now: node name -> node
    nodes: Mapping[str, Node]

    def launch(
        self,
        job: str,
        group: int,
        allocation: Sequence[str],
        command: Sequence[str],
        env: Mapping[str, str],
        cwd: str,
        busy: Mapping[str, set[int]],
    ) -> list[ReplicaRecord]:
        """Start one replica per entry of ``allocation`` (node names in rank order) on slots not
        in ``busy`` (node -> slot indices in use), with ``env`` added to the ``ADAPTRAIN_*``
        rendezvous variables; their records."""
        ...

    def exit_code(self, rec: ReplicaRecord) -> int | None:
        """How the replica ended (:data:`LOST` if it vanished without a status), ``None`` while
        it runs."""
        ...

    def signal(self, rec: ReplicaRecord, sig: int) -> None:
        """SIGTERM/SIGINT to the replica's command; SIGKILL to all it started."""
        ...

    def adopt(self, records: Sequence[ReplicaRecord]) -> list[ReplicaRecord]:
        """The records of replicas still alive, taken over by a restarted server."""
        ...

    def log_path(self, job: str, group: int, rank: int) -> str:
        """The replica's output file, readable by the server."""
        ...
