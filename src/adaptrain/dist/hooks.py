"""Thin DDP communication hooks over the pure compressors of :mod:`adaptrain.core.compress`.

Usage with ``DistributedDataParallel`` (or any module exposing ``register_comm_hook``)::

    from adaptrain.dist.hooks import PowerSGDHookState, powersgd_hook
    state = PowerSGDHookState(rank=4, reuse_query=True, params=model.parameters())
    ddp.register_comm_hook(state, powersgd_hook)

Each hook compresses the bucket's per-parameter gradients with the same functions the
:mod:`adaptrain.optim` optimizers use, through :class:`TorchCommunicator`, writes the averaged
result back into the bucket buffer and returns a completed future. Communication is blocking
inside the hook (no overlap with backward); per-bucket compressor state lives in the hook
state object, keyed by bucket index, and round-trips through ``state_dict()``.

(No ``from __future__ import annotations`` here: DDP checks the hooks' real annotations.)
"""

import logging
import math
from typing import Any

import torch
import torch.distributed as dist

from adaptrain.core.compress import (
    PowerSGDState,
    SignState,
    SparseState,
    powersgd_init,
    powersgd_update,
    sign_init,
    sign_update,
    sparse_init,
    sparse_update,
)

logger = logging.getLogger(__name__)

__all__ = [
    "TorchCommunicator",
    "default_communicator",
    "PowerSGDHookState",
    "powersgd_hook",
    "SparseHookState",
    "topk_hook",
    "SignHookState",
    "sign_hook",
]


class TorchCommunicator:
    """A :class:`adaptrain.core.compress.Communicator` over a ``torch.distributed`` group.

    Tracks ``sent_bytes``: the payload bytes this worker handed to collectives.
    """

    def __init__(self, group: Any = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "TorchCommunicator needs an initialised process group: call "
                "torch.distributed.init_process_group first (or use LocalCommunicator)"
            )
        self.group = group
        self.sent_bytes = 0

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    def all_reduce_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        self.sent_bytes += tensor.numel() * tensor.element_size()
        if self.world_size > 1:
            dist.all_reduce(tensor, group=self.group)
            tensor.div_(self.world_size)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        self.sent_bytes += tensor.numel() * tensor.element_size()
        if self.world_size == 1:
            return [tensor]
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(out, tensor.contiguous(), group=self.group)
        return out


def default_communicator(group: Any = None):
    """:class:`TorchCommunicator` when a process group is initialised, else a local one."""
    from adaptrain.core.compress import LocalCommunicator

    if dist.is_available() and dist.is_initialized():
        return TorchCommunicator(group)
    return LocalCommunicator()


def _done(tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(tensor)
    return fut


def _write_back(bucket: Any, outs: list[torch.Tensor]) -> torch.Tensor:
    buf = bucket.buffer()
    off = 0
    for o in outs:
        n = o.numel()
        buf[off : off + n].copy_(o.reshape(-1))
        off += n
    return buf


class _BucketStates:
    """Per-bucket compressor states, keyed so that DDP's bucket rebuild does not scramble them.

    With ``params`` (the model's parameters, in a fixed order), each bucket's gradients are put
    in that canonical order and the state is keyed by the bucket's parameter indices: DDP
    reorders buckets after the first iteration, and a reloaded state then still matches.
    Without ``params`` the key is the bucket index; a state whose shapes no longer match the
    bucket is re-initialised (logged at DEBUG).
    """

    def __init__(self, params: Any = None) -> None:
        self.states: dict[str, Any] = {}
        self.param_index = None if params is None else {id(p): i for i, p in enumerate(params)}

    def _layout(self, bucket: Any) -> tuple[list[torch.Tensor], list[int], str, int]:
        grads = bucket.gradients()
        if self.param_index is None:
            return list(grads), list(range(len(grads))), f"b{bucket.index()}", bucket.index()
        ids = [self.param_index[id(p)] for p in bucket.parameters()]
        order = sorted(range(len(grads)), key=lambda i: ids[i])
        key = ",".join(str(ids[i]) for i in order)
        return [grads[i] for i in order], order, key, ids[order[0]]

    def _get(self, key: str, shapes: list[tuple[int, ...]], memory_shapes) -> Any:
        st = self.states.get(key)
        if st is not None and memory_shapes(st) != shapes:
            logger.debug("bucket %s changed layout: compressor state re-initialised", key)
            st = None
        return st

    _state_type: Any = tuple  # the compressor's NamedTuple state, set by each subclass

    def state_dict(self) -> dict[str, Any]:
        return {"states": {k: tuple(v) for k, v in self.states.items()}}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.states = {str(k): self._state_type(*v) for k, v in sd["states"].items()}


def _write_back_ordered(
    bucket: Any, canonical_outs: list[torch.Tensor], order: list[int]
) -> torch.Tensor:
    outs: list[torch.Tensor] = [torch.empty(0)] * len(order)
    for pos, i in enumerate(order):
        outs[i] = canonical_outs[pos]
    return _write_back(bucket, outs)


def _split(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    out, off = [], 0
    for t in like:
        out.append(flat[off : off + t.numel()].view_as(t))
        off += t.numel()
    return out


class PowerSGDHookState(_BucketStates):
    """Configuration and per-bucket :class:`PowerSGDState` for :func:`powersgd_hook`."""

    _state_type = PowerSGDState

    def __init__(
        self,
        process_group: Any = None,
        rank: int = 1,
        reuse_query: bool = True,
        error_feedback: bool = True,
        seed: int = 0,
        params: Any = None,
    ) -> None:
        super().__init__(params)
        if int(rank) < 1:
            raise ValueError(f"rank={rank} must be a positive integer")
        self.process_group = process_group
        self.rank = int(rank)
        self.reuse_query = reuse_query
        self.error_feedback = error_feedback
        self.seed = int(seed)


def powersgd_hook(
    state: PowerSGDHookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: PowerSGD-compressed mean of the bucket's gradients."""
    grads, order, key, first = state._layout(bucket)
    shapes = [tuple(g.shape) for g in grads]
    st = state._get(key, shapes, lambda s: [tuple(m.shape) for m in s.memories])
    if st is None:
        st = powersgd_init(shapes, state.rank, state.seed + first, grads[0].dtype, grads[0].device)
    res, state.states[key] = powersgd_update(
        grads,
        st,
        TorchCommunicator(state.process_group),
        reuse_query=state.reuse_query,
        error_feedback=state.error_feedback,
    )
    return _done(_write_back_ordered(bucket, res.grads, order))


class SparseHookState(_BucketStates):
    """Configuration and per-bucket :class:`SparseState` for :func:`topk_hook`.

    ``ratio`` is the fraction of each bucket's coordinates sent (``k = ceil(ratio · numel)``).
    """

    _state_type = SparseState

    def __init__(
        self,
        process_group: Any = None,
        ratio: float = 0.01,
        method: str = "topk",
        seed: int = 0,
        params: Any = None,
    ) -> None:
        super().__init__(params)
        if not 0 < ratio <= 1:
            raise ValueError(f"ratio={ratio} must be in (0, 1]")
        self.process_group = process_group
        self.ratio = float(ratio)
        self.method = method
        self.seed = int(seed)


def topk_hook(
    state: SparseHookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: sparsified (top-k by default) mean of the bucket, with error memory."""
    grads, order, key, first = state._layout(bucket)
    flat = torch.cat([g.reshape(-1) for g in grads])
    st = state._get(key, [tuple(flat.shape)], lambda s: [tuple(s.memory.shape)])
    if st is None:
        st = sparse_init(flat.shape, state.seed + first, flat.dtype, flat.device)
    k = max(1, math.ceil(state.ratio * flat.numel()))
    res, state.states[key] = sparse_update(
        flat, st, TorchCommunicator(state.process_group), k=k, method=state.method
    )
    return _done(_write_back_ordered(bucket, _split(res.update, grads), order))


class SignHookState(_BucketStates):
    """Configuration and per-bucket :class:`SignState` for :func:`sign_hook`."""

    _state_type = SignState

    def __init__(
        self,
        process_group: Any = None,
        error_feedback: bool | None = None,
        majority_vote: bool = False,
        params: Any = None,
    ) -> None:
        super().__init__(params)
        if error_feedback is None:  # the default: error feedback unless majority vote is asked
            error_feedback = not majority_vote
        if error_feedback and majority_vote:
            raise ValueError(
                "error_feedback=True and majority_vote=True are alternatives (EF-SignSGD sends "
                "scaled signs and averages them; majority vote sends bare signs): pick one"
            )
        self.process_group = process_group
        self.error_feedback = bool(error_feedback)
        self.majority_vote = bool(majority_vote)


def sign_hook(state: SignHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: sign compression (EF-SignSGD scaled signs, or majority vote)."""
    grads, order, key, _ = state._layout(bucket)
    flat = torch.cat([g.reshape(-1) for g in grads])
    st = state._get(key, [tuple(flat.shape)], lambda s: [tuple(s.memory.shape)])
    if st is None:
        st = sign_init(flat.shape, flat.dtype, flat.device)
    res, state.states[key] = sign_update(
        flat,
        st,
        TorchCommunicator(state.process_group),
        error_feedback=state.error_feedback,
        majority=state.majority_vote,
    )
    return _done(_write_back_ordered(bucket, _split(res.update, grads), order))
