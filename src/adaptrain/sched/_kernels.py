"""The genetic searches' operators, as loops compiled by numba.

A generation of :class:`~adaptrain.sched.PolluxPolicy`'s search (and of the default policy's
genetic refinement, :class:`~adaptrain.sched._plan.WeightedGeneticSearch`) works on small
arrays: some 50-125 candidates x 5-50 jobs x 16 nodes. On them a numpy call spends most of its
time in its own overhead, not in arithmetic, so each operator here is one compiled loop
(``cache=True``: later processes load it from disk) and a generation is a few compiled calls
between the generator's draws:

- :func:`breed`: the binary tournaments and the one-point crossover over jobs;
- :func:`mutate_rows`, :func:`mutate_cells`: the sparse mutation (the dense one, the
  artifact's, is numpy code in :meth:`PolluxPolicy._mutation`);
- :func:`repair_bounds`, :func:`repair_fill`: the repair (pinned jobs, interference,
  replica and node bounds, node capacity, minimum replicas);
- :func:`fresh_rows`: the dropping of duplicate children;
- :func:`evaluate_weighted`: the weighted search's objectives;
- :func:`nondominated_ranks`, :func:`crowding`, :func:`survive`: NSGA-II's non-dominated
  sorting, crowding distance and survival.

Their results are defined to the last bit:

- the kernels draw no random numbers: the callers draw them from the search's generator with
  numpy and pass them in, and a kernel consumes them in a fixed order;
- sums over jobs follow numpy's pairwise summation (:func:`_pairwise`), so a candidate's
  fitness is numpy's ``sum`` of its terms; products, quotients and differences are single
  IEEE operations;
- sorts are stable (the survivors by rank, then by crowding distance, descending, as
  numpy's ``lexsort``); a row's random order of nodes is the stable sort of its draws;
- duplicates are compared cell by cell (a row hash only narrows the comparisons);
- the interference repair keeps the artifact's rule, quirk included: every job after a node's
  second multi-node job there loses its replicas there, multi-node or not.

``tests/sched/test_kernels.py`` checks each kernel against an independent reference on small
random inputs (pymoo's NSGA-II sorting and crowding, brute-force Python loops).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import numba
import numpy as np

__all__ = [
    "breed",
    "crowding",
    "evaluate_weighted",
    "fresh_rows",
    "interruptible",
    "mutate_cells",
    "mutate_rows",
    "nondominated_ranks",
    "repair_bounds",
    "repair_fill",
    "survive",
]

_F = TypeVar("_F", bound=Callable[..., Any])


def interruptible(method: _F) -> _F:
    """``method`` with a Ctrl-C that arrives during a kernel call raised as the
    ``KeyboardInterrupt`` it is.

    numba's dispatcher runs a little Python code as a kernel returns (it unpickles the types
    it boxes the results with); a SIGINT handled there leaves ``KeyboardInterrupt`` set while
    the kernel's result comes back, which CPython reports as a ``SystemError`` ("returned a
    result with an exception set") caused by it (through another such ``SystemError`` when the
    dispatcher boxes several results), and a caller's ``except KeyboardInterrupt``
    (``adaptrain simulate``'s one-line exit, for one) would miss it."""

    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except SystemError as exc:
            cause: BaseException | None = exc
            while isinstance(cause, SystemError):
                cause = cause.__cause__
            if isinstance(cause, KeyboardInterrupt):
                raise cause from None
            raise

    return call  # type: ignore[return-value]


def _njit(fn):
    # error_model="numpy": a float division by zero gives inf/nan as numpy does (not an error)
    return numba.njit(cache=True, error_model="numpy", nogil=True)(fn)


@_njit
def _block(a, lo, n):  # pragma: no cover - compiled
    """numpy's pairwise sum of a block of at most 128 values ``a[lo:lo + n]``: one by one
    below 8, else 8 interleaved partial sums combined as a tree, then the rest one by one."""
    if n < 8:
        res = 0.0
        for i in range(n):
            res += a[lo + i]
        return res
    r0, r1, r2, r3 = a[lo], a[lo + 1], a[lo + 2], a[lo + 3]
    r4, r5, r6, r7 = a[lo + 4], a[lo + 5], a[lo + 6], a[lo + 7]
    i = 8
    stop = n - (n % 8)
    while i < stop:
        r0 += a[lo + i]
        r1 += a[lo + i + 1]
        r2 += a[lo + i + 2]
        r3 += a[lo + i + 3]
        r4 += a[lo + i + 4]
        r5 += a[lo + i + 5]
        r6 += a[lo + i + 6]
        r7 += a[lo + i + 7]
        i += 8
    res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < n:
        res += a[lo + i]
        i += 1
    return res


@_njit
def _pairwise(a, lo, n):  # pragma: no cover - compiled
    """numpy's pairwise sum of ``a[lo:lo + n]`` (``pairwise_sum`` in its loops), in its order
    of additions: a longer range is the sum of its halves (the first a multiple of 8 long).
    The halving runs on an explicit stack (numba's cache cannot hold a recursive function)."""
    if n <= 128:
        return _block(a, lo, n)
    los = np.empty(64, dtype=np.int64)  # a range of 2**63 values splits fewer times
    ns = np.empty(64, dtype=np.int64)
    stage = np.zeros(64, dtype=np.int64)  # 0: split it, 1: its first half summed, 2: both
    left = np.empty(64)
    los[0], ns[0], sp, ret = lo, n, 0, 0.0
    while sp >= 0:
        m = ns[sp]
        if m <= 128:
            ret = _block(a, los[sp], m)
            sp -= 1
            continue
        half = m // 2
        half -= half % 8
        if stage[sp] == 0:  # first half
            stage[sp] = 1
            los[sp + 1], ns[sp + 1], stage[sp + 1] = los[sp], half, 0
            sp += 1
        elif stage[sp] == 1:  # second half, once the first is summed (in ret)
            left[sp] = ret
            stage[sp] = 2
            los[sp + 1], ns[sp + 1], stage[sp + 1] = los[sp] + half, m - half, 0
            sp += 1
        else:
            ret = left[sp] + ret
            sp -= 1
    return ret


@_njit
def _row_sum(a):  # pragma: no cover - compiled
    """``a.sum()`` of a 1-d float64 array as numpy reduces a row: ``0.0 + pairwise``."""
    return 0.0 + _pairwise(a, 0, a.shape[0])


@_njit
def crowding(F, rank):  # pragma: no cover - compiled
    """NSGA-II crowding distance of the points ``F`` (n x objectives) within each front
    (``rank``): per front and objective, in a stable sort by value, the two ends infinite and
    each inner point ``(next - previous) / (max - min)`` (0 on a flat front), summed over the
    objectives."""
    n = F.shape[0]
    dist = np.zeros(n)
    if n == 0:
        return dist
    r = np.sort(rank)
    first = np.empty(n, dtype=np.int64)  # per position in rank order: its front's first
    last = np.empty(n, dtype=np.int64)  # and last positions
    edge = np.empty(n, dtype=np.bool_)
    start = 0
    for i in range(n):
        if i == 0 or r[i] != r[i - 1]:
            start = i
        first[i] = start
    end = n - 1
    for i in range(n - 1, -1, -1):
        if i == n - 1 or r[i] != r[i + 1]:
            end = i
        last[i] = end
    for i in range(n):
        edge[i] = first[i] == i or last[i] == i
    for m in range(F.shape[1]):
        col = F[:, m].copy()
        by_f = np.argsort(col, kind="mergesort")  # stable: lexsort((F[:, m], rank))
        order = by_f[np.argsort(rank[by_f], kind="mergesort")]
        f = col[order]
        for i in range(n):
            if edge[i]:
                d = np.inf
            else:
                span = f[last[i]] - f[first[i]]
                d = (f[i + 1] - f[i - 1]) / span if span > 0 else 0.0
            dist[order[i]] += d
    return dist


@_njit
def _row_counts(states, p, j):  # pragma: no cover - compiled
    """Replicas and nodes of candidate ``p``'s row for job ``j``."""
    r = 0
    n = 0
    for k in range(states.shape[2]):
        c = states[p, j, k]
        r += c
        if c != 0:
            n += 1
    return r, n


@_njit
def evaluate_weighted(
    states, base, table, nmax, rmax, restart_factor, grow_costs, weights, cap, penalty
):  # pragma: no cover - compiled
    """:meth:`adaptrain.sched._plan.WeightedGeneticSearch._evaluate`: per candidate
    ``(-FITNESS, -utility)``."""
    P, J, N = states.shape
    any_grow = False
    for j in range(J):
        if grow_costs[j] != 0:
            any_grow = True
    had = np.zeros(J, dtype=np.int64)
    for j in range(J):
        for k in range(N):
            had[j] += base[j, k]
    out = np.empty((P, 2))
    terms = np.empty(J)
    utils = np.empty(J)
    reps = np.empty(J, dtype=np.int64)
    speed = np.empty(J)
    for p in range(P):
        total = 0  # GPUs on the nodes in use
        for k in range(N):
            used = 0
            for j in range(J):
                used += states[p, j, k]
            if used > 0:
                total += cap[k]
        unscheduled = 0
        for j in range(J):
            r, n = _row_counts(states, p, j)
            differ = False
            for k in range(N):
                if states[p, j, k] != base[j, k]:
                    differ = True
                    break
            reps[j] = r
            s = table[j, min(n, nmax), min(r, rmax)]
            speed[j] = s
            if s <= 0:
                unscheduled += 1
            factor = restart_factor[j]
            if any_grow and r > had[j] and had[j] > 0:
                factor = min(factor, 1.0 - grow_costs[j])
            terms[j] = (s * (factor if differ else 1.0)) * weights[j]
        for j in range(J):
            if reps[j] > 0:
                utils[j] = (speed[j] / reps[j]) * (reps[j] / total)
            else:
                utils[j] = 0.0
        out[p, 0] = -(_row_sum(terms) - penalty * unscheduled)
        out[p, 1] = -_row_sum(utils)
    return out


@_njit
def _set_pinned(states, p, pinned, pinned_rows):  # pragma: no cover - compiled
    """Candidate ``p``'s rows of the pinned jobs set to ``pinned_rows`` (in job order)."""
    i = 0
    for j in range(pinned.shape[0]):
        if pinned[j]:
            for k in range(states.shape[2]):
                states[p, j, k] = pinned_rows[i, k]
            i += 1


@_njit
def repair_bounds(
    states, pinned, pinned_rows, interference, max_rep, max_nodes
):  # pragma: no cover
    """The first half of :meth:`adaptrain.sched.pollux.PolluxPolicy._repair`, up to its
    random draw: a copy of ``states`` with the pinned jobs' rows set and interference
    avoided, and the (candidate x job) rows, flat and in order, over a job's replica or node
    bound (for which the caller draws a random order of nodes)."""
    P, J, N = states.shape
    out = states.copy()
    any_pinned = pinned.any()
    for p in range(P):
        _set_pinned(out, p, pinned, pinned_rows)
    multi = np.zeros(J, dtype=np.bool_)
    if interference:
        taken = np.zeros(N, dtype=np.bool_)  # nodes of a pinned multi-node job
        seen = np.zeros(N, dtype=np.int64)  # multi-node jobs kept on each node so far
        for p in range(P):
            for j in range(J):
                multi[j] = _row_counts(out, p, j)[1] > 1
            for k in range(N):
                taken[k] = False
                seen[k] = 0
            if any_pinned:
                for j in range(J):
                    if pinned[j] and multi[j]:
                        for k in range(N):
                            if out[p, j, k] > 0:
                                taken[k] = True
            # a running count over jobs, as the artifact's: once a node has seen a second
            # multi-node job, every later job (multi-node or not) loses its replicas there
            for j in range(J):
                for k in range(N):
                    mask = multi[j] and not pinned[j] and out[p, j, k] > 0
                    if mask:
                        seen[k] += 1
                    if not pinned[j] and (seen[k] > 1 or (mask and taken[k])):
                        out[p, j, k] = 0
    over = np.zeros(P * J, dtype=np.bool_)
    for p in range(P):
        for j in range(J):
            r, n = _row_counts(out, p, j)
            over[p * J + j] = r > max_rep[j] or n > max_nodes
    return out, np.nonzero(over)[0].astype(np.int64)


@_njit
def repair_fill(
    states, rows, draws, max_rep, max_nodes, pinned, pinned_rows, cap, min_rep
):  # pragma: no cover - compiled
    """The second half of :meth:`adaptrain.sched.pollux.PolluxPolicy._repair`, in place on
    :func:`repair_bounds`' copy: each row of ``rows`` cut to its bounds with nodes kept in the
    order of its ``draws`` (a stable sort), the
    pinned rows set again, node capacity filled in job order, and a job below its minimum
    emptied."""
    P, J, N = states.shape
    row = np.empty(N, dtype=np.int64)
    for i in range(rows.shape[0]):
        p, j = rows[i] // J, rows[i] % J
        order = np.argsort(draws[i], kind="mergesort")
        total = 0
        nodes = 0
        for t in range(N):
            row[t] = states[p, j, order[t]]
        for t in range(N):
            before = min(total, max_rep[j])
            total += row[t]
            c = min(total, max_rep[j]) - before
            if c > 0:
                nodes += 1
                if nodes > max_nodes:
                    c = 0
            states[p, j, order[t]] = c
    left = cap.copy()  # what the pinned jobs leave on each node
    i = 0
    for j in range(J):
        if pinned[j]:
            for k in range(N):
                left[k] -= pinned_rows[i, k]
            i += 1
    for k in range(N):
        left[k] = max(left[k], 0)
    used = np.empty(N, dtype=np.int64)
    for p in range(P):
        for k in range(N):
            used[k] = 0
        _set_pinned(states, p, pinned, pinned_rows)
        for j in range(J):
            if pinned[j]:
                continue
            r = 0
            for k in range(N):
                c = states[p, j, k]
                room = left[k] - used[k]
                if c > room:
                    c = room if room > 0 else 0
                states[p, j, k] = c
                used[k] += c
                r += c
            if r < min_rep[j]:
                for k in range(N):
                    states[p, j, k] = 0
    return states


@_njit
def mutate_rows(states, base, draws):  # pragma: no cover - compiled
    """The first step of the sparse mutation of
    :meth:`adaptrain.sched.pollux.PolluxPolicy._mutation`: a copy of ``states`` with the
    (candidate, job) rows whose ``draws[0]`` fall below 0.1 reset to the current allocation;
    and how many rows ``draws[1]`` picks (below 0.1) for zeroing, the caller's next draw."""
    P, J, N = states.shape
    out = states.copy()
    picked = 0
    for p in range(P):
        for j in range(J):
            if draws[0, p, j] < 0.1:
                for k in range(N):
                    out[p, j, k] = base[j, k]
            if draws[1, p, j] < 0.1:
                picked += 1
    return out, picked


@_njit
def mutate_cells(states, picks, draws, cap):  # pragma: no cover - compiled
    """The rest of the sparse mutation, in place on :func:`mutate_rows`' copy, up to its last
    draw: the picked rows' entries zeroed where their draws (the first ``picked x nodes`` of
    ``draws``, row by row) fall below 0.1; then each cell mutates where its draw (the rest of
    ``draws``, in C order) falls below ``p1 + p2 - p1 p2`` on a node with a free GPU (``p1 =
    1 / jobs``, ``p2 = 1 / jobs with replicas there``, for a job with replicas there) or ``p1``
    (any other job there; 0 on a full node). Returns the flat indices of the cells mutating,
    with the bounds ``[low, high)`` of their new counts."""
    P, J, N = states.shape
    i = 0
    for p in range(P):
        for j in range(J):
            if picks[p, j] < 0.1:
                for k in range(N):
                    if draws[i * N + k] < 0.1:
                        states[p, j, k] = 0
                i += 1
    at = i * N
    p1 = np.empty(N)
    p12 = np.empty(N)
    free = np.empty(N, dtype=np.bool_)
    mutate = np.zeros(P * J * N, dtype=np.bool_)
    for p in range(P):
        for k in range(N):
            used = 0
            for j in range(J):
                used += states[p, j, k]
            free[k] = cap[k] - used >= 1
            on = 0
            if free[k]:
                for j in range(J):
                    if states[p, j, k] > 0:
                        on += 1
            p1[k] = (1.0 if free[k] else 0.0) / max(J, 1)
            p2 = 1.0 / max(on, 1)
            p12[k] = (p1[k] + p2) - p1[k] * p2
        for j in range(J):
            for k in range(N):
                c = (p * J + j) * N + k
                prob = p12[k] if (states[p, j, k] > 0 and free[k]) else p1[k]
                mutate[c] = draws[at + c] < prob
    cells = np.nonzero(mutate)[0].astype(np.int64)
    hi = cap[cells % N]
    return cells, np.minimum(states.reshape(-1)[cells].astype(np.int64), hi), hi + 1


@_njit
def nondominated_ranks(F):  # pragma: no cover - compiled
    """Pareto rank (0 = non-dominated) of each row of the (n, 2) float64 array ``F``
    (minimised). In a stable sort by (f0, f1), each point joins the first front none of whose
    members dominates it; in that order a front's smallest f1 never exceeds the next front's,
    so a bisection finds it."""
    n = F.shape[0]
    col0 = F[:, 0].copy()
    col1 = F[:, 1].copy()
    by_f1 = np.argsort(col1, kind="mergesort")
    order = by_f1[np.argsort(col0[by_f1], kind="mergesort")]  # lexsort((f1, f0))
    rank = np.empty(n, dtype=np.int64)
    mins = np.empty(n)  # smallest f1 of each front
    f0_at_min = np.empty(n)  # smallest f0 among that front's members attaining it
    size = 0
    for t in range(n):
        i = order[t]
        f0, f1 = col0[i], col1[i]
        lo, hi = 0, size  # bisect_left(mins, f1)
        while lo < hi:
            mid = (lo + hi) // 2
            if mins[mid] < f1:
                lo = mid + 1
            else:
                hi = mid
        k = lo
        while k < size and mins[k] == f1 and f0_at_min[k] < f0:
            k += 1
        if k == size:
            mins[size] = f1
            f0_at_min[size] = f0
            size += 1
        elif f1 < mins[k]:
            mins[k] = f1
            f0_at_min[k] = f0
        rank[i] = k
    return rank


@_njit
def breed(pop, rank, crowd, a1, b1, a2, b2, points, coin):  # pragma: no cover - compiled
    """The children of one batch of :meth:`adaptrain.sched.pollux.PolluxPolicy._generation`,
    before mutation: two binary tournaments (``a1`` against ``b1``, ``a2`` against ``b2``:
    ``b`` wins on a lower rank, or on the same rank with a larger crowding distance), then a
    one-point crossover over jobs of each pair (the first ``points[i]`` jobs swapped where
    ``coin[i] < 0.9``); the first children first, then the second."""
    m = a1.shape[0]
    J, N = pop.shape[1], pop.shape[2]
    out = np.empty((2 * m, J, N), dtype=pop.dtype)
    for i in range(m):
        a, b = a1[i], b1[i]
        x = b if rank[b] < rank[a] or (rank[b] == rank[a] and crowd[b] > crowd[a]) else a
        a, b = a2[i], b2[i]
        y = b if rank[b] < rank[a] or (rank[b] == rank[a] and crowd[b] > crowd[a]) else a
        cut = points[i, 0] if coin[i, 0] < 0.9 else 0
        for j in range(J):
            first, second = (y, x) if j < cut else (x, y)
            for k in range(N):
                out[i, j, k] = pop[first, j, k]
                out[m + i, j, k] = pop[second, j, k]
    return out


@_njit
def _row_hashes(states):  # pragma: no cover - compiled
    """A 64-bit FNV-1a-style hash of each candidate's counts, one 16-bit count at a time
    (equal rows, equal hashes)."""
    P = states.shape[0]
    flat = states.reshape(P, -1)
    out = np.empty(P, dtype=np.uint64)
    prime = np.uint64(1099511628211)
    for p in range(P):
        h = np.uint64(14695981039346656037)
        for t in range(flat.shape[1]):
            h = (h ^ np.uint64(np.int64(flat[p, t]) & 0xFFFF)) * prime
        out[p] = h
    return out


@_njit
def _same_row(a, i, b, k):  # pragma: no cover - compiled
    """Whether candidate ``i`` of ``a`` and candidate ``k`` of ``b`` hold the same counts."""
    fa, fb = a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1)
    for t in range(fa.shape[1]):
        if fa[i, t] != fb[k, t]:
            return False
    return True


@_njit
def fresh_rows(pop, off, new):  # pragma: no cover - compiled
    """The children of ``new`` that are not duplicates: the indices of ``new``'s rows found
    in neither ``pop`` nor ``off``, each at its first occurrence, in order (rows compared in
    full where their hashes agree)."""
    hp, ho, hn = _row_hashes(pop), _row_hashes(off), _row_hashes(new)
    keep = np.empty(new.shape[0], dtype=np.int64)
    kept = 0
    for i in range(new.shape[0]):
        dup = False
        for k in range(pop.shape[0]):
            if hp[k] == hn[i] and _same_row(new, i, pop, k):
                dup = True
                break
        if not dup:
            for k in range(off.shape[0]):
                if ho[k] == hn[i] and _same_row(new, i, off, k):
                    dup = True
                    break
        if not dup:
            for t in range(kept):
                k = keep[t]
                if hn[k] == hn[i] and _same_row(new, i, new, k):
                    dup = True
                    break
        if not dup:
            keep[kept] = i
            kept += 1
    return keep[:kept]


@_njit
def survive(pop, off, F, F_off, size):  # pragma: no cover - compiled
    """The end of :meth:`adaptrain.sched.pollux.PolluxPolicy._generation`: parents and
    children ranked and crowded together, the first ``size`` by (rank, -crowding) kept (a
    stable sort, as ``lexsort``), with their objectives, ranks and recomputed crowding."""
    n, m = pop.shape[0], off.shape[0]
    Fm = np.empty((n + m, F.shape[1]))
    Fm[:n] = F
    Fm[n:] = F_off
    rank = nondominated_ranks(Fm)
    neg = -crowding(Fm, rank)
    by_crowd = np.argsort(neg, kind="mergesort")
    order = by_crowd[np.argsort(rank[by_crowd], kind="mergesort")][:size]
    out = np.empty((order.shape[0], pop.shape[1], pop.shape[2]), dtype=pop.dtype)
    F_out = np.empty((order.shape[0], F.shape[1]))
    rank_out = np.empty(order.shape[0], dtype=np.int64)
    for t in range(order.shape[0]):
        i = order[t]
        for j in range(pop.shape[1]):
            for k in range(pop.shape[2]):
                out[t, j, k] = pop[i, j, k] if i < n else off[i - n, j, k]
        for c in range(F.shape[1]):
            F_out[t, c] = Fm[i, c]
        rank_out[t] = rank[i]
    return out, F_out, rank_out, crowding(F_out, rank_out)
