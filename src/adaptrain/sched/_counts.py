"""Exact, fast reductions over the genetic searches' (candidates x jobs x nodes) count arrays.

The searches of :mod:`adaptrain.sched.pollux` hold replica counts in int16 arrays of shape
``(P, J, N)``: some 75-100 candidates, 5-50 jobs, 16 nodes on the artifact's cluster. numpy's
integer reductions over such short axes (``sum(axis=2)``, ``count_nonzero(axis=2)``) spend
most of their time in per-row loop overhead, 2-4 x longer than a float64 matrix product over
the same data. Integers below 2**53
add exactly in float64 in any order, so these helpers return exactly numpy's integers, only
sooner; ``tests/sched/test_genetic_operators.py`` checks them against numpy on random arrays.
They do not draw random numbers and change no result of the searches.
"""

from __future__ import annotations

import numpy as np

__all__ = ["count_nodes", "rows_differ", "sum_jobs", "sum_nodes"]


def sum_nodes(states: np.ndarray) -> np.ndarray:
    """``states.sum(axis=2)`` as int64: replicas per (candidate, job)."""
    P, J, N = states.shape
    if states.size == 0:
        return np.zeros((P, J), dtype=np.int64)
    flat = states.reshape(P * J, N).astype(np.float64)
    return (flat @ np.ones(N)).astype(np.int64).reshape(P, J)


def count_nodes(states: np.ndarray) -> np.ndarray:
    """``np.count_nonzero(states, axis=2)`` as int64: nodes per (candidate, job)."""
    return sum_nodes(states != 0)


def sum_jobs(states: np.ndarray) -> np.ndarray:
    """``states.sum(axis=1)`` as int64: replicas per (candidate, node)."""
    P, J, N = states.shape
    if states.size == 0:
        return np.zeros((P, N), dtype=np.int64)
    return (np.ones(J) @ states.astype(np.float64)).astype(np.int64)


def rows_differ(states: np.ndarray, base: np.ndarray) -> np.ndarray:
    """``np.any(states != base[None], axis=2)``: the (candidate, job) rows unlike ``base``'s.
    Integer rows are compared a machine word (several nodes) at a time: equal bits, equal
    integers."""
    if states.dtype == base.dtype and np.issubdtype(states.dtype, np.integer):
        a, b = np.ascontiguousarray(states), np.ascontiguousarray(base)
        nbytes = a.shape[2] * a.itemsize
        for word in (np.uint64, np.uint32):
            if nbytes and nbytes % np.dtype(word).itemsize == 0:
                return (a.view(word) != b.view(word)[None]).any(axis=2)
    return np.any(states != base[None], axis=2)
