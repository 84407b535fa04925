"""Pure gradient compressors with explicit state (init/update pairs), and gossip mixing.

Every ``*_update`` takes a communicator (see :mod:`._comm`) for its collective step, so the
same code runs in one process (:class:`LocalCommunicator`) and over ``torch.distributed``.
"""

from adaptrain.core.compress._comm import Communicator, LocalCommunicator
from adaptrain.core.compress.gossip import gossip_mix
from adaptrain.core.compress.powersgd import (
    PowerSGDResult,
    PowerSGDState,
    orthogonalize,
    powersgd_init,
    powersgd_update,
)
from adaptrain.core.compress.sign import (
    SignResult,
    SignState,
    majority_vote,
    pack_signs,
    pack_ternary,
    sign_init,
    sign_update,
    signs,
    unpack_signs,
    unpack_ternary,
)
from adaptrain.core.compress.sketch import count_sketch
from adaptrain.core.compress.sparsify import (
    SparseResult,
    SparseState,
    block_indices,
    cyclic_block_indices,
    randomk_indices,
    sparse_init,
    sparse_update,
    topk_indices,
)

__all__ = [
    "Communicator",
    "LocalCommunicator",
    "PowerSGDResult",
    "PowerSGDState",
    "SignResult",
    "SignState",
    "SparseResult",
    "SparseState",
    "block_indices",
    "count_sketch",
    "cyclic_block_indices",
    "gossip_mix",
    "majority_vote",
    "orthogonalize",
    "pack_signs",
    "pack_ternary",
    "powersgd_init",
    "powersgd_update",
    "randomk_indices",
    "sign_init",
    "sign_update",
    "signs",
    "sparse_init",
    "sparse_update",
    "topk_indices",
    "unpack_signs",
    "unpack_ternary",
]
