"""``init_process_group``: join (or create) the job's torch.distributed group.

Sources of the group's coordinates, first match wins for each value:

* the arguments ``init_method``, ``world_size``, ``rank``;
* ``ADAPTRAIN_MASTER_ADDR``/``ADAPTRAIN_MASTER_PORT``/``ADAPTRAIN_NUM_REPLICAS``/
  ``ADAPTRAIN_REPLICA_RANK`` (the seed's "Distributed Training" variables);
* torchrun's ``MASTER_ADDR``/``MASTER_PORT``/``WORLD_SIZE``/``RANK``;
* nothing: a single process, a 1-member group on 127.0.0.1 with a free port.

Then the python-object collectives are initialised, the SIGINT/SIGTERM handlers installed, the
checkpoint to restore from (if ``ADAPTRAIN_CHECKPOINT_PATH`` holds one) chosen, and an exit
hook registered that destroys the process group cleanly.
"""

from __future__ import annotations

import atexit
import logging
from datetime import timedelta

import torch.distributed as dist

from adaptrain import env
from adaptrain.dist import checkpoint, collective, signals

__all__ = ["init_process_group"]

logger = logging.getLogger(__name__)


def init_process_group(
    backend: str,
    init_method: str | None = None,
    world_size: int | None = None,
    rank: int | None = None,
    timeout: timedelta | None = None,
) -> None:
    """Initialise the default process group and adaptrain's collectives.

    Args:
        backend: ``"nccl"`` for GPUs, else ``"gloo"``.
        init_method: URL such as ``tcp://host:port``; default from the environment.
        world_size: number of replicas; default ``adaptrain.env.num_replicas()``.
        rank: this replica's rank; default ``adaptrain.env.replica_rank()``.
        timeout: collective timeout (torch's default if None).

    Raises:
        ValueError: inconsistent rank/world size, or several replicas but no master port.
    """
    if world_size is None:
        world_size = env.num_replicas()
    if rank is None:
        rank = env.replica_rank()
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(
            f"rank={rank} world_size={world_size}: need world_size >= 1 and 0 <= rank < "
            "world_size; check ADAPTRAIN_REPLICA_RANK/ADAPTRAIN_NUM_REPLICAS (or RANK/WORLD_SIZE)"
        )
    if dist.is_initialized():
        logger.info("torch.distributed already initialized; reusing the default group")
    else:
        if init_method is None:
            init_method = collective.rendezvous_url(world_size)
        logger.info(
            "initializing torch.distributed using %s?rank=%d&world_size=%d",
            init_method,
            rank,
            world_size,
        )
        kwargs = {} if timeout is None else {"timeout": timeout}
        dist.init_process_group(
            backend, init_method=init_method, world_size=world_size, rank=rank, **kwargs
        )
        logger.info("torch.distributed initialized")
    collective.initialize(timeout=timeout)
    signals.install()
    atexit.unregister(_shutdown)
    atexit.register(_shutdown)
    # Choose (and validate) the checkpoint to restore from now, before any State loads: rank
    # 0's choice, on every replica.
    checkpoint.restore_dir(agree=True)


def _shutdown() -> None:
    """At exit: finish the pending stop poll, stop the collective thread, destroy the group.

    Leaving a gloo process group to be torn down during interpreter finalisation can abort the
    process ("terminate called without an active exception"), which torchrun reports as a
    failure; destroying it here avoids that. The SIGINT/SIGTERM handlers stay installed: a
    signal during the teardown (a scheduler rescaling the job as it ends) only gets recorded,
    so a run that finished exits 0; with the default action it would die with 143 and be
    resumed from its last periodic checkpoint, training again on what followed it.
    """
    try:
        checkpoint.wait_for_background_save()  # a periodic checkpoint being written
        signals.reset(keep_handlers=True)  # a late SIGTERM must not turn exit 0 into 143
        collective.teardown()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - best effort at exit
        logger.debug("shutdown: %s", exc)
