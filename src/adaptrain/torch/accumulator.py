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

Updates made outside data-loader loops are replayed too (a loader skips the loops it finished;
the code around them runs again). AdaptDL's Accumulator counts such an update twice when no
synchronization lies between it and the checkpoint; adaptrain recognises the replayed ones by
where they are made. Each update outside a loop is identified by its epoch, the number of the
epoch's data-loader loops finished before it, its key, the line that makes it (the first frame
outside this module: module, function, line number) and its order among the updates so
identified. A checkpoint records how many updates each identity had counted (on any replica);
after a restart an update whose identity had counted more than its order is a replay and is
dropped, any other counts. So code guarded to run once (``if env.num_restarts() == 0:``, the
AdaptDL idiom for code that must not run twice) and code that runs again both come out right:
a skipped update leaves no gap that a genuine one would fill, and code after the loop the
checkpoint interrupted always counts. This relies on the replay making the same unguarded
updates from the same lines as before, in the same order per line.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import pickle
import sys
from collections.abc import Iterator, MutableMapping
from typing import Any, BinaryIO

from adaptrain.dist import checkpoint, collective
from adaptrain.torch.data import AdaptiveDataLoaderHelper, current_dataloader
from adaptrain.torch.epoch import current_epoch

__all__ = ["Accumulator"]


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for key, val in b.items():
        out[key] = out[key] + val if key in out else val
    return out


def _most(a: dict, b: dict) -> dict:
    """Per epoch and identity, the larger of two replicas' counts of updates made outside loops."""
    out = {epoch: dict(counts) for epoch, counts in a.items()}
    for epoch, counts in b.items():
        mine = out.setdefault(epoch, {})
        for site, n in counts.items():
            mine[site] = max(mine.get(site, 0), n)
    return out


def _merge_for_checkpoint(a: tuple, b: tuple) -> tuple:
    return _merge(a[0], b[0]), _most(a[1], b[1])


def _call_site() -> tuple:
    """(module, function, line) of the first frame outside this module: where the update is made
    (``acc.update(...)`` and ``acc += {...}`` go through this module on their way)."""
    frame = sys._getframe(1)
    here = globals()
    while frame is not None and frame.f_globals is here:
        frame = frame.f_back
    if frame is None:  # pragma: no cover - always called from somewhere
        return ("", "", 0)
    code = frame.f_code
    name = getattr(code, "co_qualname", code.co_name)  # Python 3.11+
    return (frame.f_globals.get("__name__", ""), name, frame.f_lineno)


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
        # Updates made outside data-loader loops, per epoch (None: before the epoch loop) and
        # identity (see the module docstring), counted in this process; and the counts of the
        # checkpoint restored (None: a checkpoint without them, nothing is recognised).
        self.outside: dict = {}
        self.replayed: dict | None = {}
        self._gathered: dict | None = None  # every replica's counts, gathered by sync()

    def count_outside_update(self, epoch: Any, key: Any) -> bool:
        """Count an update made outside a data-loader loop; False if it is a replayed one."""
        for old in [k for k in self.outside if k is not None and epoch is not None]:
            if old < epoch:  # finished epochs are never replayed
                self.outside.pop(old)
                if self.replayed is not None:
                    self.replayed.pop(old, None)
        site = (AdaptiveDataLoaderHelper._position[epoch], key, *_call_site())
        counts = self.outside.setdefault(epoch, {})
        n = counts.get(site, 0)
        counts[site] = n + 1
        if self.replayed is None:
            return True
        return n >= self.replayed.get(epoch, {}).get(site, 0)

    def sum_updates(self) -> None:
        """Sum every replica's pending updates into ``results`` (collective)."""
        self.results = _merge(self.results, collective.allreduce(self.updates, _merge))
        self.updates = {}

    def sync(self) -> None:
        """Before a checkpoint (collective): sum the pending updates, and gather the counts of
        updates made outside loops, the most any replica made of each (code that only some
        replicas run is recognised on every replica after the restart)."""
        updates, self._gathered = collective.allreduce(
            (self.updates, self.outside), _merge_for_checkpoint
        )
        self.results = _merge(self.results, updates)
        self.updates = {}

    def save(self, fileobj: BinaryIO) -> None:
        outside = self.outside if self._gathered is None else self._gathered
        self._gathered = None
        pickle.dump(
            {
                "results": self.results,
                "history": dict(self.results_history),
                "outside_sites": {epoch: dict(counts) for epoch, counts in outside.items()},
            },
            fileobj,
        )

    def load(self, fileobj: BinaryIO) -> None:
        data = pickle.load(fileobj)
        self.results = data["results"]
        self.results_history = collections.defaultdict(list, data["history"])
        # A checkpoint without the identities (an older format): nothing to recognise.
        self.replayed = data.get("outside_sites")
        self.outside = {}


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
            # again).
            self._synchronized = copy.deepcopy(results_list[count])
            if self._state.replayed is None:
                # Updates are not recognised (a checkpoint without their identities): the
                # pending ones come from replayed code, already counted: dropped. Otherwise
                # the replayed ones were dropped as they were made, and those pending are new.
                self._state.updates = {}
        else:
            self._state.sum_updates()
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
        if current_dataloader() is None and not self._state.count_outside_update(
            current_epoch(), key
        ):
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
