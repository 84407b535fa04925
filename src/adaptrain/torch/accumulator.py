"""Dict-like sums across replicas and restarts (``adaptdl.torch.Accumulator`` equivalent).

Two modes:

* **accumulation** (default): ``acc[k] += v``, ``acc[k] -= v``, ``acc.update(...)``,
  ``acc.subtract(...)``, ``acc += {...}``, ``acc -= {...}`` add the update to this replica's
  private ``updates``; reads behave as on an empty dict.
* **synchronized** (inside ``with acc.synchronized():``, a collective): every replica's updates
  are summed into ``results`` (the same on every replica) and the accumulator behaves as a dict
  on it; writes must be the same on every replica.

Restart consistency: pending updates are folded in (synced) before every checkpoint; the
results of every synchronization made outside a data-loader loop in the current epoch are kept
in ``results_history`` so that, when a restart replays that code, the replay reads the recorded
result instead of re-summing (which would count the replayed updates twice). A replayed block
only shows the recorded result: its writes are discarded and the checkpointed running sums are
kept, so sums collected after it (e.g. the first half of a validation loop that a checkpoint
interrupted) still count. History of finished epochs is dropped.

Updates made outside data-loader loops are replayed too (a loader skips the batches it already
served; the code around it runs again): the checkpoint records how many such updates the
current epoch (or the code before the epoch loop) had made, and after a restart that many are
dropped before new ones count. AdaptDL's Accumulator counts them twice when no synchronization
lies between them and the checkpoint. Like the recorded synchronizations, this relies on the
program making the same updates in the same order when it replays.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import pickle
from collections.abc import Iterator, MutableMapping
from typing import Any, BinaryIO

from adaptrain.dist import checkpoint, collective
from adaptrain.torch.data import current_dataloader
from adaptrain.torch.epoch import current_epoch

__all__ = ["Accumulator"]


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for key, val in b.items():
        out[key] = out[key] + val if key in out else val
    return out


class _AccumulatorState(checkpoint.State):
    init_count: collections.Counter = collections.Counter()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if current_dataloader() is not None:
            raise RuntimeError(
                "an Accumulator may not be created inside a data-loader loop; create it before"
            )
        epoch = current_epoch()
        count = _AccumulatorState.init_count[epoch]
        super().__init__(f"adaptrain-accumulator-epoch{epoch}-{count}")
        _AccumulatorState.init_count[epoch] += 1
        self.results: dict = dict(*args, **kwargs)
        self.updates: dict = {}
        self.results_history: dict = collections.defaultdict(list)
        # updates made outside data-loader loops, per epoch (None: before the epoch loop), and
        # how many of them a restart replays (the count at the checkpoint it restored)
        self.outside_count: dict = {}
        self.replayed: dict = {}

    def count_outside_update(self, epoch: Any) -> bool:
        """Count an update made outside a data-loader loop; False if it is a replayed one."""
        for key in [k for k in self.outside_count if k is not None and epoch is not None]:
            if key < epoch:  # finished epochs are never replayed
                self.outside_count.pop(key)
                self.replayed.pop(key, None)
        n = self.outside_count.get(epoch, 0)
        self.outside_count[epoch] = n + 1
        return n >= self.replayed.get(epoch, 0)

    def sync(self) -> None:
        self.results = _merge(self.results, collective.allreduce(self.updates, _merge))
        self.updates = {}

    def save(self, fileobj: BinaryIO) -> None:
        pickle.dump(
            {
                "results": self.results,
                "history": dict(self.results_history),
                "outside": dict(self.outside_count),
            },
            fileobj,
        )

    def load(self, fileobj: BinaryIO) -> None:
        data = pickle.load(fileobj)
        self.results = data["results"]
        self.results_history = collections.defaultdict(list, data["history"])
        self.replayed = dict(data.get("outside", {}))  # older checkpoints: nothing to drop
        self.outside_count = {}


def _reset() -> None:
    _AccumulatorState.init_count.clear()


checkpoint.register_reset_hook(_reset)


class Accumulator(MutableMapping):
    """Sum statistics over replicas and restarts; see the module docstring for the two modes.

    Example::

        acc = Accumulator()
        for epoch in remaining_epochs_until(10):
            for x, y in valid_loader:
                acc["correct"] += (model(x).argmax(1) == y).sum().item()
                acc["total"] += len(y)
            with acc.synchronized():
                print(acc["correct"] / acc["total"])
                acc.clear()

    Args:
        args, kwargs: initial contents, as for ``dict``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._sync_count: collections.Counter = collections.Counter()
        self._synchronized: dict | None = None
        self._state = _AccumulatorState(*args, **kwargs)
        checkpoint.load_state(self._state)

    @contextlib.contextmanager
    def synchronized(self) -> Iterator[Accumulator]:
        """Enter synchronized mode (a collective: every replica must enter at the same point)."""
        if self._synchronized is not None:
            yield self
            return
        epoch = current_epoch()
        history = self._state.results_history
        for key in list(history):
            if key is not None and epoch is not None and key < epoch:
                history.pop(key)
        count = self._sync_count[epoch]
        self._sync_count[epoch] += 1
        results_list = history[epoch]
        if count < len(results_list):
            # Replay after a restart: this synchronization already happened before the
            # checkpoint. Show what it showed then, on a copy: the checkpointed running sums
            # (``results``) already hold every effect of the code before the checkpoint, sums
            # collected after this synchronization included, so they stay untouched, and so do
            # the writes replayed inside the block (e.g. an ``acc.clear()`` that must not wipe
            # those later sums) and the recorded entry itself (a second restart replays it
            # again). The pending updates come from replayed code, already counted: dropped.
            self._synchronized = copy.deepcopy(results_list[count])
            self._state.updates = {}
        else:
            self._state.sync()
            if current_dataloader() is None:
                # Code inside data-loader loops is never replayed: nothing to record there.
                results_list.append(copy.deepcopy(self._state.results))
            self._synchronized = self._state.results
        try:
            yield self
        finally:
            self._synchronized = None

    def update(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        """Add each value to its key (``dict.update`` arguments), unlike ``dict.update``."""
        for key, val in dict(*args, **kwargs).items():
            self[key] += val

    def subtract(self, *args: Any, **kwargs: Any) -> None:
        """Subtract each value from its key (same arguments as :meth:`update`)."""
        for key, val in dict(*args, **kwargs).items():
            self[key] -= val

    def __iadd__(self, other: Any) -> Accumulator:
        self.update(other)
        return self

    def __isub__(self, other: Any) -> Accumulator:
        self.subtract(other)
        return self

    def __getitem__(self, key: Any) -> Any:
        if self._synchronized is not None:
            return self._synchronized[key]
        # Accumulation mode: capture ``acc[k] += v`` as an update (see _Value).
        return _Value(self, key)

    def __setitem__(self, key: Any, value: Any) -> None:
        if self._synchronized is not None:
            self._synchronized[key] = value
            return
        if not isinstance(value, _Value) or value.accum is not self or value.key != key:
            raise TypeError(
                f"in accumulation mode only acc[{key!r}] += v / -= v are allowed, not "
                f"assignment of {type(value).__name__}; assign inside `with acc.synchronized():`"
            )
        if current_dataloader() is None and not self._state.count_outside_update(current_epoch()):
            return  # replayed after a restart: already in the checkpointed results
        updates = self._state.updates
        updates[key] = updates[key] + value.update if key in updates else value.update

    def __delitem__(self, key: Any) -> None:
        if self._synchronized is None:
            raise KeyError(key)
        del self._synchronized[key]

    _NO_DEFAULT = object()

    def get(self, key: Any, default: Any = None) -> Any:
        """``results.get`` when synchronized; ``default`` in accumulation mode (an empty dict)."""
        if self._synchronized is None:
            return default
        return self._synchronized.get(key, default)

    def pop(self, key: Any, default: Any = _NO_DEFAULT) -> Any:
        """``results.pop`` when synchronized; in accumulation mode as on an empty dict."""
        if self._synchronized is not None:
            if default is Accumulator._NO_DEFAULT:
                return self._synchronized.pop(key)
            return self._synchronized.pop(key, default)
        if default is Accumulator._NO_DEFAULT:
            raise KeyError(key)
        return default

    def setdefault(self, key: Any, default: Any = None) -> Any:
        """``results.setdefault`` when synchronized; in accumulation mode a write, refused."""
        if self._synchronized is None:
            raise TypeError(
                f"acc.setdefault({key!r}, ...) writes: call it inside `with acc.synchronized():`"
            )
        return self._synchronized.setdefault(key, default)

    def __contains__(self, key: object) -> bool:
        return self._synchronized is not None and key in self._synchronized

    def __iter__(self) -> Iterator[Any]:
        return iter(self._synchronized if self._synchronized is not None else {})

    def __len__(self) -> int:
        return len(self._synchronized) if self._synchronized is not None else 0

    def __repr__(self) -> str:
        return repr(self._synchronized if self._synchronized is not None else {})


class _Value:
    """Stand-in returned by ``acc[k]`` in accumulation mode; records ``+ v`` / ``- v``."""

    __slots__ = ["accum", "key", "update"]

    def __init__(self, accum: Accumulator, key: Any) -> None:
        self.accum = accum
        self.key = key
        self.update: Any = 0

    def __add__(self, other: Any) -> _Value:
        self.update = self.update + other
        return self

    def __sub__(self, other: Any) -> _Value:
        self.update = self.update - other
        return self

    __iadd__ = __add__
    __isub__ = __sub__
