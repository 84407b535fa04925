"""The ``adaptrain`` command line (services layer)."""

from adaptrain.cli._main import main

__all__ = ["main"]
