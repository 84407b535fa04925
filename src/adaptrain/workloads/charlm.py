"""Character-level language modelling on the Python standard library's own source code.

The corpus is the text of the ``.py`` files under ``sysconfig.get_paths()["stdlib"]`` on this
machine, read in sorted path order and capped at ``max_chars`` characters, so it is real text
available offline. Excluded are third-party packages (``site-packages``, ``dist-packages``) and
the files a build or a distribution writes for one machine: ``_sysconfigdata*.py`` (the install
prefix, compiler and flags), the ``config-*`` build folder and ``sitecustomize.py``. The corpus
is therefore the same on every machine with the same Python version from the same source (e.g.
every pyenv or python.org 3.11.7, wherever installed); another patch version, or a
distribution's patched standard library (Debian's, say), gives another corpus, so replicas on
several machines need the same Python. Characters map to a fixed vocabulary: index 0 is
"unknown", then tab, newline and the 95 printable ASCII characters (98 symbols).

The model (:class:`CharLM`) is an embedding → GRU → linear next-character predictor, small
enough to train a few steps per second on one CPU core at batch 32 × 64 characters.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from adaptrain.workloads._seed import seeded

__all__ = [
    "VOCAB",
    "VOCAB_SIZE",
    "UNK",
    "encode",
    "decode",
    "stdlib_text",
    "CharLMDataset",
    "charlm_datasets",
    "CharLM",
    "loss",
]

#: The symbols, by index; index 0 (``UNK``) stands for every character not listed.
VOCAB: str = "\x00\t\n" + "".join(chr(c) for c in range(32, 127))
VOCAB_SIZE: int = len(VOCAB)
UNK: int = 0

_LOOKUP = np.zeros(128, dtype=np.int64)
for _i, _c in enumerate(VOCAB[1:], start=1):
    _LOOKUP[ord(_c)] = _i


def encode(text: str) -> torch.Tensor:
    """Indices (int64) of ``text`` in :data:`VOCAB`; non-ASCII or control characters → ``UNK``."""
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32).astype(np.int64)
    ids = np.where(codes < 128, _LOOKUP[np.minimum(codes, 127)], UNK)
    return torch.from_numpy(ids)


def decode(ids: torch.Tensor | np.ndarray | list[int]) -> str:
    """The text of ``ids``; ``UNK`` decodes to U+FFFD."""
    chars = [VOCAB[i] if 0 < i < VOCAB_SIZE else "\ufffd" for i in np.asarray(ids).reshape(-1)]
    return "".join(chars)


#: Folders not read: third-party packages, bytecode, the build's ``config-3.11-<platform>``.
_SKIP_DIRS = ("site-packages", "dist-packages", "__pycache__")
#: Files written for one machine (install prefix, compiler flags, local site configuration).
_SKIP_FILE_PREFIXES = ("_sysconfigdata", "sitecustomize.py")


def _stdlib_files(root: Path) -> list[Path]:
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("config-")
        )
        files.extend(
            Path(dirpath) / f
            for f in sorted(filenames)
            if f.endswith(".py") and not f.startswith(_SKIP_FILE_PREFIXES)
        )
    return files


def stdlib_text(max_chars: int = 1_000_000, root: str | os.PathLike[str] | None = None) -> str:
    """Concatenated source of the standard library's ``.py`` files, at most ``max_chars`` long.

    Files are read in sorted path order (UTF-8, undecodable bytes replaced, line endings as
    ``\\n``), each followed by a newline, until ``max_chars`` characters are collected; the
    machine-specific files the module docstring lists are left out.

    Args:
        max_chars: cap on the corpus length.
        root: directory to read instead of ``sysconfig.get_paths()["stdlib"]``.

    Raises:
        ValueError: if ``max_chars < 2`` or the directory holds no ``.py`` text.
    """
    if max_chars < 2:
        raise ValueError(f"max_chars={max_chars} must be at least 2")
    base = Path(root) if root is not None else Path(sysconfig.get_paths()["stdlib"])
    parts: list[str] = []
    total = 0
    for path in _stdlib_files(base):
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        parts.append(text + "\n")
        total += len(text) + 1
        if total >= max_chars:
            break
    corpus = "".join(parts)[:max_chars]
    if len(corpus) < 2:
        raise ValueError(
            f"no Python source found under {base}; pass root= a directory with .py files"
        )
    return corpus


class CharLMDataset(Dataset):
    """Non-overlapping windows of a character stream as ``(input, target)`` int64 pairs.

    Window ``i`` is ``ids[i·L : i·L + L]`` and its target the same window shifted by one
    character, ``ids[i·L + 1 : i·L + L + 1]``; there are ``(len(ids) − 1) // L`` windows.

    Args:
        text: a string (encoded with :func:`encode`) or a 1-D tensor of indices.
        seq_len: window length ``L``.
    """

    def __init__(self, text: str | torch.Tensor, seq_len: int) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len={seq_len} must be a positive window length")
        ids = encode(text) if isinstance(text, str) else torch.as_tensor(text, dtype=torch.int64)
        if ids.dim() != 1:
            raise ValueError(f"text tensor has shape {tuple(ids.shape)}; expected a 1-D tensor")
        n = (ids.numel() - 1) // seq_len
        if n < 1:
            raise ValueError(
                f"text of {ids.numel()} characters is too short for seq_len={seq_len} "
                "(needs at least seq_len + 1)"
            )
        self.seq_len = seq_len
        self.ids = ids[: n * seq_len + 1].clone()
        self._inputs = self.ids[:-1].view(n, seq_len)
        self._targets = self.ids[1:].view(n, seq_len)

    def __len__(self) -> int:
        return self._inputs.shape[0]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._inputs[index], self._targets[index]


def _cache_path(cache_dir: str | os.PathLike[str], max_chars: int, root: str | None) -> Path:
    # "v2": the corpus without the machine-specific files (an older cache holds them).
    key = f"v2|{sys.version}|{root or sysconfig.get_paths()['stdlib']}|{max_chars}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return Path(cache_dir) / f"charlm-{digest}.npy"


def charlm_datasets(
    seq_len: int = 64,
    max_chars: int = 1_000_000,
    valid_fraction: float = 0.1,
    cache_dir: str | os.PathLike[str] | None = None,
    root: str | os.PathLike[str] | None = None,
) -> tuple[CharLMDataset, CharLMDataset]:
    """Train and validation datasets: the first ``1 − valid_fraction`` of the corpus and the rest.

    A contiguous split (no window straddles it). With ``cache_dir`` the encoded corpus is saved
    there as ``.npy`` and reused; nothing is written anywhere else.

    Raises:
        ValueError: if ``valid_fraction`` is not in ``(0, 1)`` or a split is shorter than one window.
    """
    if not 0.0 < valid_fraction < 1.0:
        raise ValueError(f"valid_fraction={valid_fraction} must lie strictly between 0 and 1")
    ids: torch.Tensor | None = None
    path = None
    if cache_dir is not None:
        path = _cache_path(cache_dir, max_chars, None if root is None else str(root))
        if path.exists():
            ids = torch.from_numpy(np.load(path))
    if ids is None:
        ids = encode(stdlib_text(max_chars, root))
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            # A name unique to this process: replicas may build the same cache at once.
            tmp = path.with_suffix(f".{os.getpid()}.tmp.npy")
            np.save(tmp, ids.numpy())
            os.replace(tmp, path)
    n_valid = int(round(valid_fraction * ids.numel()))
    split = ids.numel() - n_valid
    return CharLMDataset(ids[:split], seq_len), CharLMDataset(ids[split:], seq_len)


class CharLM(nn.Module):
    """Embedding → GRU → linear next-character model.

    Args:
        vocab_size: number of symbols (default :data:`VOCAB_SIZE`).
        embed_dim: embedding width.
        hidden: GRU width.
        num_layers: stacked GRU layers.
        seed: if given, the initial weights depend only on it (global RNG untouched).

    ``forward(ids [N, L]) -> logits [N, L, vocab_size]``.
    """

    def __init__(
        self,
        vocab_size: int = VOCAB_SIZE,
        embed_dim: int = 32,
        hidden: int = 128,
        num_layers: int = 1,
        seed: int | None = None,
    ) -> None:
        super().__init__()
        if min(vocab_size, embed_dim, hidden, num_layers) < 1:
            raise ValueError(
                f"vocab_size={vocab_size}, embed_dim={embed_dim}, hidden={hidden}, "
                f"num_layers={num_layers} must all be positive"
            )
        self.vocab_size = vocab_size
        with seeded(seed):
            self.embed = nn.Embedding(vocab_size, embed_dim)
            self.rnn = nn.GRU(embed_dim, hidden, num_layers=num_layers, batch_first=True)
            self.out = nn.Linear(hidden, vocab_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(self.embed(ids))
        return self.out(h)


def loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean next-character cross-entropy (nats per character) of ``model`` on a batch."""
    inputs, targets = batch
    logits = model(inputs)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
