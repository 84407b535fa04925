"""Accessors for the job's environment: the only module of adaptrain that reads ``os.environ``.

Each accessor mirrors ``adaptdl.env`` with ``ADAPTRAIN_*`` where AdaptDL reads ``ADAPTDL_*``.
torchrun's standard variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``, ``LOCAL_WORLD_SIZE``, ``TORCHELASTIC_RUN_ID``, ``TORCHELASTIC_RESTART_COUNT``) are
honoured as fallbacks, so a script launched by ``torchrun`` needs no ``ADAPTRAIN_*`` variable.

Precedence for every value: ``ADAPTRAIN_*`` first, then torchrun's variable, then the default;
except the rendezvous address and port under torchrun, whose agent's store is the only one
workers can join (an ``ADAPTRAIN_MASTER_*`` that disagrees is logged and ignored there).
"""

from __future__ import annotations

import logging
import math
import os

__all__ = [
    "adaptdl_sched_version",
    "adaptrain_sched_version",
    "aws_metadata_url",
    "checkpoint_interval",
    "checkpoint_path",
    "from_ray",
    "gcp_metadata_url",
    "hints_interval",
    "job_id",
    "job_token",
    "local_rank",
    "master_addr",
    "master_port",
    "num_nodes",
    "num_replicas",
    "num_restarts",
    "replica_rank",
    "server_token",
    "server_url",
    "share_path",
    "supervisor_url",
    "tensorboard_path",
    "launched_by_torchrun",
]

logger = logging.getLogger(__name__)


def _get(*names: str) -> str | None:
    for name in names:
        value = os.environ.get(name)
        if value is not None and value != "":
            return value
    return None


def _get_int(
    default: int, *names: str, bounds: tuple[int, int] | None = None, what: str = "allowed"
) -> int:
    """The first set variable of ``names`` as an integer (within ``bounds``, else a
    ValueError saying it is not ``what``)."""
    value = _get(*names)
    if value is None:
        return default
    name = next(n for n in names if os.environ.get(n))
    try:
        number = int(value)
    except ValueError:
        raise ValueError(
            f"environment variable {name}={value!r} is not an integer; unset it or give a "
            "whole number"
        ) from None
    if bounds is not None and not bounds[0] <= number <= bounds[1]:
        raise ValueError(
            f"environment variable {name}={number} is not {what} ({bounds[0]}..{bounds[1]})"
        )
    return number


def _get_seconds(default: float, name: str, *, positive: bool) -> float:
    """The variable ``name`` as a finite number of seconds (> 0 if ``positive``, else ≥ 0),
    ``default`` when unset; else a ValueError naming the variable."""
    value = _get(name)
    if value is None:
        return default
    try:
        number = float(value)
    except ValueError:
        raise ValueError(
            f"environment variable {name}={value!r} is not a number of seconds; unset it or "
            "give a number such as 30 or 0.5"
        ) from None
    if not math.isfinite(number) or number < 0 or (positive and number == 0):
        raise ValueError(
            f"environment variable {name}={value!r} is not a "
            + ("positive" if positive else "non-negative")
            + " finite number of seconds"
        )
    return number


#: Bounds of counts and ranks (``_get_int``): non-negative, and sizes at least 1.
_COUNT = (0, 2**31 - 1)
_POSITIVE = (1, 2**31 - 1)


def checkpoint_path() -> str | None:
    """Directory for saving and loading checkpoints (``ADAPTRAIN_CHECKPOINT_PATH``), or None.

    Checkpoint-restart is enabled only when this is set. Give every job its own directory: a
    job restores the newest checkpoint found there and a save deletes the older ones.
    """
    return _get("ADAPTRAIN_CHECKPOINT_PATH")


def share_path() -> str | None:
    """Directory shared by all replicas of the job (``ADAPTRAIN_SHARE_PATH``), or None."""
    return _get("ADAPTRAIN_SHARE_PATH")


def tensorboard_path() -> str | None:
    """Directory for TensorBoard event files (``ADAPTRAIN_TENSORBOARD_LOGDIR``), or None."""
    return _get("ADAPTRAIN_TENSORBOARD_LOGDIR")


def job_id() -> str | None:
    """Unique identifier of the job (``ADAPTRAIN_JOB_ID``, else ``TORCHELASTIC_RUN_ID``), or None."""
    value = _get("ADAPTRAIN_JOB_ID")
    if value is None:
        run_id = _get("TORCHELASTIC_RUN_ID")
        # torchrun's default run id "none" is no identity.
        value = run_id if run_id not in (None, "none") else None
    return value


def num_restarts() -> int:
    """Times the job was restarted (``ADAPTRAIN_NUM_RESTARTS``, else torchrun's restart count)."""
    return _get_int(
        0, "ADAPTRAIN_NUM_RESTARTS", "TORCHELASTIC_RESTART_COUNT", bounds=_COUNT, what="a count"
    )


def num_replicas() -> int:
    """Total number of replicas (``ADAPTRAIN_NUM_REPLICAS``, else ``WORLD_SIZE``; under
    torchrun its ``WORLD_SIZE``), default 1."""
    return _get_int(
        1, *_rendezvous("ADAPTRAIN_NUM_REPLICAS", "WORLD_SIZE"), bounds=_POSITIVE, what="a size"
    )


def replica_rank() -> int:
    """Rank of this replica in 0..K-1 (``ADAPTRAIN_REPLICA_RANK``, else ``RANK``; under torchrun
    its ``RANK``), default 0."""
    return _get_int(0, *_rendezvous("ADAPTRAIN_REPLICA_RANK", "RANK"), bounds=_COUNT, what="a rank")


def local_rank() -> int:
    """Rank of this replica on its node (``ADAPTRAIN_LOCAL_RANK``, else ``LOCAL_RANK``; under
    torchrun its ``LOCAL_RANK``), default 0."""
    return _get_int(
        0, *_rendezvous("ADAPTRAIN_LOCAL_RANK", "LOCAL_RANK"), bounds=_COUNT, what="a rank"
    )


def num_nodes() -> int:
    """Number of distinct nodes (``ADAPTRAIN_NUM_NODES``).

    Without it, torchrun's ``WORLD_SIZE // LOCAL_WORLD_SIZE`` is used when both are set (and,
    outside torchrun, ``ADAPTRAIN_NUM_REPLICAS`` is not), else :func:`num_replicas` (one
    replica per node), as AdaptDL does.
    """
    value = _get("ADAPTRAIN_NUM_NODES")
    if value is not None:
        return _get_int(1, "ADAPTRAIN_NUM_NODES", bounds=_POSITIVE, what="a node count")
    local_world = _get("LOCAL_WORLD_SIZE")
    # Under torchrun its WORLD_SIZE wins over ADAPTRAIN_NUM_REPLICAS (num_replicas), so its
    # node count does too.
    if local_world is not None and (
        launched_by_torchrun() or _get("ADAPTRAIN_NUM_REPLICAS") is None
    ):
        lw = _get_int(1, "LOCAL_WORLD_SIZE", bounds=_POSITIVE, what="a size")
        return max(1, num_replicas() // max(lw, 1))
    return num_replicas()


def _rendezvous(ours: str, torchrun: str) -> tuple[str, ...]:
    """Lookup order of a rendezvous variable (address, port, rank, world size): torchrun's
    first when torchrun launched this process (its workers join the agent's store with those;
    a stray ``ADAPTRAIN_*`` value would hang the rendezvous)."""
    if launched_by_torchrun() and _get(torchrun) is not None:
        mine, theirs = _get(ours), _get(torchrun)
        if mine is not None and mine != theirs and (ours, mine, theirs) not in _warned:
            # Once per value: the accessors are read at every step (num_nodes() by the
            # step-time profile), and one warning says it all.
            _warned.add((ours, mine, theirs))
            logger.warning(
                "%s=%s ignored: torchrun's %s=%s is where its workers meet",
                ours,
                mine,
                torchrun,
                theirs,
            )
        return (torchrun,)
    return (ours, torchrun)


_warned: set[tuple[str, str, str]] = set()  # (our variable, its value, torchrun's) warned of


def master_addr() -> str:
    """Address of the rank-0 replica (``ADAPTRAIN_MASTER_ADDR``, else ``MASTER_ADDR``; under
    torchrun its ``MASTER_ADDR``).

    Default ``127.0.0.1``: a single-process job needs no network.
    """
    return _get(*_rendezvous("ADAPTRAIN_MASTER_ADDR", "MASTER_ADDR")) or "127.0.0.1"


def master_port() -> int:
    """Port of the rank-0 replica (``ADAPTRAIN_MASTER_PORT``, else ``MASTER_PORT``; under
    torchrun its ``MASTER_PORT``), or 0 if unset.

    0 means "not set": a single-process job then picks a free port itself.

    Raises:
        ValueError: a value outside 0..65535, naming the variable.
    """
    names = _rendezvous("ADAPTRAIN_MASTER_PORT", "MASTER_PORT")
    return _get_int(0, *names, bounds=(0, 65535), what="a port")


def launched_by_torchrun() -> bool:
    """True when torchrun (torch.distributed.elastic) started this process."""
    return _get("TORCHELASTIC_RUN_ID") is not None or _get("TORCHELASTIC_RESTART_COUNT") is not None


def supervisor_url() -> str | None:
    """URL of the scheduler's supervisor (``ADAPTRAIN_SUPERVISOR_URL``), or None when standalone."""
    return _get("ADAPTRAIN_SUPERVISOR_URL")


def supervisor_file() -> str | None:
    """A JSON file naming the supervisor's current URL (``ADAPTRAIN_SUPERVISOR_FILE``, set by
    the server: its ``server.json``), read again when a post fails; None when not set."""
    return _get("ADAPTRAIN_SUPERVISOR_FILE")


def job_token() -> str | None:
    """The job's secret for the supervisor (``ADAPTRAIN_JOB_TOKEN``), or None.

    Sent as ``Authorization: Bearer <token>`` with every request to the supervisor.
    """
    return _get("ADAPTRAIN_JOB_TOKEN")


def hints_interval() -> float:
    """Seconds between two posts of scheduling hints (``ADAPTRAIN_HINTS_INTERVAL``), default 30.

    Raises:
        ValueError: a value that is not a positive finite number, naming the variable.
    """
    return _get_seconds(30.0, "ADAPTRAIN_HINTS_INTERVAL", positive=True)


def checkpoint_interval() -> float:
    """Seconds of training between two periodic checkpoints (``ADAPTRAIN_CHECKPOINT_INTERVAL``);
    0 (the default, and the variable's value 0) turns periodic checkpoints off.

    Raises:
        ValueError: a value that is not a non-negative finite number, naming the variable.
    """
    return _get_seconds(0.0, "ADAPTRAIN_CHECKPOINT_INTERVAL", positive=False)


def adaptrain_sched_version() -> str | None:
    """Version of the scheduler that started the job (``ADAPTRAIN_SCHED_VERSION``), or None."""
    return _get("ADAPTRAIN_SCHED_VERSION")


def adaptdl_sched_version() -> str | None:
    """AdaptDL's name for :func:`adaptrain_sched_version` (code migrated by changing the import)."""
    return adaptrain_sched_version()


def from_ray() -> bool:
    """True when the job runs under the Ray backend (``ADAPTRAIN_RAY`` set to a true value)."""
    return (_get("ADAPTRAIN_RAY") or "").lower() in ("1", "true", "yes")


def server_url() -> str | None:
    """URL of the scheduler service the CLI talks to (``ADAPTRAIN_SERVER``), or None."""
    return _get("ADAPTRAIN_SERVER")


def server_token() -> str | None:
    """The service's token for the CLI (``ADAPTRAIN_TOKEN``), or None."""
    return _get("ADAPTRAIN_TOKEN")


def aws_metadata_url() -> str:
    """Base URL of the AWS instance metadata service (``ADAPTRAIN_AWS_METADATA_URL``), default
    ``http://169.254.169.254``: where ``adaptrain ray submit`` watches for spot interruption
    notices (IMDSv2) on each node."""
    return (_get("ADAPTRAIN_AWS_METADATA_URL") or "http://169.254.169.254").rstrip("/")


def gcp_metadata_url() -> str:
    """Base URL of the GCP metadata server (``ADAPTRAIN_GCP_METADATA_URL``), default
    ``http://169.254.169.254`` (``metadata.google.internal``'s address, with no name lookup):
    where ``adaptrain ray submit`` watches for preemption on each node."""
    return (_get("ADAPTRAIN_GCP_METADATA_URL") or "http://169.254.169.254").rstrip("/")
