"""Sign compression: signSGD with majority vote (Bernstein, Zhao, Azizzadenesheli & Anandkumar,
2019, "signSGD with Majority Vote is Communication Efficient and Fault Tolerant") and error
feedback (Karimireddy, Rebjock, Stich & Jaggi, 2019, "Error Feedback Fixes SignSGD").

On worker ``w`` with input ``x_w``:

* ``majority_vote``: ``out = sign(Σ_w sign(x_w))`` (``0`` on a tie);
* ``error_feedback``: ``p_w = x_w + e_w``, ``c_w = (‖p_w‖₁ / d) · s(p_w)``,
  ``e_w ← p_w − c_w``, ``out = mean_w c_w`` (one float scale + d bits per worker);
* neither: ``out = mean_w sign(x_w)``.

Transport. Error feedback sends 1 bit per coordinate, ``s(x) = +1`` for ``x ≥ 0`` and ``-1``
otherwise (:func:`pack_signs`): a zero sent as ``+1`` stays in the residual and is corrected
later. Without a residual nothing would correct it, so majority vote and the plain mean send
the ternary ``sign(x) ∈ {−1, 0, +1}`` as two bit planes (:func:`pack_ternary`, 2 bits per
coordinate): a coordinate whose gradient is exactly zero on every worker (a dead unit, an
unused embedding row, a parameter without a gradient) does not move.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from adaptrain.core.compress._comm import LOCAL, Communicator

__all__ = [
    "SignState",
    "SignResult",
    "signs",
    "pack_signs",
    "unpack_signs",
    "pack_ternary",
    "unpack_ternary",
    "majority_vote",
    "sign_init",
    "sign_update",
]

_BITS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)


class SignState(NamedTuple):
    """Error-feedback residual ``e`` (zeros when error feedback is off)."""

    memory: torch.Tensor


class SignResult(NamedTuple):
    """Aggregated update and the bytes this worker sent (vs. a dense all-reduce)."""

    update: torch.Tensor
    sent_bytes: int
    dense_bytes: int


def signs(x: torch.Tensor) -> torch.Tensor:
    """``+1`` where ``x ≥ 0``, ``-1`` elsewhere (same dtype as ``x``)."""
    return torch.where(x >= 0, torch.ones_like(x), -torch.ones_like(x))


def _pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A boolean tensor as ``ceil(numel/8)`` uint8, most significant bit first."""
    bits = mask.reshape(-1).to(torch.uint8)
    pad = (-bits.numel()) % 8
    if pad:
        bits = torch.cat([bits, torch.zeros(pad, dtype=torch.uint8, device=bits.device)])
    return (bits.reshape(-1, 8) * _BITS.to(bits.device)).sum(dim=1, dtype=torch.uint8)


def _unpack_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of :func:`_pack_bits`: a 1-D boolean tensor of length ``numel``."""
    bits = (packed.reshape(-1, 1) & _BITS.to(packed.device)) != 0
    return bits.reshape(-1)[:numel]


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """Pack ``x ≥ 0`` bits of a tensor into ``ceil(numel/8)`` uint8, most significant bit first."""
    return _pack_bits(x >= 0)


def unpack_signs(
    packed: torch.Tensor, numel: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of :func:`pack_signs`: a 1-D tensor of ``±1`` of length ``numel``."""
    one = torch.ones(numel, dtype=dtype, device=packed.device)
    return torch.where(_unpack_bits(packed, numel), one, -one)


def pack_ternary(x: torch.Tensor) -> torch.Tensor:
    """Pack ``sign(x) ∈ {−1, 0, +1}`` as two bit planes (``x > 0``, then ``x < 0``):
    ``2·ceil(numel/8)`` uint8. NaN packs as 0."""
    flat = x.reshape(-1)
    return torch.cat([_pack_bits(flat > 0), _pack_bits(flat < 0)])


def unpack_ternary(
    packed: torch.Tensor, numel: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of :func:`pack_ternary`: a 1-D tensor of ``−1 / 0 / +1`` of length ``numel``."""
    half = packed.numel() // 2
    pos = _unpack_bits(packed[:half], numel).to(dtype)
    return pos - _unpack_bits(packed[half:], numel).to(dtype)


def majority_vote(votes: Sequence[torch.Tensor]) -> torch.Tensor:
    """Element-wise sign of the sum of ``±1`` votes; ``0`` where the vote is tied."""
    if not votes:
        raise ValueError("majority_vote needs at least one vote tensor")
    return torch.sign(torch.stack(list(votes)).sum(dim=0))


def sign_init(
    shape, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> SignState:
    """Zero error-feedback residual for inputs of ``shape``."""
    return SignState(torch.zeros(tuple(shape), dtype=dtype, device=device))


def sign_update(
    x: torch.Tensor,
    state: SignState,
    comm: Communicator = LOCAL,
    *,
    error_feedback: bool = False,
    majority: bool = False,
) -> tuple[SignResult, SignState]:
    """One sign-compressed round (see module docstring); inputs are not modified."""
    if error_feedback and majority:
        raise ValueError(
            "error_feedback=True and majority_vote=True are alternatives (EF-SignSGD sends scaled "
            "signs and averages them; majority vote sends bare signs): pick one"
        )
    if x.shape != state.memory.shape:
        raise ValueError(f"input shape {tuple(x.shape)} != state shape {tuple(state.memory.shape)}")
    d = x.numel()
    p = x + state.memory if error_feedback else x
    pack, unpack = (pack_signs, unpack_signs) if error_feedback else (pack_ternary, unpack_ternary)
    packed = pack(p)
    sent = packed.numel() * packed.element_size()
    gathered = comm.all_gather(packed)
    votes = [unpack(b, d, x.dtype).reshape(x.shape) for b in gathered]
    new_state = state
    if majority:
        out = majority_vote(votes)
    elif error_feedback:
        # The mean |p| fits x's dtype; the sum of a large fp16 bucket does not (> 65504).
        acc = torch.promote_types(x.dtype, torch.float32)
        scale = (p.abs().sum(dtype=acc) / d).to(x.dtype).reshape(1)
        sent += scale.numel() * scale.element_size()
        scales = comm.all_gather(scale)
        out = sum(s * v for s, v in zip(scales, votes)) / comm.world_size
        new_state = SignState(p - scale * signs(p))
    else:
        out = sum(votes) / comm.world_size
    return SignResult(out, sent, d * x.element_size()), new_state
