"""Tests of the real-data workloads: digits (sklearn) and the stdlib character LM."""

from __future__ import annotations

import string
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from adaptrain.workloads import (
    VOCAB,
    VOCAB_SIZE,
    CharLM,
    CharLMDataset,
    DigitsNet,
    charlm_datasets,
    charlm_loss,
    decode,
    digits_datasets,
    digits_loss,
    encode,
    stdlib_text,
)

torch.set_num_threads(1)


def _sgd_steps(model, loss_fn, loader, steps, lr):
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    it = iter(loader)
    for _ in range(steps):
        try:
            batch = next(it)
        except StopIteration:
            it = iter(loader)
            batch = next(it)
        opt.zero_grad()
        loss_fn(model, batch).backward()
        opt.step()


def _mean_loss(model, loss_fn, dataset, batch_size=256):
    with torch.no_grad():
        losses = [loss_fn(model, b) * len(b[1]) for b in DataLoader(dataset, batch_size=batch_size)]
    return float(sum(losses) / len(dataset))


# ------------------------------------------------------------------ digits


def test_digits_shapes_and_split():
    train, test = digits_datasets()
    assert len(train) + len(test) == 1797
    assert len(test) == round(0.2 * 1797)
    x, y = train.tensors
    assert x.dtype == torch.float32 and x.shape[1:] == (1, 8, 8)
    assert y.dtype == torch.int64 and set(y.tolist()) == set(range(10))
    assert float(x.min()) >= 0.0 and float(x.max()) <= 1.0 and float(x.max()) > 0.9
    # Disjoint splits covering the whole set.
    all_x = torch.cat([train.tensors[0], test.tensors[0]]).reshape(-1, 64)
    assert torch.unique(all_x, dim=0).shape[0] >= 1790  # a handful of exact duplicates exist


def test_digits_deterministic():
    a_train, a_test = digits_datasets(0.3, seed=5)
    b_train, b_test = digits_datasets(0.3, seed=5)
    c_train, _ = digits_datasets(0.3, seed=6)
    for a, b in zip(a_train.tensors + a_test.tensors, b_train.tensors + b_test.tensors):
        assert torch.equal(a, b)
    assert not torch.equal(a_train.tensors[1], c_train.tensors[1])


def test_digits_bad_fraction():
    with pytest.raises(ValueError, match="test_fraction=1.5"):
        digits_datasets(1.5)


@pytest.mark.parametrize("conv", [True, False])
def test_digits_sgd_reduces_loss(conv):
    torch.manual_seed(0)
    train, test = digits_datasets()
    model = DigitsNet(conv=conv)
    assert model(train.tensors[0][:5]).shape == (5, 10)
    assert model(train.tensors[0][:5].reshape(5, 64)).shape == (5, 10)
    before = _mean_loss(model, digits_loss, test)
    loader = DataLoader(
        train, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(0)
    )
    _sgd_steps(model, digits_loss, loader, steps=60, lr=0.05)
    after = _mean_loss(model, digits_loss, test)
    assert after < 0.6 * before, (before, after)


# ------------------------------------------------------------------ char LM


def test_vocab_and_roundtrip():
    assert VOCAB_SIZE == len(VOCAB) == 98
    assert set(string.ascii_letters + string.digits + string.punctuation + " \n\t") <= set(VOCAB)
    text = "def f(x):\n\treturn x  # ok\n"
    ids = encode(text)
    assert ids.dtype == torch.int64 and ids.shape == (len(text),)
    assert decode(ids) == text
    # Non-ASCII and control characters map to the unknown symbol 0.
    assert encode("é\x07€").tolist() == [0, 0, 0]
    assert decode(encode("aéb")) == "a\ufffdb"
    assert int(encode(VOCAB[1:]).min()) == 1 and int(encode(VOCAB[1:]).max()) == VOCAB_SIZE - 1


def test_stdlib_text_deterministic_and_capped():
    a = stdlib_text(50_000)
    assert len(a) == 50_000
    assert a == stdlib_text(50_000)
    assert stdlib_text(10_000) == a[:10_000]  # a prefix: same file order
    assert "def " in a and "import " in a
    ids = encode(a)
    assert float((ids == 0).double().mean()) < 0.01  # Python source is nearly all ASCII


def test_stdlib_text_given_root(tmp_path):
    (tmp_path / "b.py").write_text("print('b')\n")
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "site-packages" / "c.py").write_text("skip = True\n")
    (tmp_path / "notes.txt").write_text("not python\n")
    assert stdlib_text(1000, root=tmp_path) == "x = 1\n\nprint('b')\n\n"
    with pytest.raises(ValueError, match="no Python source"):
        stdlib_text(1000, root=tmp_path / "site-packages" / "missing")


def _fake_stdlib(root: Path, prefix: str) -> Path:
    """A tiny standard library as one build installs it under ``prefix``."""
    (root / "json").mkdir(parents=True)
    (root / "abc.py").write_text("def f():\n    return 1\n" * 20)
    (root / "json" / "__init__.py").write_text("import abc\n" * 10)
    (root / "zipfile.py").write_text("class ZipFile:\n    pass\n" * 10)
    (root / "_sysconfigdata__linux_x86_64-linux-gnu.py").write_text(
        f"build_time_vars = {{'prefix': '{prefix}', 'CC': 'gcc -pthread'}}\n"
    )
    config = root / "config-3.11-x86_64-linux-gnu"
    config.mkdir()
    (config / "python-config.py").write_text(f"#!{prefix}/bin/python3.11\nprefix = '{prefix}'\n")
    (root / "sitecustomize.py").write_text(f"# site configuration of {prefix}\n")
    return root


def test_the_corpus_does_not_depend_on_where_python_is_installed(tmp_path):
    # The same Python version built and installed under two prefixes (two machines, two users'
    # pyenv): the build writes the prefix into _sysconfigdata*.py and config-*/python-config.py.
    a = _fake_stdlib(tmp_path / "a", "/root/.pyenv/versions/3.11.7")
    b = _fake_stdlib(tmp_path / "b", "/home/someone/.local/python-3.11.7-with-a-longer-path")
    text_a, text_b = stdlib_text(10_000, root=a), stdlib_text(10_000, root=b)
    assert text_a == text_b  # replicas on both machines train on the same windows
    assert "pyenv" not in text_a and "ZipFile" in text_a and "import abc" in text_a


def test_charlm_dataset_windows():
    text = "abcdefghijklmnopqrstuvwxyz"  # 26 characters, windows of 8 → (26 − 1)//8 = 3
    ds = CharLMDataset(text, seq_len=8)
    assert len(ds) == 3
    x, y = ds[1]
    assert x.dtype == torch.int64 and x.shape == (8,) and y.shape == (8,)
    assert decode(x) == "ijklmnop" and decode(y) == "jklmnopq"
    assert decode(ds[2][1]) == "rstuvwxy"
    # Non-overlapping: the inputs tile the text.
    assert "".join(decode(ds[i][0]) for i in range(len(ds))) == text[:24]
    with pytest.raises(ValueError, match="seq_len=0"):
        CharLMDataset(text, 0)
    with pytest.raises(ValueError, match="too short"):
        CharLMDataset("abc", 8)


def test_charlm_datasets_split_and_cache(tmp_path):
    train, valid = charlm_datasets(seq_len=32, max_chars=20_000, valid_fraction=0.25)
    assert len(train) == (15_000 - 1) // 32 and len(valid) == (5_000 - 1) // 32
    corpus = encode(stdlib_text(20_000))
    assert torch.equal(train.ids, corpus[: len(train) * 32 + 1])
    assert torch.equal(valid.ids, corpus[15_000 : 15_000 + len(valid) * 32 + 1])
    cache = tmp_path / "cache"
    t1, v1 = charlm_datasets(seq_len=32, max_chars=20_000, valid_fraction=0.25, cache_dir=cache)
    files = list(cache.iterdir())
    assert len(files) == 1 and files[0].suffix == ".npy"
    t2, v2 = charlm_datasets(seq_len=32, max_chars=20_000, valid_fraction=0.25, cache_dir=cache)
    assert torch.equal(t1.ids, t2.ids) and torch.equal(v1.ids, v2.ids)
    assert torch.equal(t1.ids, train.ids)
    assert np.load(files[0]).shape == (20_000,)
    with pytest.raises(ValueError, match="valid_fraction=0"):
        charlm_datasets(valid_fraction=0)


def test_charlm_model_shapes_and_determinism():
    torch.manual_seed(0)
    a = CharLM()
    torch.manual_seed(0)
    b = CharLM()
    ids = encode("import os\n" * 4)[:32].reshape(2, 16)
    assert a(ids).shape == (2, 16, VOCAB_SIZE)
    assert torch.equal(a(ids), b(ids))
    with pytest.raises(ValueError, match="hidden=0"):
        CharLM(hidden=0)


def test_charlm_sgd_reduces_loss():
    torch.manual_seed(0)
    train, valid = charlm_datasets(seq_len=64, max_chars=200_000)
    model = CharLM()
    before = _mean_loss(model, charlm_loss, valid)
    assert before == pytest.approx(np.log(VOCAB_SIZE), rel=0.1)  # ~uniform at init
    loader = DataLoader(
        train, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(0)
    )
    _sgd_steps(model, charlm_loss, loader, steps=40, lr=0.3)
    after = _mean_loss(model, charlm_loss, valid)
    assert after < before - 1.0, (before, after)


@pytest.mark.parametrize("make", [lambda s: DigitsNet(seed=s), lambda s: CharLM(seed=s)])
def test_seeded_models_deterministic_and_leave_global_rng(make):
    torch.manual_seed(123)
    state = torch.get_rng_state()
    a, b, c = make(7), make(7), make(8)
    assert torch.equal(torch.get_rng_state(), state)  # global RNG untouched
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)


def test_digits_read_without_sklearn_equal_load_digits():
    from sklearn.datasets import load_digits

    from adaptrain.workloads.digits import _load_digits

    images, labels = _load_digits()
    ref = load_digits()
    assert np.array_equal(images, ref.images) and np.array_equal(labels, ref.target)
