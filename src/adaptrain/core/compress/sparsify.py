"""Sparsification with error memory: top-k, random-k and block (Stich, Cordonnier & Jaggi, 2018,
"Sparsified SGD with Memory"; Aji & Heafield, 2017 for top-k).

Per step, on worker ``w`` with input ``x_w`` (e.g. ``lr · grad``) and memory ``m_w``::

    a_w  = m_w + x_w
    I    = select(a_w, k)                # top-k | random-k | one block of k | cyclic block
    send a_w[I];  m_w ← a_w with a_w[I] set to 0   (memory keeps exactly what was not sent)
    out  = mean_w scatter(I_w, a_w[I_w])

Random-k and block indices come from a generator seeded by ``(seed, step)``: all workers pick
the same ``I`` and one all-reduce of ``k`` values suffices. ``"block"`` draws the block uniformly
at random every step (each block waits a geometric number of steps, mean ``d/k`` but often
several times that); ``"cyclic_block"`` visits the ``⌈d/k⌉`` blocks in a seeded random order,
redrawn every ``⌈d/k⌉`` steps (sampling without replacement), so no coordinate waits more than
``2⌈d/k⌉ − 1`` steps and the memory never holds more than that many steps of input.
Top-k indices differ per worker, so values and indices are all-gathered.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from adaptrain.core.compress._comm import LOCAL, Communicator

__all__ = [
    "SparseState",
    "SparseResult",
    "sparse_init",
    "sparse_update",
    "topk_indices",
    "randomk_indices",
    "block_indices",
    "cyclic_block_indices",
]

METHODS = ("topk", "randomk", "block", "cyclic_block")


class SparseState(NamedTuple):
    """Error memory (shape of the input), step counter and selection seed."""

    memory: torch.Tensor
    step: int
    seed: int


class SparseResult(NamedTuple):
    """Averaged sparse update (dense tensor), this worker's sent indices/values and traffic."""

    update: torch.Tensor
    indices: torch.Tensor
    values: torch.Tensor
    sent_bytes: int
    dense_bytes: int


def _generator(seed: int, step: int, salt: int = 0) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed((seed * 1_000_003 + step + salt * 0x9E3779B97F4A7C15) % (2**63 - 1))
    return g


def _check_k(k: int, numel: int) -> int:
    if int(k) < 1:
        raise ValueError(f"k={k} must be a positive number of coordinates (e.g. k=10)")
    return min(int(k), numel)


def topk_indices(flat: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest-magnitude entries of a 1-D tensor (ties: lowest index)."""
    k = _check_k(k, flat.numel())
    # torch.topk breaks ties arbitrarily: take every entry above the k-th largest magnitude,
    # then the lowest-indexed entries equal to it. NaN ranks as the largest (as in topk).
    mag = torch.nan_to_num(flat.abs(), nan=float("inf"))
    kth = torch.topk(mag, k, sorted=False).values.min()
    above = (mag > kth).nonzero().flatten()
    tied = (mag == kth).nonzero().flatten()[: k - above.numel()]
    return torch.cat([above, tied]).sort().values


def randomk_indices(numel: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """``k`` distinct uniformly random indices in ``[0, numel)``, sorted."""
    k = _check_k(k, numel)
    return torch.randperm(numel, generator=generator)[:k].sort().values


def block_indices(numel: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """One aligned block ``[b·k, min((b+1)·k, numel))`` with ``b`` uniform over the blocks."""
    k = _check_k(k, numel)
    nblocks = -(-numel // k)
    b = int(torch.randint(nblocks, (1,), generator=generator))
    return torch.arange(b * k, min((b + 1) * k, numel))


def cyclic_block_indices(numel: int, k: int, seed: int, step: int) -> torch.Tensor:
    """Block ``π_e(step mod n)`` of the ``n = ⌈numel/k⌉`` aligned blocks, ``e = step // n``.

    ``π_e`` is a random permutation of the blocks seeded by ``(seed, e)``: every block is taken
    exactly once in each round of ``n`` consecutive steps.
    """
    k = _check_k(k, numel)
    if step < 0:
        raise ValueError(f"step={step} must be >= 0")
    nblocks = -(-numel // k)
    order = torch.randperm(nblocks, generator=_generator(seed, step // nblocks, salt=1))
    b = int(order[step % nblocks])
    return torch.arange(b * k, min((b + 1) * k, numel))


def sparse_init(
    shape, seed: int = 0, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> SparseState:
    """Zero memory for an input of ``shape``."""
    return SparseState(torch.zeros(tuple(shape), dtype=dtype, device=device), 0, int(seed))


def sparse_update(
    x: torch.Tensor,
    state: SparseState,
    comm: Communicator = LOCAL,
    *,
    k: int,
    method: str = "topk",
    memory: bool = True,
) -> tuple[SparseResult, SparseState]:
    """One sparsified round for input ``x``; returns the averaged sparse update and new state.

    With ``memory=False`` the unsent remainder is discarded (plain sparsification).
    """
    if method not in METHODS:
        raise ValueError(f"method={method!r}; choose one of {METHODS}")
    if x.shape != state.memory.shape:
        raise ValueError(f"input shape {tuple(x.shape)} != state shape {tuple(state.memory.shape)}")
    acc = (state.memory + x) if memory else x.clone()
    flat = acc.reshape(-1)
    if method == "topk":
        idx = topk_indices(flat, k)
    elif method == "randomk":
        idx = randomk_indices(flat.numel(), k, _generator(state.seed, state.step))
    elif method == "block":
        idx = block_indices(flat.numel(), k, _generator(state.seed, state.step))
    else:
        idx = cyclic_block_indices(flat.numel(), k, state.seed, state.step)
    values = flat[idx].clone()
    out = torch.zeros_like(flat)
    if method == "topk":
        idx32 = idx.to(torch.int32)
        sent = values.numel() * values.element_size() + idx32.numel() * idx32.element_size()
        all_vals = comm.all_gather(values)
        all_idx = comm.all_gather(idx32)
        for v, i in zip(all_vals, all_idx):
            out.index_add_(0, i.long(), v)
        out.div_(comm.world_size)
    else:
        sent = values.numel() * values.element_size()
        out[idx] = comm.all_reduce_mean(values.clone())
    if memory:
        rest = flat.clone()
        rest[idx] = 0
        new_mem = rest.reshape(x.shape)
    else:
        new_mem = state.memory
    result = SparseResult(out.reshape(x.shape), idx, values, sent, x.numel() * x.element_size())
    return result, SparseState(new_mem, state.step + 1, state.seed)
