"""A thread-backed communicator: simulates N workers in one process for pure compressor tests."""

from __future__ import annotations

import threading

import torch


class ThreadGroup:
    """N in-process workers; each gets a communicator whose collectives meet at a barrier."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.barrier = threading.Barrier(n, timeout=30)
        self.slots: list = [None] * n

    def _exchange(self, rank: int, t: torch.Tensor) -> list[torch.Tensor]:
        self.slots[rank] = t.detach().clone()
        self.barrier.wait()
        out = [s.clone() for s in self.slots]
        self.barrier.wait()
        return out


class ThreadComm:
    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self.group = group
        self.rank = rank

    @property
    def world_size(self) -> int:
        return self.group.n

    def all_reduce_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        xs = self.group._exchange(self.rank, tensor)
        total = xs[0].clone()
        for x in xs[1:]:
            total += x
        return total / self.group.n

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return self.group._exchange(self.rank, tensor)


def run_workers(n: int, fn):
    """Run ``fn(rank, comm)`` on n threads; return results by rank (re-raising failures)."""
    group = ThreadGroup(n)
    results: list = [None] * n
    errors: list = []

    def target(r: int) -> None:
        try:
            results[r] = fn(r, ThreadComm(group, r))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
            group.barrier.abort()

    threads = [threading.Thread(target=target, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return results
