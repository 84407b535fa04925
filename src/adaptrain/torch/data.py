"""Elastic, restart-safe data loading with adaptive batch size (``adaptdl.torch.data`` equivalent).

Exactly-once rule. Each epoch has one fixed order of the dataset (a permutation seeded by the
epoch when ``shuffle``). A data-loader loop ("pass") walks that order from
``current_index`` (checkpointed) to the end; every micro-batch takes the next ``size`` samples
of the order, and replica ``r`` of ``R`` gets ``chunk[r::R]``. ``current_index`` advances by
``size`` on every replica once the micro-batch has been processed, so a checkpoint taken at a
step boundary, then resumed on any number of replicas, continues with exactly the samples not
yet processed: within each pass every sample is processed exactly once, with no padding.

The end of a pass: a global micro-batch normally holds ``local_bsz * R`` samples; if fewer
than ``R`` samples would be left after it, they are folded into it (local sizes then differ by at
most one), so every replica always gets at least one sample and all replicas take the same
number of steps (DDP's collectives stay matched). The only case that cannot be split that way is
a pass that *starts* with fewer than ``R`` samples left (a resume very near the end of an epoch
on more replicas): a training loop then gives the replicas without a sample a copy of one (logged;
the only duplicate this loader ever makes), while an evaluation loop (a loader that is not the
training loader, iterated with gradients disabled) never pads: those replicas yield nothing.
``drop_last=True`` drops the final incomplete optimizer step of a pass instead.

Epochs with adaptive batch size end after **one pass over the dataset** (not after "one
dataset's worth of statistical progress" as AdaptDL does): simpler, and exactly-once holds
per epoch. The batch size is set at the start of each pass; when autoscaling it is decided at
the start of each *segment* of optimizer steps instead: soon after each change (once the new
configuration has been profiled for ``_metrics.MIN_SAMPLES`` steps), then at doubling intervals
up to every ``reoptimize_every`` optimizer steps (default 50). A segment that a pass ends early
goes on in the next pass (a small dataset at a large batch would otherwise re-decide every few
steps). Rank 0 asks ``_metrics.suggest_batch_size`` (which switches only for a ≥ 5% predicted
goodput gain) and broadcasts the answer; nothing is decided mid-step, so accumulation cycles are
never cut.

Stopping: at every optimizer-step boundary all replicas call
:func:`adaptrain.dist.signals.poll_stop` (its all-reduce runs every step, or every few steps when
steps are faster than ``signals.POLL_PERIOD``); on an agreed SIGINT/SIGTERM the loader
checkpoints every State and exits (code 143/130). The same poll takes the periodic checkpoints
(``ADAPTRAIN_CHECKPOINT_INTERVAL``), and with a supervisor rank 0's training loader hands the
scheduling hints to their sending thread there (:mod:`adaptrain.torch._hints`).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import operator
import pickle
import random
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, Sampler

from adaptrain import env
from adaptrain.dist import checkpoint, collective, signals
from adaptrain.torch import _hints, _metrics
from adaptrain.torch.epoch import current_epoch

__all__ = [
    "AdaptiveDataLoader",
    "AdaptiveDataLoaderHelper",
    "AdaptiveDataLoaderMixin",
    "ElasticSampler",
    "current_dataloader",
]

logger = logging.getLogger(__name__)


def _world() -> tuple[int, int]:
    """(num_replicas, rank) of this process."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return env.num_replicas(), env.replica_rank()


_PASS_SEED_STRIDE = 0x9E3779B97F4A7C15  # 2**64 / golden ratio: spreads the passes' seeds


def _permutation(
    n: int, shuffle: bool, epoch: int | None, seed: int, pass_index: int = 0
) -> list[int]:
    """Order of pass ``pass_index`` (0: the first) of ``epoch`` over ``n`` samples."""
    if not shuffle:
        return list(range(n))
    g = torch.Generator()
    base = int(seed) * 1_000_003 + int(epoch or 0)
    if pass_index:  # a later pass of the same epoch: another deterministic shuffle
        base = (base + pass_index * _PASS_SEED_STRIDE) % (1 << 64)
    g.manual_seed(base)
    return torch.randperm(n, generator=g).tolist()


class ElasticSampler(Sampler[int]):
    """Partition a dataset over replicas, resumable at any index, without padding.

    For the epoch set by :meth:`set_epoch` the dataset order is fixed (deterministic shuffle
    seeded by the epoch); from ``index`` on, replica ``r`` of ``R`` yields ``order[index + r::R]``
    (for an index below the dataset's length).

    As in AdaptDL, ``index`` may go past the end of the dataset: index ``k · len(dataset) + i``
    is position ``i`` of the epoch's pass ``k``, each pass in its own deterministic order (the
    same order every pass without ``shuffle``). A loader that runs several passes in one epoch
    and rounds its index up to the next multiple of the dataset's length after each (AdaptDL's
    loader with an adaptive batch size) resumes the right pass after a restart; an index equal
    to the length starts the next pass, it does not end the epoch.

    Unlike AdaptDL's, the replicas' shares may differ by one sample (10 samples on 3 replicas:
    4 / 3 / 3), so that every sample is seen exactly once. A custom loader batching this
    output must give every replica the same number of batches (``profile()`` and DDP's
    all-reduce are collectives), e.g. by cutting batches by global position as
    :class:`AdaptiveDataLoader` does, or by dropping the last incomplete batch.

    ``num_replicas`` and ``rank`` are read at construction (the process group's, else the
    environment's) and kept: a caller may set them, and :meth:`set_epoch` leaves them alone.

    Args:
        dataset: a map-style dataset (with ``__len__``).
        shuffle: shuffle deterministically per epoch.
        seed: base seed of the shuffle (same on every replica).
    """

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0) -> None:
        if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
            raise ValueError("ElasticSampler needs a map-style dataset with __len__")
        self.dataset = dataset
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.num_replicas, self.rank = _world()
        self.epoch = 0
        self.index = 0

    def _position(self) -> tuple[int, int]:
        """(pass, position within it) of the set index (pass 0 for an empty dataset)."""
        n = len(self.dataset)
        return divmod(self.index, n) if n else (0, 0)

    def order(self) -> list[int]:
        """The order of all dataset indices in the set index's pass of the set epoch (the same
        on every replica; the epoch's first pass for an index below the dataset's length)."""
        k = self._position()[0]
        return _permutation(len(self.dataset), self.shuffle, self.epoch, self.seed, k)

    def __iter__(self) -> Iterator[int]:
        """This replica's indices of the set epoch, from the set index on."""
        start = self._position()[1]
        return iter(self.order()[start + self.rank :: self.num_replicas])

    def __len__(self) -> int:
        """Number of indices :meth:`__iter__` yields on this replica."""
        start = self._position()[1]
        return len(range(start + self.rank, len(self.dataset), self.num_replicas))

    def set_epoch(self, epoch: int, index: int = 0) -> None:
        """Use ``epoch``'s order and start at global position ``index`` (e.g. after a restart).

        Only the epoch and the index change (``num_replicas`` and ``rank`` stay as they are).
        An index past the dataset's length continues into a later pass (see the class).

        Raises:
            ValueError: if ``index`` is negative.
        """
        index = operator.index(index)
        if index < 0:
            raise ValueError(f"index={index} must be ≥ 0 (a global position in the epoch)")
        self.epoch = epoch
        self.index = index


@dataclass
class _MicroBatch:
    start: int  # global position of its first sample in the epoch's order
    size: int  # samples over all replicas
    first: bool  # first micro-batch of an optimizer step (a step boundary)
    optim: bool  # last micro-batch of an optimizer step


def plan_pass(
    start: int,
    end: int,
    local_bsz: int,
    accum_steps: int,
    num_replicas: int,
    drop_last: bool = False,
    max_steps: int | None = None,
) -> list[_MicroBatch]:
    """Micro-batches covering ``[start, end)`` exactly once (see the module docstring).

    Each optimizer step has up to ``accum_steps`` micro-batches of ``local_bsz * num_replicas``
    samples; a remainder smaller than ``num_replicas`` is folded into the micro-batch before it
    (with ``drop_last``, dropped with the incomplete step: every micro-batch is full).
    Stops after ``max_steps`` optimizer steps if given.
    """
    if local_bsz < 1 or accum_steps < 1 or num_replicas < 1:
        raise ValueError(
            f"local_bsz={local_bsz}, accum_steps={accum_steps}, num_replicas={num_replicas} "
            "must all be ≥ 1"
        )
    g = local_bsz * num_replicas
    out: list[_MicroBatch] = []
    idx, steps = start, 0
    while idx < end and (max_steps is None or steps < max_steps):
        if drop_last and end - idx < g * accum_steps:
            break
        for i in range(accum_steps):
            left = end - idx
            size = min(g, left)
            if not drop_last and 0 < left - size < num_replicas:
                size = left  # under drop_last the remainder goes with the incomplete step
            last = i == accum_steps - 1 or idx + size == end
            out.append(_MicroBatch(idx, size, i == 0, last))
            idx += size
            if last:
                break
        steps += 1
    return out


class _PlanBatchSampler:
    """Batch sampler replaying a fixed list of local index lists (one DataLoader iterator)."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    def __iter__(self) -> Iterator[list[int]]:
        return iter([b for b in self.batches if b])

    def __len__(self) -> int:
        return sum(1 for b in self.batches if b)


def current_dataloader() -> AdaptiveDataLoaderHelper | None:
    """The :class:`AdaptiveDataLoaderHelper` being iterated now, or None."""
    return AdaptiveDataLoaderHelper._current


class _AdaptiveDataLoaderState(checkpoint.State):
    # Loaders are created in the same order on every replica: (epoch, count) names them.
    init_count: collections.Counter = collections.Counter()

    def __init__(self) -> None:
        if current_dataloader() is not None:
            raise RuntimeError(
                "a data loader may not be created while another one is being iterated"
            )
        epoch = current_epoch()
        count = _AdaptiveDataLoaderState.init_count[epoch]
        super().__init__(f"adaptrain-dataloader-epoch{epoch}-{count}")
        _AdaptiveDataLoaderState.init_count[epoch] += 1
        self.current_index = 0  # samples of the current pass processed by all replicas
        self.end_index = 0
        self.last_position: dict = {}  # epoch -> position of the last finished loop
        self.local_bsz = 0  # batch-size decision (0: none yet)
        self.accum_steps = 1
        self.num_replicas = 0  # replica count the decision was made for

    def save(self, fileobj: BinaryIO) -> None:
        pickle.dump(
            {
                "current_index": int(self.current_index),
                "end_index": int(self.end_index),
                "last_position": dict(self.last_position),
                "local_bsz": int(self.local_bsz),
                "accum_steps": int(self.accum_steps),
                "num_replicas": int(self.num_replicas),
            },
            fileobj,
        )

    def load(self, fileobj: BinaryIO) -> None:
        d = pickle.load(fileobj)
        self.current_index = d["current_index"]
        self.end_index = d["end_index"]
        self.last_position = d["last_position"]
        self.local_bsz = d["local_bsz"]
        self.accum_steps = d["accum_steps"]
        self.num_replicas = d["num_replicas"]


def _positive_int(value: Any) -> bool:
    """``value`` is an int ≥ 1 (a bool is not)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _check_batch_size(batch_size: Any) -> int:
    if not _positive_int(batch_size):
        raise ValueError(f"batch_size={batch_size!r} must be a positive int (global batch size)")
    return batch_size


class AdaptiveDataLoaderHelper:
    """Elastic bookkeeping of one data loader; custom loaders build on it (see the mixin).

    Args:
        batch_size: target global batch size (all replicas, one optimizer step).
    """

    _position: collections.Counter = collections.Counter()  # epoch -> loops finished in it
    _training: AdaptiveDataLoaderHelper | None = None
    _current: AdaptiveDataLoaderHelper | None = None

    def __init__(self, batch_size: int = 1) -> None:
        self.batch_size = _check_batch_size(batch_size)
        self._max_batch_size: int | None = None
        self._local_bsz_bounds: tuple[int | None, int | None] | None = None
        self._gradient_accumulation = False
        self.min_improvement = 0.05
        self.reoptimize_every = 50
        self._segment: int | None = None  # optimizer steps of the current segment
        self._segment_decision: tuple[int, int, int] | None = None
        # Optimizer steps left in the segment a finished pass cut short (None: decide anew).
        self._segment_left: int | None = None
        self._state = _AdaptiveDataLoaderState()
        checkpoint.load_state(self._state)
        self._accum_count = 0
        self._mb: _MicroBatch | None = None
        self._mb_local = 0
        self._poll_ok = True
        self._skipped = False  # skipdone() skipped the loop of the current context
        # (local_bsz, accum_steps, num_replicas) last decided in this process: while the state
        # still holds it, it is for the current replica count (the properties' fast path).
        self._decided: tuple[int, int, int] | None = None

    # ----- properties ---------------------------------------------------------------------------
    @property
    def current_index(self) -> int | None:
        """Samples of the current loop processed so far by all replicas; None when not iterating."""
        if AdaptiveDataLoaderHelper._current is not self:
            return None
        return self._state.current_index

    @current_index.setter
    def current_index(self, index: int) -> None:
        if AdaptiveDataLoaderHelper._current is self:
            self._state.current_index = index

    @property
    def end_index(self) -> int:
        """(Optional) end index of the current loop, kept across restarts."""
        return self._state.end_index

    @end_index.setter
    def end_index(self, index: int) -> None:
        self._state.end_index = index

    @property
    def max_batch_size(self) -> int | None:
        """Largest global batch size allowed; None when adaptive batch size is off."""
        return self._max_batch_size

    @property
    def local_bsz_bounds(self) -> tuple[int | None, int | None] | None:
        """``(min_local_bsz, max_local_bsz)`` per replica, or None."""
        return self._local_bsz_bounds

    @property
    def current_local_bsz(self) -> int:
        """Samples per micro-batch on each replica (the last one of a loop may differ by ±1).

        Always for the current replica count: after a restart on another count, before the
        first iteration, it is the checkpointed decision converted to the same global batch.
        """
        return self._current_decision()[0]

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per optimizer step (≥ 1; 1 means no gradient accumulation)."""
        return self._current_decision()[1]

    @property
    def current_batch_size(self) -> int:
        """Global samples per optimizer step: local_bsz × accumulation_steps × replicas."""
        return self.current_local_bsz * self.accumulation_steps * _world()[0]

    @property
    def training(self) -> bool:
        """Whether this is the job's training loader (set by :meth:`train`/autoscale)."""
        return self is AdaptiveDataLoaderHelper._training

    def is_accum_step(self) -> bool:
        """Whether the current micro-batch's gradient is only accumulated (no optimizer step)."""
        if self._mb is not None:
            return not self._mb.optim
        return self._accum_count < self.accumulation_steps - 1

    def is_optim_step(self) -> bool:
        """Whether the optimizer steps after the current micro-batch."""
        return not self.is_accum_step()

    # ----- configuration ------------------------------------------------------------------------
    def train(self) -> None:
        """Mark this loader as the training loader if there is none yet.

        :meth:`autoscale_batch_size` makes its loader the training loader even when another one
        is (e.g. a new training loader created each epoch); a plain ``train()`` (as
        :class:`~adaptrain.torch.AdaptiveDataParallel` calls on the loader it backpropagates
        from) does not take over.
        """
        if AdaptiveDataLoaderHelper._training is None:
            AdaptiveDataLoaderHelper._training = self
        if self.training:
            _metrics.set_batch_size(
                self.batch_size,
                self._max_batch_size,
                self._local_bsz_bounds,
                self._gradient_accumulation,
            )

    def autoscale_batch_size(
        self,
        max_batch_size: int,
        local_bsz_bounds: tuple[int | None, int | None] | None = None,
        gradient_accumulation: bool = False,
        *,
        reoptimize_every: int | None = None,
    ) -> None:
        """Let the batch size adapt up to ``max_batch_size`` (global); call once after creation.

        Makes this loader the training loader (the one whose batch size adapts, profiled, with
        gradient accumulation), in place of any earlier one: a training loader created anew
        each epoch takes over from the previous epoch's.

        ``reoptimize_every`` (keyword only, an adaptrain extension; None keeps the current
        value, 50 by default): the most optimizer steps between two batch-size decisions once
        the configuration has settled (after a change the next decision comes within a few
        steps, and the gap then doubles up to this).

        Raises:
            ValueError: ``max_batch_size`` not an int ≥ the initial batch size, bounds that are
                not ``(min, max)`` with ``1 ≤ min ≤ max`` and ``min ≤ max_batch_size``, or a
                ``reoptimize_every`` that is not an int ≥ 1.
                (``min × replicas > max_batch_size`` is only logged: the global batch size then
                exceeds ``max_batch_size`` on this replica count.)
            RuntimeError: called while another loader, the training loader, is being iterated
                (it would stop being the training loader mid-loop).
        """
        if not _positive_int(max_batch_size) or max_batch_size < self.batch_size:
            raise ValueError(
                f"max_batch_size={max_batch_size!r} must be an int ≥ the loader's "
                f"batch_size={self.batch_size}"
            )
        if reoptimize_every is not None and not _positive_int(reoptimize_every):
            raise ValueError(
                f"reoptimize_every={reoptimize_every!r} must be an int ≥ 1 (optimizer steps "
                "between two batch-size decisions), or None to keep the current value"
            )
        if local_bsz_bounds is not None:
            try:
                lo, hi = local_bsz_bounds
            except (TypeError, ValueError):
                raise ValueError(
                    f"local_bsz_bounds={local_bsz_bounds!r} must be a pair (min_local_bsz, "
                    "max_local_bsz)"
                ) from None
            for v in (lo, hi):
                if v is not None and not _positive_int(v):
                    raise ValueError(
                        f"local_bsz_bounds={local_bsz_bounds!r}: bounds must be positive ints "
                        "or None"
                    )
            if lo is not None and hi is not None and lo > hi:
                raise ValueError(f"local_bsz_bounds={local_bsz_bounds!r}: min > max")
            if lo is not None and lo > max_batch_size:
                raise ValueError(
                    f"local_bsz_bounds={local_bsz_bounds!r}: min_local_bsz exceeds "
                    f"max_batch_size={max_batch_size}"
                )
            local_bsz_bounds = (lo, hi)
        previous = AdaptiveDataLoaderHelper._training
        if (
            previous is not None
            and previous is not self
            and previous is AdaptiveDataLoaderHelper._current
        ):
            raise RuntimeError(
                "autoscale_batch_size() called on another loader while the training loader is "
                "being iterated: call it before (or after) the training loop"
            )
        self._max_batch_size = max_batch_size
        self._local_bsz_bounds = local_bsz_bounds
        self._gradient_accumulation = bool(gradient_accumulation)
        if reoptimize_every is not None:
            self.reoptimize_every = reoptimize_every
        num_replicas, rank = _world()
        lo = local_bsz_bounds[0] if local_bsz_bounds is not None else None
        if rank == 0 and lo is not None and lo * num_replicas > max_batch_size:
            # Not an error: the replica count is the scheduler's choice, not the program's.
            logger.warning(
                "local_bsz_bounds=%s: min_local_bsz=%d on %d replicas makes a global batch "
                "of at least %d, above max_batch_size=%d: on this replica count the batch "
                "size exceeds max_batch_size",
                local_bsz_bounds,
                lo,
                num_replicas,
                lo * num_replicas,
                max_batch_size,
            )
        if rank == 0:  # rank 0 decides: its fit's solver loads off the critical path
            _metrics.prefetch_fit_solver()
        AdaptiveDataLoaderHelper._training = self
        self.train()

    # ----- batch-size decision ------------------------------------------------------------------
    def _clamp(self, target: int, num_replicas: int) -> tuple[int, int]:
        """(local_bsz, accum_steps) closest to a global ``target`` within the bounds.

        Never above ``max_batch_size`` globally, except when ``min_local_bsz × num_replicas``
        alone exceeds it (logged by :meth:`autoscale_batch_size`).
        """
        lo, hi = self._local_bsz_bounds or (None, None)
        min_local = lo or 1
        accum = 1
        local = max(1, math.ceil(target / num_replicas))
        if hi is not None and local > hi:
            if self._gradient_accumulation:
                accum = math.ceil(local / hi)
                local = max(1, math.ceil(target / (num_replicas * accum)))
            local = min(local, hi)
        if local < min_local:
            local = min_local
            # The accumulation count was chosen for a smaller local batch: recount it (nearest,
            # halves up; never more than before).
            per_step = num_replicas * local
            accum = max(1, min(accum, (2 * target + per_step) // (2 * per_step)))
        limit = self._max_batch_size
        if limit is not None and local * accum * num_replicas > limit:
            # Rounding up overshot: fewer micro-batches first, then smaller ones (not below
            # the lower bound).
            accum = max(1, min(accum, limit // (num_replicas * local)))
            if local * accum * num_replicas > limit:
                local = max(min_local, limit // (num_replicas * accum))
        return local, accum

    def _default_decision(self) -> tuple[int, int]:
        num_replicas = _world()[0]
        if self._max_batch_size is None:
            return max(1, math.ceil(self.batch_size / num_replicas)), 1
        return self._clamp(self.batch_size, num_replicas)

    def _current_decision(self) -> tuple[int, int]:
        """``(local_bsz, accum_steps)`` in force for the current replica count (local, no
        collective, state untouched).

        Without autoscaling: the batch size split over the replicas. With it: the last decision
        if it was made for this replica count; else (none yet, or a restart on another count)
        that decision's global batch size (the initial one if none) on this count, within the
        bounds. :meth:`_decide` starts from the same value, so what the properties and
        ``len()`` report before an iteration is what the iteration uses unless it re-decides.
        """
        s = self._state
        if self._decided is not None and self._decided == (
            s.local_bsz,
            s.accum_steps,
            s.num_replicas,
        ):
            return s.local_bsz, s.accum_steps  # decided here, for this replica count
        num_replicas = _world()[0]
        if self._max_batch_size is None:
            return self._default_decision()
        if s.local_bsz and s.num_replicas == num_replicas:
            return s.local_bsz, s.accum_steps
        target = s.local_bsz * s.accum_steps * s.num_replicas or self.batch_size
        return self._clamp(min(target, self._max_batch_size), num_replicas)

    def _decide(self) -> tuple[int, int]:
        """Batch size for the next segment (collective when autoscaling)."""
        num_replicas = _world()[0]
        s = self._state
        if self._max_batch_size is None:
            s.local_bsz, s.accum_steps = self._default_decision()
        else:
            # First decision, or a restart on another replica count: keep the global batch.
            s.local_bsz, s.accum_steps = self._current_decision()
            before = decision = (s.local_bsz, s.accum_steps)
            if _world()[1] == 0:
                nodes = min(max(env.num_nodes(), 1), num_replicas)
                suggestion = _metrics.suggest_batch_size(
                    nodes, num_replicas, s.local_bsz, s.accum_steps, self.min_improvement
                )
                if suggestion is not None:
                    decision = (int(suggestion[0]), int(suggestion[1]))
            s.local_bsz, s.accum_steps = collective.broadcast(decision)
            if (s.local_bsz, s.accum_steps) != before:
                _hints.post_soon()  # the scheduler hears of a new batch size at once
        s.num_replicas = num_replicas
        self._decided = (s.local_bsz, s.accum_steps, s.num_replicas)
        return s.local_bsz, s.accum_steps

    def _segment_steps(self, num_replicas: int, local_bsz: int, accum: int) -> int | None:
        """Optimizer steps until the next decision (None: one segment per pass, no autoscale).

        Right after a change of configuration (and at the start) the next decision comes as
        soon as the new configuration can have :data:`~adaptrain.torch._metrics.MIN_SAMPLES`
        profiled steps (the first step of a segment is not timed); while nothing changes the
        segment doubles, up to ``reoptimize_every``. A job therefore explores and settles its
        batch size within tens of steps instead of hundreds, and then re-decides rarely.
        """
        if not self._max_batch_size:
            return None
        decision = (num_replicas, local_bsz, accum)
        if self._segment is None or decision != self._segment_decision:
            self._segment = _metrics.MIN_SAMPLES + 1
        else:
            self._segment *= 2
        self._segment_decision = decision
        return max(1, min(self._segment, int(self.reoptimize_every)))

    def _carried_segment(self, num_replicas: int) -> tuple[int, int, int] | None:
        """``(local_bsz, accum_steps, steps)`` of the segment a pass cut short, if it goes on.

        A pass over a small dataset at a large batch holds only a few optimizer steps; deciding
        again at each pass would refit the step-time model every few steps. The rest of the
        segment carries into the next pass instead, unless the replica count changed. Every
        replica computes the same plans, so all skip the (collective) decision together.
        """
        left, s = self._segment_left, self._state
        self._segment_left = None
        if left is None or left < 1 or not s.local_bsz or s.num_replicas != num_replicas:
            return None
        return s.local_bsz, s.accum_steps, left

    # ----- loop protocol ------------------------------------------------------------------------
    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        """Wrap every loop over the loader: registers it as current and records its completion."""
        epoch = current_epoch()
        if AdaptiveDataLoaderHelper._current is not None:
            raise RuntimeError(
                "overlapping data-loader iterations detected: finish (or break out of) the "
                "current loop before iterating another adaptive loader"
            )
        AdaptiveDataLoaderHelper._current = self
        signals.install()
        _hints.configure()
        self._skipped = False
        try:
            yield
        finally:
            if self._skipped:
                # skipdone() already counted this loop's position; counting it again (as AdaptDL
                # does) would shift every later loop of the epoch by one, and a second loop
                # finished before the restart would then run again. Its indices are left as
                # they are: they belong to a later loop of this loader that the restart
                # interrupted (the same loader looped twice in an epoch), which resumes there.
                self._skipped = False
            else:
                self._state.current_index = 0
                self._state.end_index = 0
                self._state.last_position[epoch] = AdaptiveDataLoaderHelper._position[epoch]
                AdaptiveDataLoaderHelper._position[epoch] += 1
            AdaptiveDataLoaderHelper._current = None
            self._mb = None
            self._accum_count = 0
            self._poll_ok = True

    def skipdone(self) -> bool:
        """True (skip the loop) if this loop already finished in this epoch before a restart."""
        epoch = current_epoch()
        position = AdaptiveDataLoaderHelper._position[epoch]
        if position <= self._state.last_position.get(epoch, -1):
            logger.info("skipping finished loop at position %s in epoch %s", position, epoch)
            AdaptiveDataLoaderHelper._position[epoch] += 1
            self._skipped = AdaptiveDataLoaderHelper._current is self
            return True
        return False

    @contextlib.contextmanager
    def profile(self, commit: bool) -> Iterator[None]:
        """Wrap every micro-batch (same number of times on every replica).

        At each optimizer-step boundary polls the agreed stop flag (checkpoint and exit if set),
        then times the micro-batch for the goodput model; ``commit`` records the timing.
        """
        if self._accum_count == 0 and self._poll_ok:
            signum = signals.poll_stop()
            if signum:
                signals.graceful_exit(signum)
            if _hints.active and self.training:  # rank 0 with a supervisor
                _hints.tick(self)
        training = self.training
        if training:
            _metrics.profile_step_start(self._mb_local or self.current_local_bsz)
        yield
        if training and commit:
            _metrics.profile_step_commit(self.is_accum_step())
        self._accum_count = 0 if self.is_optim_step() else self._accum_count + 1

    def to_tensorboard(self, writer: Any, global_step: int, tag_prefix: str = "") -> None:
        """Write Total_Batch_Size, Local_Batch_Size and Accumulation_Steps scalars."""
        if tag_prefix and not tag_prefix.endswith("/"):
            tag_prefix += "/"
        writer.add_scalar(tag_prefix + "Total_Batch_Size", self.current_batch_size, global_step)
        writer.add_scalar(tag_prefix + "Local_Batch_Size", self.current_local_bsz, global_step)
        writer.add_scalar(tag_prefix + "Accumulation_Steps", self.accumulation_steps, global_step)


def _reset() -> None:
    AdaptiveDataLoaderHelper._position.clear()
    AdaptiveDataLoaderHelper._training = None
    AdaptiveDataLoaderHelper._current = None
    _AdaptiveDataLoaderState.init_count.clear()


checkpoint.register_reset_hook(_reset)


class AdaptiveDataLoaderMixin:
    """Elastic functionality for custom loaders: holds an :class:`AdaptiveDataLoaderHelper`
    as ``self._elastic`` and exposes its public methods."""

    def __init__(self, batch_size: int) -> None:
        self._elastic = AdaptiveDataLoaderHelper(batch_size)

    def autoscale_batch_size(
        self,
        max_batch_size: int,
        local_bsz_bounds: tuple[int | None, int | None] | None = None,
        gradient_accumulation: bool = False,
        *,
        reoptimize_every: int | None = None,
    ) -> None:
        """See :meth:`AdaptiveDataLoaderHelper.autoscale_batch_size`."""
        self._elastic.autoscale_batch_size(
            max_batch_size,
            local_bsz_bounds,
            gradient_accumulation,
            reoptimize_every=reoptimize_every,
        )

    @property
    def current_local_bsz(self) -> int | None:
        """Local micro-batch size while this loader is iterated, else None."""
        if AdaptiveDataLoaderHelper._current is not self._elastic:
            return None
        return self._elastic.current_local_bsz

    @property
    def current_batch_size(self) -> int | None:
        """Global batch size per optimizer step while this loader is iterated, else None."""
        if AdaptiveDataLoaderHelper._current is not self._elastic:
            return None
        return self._elastic.current_batch_size

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per optimizer step (≥ 1)."""
        return self._elastic.accumulation_steps

    @property
    def training(self) -> bool:
        return self._elastic.training

    def to_tensorboard(self, writer: Any, global_step: int, tag_prefix: str = "") -> None:
        """See :meth:`AdaptiveDataLoaderHelper.to_tensorboard`."""
        self._elastic.to_tensorboard(writer, global_step, tag_prefix)


class _WorkerInit:
    """``worker_init_fn`` of an :class:`AdaptiveDataLoader`: distinct python/numpy/torch seeds per
    worker and replica, then the user's ``worker_init_fn``.

    A module-level class, not a closure, so that it pickles: DataLoader workers started with the
    ``spawn``/``forkserver`` multiprocessing contexts receive it pickled. The replica rank is
    taken in the parent (the workers of a spawn context have no process group).
    """

    def __init__(self, worker_init_fn: Any, num_workers: int | None, rank: int) -> None:
        self.worker_init_fn = worker_init_fn
        self.num_workers = num_workers
        self.rank = rank
        if worker_init_fn is not None:
            self.__wrapped__ = worker_init_fn

    def __call__(self, worker_id: int) -> Any:
        # A Ctrl-C reaches the whole foreground process group: the main process checkpoints
        # and shuts the workers down, so they must not die of it first (workers started with
        # spawn/forkserver have Python's default handler; forked ones inherit ours).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        seed = torch.initial_seed() + self.rank * (self.num_workers or 1)
        torch.manual_seed(seed)
        np.random.seed(seed % 2**32)
        random.seed(seed)
        result = None
        before = signal.getsignal(signal.SIGTERM)
        if self.worker_init_fn is not None:
            result = self.worker_init_fn(worker_id)
        # A SIGTERM to the whole process group (Slurm) likewise: only the parent's ends a
        # worker. Not when the user's worker_init_fn installed a SIGTERM handler of its own.
        signals.shield_loader_worker(signal.getsignal(signal.SIGTERM) is before)
        return result

    def __repr__(self) -> str:
        return f"_WorkerInit({self.worker_init_fn!r}, rank={self.rank})"


class AdaptiveDataLoader(DataLoader, AdaptiveDataLoaderMixin):
    """A ``DataLoader`` with a global, adaptive batch size and checkpoint-restart elasticity.

    Differences from ``torch.utils.data.DataLoader``: ``batch_size`` is the global target over
    all replicas; custom ``sampler``/``batch_sampler`` are refused; loop over it inside
    :func:`~adaptrain.torch.remaining_epochs_until`, one loader loop at a time. Each loop is
    one pass over the dataset, processing every sample exactly once across replicas (module
    docstring).

    Args:
        dataset: map-style dataset.
        batch_size: target global batch size.
        shuffle: reshuffle (deterministically) every epoch.
        **kwargs: passed to ``DataLoader`` (``num_workers``, ``collate_fn``, ``drop_last``...).
            With ``num_workers > 0``, ``persistent_workers`` defaults to True: the loader starts
            a new iterator at every batch-size decision, and the workers are kept between them.

    Raises:
        ValueError: ``sampler``/``batch_sampler`` given, bad ``batch_size``, iterable dataset.
    """

    def __init__(self, dataset: Any, batch_size: int = 1, shuffle: bool = False, **kwargs: Any):
        if kwargs.get("batch_sampler") is not None or kwargs.get("sampler") is not None:
            raise ValueError(
                "AdaptiveDataLoader does not support a custom 'sampler' or 'batch_sampler' "
                "(it partitions the data itself); use AdaptiveDataLoaderMixin for custom loaders"
            )
        kwargs.pop("sampler", None)
        kwargs.pop("batch_sampler", None)
        _check_batch_size(batch_size)
        if isinstance(dataset, IterableDataset):
            raise ValueError("AdaptiveDataLoader needs a map-style dataset (with __len__)")
        drop_last = bool(kwargs.pop("drop_last", False))
        if kwargs.get("num_workers") and "persistent_workers" not in kwargs:
            # Autoscaling starts a DataLoader iterator per segment of 11-50 steps: keep the
            # workers between them instead of forking new ones each time (a new iterator with
            # 1-2 fresh workers took 35-57 ms to its first batch on a 2-CPU host).
            kwargs["persistent_workers"] = True
        kwargs["worker_init_fn"] = _WorkerInit(
            kwargs.get("worker_init_fn"), kwargs.get("num_workers"), _world()[1]
        )
        plan_sampler = _PlanBatchSampler()
        super().__init__(dataset, batch_sampler=plan_sampler, **kwargs)
        AdaptiveDataLoaderMixin.__init__(self, batch_size)
        elastic_sampler = ElasticSampler(dataset, shuffle=shuffle)
        # DataLoader forbids reassigning these after __init__; ours are informational.
        object.__setattr__(self, "sampler", elastic_sampler)
        self._plan_sampler = plan_sampler
        self._elastic_drop_last = drop_last

    @property
    def batch_size_target(self) -> int:
        """The global batch size given at construction."""
        return self._elastic.batch_size

    def __len__(self) -> int:
        """Micro-batches this replica yields in a full pass at the current batch size.

        With fewer samples than replicas, the count follows the same padding rule as the loop
        would at the time of the call (see the module docstring).
        """
        num_replicas, rank = _world()
        pad = self._elastic.training or torch.is_grad_enabled()
        n = len(self.dataset)
        plan = plan_pass(
            0,
            n,
            self._elastic.current_local_bsz,
            self._elastic.accumulation_steps,
            num_replicas,
            self._elastic_drop_last,
        )
        return sum(1 for mb in plan if pad or mb.size > rank)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        """One pass over the dataset (the rest of it after a restart), exactly once overall."""
        epoch = current_epoch()
        helper = self._elastic
        n = len(self.dataset)
        with helper.context():
            if helper.skipdone():
                return
            # Evaluation loops (not the training loader, no gradients) never pad.
            pad = helper.training or torch.is_grad_enabled()
            while helper._state.current_index < n:
                num_replicas, rank = _world()
                carried = helper._carried_segment(num_replicas)
                if carried is not None:
                    local_bsz, accum, max_steps = carried
                else:
                    local_bsz, accum = helper._decide()
                    max_steps = helper._segment_steps(num_replicas, local_bsz, accum)
                start = helper._state.current_index
                self.sampler.set_epoch(epoch, start)
                order = self.sampler.order()
                plan = plan_pass(
                    start, n, local_bsz, accum, num_replicas, self._elastic_drop_last, max_steps
                )
                if not plan:
                    # drop_last left only an incomplete step: the segment (carried or just
                    # decided) goes on, unused, in the next pass instead of being lost.
                    helper._segment_left = max_steps
                    break
                locals_: list[list[int]] = []
                for mb in plan:
                    idx = order[mb.start + rank : mb.start + mb.size : num_replicas]
                    if not idx and pad:
                        logger.warning(
                            "only %d sample(s) left for %d replicas: replica %d repeats one",
                            mb.size,
                            num_replicas,
                            rank,
                        )
                        idx = [order[mb.start + rank % mb.size]]
                    locals_.append(idx)
                self._plan_sampler.batches = locals_
                starting = contextlib.nullcontext()
                if self.num_workers > 0:  # no fork while the solver's import holds its locks
                    _metrics.wait_for_solver_prefetch()
                    if isinstance(self.worker_init_fn, _WorkerInit):
                        self.worker_init_fn.rank = rank  # for workers started from now on
                        # SIGTERM blocked in the workers from their start; _WorkerInit
                        # shields them.
                        ctx = self.multiprocessing_context
                        method = None if ctx is None else ctx.get_start_method()
                        starting = signals.loader_workers_starting(method)
                with starting:
                    it = super().__iter__()
                for i, (mb, idx) in enumerate(zip(plan, locals_)):
                    helper._mb = mb
                    helper._mb_local = len(idx)
                    helper._poll_ok = pad or mb.size >= num_replicas
                    if idx:
                        with helper.profile(commit=helper.training and i > 0):
                            yield next(it)
                            helper._state.current_index = mb.start + mb.size
                    else:
                        helper._state.current_index = mb.start + mb.size
                helper._mb = None
                del it
                if max_steps is not None:  # a pass that ended mid-segment hands on the rest
                    helper._segment_left = max_steps - sum(mb.first for mb in plan)
