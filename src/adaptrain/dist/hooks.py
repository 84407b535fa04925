"""Thin DDP communication hooks over the pure compressors of :mod:`adaptrain.core.compress`.

Usage with ``DistributedDataParallel`` (or any module exposing ``register_comm_hook``)::

    from adaptrain.dist.hooks import PowerSGDHookState, powersgd_hook
    state = PowerSGDHookState(rank=4, reuse_query=True, params=model.parameters())
    ddp.register_comm_hook(state, powersgd_hook)

Each hook compresses the bucket's per-parameter gradients with the same functions the
:mod:`adaptrain.optim` optimizers use, through :class:`TorchCommunicator`, writes the averaged
result back into the bucket buffer and returns a completed future. Communication is blocking
inside the hook (no overlap with backward); compressor state lives in the hook state object
and round-trips through ``state_dict()``. :func:`powersgd_hook` keeps it per parameter (error
memory and warm-start query) and assembles each bucket's state from those entries, so DDP's
bucket rebuild after the first iteration loses nothing; the sparse and sign hooks keep one
state per bucket, keyed by the bucket's parameter indices.

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
    sign_update,
    sparse_update,
)
from adaptrain.core.compress.powersgd import _factor_shape  # the compressor's own rule

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


class _SlotState:
    """Compressor state kept per parameter ("slot"), so DDP's bucket rebuild loses nothing.

    DDP regroups its buckets after the first iteration (in gradient-ready order). State kept
    per bucket would be orphaned under the old grouping and the new buckets would start from
    zero error memory, so what the first iteration's compression dropped would never be fed
    back. Here every entry belongs to one parameter: with ``params`` the key is its index
    (``"3"``); without, the bucket slot (``"b0.3"``: bucket 0, position 3), a bucket whose
    layout (its gradients' shapes) changed starts afresh, and the slots no bucket used in an
    iteration are dropped. ``step`` counts the iterations; it advances after the last bucket.
    """

    _slot_dicts: tuple[str, ...] = ("memories",)

    def __init__(self, params: Any = None) -> None:
        self.param_index = None if params is None else {id(p): i for i, p in enumerate(params)}
        self.memories: dict[str, torch.Tensor] = {}
        self.step = 0
        self._used: set[str] = set()  # within an iteration: the slots buckets used

    def _canonical(self, bucket: Any) -> tuple[list[torch.Tensor], list[int], list[int] | None]:
        """The bucket's gradients in parameter-index order, that order, and the indices."""
        grads = bucket.gradients()
        if self.param_index is None:
            return list(grads), list(range(len(grads))), None
        ids = [self.param_index[id(p)] for p in bucket.parameters()]
        order = sorted(range(len(grads)), key=lambda i: ids[i])
        return [grads[i] for i in order], order, [ids[i] for i in order]

    def _keys(self, bucket: Any, ids: list[int] | None, n: int) -> list[str]:
        if ids is None:
            return [f"b{bucket.index()}.{j}" for j in range(n)]
        return [str(i) for i in ids]

    def _check_layout(self, keys: list[str], grads: list[torch.Tensor]) -> None:
        """Without ``params``: forget a bucket's slots unless its layout is unchanged."""
        if self.param_index is not None:
            return
        bucket = keys[0].rsplit(".", 1)[0]
        old = [self.memories.get(k) for k in keys]
        if f"{bucket}.{len(keys)}" in self.memories or any(
            m is None or m.shape != g.shape for m, g in zip(old, grads)
        ):
            if any(m is not None for m in old):
                logger.debug("bucket %s changed layout: compressor state re-initialised", bucket)
            for k in keys:
                for name in self._slot_dicts:
                    getattr(self, name).pop(k, None)

    def _end_iteration(self, advance: bool = True) -> None:
        if advance:
            self.step += 1
        if self.param_index is None:  # bucket slots no bucket used any more
            for key in [k for k in self.memories if k not in self._used]:
                for name in self._slot_dicts:
                    getattr(self, name).pop(key, None)
        self._used = set()


class _FlatMemoryState(_SlotState):
    """Per-parameter error memory of a hook that compresses a bucket as one flat vector.

    Top-k, random-k and sign compression take the bucket's gradients concatenated; their error
    memory is elementwise, so each parameter keeps its piece and the bucket's flat memory is
    assembled from the pieces and split back after the update.
    """

    def _flat(
        self, bucket: Any
    ) -> tuple[list[torch.Tensor], list[int], list[str], int, torch.Tensor, torch.Tensor]:
        """Gradients (canonical order), their order in the bucket, keys, the bucket's first
        parameter index (bucket index without ``params``), flat gradients and flat memory."""
        grads, order, ids = self._canonical(bucket)
        keys = self._keys(bucket, ids, len(grads))
        self._check_layout(keys, grads)
        flat = torch.cat([g.reshape(-1) for g in grads])
        pieces = []
        for key, g in zip(keys, grads):
            m = self.memories.get(key)
            if m is None or m.shape != g.shape:
                m = torch.zeros_like(g)
            pieces.append(m.reshape(-1).to(device=flat.device, dtype=flat.dtype))
        first = bucket.index() if ids is None else ids[0]
        return grads, order, keys, first, flat, torch.cat(pieces)

    def _keep(self, bucket: Any, keys: list[str], grads: list[torch.Tensor], memory) -> None:
        for key, piece in zip(keys, _split(memory, grads)):
            self.memories[key] = piece
        self._used.update(keys)
        if bucket.is_last():
            self._end_iteration()

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "memories": dict(self.memories)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Load a :meth:`state_dict`. The per-bucket format of earlier versions
        (``{"states": …}``) holds flat memories that cannot be split without the parameters'
        shapes: it loads with empty error memory (a warning says so)."""
        if "states" in sd:
            logger.warning(
                "%s: per-bucket state of an earlier version; the error memory restarts at zero",
                type(self).__name__,
            )
            steps = [int(v[1]) for v in sd["states"].values() if len(v) > 1]
            self.step, self.memories = max(steps, default=0), {}
        else:
            self.step = int(sd["step"])
            self.memories = {str(k): v for k, v in sd["memories"].items()}
        self._used = set()


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


class PowerSGDHookState(_SlotState):
    """Configuration and per-parameter PowerSGD state for :func:`powersgd_hook`.

    The state is kept per parameter, not per bucket: ``memories[key]`` (the error memory,
    shaped like the gradient) and ``qs[key]`` (the warm-start query, ``m × r``; ``0 × 0`` for
    tensors sent uncompressed), plus one ``step`` counter (iterations whose update went
    through; it advances after the last bucket of an iteration unless a bucket of that
    iteration saw non-finite values). The hook assembles each bucket's
    :class:`~adaptrain.core.compress.PowerSGDState` from these entries and writes them back,
    so DDP's bucket rebuild after the first iteration regroups the same tensors and no entry is
    orphaned. With ``params`` the key is the parameter's index (``"3"``) and each fresh query
    is drawn from ``(seed, step, parameter index)``, independent of the bucketing; without
    ``params`` it is the bucket slot (``"b0.3"``: bucket 0, position 3); a bucket whose layout
    (its gradients' shapes) changed is re-initialised, and the slots no bucket used in an
    iteration are dropped.

    A matrix is sent uncompressed when ``(n + m) · r · min_compression_rate ≥ n · m``: by default
    (``1``) when ``P`` and ``Q`` would not be smaller than the matrix (e.g. ``10 × 10`` at rank 8),
    as torch's hook does (its default is 2); ``0`` compresses every matrix.
    """

    def __init__(
        self,
        process_group: Any = None,
        rank: int = 1,
        reuse_query: bool = True,
        error_feedback: bool = True,
        seed: int = 0,
        params: Any = None,
        min_compression_rate: float = 1.0,
    ) -> None:
        super().__init__(params)
        if int(rank) < 1:
            raise ValueError(f"rank={rank} must be a positive integer")
        if not min_compression_rate >= 0:
            raise ValueError(f"min_compression_rate={min_compression_rate} must be ≥ 0")
        self.process_group = process_group
        self.rank = int(rank)
        self.reuse_query = reuse_query
        self.error_feedback = error_feedback
        self.seed = int(seed)
        self.min_compression_rate = float(min_compression_rate)
        self.qs: dict[str, torch.Tensor] = {}
        self._skipped = False  # within an iteration: a bucket's update was skipped (non-finite)

    _slot_dicts = ("memories", "qs")

    def _slots(
        self, bucket: Any
    ) -> tuple[list[torch.Tensor], list[int], list[str], list[int], int]:
        """Gradients (canonical order), their order in the bucket, keys, query indices and the
        offset added to ``seed``."""
        grads, order, ids = self._canonical(bucket)
        keys = self._keys(bucket, ids, len(grads))
        if ids is None:  # the former per-bucket seeds and query indices
            return grads, order, keys, list(range(len(grads))), bucket.index()
        return grads, order, keys, ids, 0

    def _assemble(
        self, grads: list[torch.Tensor], keys: list[str], qidx: list[int], seed: int
    ) -> PowerSGDState:
        self._check_layout(keys, grads)
        fresh = None
        mems, qs = [], []
        for j, (g, key) in enumerate(zip(grads, keys)):
            mem, q = self.memories.get(key), self.qs.get(key)
            if mem is not None and mem.shape != g.shape:
                logger.debug("parameter %s changed shape: PowerSGD state re-initialised", key)
                mem = q = None
            if q is not None:
                fs = _factor_shape(g.shape, self.rank, self.min_compression_rate)
                if tuple(q.shape) != ((0, 0) if fs is None else fs[1:]):  # another rank or rate
                    q = None
            if mem is None or q is None:
                if fresh is None:
                    shapes = [tuple(t.shape) for t in grads]
                    fresh = powersgd_init(
                        shapes,
                        self.rank,
                        seed,
                        g.dtype,
                        g.device,
                        query_indices=qidx,
                        min_compression_rate=self.min_compression_rate,
                    )
                mem = fresh.memories[j] if mem is None else mem
                q = fresh.qs[j] if q is None else q
            mems.append(_like(mem, g))
            qs.append(_like(q, g))
        return PowerSGDState(tuple(mems), tuple(qs), self.step, seed, self.rank)

    def _store(self, keys: list[str], old: PowerSGDState, new: PowerSGDState) -> None:
        for key, mem, q in zip(keys, new.memories, new.qs):
            self.memories[key] = mem
            self.qs[key] = q
        self._used.update(keys)
        if new.step == old.step:  # non-finite values: the compressor kept the old state
            self._skipped = True

    def _end_iteration(self, advance: bool = True) -> None:
        super()._end_iteration(advance and not self._skipped)
        self._skipped = False

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "memories": dict(self.memories), "qs": dict(self.qs)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Load a :meth:`state_dict`; the older per-bucket format (``{"states": …}``) is
        converted: each parameter takes its entry from the bucket state with the latest step."""
        if "states" in sd:
            self.step, self.memories, self.qs = _from_bucket_states(sd["states"])
        else:
            self.step = int(sd["step"])
            self.memories = {str(k): v for k, v in sd["memories"].items()}
            self.qs = {str(k): v for k, v in sd["qs"].items()}
        self._skipped = False
        self._used = set()


def _from_bucket_states(states: dict[str, Any]) -> tuple[int, dict, dict]:
    """Per-parameter entries from the per-bucket format (keys ``"0,1,2"`` or ``"b0"``)."""
    latest: dict[str, tuple[int, torch.Tensor, torch.Tensor]] = {}
    for key, fields in states.items():
        st = PowerSGDState(*fields)
        key = str(key)
        if key.startswith("b"):
            slots = [f"{key}.{j}" for j in range(len(st.memories))]
        else:
            slots = key.split(",")
        if len(slots) != len(st.memories):
            raise ValueError(f"PowerSGD bucket state {key!r} has {len(st.memories)} tensors")
        for slot, mem, q in zip(slots, st.memories, st.qs):
            if slot not in latest or st.step > latest[slot][0]:
                latest[slot] = (int(st.step), mem, q)
    step = max((v[0] for v in latest.values()), default=0)
    return step, {k: v[1] for k, v in latest.items()}, {k: v[2] for k, v in latest.items()}


def _like(t: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``t`` on ``g``'s device and in its dtype (itself when it already is)."""
    return t if t.dtype == g.dtype and t.device == g.device else t.to(g.device, g.dtype)


def _write_back_flat(
    bucket: Any, canonical_outs: list[torch.Tensor], order: list[int]
) -> torch.Tensor:
    """The bucket buffer holding ``canonical_outs`` (canonical order) in bucket order: one
    ``cat`` straight into the buffer instead of one copy per tensor."""
    buf = bucket.buffer()
    outs: list[torch.Tensor] = [torch.empty(0)] * len(order)
    for pos, i in enumerate(order):
        outs[i] = canonical_outs[pos].reshape(-1)
    if sum(o.numel() for o in outs) == buf.numel() and all(o.dtype == buf.dtype for o in outs):
        torch.cat(outs, out=buf)  # (a size mismatch would resize the buffer: not here)
        return buf
    return _write_back(bucket, outs)


def powersgd_hook(
    state: PowerSGDHookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: PowerSGD-compressed mean of the bucket's gradients (Vogels et al., 2019,
    arXiv:1905.13727; the update rule of :func:`adaptrain.core.compress.powersgd_update`).

    Per bucket: two all-reduces (the uncompressed gradients with all ``P`` factors, then all
    ``Q`` factors) and one host-device synchronisation (the finiteness verdict). If the
    bucket's all-reduced values are not finite (an fp16 overflow), the output is non-finite,
    so a ``GradScaler`` skips the step, and the stored state is left unchanged.
    """
    grads, order, keys, qidx, seed = state._slots(bucket)
    st = state._assemble(grads, keys, qidx, state.seed + seed)
    res, new = powersgd_update(
        grads,
        st,
        TorchCommunicator(state.process_group),
        reuse_query=state.reuse_query,
        error_feedback=state.error_feedback,
        query_indices=qidx,
        min_compression_rate=state.min_compression_rate,
    )
    state._store(keys, st, new)
    if bucket.is_last():
        state._end_iteration()
    return _done(_write_back_flat(bucket, res.grads, order))


class SparseHookState(_FlatMemoryState):
    """Configuration and per-parameter error memory for :func:`topk_hook`.

    ``ratio`` is the fraction of each bucket's coordinates sent (``k = ceil(ratio · numel)``);
    random-k draws them from ``seed`` + the bucket's first parameter index and ``step``.
    """

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
    grads, order, keys, first, flat, memory = state._flat(bucket)
    st = SparseState(memory, state.step, state.seed + first)
    k = max(1, math.ceil(state.ratio * flat.numel()))
    res, new = sparse_update(
        flat, st, TorchCommunicator(state.process_group), k=k, method=state.method
    )
    state._keep(bucket, keys, grads, new.memory)
    return _done(_write_back_ordered(bucket, _split(res.update, grads), order))


class SignHookState(_FlatMemoryState):
    """Configuration and per-parameter error memory for :func:`sign_hook`."""

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
    grads, order, keys, _, flat, memory = state._flat(bucket)
    res, new = sign_update(
        flat,
        SignState(memory),
        TorchCommunicator(state.process_group),
        error_feedback=state.error_feedback,
        majority=state.majority_vote,
    )
    state._keep(bucket, keys, grads, new.memory)
    return _done(_write_back_ordered(bucket, _split(res.update, grads), order))
