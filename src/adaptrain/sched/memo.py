"""The one memo mechanism of the scheduler and the simulator.

Everything cached here is a pure function of its key (a fit of a profile, the batch size a
goodput model picks, a speedup table), so a memo saves time and changes no result. A
:class:`Memo` is a bounded mapping that evicts the entry used least recently. Its owner reads
and fills it (:meth:`Memo.get_or_compute`); another process that computed entries of the same
function hands them over as ``(key, value)`` pairs (:meth:`Memo.recording` collects them
there, :meth:`Memo.merge` takes them here). :func:`memoized` wraps a pure function in a memo.
"""

from __future__ import annotations

import collections
import contextlib
import functools
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Any, TypeVar

__all__ = ["Memo", "memoized"]

T = TypeVar("T")


class Memo:
    """A bounded memo of a pure function's values, least recently used evicted first."""

    def __init__(self, maxsize: int) -> None:
        if int(maxsize) < 1:
            raise ValueError(f"maxsize={maxsize} must be >= 1")
        self.maxsize = int(maxsize)
        self._data: collections.OrderedDict = collections.OrderedDict()
        self._recorders: list[list[tuple[Any, Any]]] = []
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._data

    def keys(self) -> list[Hashable]:
        """The keys held, least recently used first."""
        return list(self._data)

    def get(self, key: Hashable, default: Any = None) -> Any:
        """The value held for ``key`` (marked as used), else ``default``."""
        try:
            value = self._data[key]
        except KeyError:
            self.misses += 1
            return default
        self._data.move_to_end(key)
        self.hits += 1
        return value

    def put(self, key: Hashable, value: Any) -> None:
        """Hold ``value`` for ``key``, evicting the least recently used entry when full."""
        self._data[key] = value
        self._data.move_to_end(key)
        while len(self._data) > self.maxsize:
            self._data.popitem(last=False)
        for log in self._recorders:
            log.append((key, value))

    def get_or_compute(self, key: Hashable, compute: Callable[[], T]) -> T:
        """The value for ``key``, computed by ``compute()`` and held if it is not yet."""
        value = self.get(key, _MISSING)
        if value is _MISSING:
            value = compute()
            self.put(key, value)
        return value

    def merge(self, entries: Iterable[tuple[Hashable, Any]]) -> int:
        """Hold the ``entries`` this memo lacks (those held are kept: both are the same pure
        function of the key); how many were added."""
        added = 0
        for key, value in entries:
            if key not in self._data:
                self.put(key, value)
                added += 1
        return added

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[tuple[Any, Any]]]:
        """Collect the entries put inside the block, in the order put."""
        log: list[tuple[Any, Any]] = []
        self._recorders.append(log)
        try:
            yield log
        finally:
            self._recorders.remove(log)

    def clear(self) -> None:
        self._data.clear()


_MISSING = object()


def memoized(maxsize: int) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Memoise a pure function of hashable positional arguments in a :class:`Memo`
    (reachable as the wrapper's ``memo`` attribute)."""

    def wrap(fn: Callable[..., T]) -> Callable[..., T]:
        memo = Memo(maxsize)

        @functools.wraps(fn)
        def wrapper(*args: Hashable) -> T:
            return memo.get_or_compute(args, lambda: fn(*args))

        wrapper.memo = memo  # type: ignore[attr-defined]
        return wrapper

    return wrap
