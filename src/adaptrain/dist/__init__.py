"""Distributed glue: process groups, python-object collectives, checkpoints, DDP hooks."""

from adaptrain.dist.spawn import SpawnError, free_port, spawn

__all__ = ["SpawnError", "free_port", "spawn"]
