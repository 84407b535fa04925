"""Handwritten digits (sklearn's bundled 8×8 ``load_digits``) as a small real-data workload.

1,797 grey-scale 8×8 images of the digits 0–9 (UCI optical recognition data set, bundled with
scikit-learn, so no download). Used by the examples, the demo, tests and benchmarks.
"""

from __future__ import annotations

import gzip
import importlib.util
import os

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

from adaptrain.workloads._seed import seeded

__all__ = ["digits_datasets", "DigitsNet", "digits_loss", "NUM_CLASSES"]

NUM_CLASSES = 10


def digits_datasets(
    test_fraction: float = 0.2, seed: int = 0
) -> tuple[TensorDataset, TensorDataset]:
    """Train and test splits of the digits: ``(images float32 [N,1,8,8] in [0,1], labels int64)``.

    Pixels (0–16 in the raw data) are divided by 16. The split is a seeded permutation, so the
    same ``(test_fraction, seed)`` gives the same datasets.

    Raises:
        ValueError: if ``test_fraction`` is not in ``(0, 1)``.
        ImportError: if scikit-learn is not installed (``pip install scikit-learn``).
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction={test_fraction} must lie strictly between 0 and 1")
    raw_images, raw_labels = _load_digits()
    images = (np.asarray(raw_images, dtype=np.float32) / 16.0)[:, None, :, :]
    labels = np.asarray(raw_labels, dtype=np.int64)
    perm = np.random.RandomState(seed).permutation(len(labels))
    n_test = max(1, int(round(test_fraction * len(labels))))
    test_idx, train_idx = np.sort(perm[:n_test]), np.sort(perm[n_test:])

    def make(idx: np.ndarray) -> TensorDataset:
        return TensorDataset(torch.from_numpy(images[idx].copy()), torch.from_numpy(labels[idx]))

    return make(train_idx), make(test_idx)


def _load_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits, ``(images [N, 8, 8], labels [N])``: read from the data file it
    bundles without importing ``sklearn`` (over a second on a busy 2-core machine, most of a
    job's start-up), through ``load_digits`` where that file is not found."""
    spec = importlib.util.find_spec("sklearn")  # locates the package, imports nothing
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        path = os.path.join(folder, "datasets", "data", "digits.csv.gz")
        if os.path.isfile(path):
            with gzip.open(path, "rt") as f:
                data = np.loadtxt(f, delimiter=",")
            return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int)
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:  # pragma: no cover - sklearn is a test/demo dependency
        raise ImportError("digits_datasets needs scikit-learn: pip install scikit-learn") from exc
    data = load_digits()
    return data.images, data.target


class DigitsNet(nn.Module):
    """A small CNN for 8×8 digits (≈ 40k parameters), or an MLP with ``conv=False``.

    CNN: conv3×3(1→16) → ReLU → conv3×3(16→32) → ReLU → maxpool 2 → linear(512→hidden) → ReLU →
    linear(hidden→10). MLP: linear(64→hidden) → ReLU → linear(hidden→10). Accepts inputs of
    shape ``[N, 1, 8, 8]`` or ``[N, 64]`` and returns logits ``[N, 10]``. With ``seed`` the
    initial weights depend only on it (the global RNG is left untouched).
    """

    def __init__(self, hidden: int = 64, conv: bool = True, seed: int | None = None) -> None:
        super().__init__()
        if hidden < 1:
            raise ValueError(f"hidden={hidden} must be a positive width")
        with seeded(seed):
            self.conv = conv
            if conv:
                self.features: nn.Module = nn.Sequential(
                    nn.Conv2d(1, 16, 3, padding=1),
                    nn.ReLU(),
                    nn.Conv2d(16, 32, 3, padding=1),
                    nn.ReLU(),
                    nn.MaxPool2d(2),
                    nn.Flatten(),
                )
                in_features = 32 * 4 * 4
            else:
                self.features = nn.Flatten()
                in_features = 64
            self.head = nn.Sequential(
                nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, NUM_CLASSES)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(x.shape[0], 1, 8, 8) if self.conv else x.reshape(x.shape[0], 64)
        return self.head(self.features(x))


def digits_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean cross-entropy of ``model`` on an ``(images, labels)`` batch."""
    images, labels = batch
    return nn.functional.cross_entropy(model(images), labels)
