"""Checkpoint-restart of named state (``adaptdl.checkpoint`` equivalent).

See :mod:`adaptrain.dist.checkpoint` for the on-disk format and the atomicity guarantees.
"""

from adaptrain.dist.checkpoint import (
    State,
    latest_checkpoint,
    load_state,
    reset,
    save_all_states,
    save_state,
)

__all__ = ["State", "latest_checkpoint", "load_state", "reset", "save_all_states", "save_state"]
