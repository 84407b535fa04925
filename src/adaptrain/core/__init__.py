"""Pure math layer: goodput model, noise-scale estimators, scaling rules, compressors.

Modules here use numpy, scipy and torch tensors only: no ``torch.distributed``, no environment,
no I/O. Higher layers (``adaptrain.dist``, ``adaptrain.torch``, ``adaptrain.optim``,
``adaptrain.sched``) import from here, never the other way round.
"""

__all__: list[str] = []
