"""Collectives on small python objects (``adaptdl.collective`` equivalent).

See :mod:`adaptrain.dist.collective` for the implementation notes.
"""

from adaptrain.dist.collective import (
    allreduce,
    allreduce_async,
    barrier,
    broadcast,
    default_reduce_fn,
    initialize,
    teardown,
)

__all__ = [
    "allreduce",
    "allreduce_async",
    "barrier",
    "broadcast",
    "default_reduce_fn",
    "initialize",
    "teardown",
]
