"""adaptrain: adaptive batch size, elastic training and communication-efficient optimizers on PyTorch."""

__version__ = "0.1.0"

__all__ = ["__version__"]
