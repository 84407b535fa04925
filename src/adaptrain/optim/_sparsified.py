"""Sparsified SGD with memory (Stich, Cordonnier & Jaggi, 2018), API-compatible with
mlbench-core's ``SparsifiedSGD`` and ``CentralizedSparsifiedSGD``.

Per parameter ``p`` (memory ``m``, ``k = sparse_grad_size``)::

    a = m + lr · (grad + weight_decay · p)
    I = random-k (random_sparse=True), one random block of k coordinates (default), or the
        next block of a seeded random cycle through all blocks (cyclic_blocks=True), drawn
        from a generator seeded by (seed + parameter index, step): equal on all workers
    p[I] ← p[I] − mean_workers(a[I])      (sum with average_world=False)
    m ← a with a[I] = 0                     (memory keeps exactly what was not applied)

:meth:`SparsifiedSGD.update_estimated_weights` keeps the weighted average of iterates of the
paper's Theorem 2.4 (``ρ_t`` with shift ``τ = numel / k``). Unlike mlbench-core, the model's
weights are never re-initialised, any parameter shape works, and selection is seeded.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim import Optimizer
from torch.optim.optimizer import required

from adaptrain.core.compress import LocalCommunicator, SparseState, sparse_update
from adaptrain.dist.hooks import default_communicator
from adaptrain.optim._centralized import group_world_size

__all__ = ["SparsifiedSGD", "CentralizedSparsifiedSGD"]


class SparsifiedSGD(Optimizer):
    """Single-worker sparsified SGD with memory.

    Args:
        params: parameters or parameter groups.
        lr: learning rate.
        weight_decay: L2 penalty.
        sparse_grad_size: number ``k`` of coordinates applied per parameter per step.
        random_sparse: random-k selection instead of a random block (keyword extension).
        seed: selection seed (keyword extension).
        cyclic_blocks: visit the blocks in a seeded random order without replacement
            (``"cyclic_block"`` in :func:`~adaptrain.core.compress.sparse_update`) instead of
            drawing one uniformly each step; bounds each coordinate's delay by ``2⌈d/k⌉ − 1``
            steps (keyword extension; ignored with ``random_sparse=True``).
    """

    def __init__(
        self,
        params,
        lr=required,
        weight_decay=0,
        sparse_grad_size=10,
        *,
        random_sparse: bool = False,
        seed: int = 0,
        cyclic_blocks: bool = False,
    ) -> None:
        if lr is not required and lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if int(sparse_grad_size) < 1:
            raise ValueError(f"sparse_grad_size={sparse_grad_size} must be a positive integer")
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay))
        self.num_coordinates = int(sparse_grad_size)
        self.random_sparse = random_sparse
        self.cyclic_blocks = bool(cyclic_blocks)
        self.seed = int(seed)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (``torch.optim.Optimizer``'s contract); its parameters get a zero
        memory and an estimated-weight average starting at their current values."""
        super().add_param_group(param_group)
        for p in self.param_groups[-1]["params"]:
            st = self.state[p]
            if "memory" not in st:
                st["memory"] = torch.zeros_like(p)
                st["estimated_w"] = p.detach().clone()
                st["sparse_step"] = 0

    def _params(self) -> list[torch.nn.Parameter]:
        return [p for g in self.param_groups for p in g["params"]]

    def _comm(self):
        return LocalCommunicator()

    def _round(self, param: torch.nn.Parameter, lr: float, weight_decay: float, index: int, comm):
        st = self.state[param]
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        x = grad.add(param, alpha=weight_decay) if weight_decay != 0 else grad
        res, new = sparse_update(
            x.detach() * lr,
            SparseState(st["memory"], int(st["sparse_step"]), self.seed + index),
            comm,
            k=self.num_coordinates,
            method=self._method(),
        )
        st["memory"] = new.memory
        st["sparse_step"] = new.step
        return res

    def _method(self) -> str:
        if self.random_sparse:
            return "randomk"
        return "cyclic_block" if self.cyclic_blocks else "block"

    @torch.no_grad()
    def sparsify_gradients(self, param: torch.nn.Parameter, lr: float) -> torch.Tensor:
        """Add ``lr · grad`` to the memory, take k coordinates out; returns ``[indices; values]``.

        The returned ``2 × k`` tensor holds the flat indices (as floats) and the values to
        subtract from the parameter; the memory no longer holds them. Its dtype is the
        parameter's, widened (float32, then float64) where that dtype cannot hold every index
        of the parameter exactly (fp16 above 2048, bf16 above 256).
        """
        index = next((i for i, p in enumerate(self._params()) if p is param), None)
        if index is None:
            raise ValueError(
                f"param of shape {tuple(param.shape)} is not optimized by this optimizer: pass "
                "one of its parameters (or add it with add_param_group)"
            )
        wd = next(
            g["weight_decay"] for g in self.param_groups if any(q is param for q in g["params"])
        )
        res = self._round(param, lr, wd, index, LocalCommunicator())
        dtype = res.values.dtype
        exact = {torch.float16: 2**11, torch.bfloat16: 2**8, torch.float32: 2**24}
        if param.numel() > exact.get(dtype, 2**53):
            dtype = torch.float32 if param.numel() <= 2**24 else torch.float64
        return torch.stack([res.indices.to(dtype), res.values.to(dtype)])

    def _scale(self, comm) -> float:
        return 1.0

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        """One sparsified step for every parameter; returns the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        comm = self._comm()
        scale = self._scale(comm)
        live = self._has_grad_anywhere(comm)
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                if live[index]:
                    res = self._round(p, group["lr"], group["weight_decay"], index, comm)
                    p.sub_(res.update if scale == 1.0 else res.update * scale)
                index += 1
        return loss

    def _has_grad_anywhere(self, comm) -> list[bool]:
        """Per parameter: whether any worker has a gradient for it.

        A parameter with a gradient on no worker is skipped (no weight decay, nothing enters
        its memory), as ``torch.optim.SGD`` does; one with a gradient on some worker takes part
        everywhere, as zeros where it is missing. With several workers this costs one small
        all-reduce of the flags per step, so all workers run the same collectives.
        """
        params = self._params()
        flags = [p.grad is not None for p in params]
        if comm.world_size == 1 or not params:
            return flags
        t = torch.tensor([float(f) for f in flags], device=params[0].device)
        return [v > 0 for v in comm.all_reduce_mean(t).tolist()]

    @torch.no_grad()
    def update_estimated_weights(self, iteration: int, sparse_vector_size: int) -> None:
        """``w̄ ← (1−ρ) w̄ + ρ w`` with ``ρ = 6(t+τ)² / ((1+t)(6τ² + t + 6τt + 2t²))``, ``τ = numel/k``."""
        t = float(iteration)
        for p in self._params():
            tau = p.numel() / float(sparse_vector_size)
            rho = 6 * (t + tau) ** 2 / ((1 + t) * (6 * tau**2 + t + 6 * tau * t + 2 * t**2))
            est = self.state[p]["estimated_w"]
            est.mul_(1 - rho).add_(p, alpha=rho)

    def get_estimated_weights(self) -> list[torch.Tensor]:
        """The weighted-average parameters, one tensor per parameter."""
        return [self.state[p]["estimated_w"] for p in self._params()]


class CentralizedSparsifiedSGD(SparsifiedSGD):
    """Sparsified SGD with memory where the workers average the selected coordinates.

    All workers select the same coordinates (shared seed), so one all-reduce of ``k`` values
    per parameter replaces the dense gradient all-reduce. A parameter with a gradient on no
    worker is skipped, at any world size; one with a gradient on some worker counts as zeros on
    the others (one small all-reduce of "has a gradient" flags per step decides).
    """

    def __init__(
        self,
        params=None,
        lr=required,
        weight_decay=0,
        sparse_grad_size=10,
        random_sparse=False,
        world_size=1,
        average_world=True,
        *,
        seed: int = 0,
        cyclic_blocks: bool = False,
        process_group: Any = None,
    ) -> None:
        if params is None:
            raise ValueError("params=None: pass the parameters to optimize")
        super().__init__(
            params,
            lr,
            weight_decay,
            sparse_grad_size,
            random_sparse=random_sparse,
            seed=seed,
            cyclic_blocks=cyclic_blocks,
        )
        if world_size != 1:
            group_world_size(world_size, process_group)
        self.average_world = average_world
        self.process_group = process_group

    def _comm(self):
        return default_communicator(self.process_group)

    def _scale(self, comm) -> float:
        return 1.0 if self.average_world else float(comm.world_size)
