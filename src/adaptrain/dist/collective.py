"""Collectives on small python objects over torch.distributed (distributed glue).

Mirrors ``adaptdl.collective``: :func:`allreduce`, :func:`allreduce_async` and :func:`broadcast`
of picklable python objects. They are meant for small control values (stop flags, batch-size
decisions, accumulator sums), not tensors of training data.

Implementation: every object collective runs on a dedicated gloo process group (created on first
use or by :func:`initialize`, collectively, so every replica must make its first call at the same
point in its program), on ONE background thread. One thread keeps the collectives of this module
in the same order on every replica, and lets :func:`allreduce_async` return at once while the
main thread keeps using the default group (NCCL or gloo) for gradients. The reduction is
``functools.reduce(reduce_fn, values_in_rank_order)``, so every replica computes the same result.

Without an initialised process group (single process) every function returns its input.

All functions must be called in the same order on every replica.
"""

from __future__ import annotations

import datetime
import functools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "allreduce",
    "allreduce_async",
    "barrier",
    "broadcast",
    "default_reduce_fn",
    "initialize",
    "is_distributed",
    "rendezvous_url",
    "teardown",
]

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_group: Any = None
_group_of: Any = None  # the default group our group was made for (detects re-initialisation)
_timeout: Any = None  # the timeout given to adaptrain.torch.init_process_group, if any
_executor: ThreadPoolExecutor | None = None


def default_reduce_fn(a: Any, b: Any) -> Any:
    """Sum: ``a + b``."""
    return a + b


def is_distributed() -> bool:
    """True when a torch.distributed default group with more than one member exists."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rendezvous_url(
    world_size: int, master_addr: str | None = None, master_port: int | None = None
) -> str:
    """``tcp://addr:port`` of the rank-0 replica (defaults from :mod:`adaptrain.env`); a single
    replica without a port gets a free one.

    Raises:
        ValueError: several replicas and no port.
    """
    from adaptrain import env
    from adaptrain.dist.spawn import free_port

    port = int(master_port or env.master_port())
    if not port:
        if world_size > 1:
            raise ValueError(
                f"world_size={world_size} needs a rendezvous port: set ADAPTRAIN_MASTER_PORT "
                "(or MASTER_PORT) on every replica, pass master_port, or pass "
                "init_method='tcp://host:port'"
            )
        port = free_port()
    addr = master_addr or env.master_addr()
    if ":" in addr and not addr.startswith("["):
        addr = f"[{addr}]"  # an IPv6 literal: torch's tcp:// parser needs the brackets
    return f"tcp://{addr}:{port}"


def initialize(
    master_addr: str | None = None,
    master_port: int | None = None,
    replica_rank: int | None = None,
    num_replicas: int | None = None,
    timeout: datetime.timedelta | None = None,
) -> None:
    """Create the gloo group and worker thread now (collective: call on every replica).

    Called by :func:`adaptrain.torch.init_process_group`; otherwise done lazily on first use.
    AdaptDL's signature: without a ``torch.distributed`` default group and with several replicas
    (or any argument given), one is created first, gloo at ``tcp://master_addr:master_port``
    with rank ``replica_rank`` of ``num_replicas`` (each default from :mod:`adaptrain.env`).
    Unlike AdaptDL, a second call is a no-op rather than an error. ``timeout`` bounds every
    collective of adaptrain's own groups (default: the default group's timeout).

    Raises:
        ValueError: no rendezvous port for several replicas, or ``num_replicas`` disagreeing
            with an existing default group.
    """
    from adaptrain import env

    global _timeout
    if timeout is not None:
        _timeout = timeout
    given = (master_addr, master_port, replica_rank, num_replicas)
    if dist.is_available() and not dist.is_initialized():
        world = env.num_replicas() if num_replicas is None else int(num_replicas)
        if world > 1 or any(v is not None for v in given):
            url = rendezvous_url(world, master_addr, master_port)
            rank = env.replica_rank() if replica_rank is None else int(replica_rank)
            kwargs = {} if timeout is None else {"timeout": timeout}
            dist.init_process_group("gloo", init_method=url, rank=rank, world_size=world, **kwargs)
    elif num_replicas is not None and dist.is_initialized():
        if int(num_replicas) != dist.get_world_size():
            raise ValueError(
                f"num_replicas={num_replicas} but the torch.distributed default group has "
                f"{dist.get_world_size()} members"
            )
    if is_distributed():
        _ensure()


def group_timeout() -> datetime.timedelta | None:
    """The timeout for adaptrain's own gloo groups: the one given to
    :func:`adaptrain.torch.init_process_group` (or :func:`initialize`), else the default
    group's own, else None (torch's default). ``dist.new_group`` does not inherit it."""
    if _timeout is not None:
        return _timeout
    world = dist.group.WORLD
    devices = [torch.device("cpu"), *getattr(world, "_device_types", ())]
    for device in devices:  # a default group created by the user (no public getter in torch)
        try:
            return world._get_backend(device).options._timeout
        except Exception:  # noqa: BLE001, S112 - no such backend here, or another torch
            continue
    return None


def new_gloo_group() -> Any:
    """A gloo group of every replica with :func:`group_timeout` (collective)."""
    timeout = group_timeout()
    return dist.new_group(backend="gloo", **({} if timeout is None else {"timeout": timeout}))


def _ensure() -> tuple[Any, ThreadPoolExecutor]:
    global _group, _group_of, _executor
    with _lock:
        default = dist.group.WORLD
        if _group is None or _group_of is not default:
            # A separate gloo group keeps our traffic off the user's default group (which may
            # be NCCL, where object collectives would need device tensors).
            _group = new_gloo_group()
            _group_of = default
            if _executor is not None:
                _executor.shutdown(wait=False)
            _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="adaptrain-collective")
        return _group, _executor


def teardown() -> None:
    """Forget the group and stop the worker thread (before ``destroy_process_group``)."""
    global _group, _group_of, _executor, _timeout
    _timeout = None
    with _lock:
        if _executor is not None:
            _executor.shutdown(wait=True)
        _group = _group_of = _executor = None


def _gather(value: Any, group: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value, group=group)
    return out


def _reduce(value: Any, reduce_fn: Callable[[Any, Any], Any], group: Any) -> Any:
    return functools.reduce(reduce_fn, _gather(value, group))


def _broadcast(value: Any, group: Any) -> Any:
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def allreduce_async(value: Any, reduce_fn: Callable[[Any, Any], Any] = default_reduce_fn) -> Future:
    """Start reducing ``value`` over all replicas; return a Future whose ``result()`` is it.

    The reduction is ``reduce_fn`` applied left to right over the values in rank order.
    """
    if not is_distributed():
        fut: Future = Future()
        fut.set_result(value)
        return fut
    group, executor = _ensure()
    return executor.submit(_reduce, value, reduce_fn, group)


def allreduce(value: Any, reduce_fn: Callable[[Any, Any], Any] = default_reduce_fn) -> Any:
    """Reduce ``value`` over all replicas and return the result on every replica (blocking)."""
    return allreduce_async(value, reduce_fn).result()


def barrier() -> None:
    """Block until every replica reaches this call (no-op in a single process)."""
    allreduce(0)


def broadcast(value: Any) -> Any:
    """Return rank 0's ``value`` on every replica (blocking); others' ``value`` is ignored."""
    if not is_distributed():
        return value
    group, executor = _ensure()
    return executor.submit(_broadcast, value, group).result()
