"""``save_state`` and the files of a checkpoint: crash safety, file names (old and new), and
malformed manifests."""

from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path

import pytest

from adaptrain import checkpoint
from adaptrain.dist import checkpoint as dckpt


class _Plain(checkpoint.State):
    """A State with the default (no-op) sync."""

    def __init__(self, name: str, value: object = None) -> None:
        super().__init__(name)
        self.value = value

    def save(self, fileobj) -> None:
        pickle.dump(self.value, fileobj)

    def load(self, fileobj) -> None:
        self.value = pickle.load(fileobj)


pytestmark = pytest.mark.usefixtures("fresh_checkpoints")


def _files(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def _restart_and_load(name: str) -> object:
    """``name``'s value as a restarted process loads it (the registry is empty afterwards)."""
    checkpoint.reset()
    s = _Plain(name)
    assert checkpoint.load_state(s)
    checkpoint.reset()
    return s.value


def _checkpoint_dir(monkeypatch, tmp_path: Path) -> Path:
    """Checkpointing on under ``tmp_path``, and its (empty) first checkpoint directory."""
    monkeypatch.setenv("ADAPTRAIN_CHECKPOINT_PATH", str(tmp_path))
    ckpt = tmp_path / "checkpoint-000000"
    ckpt.mkdir()
    return ckpt


def test_a_crash_between_the_file_and_the_manifest_keeps_the_previous_value(
    monkeypatch, tmp_path: Path
) -> None:
    # Before, the state's file was replaced in place and the manifest rewritten after it: a
    # crash in between left a manifest whose checksum no longer matched the file, and the
    # checkpoint read as corrupt.
    ckpt = _checkpoint_dir(monkeypatch, tmp_path)
    s = _Plain("m", "old")
    checkpoint.save_state(s, str(ckpt))
    s.value = "new"
    real = dckpt._write_manifest
    written: list[list[str]] = []

    def crash(ckpt_dir: str, manifest: dict) -> None:
        written.append(_files(ckpt))  # the new state file is already there
        raise OSError("simulated crash before the manifest")

    monkeypatch.setattr(dckpt, "_write_manifest", crash)
    with pytest.raises(OSError, match="simulated crash"):
        checkpoint.save_state(s, str(ckpt))
    assert _restart_and_load("m") == "old"
    assert len([f for f in written[0] if f.startswith("state-m")]) == 2  # old and new

    # The next save goes through and leaves one file for the State: the debris is gone.
    monkeypatch.setattr(dckpt, "_write_manifest", real)
    s = _Plain("m", "newer")
    checkpoint.save_state(s, str(ckpt))
    assert [f for f in _files(ckpt) if f != "MANIFEST.json"] == [
        json.loads((ckpt / "MANIFEST.json").read_text())["states"]["m"]["file"]
    ]
    assert _restart_and_load("m") == "newer"


def test_a_failed_save_leaves_no_partial_file_and_the_previous_value(
    monkeypatch, tmp_path: Path
) -> None:
    ckpt = _checkpoint_dir(monkeypatch, tmp_path)

    class Failing(_Plain):
        def save(self, fileobj) -> None:
            if self.value == "boom":
                fileobj.write(b"partial")
                raise OSError("disk full")
            super().save(fileobj)

    s = Failing("f", "old")
    checkpoint.save_state(s, str(ckpt))
    before = _files(ckpt)
    s.value = "boom"
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save_state(s, str(ckpt))
    assert _files(ckpt) == before
    assert _restart_and_load("f") == "old"


def _old_format_checkpoint(ckpt: Path, states: dict[str, object]) -> None:
    """A checkpoint as the earlier save_state wrote it: ``state-<quoted name>`` files."""
    ckpt.mkdir()
    entries = {}
    for name, value in states.items():
        data = pickle.dumps(value)
        fname = dckpt._file_name(name)
        (ckpt / fname).write_bytes(data)
        entries[name] = {"file": fname, "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / "MANIFEST.json").write_text(json.dumps({"format": 1, "states": entries}))


def test_old_file_names_still_load_and_are_replaced_by_the_next_save(
    monkeypatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("ADAPTRAIN_CHECKPOINT_PATH", str(tmp_path))
    ckpt = tmp_path / "checkpoint-000000"
    _old_format_checkpoint(ckpt, {"m": "old", "other": 7})
    assert _restart_and_load("m") == "old"
    checkpoint.reset()
    checkpoint.save_state(_Plain("m", "new"), str(ckpt))
    files = _files(ckpt)
    assert "state-m" not in files and "state-other" in files  # only m's old file went
    assert len(files) == 3 and any(f.startswith("state-m%v") for f in files)
    assert _restart_and_load("m") == "new" and _restart_and_load("other") == 7


def test_save_state_round_trips_and_leaves_other_states_alone(monkeypatch, tmp_path: Path) -> None:
    ckpt = _checkpoint_dir(monkeypatch, tmp_path)
    # Neighbours whose file names begin like "a"'s: an "a" save must not take them for its own.
    # (Before, saving "a" wrote "state-a.tmp" and renamed it: "a.tmp"'s file was lost.)
    names = ["a", "a%v", "a.tmp", "a%vdeadbeef", "x" * 300]
    states = [_Plain(n, i) for i, n in enumerate(names)]
    for s in states:
        checkpoint.save_state(s, str(ckpt))
    for round_ in range(3):
        states[0].value = ("a", round_)
        checkpoint.save_state(states[0], str(ckpt))
        assert len(_files(ckpt)) == len(names) + 1
    assert max(len(f.encode()) for f in _files(ckpt)) <= 255
    assert [_restart_and_load(n) for n in names] == [("a", 2), 1, 2, 3, 4]
    # The whole-checkpoint path still works beside it.
    checkpoint.reset()
    _Plain("a", "all")
    assert checkpoint.save_all_states()
    assert _restart_and_load("a") == "all"


@pytest.mark.parametrize(
    "entry",
    [
        "state-m",  # not a table
        {"sha256": "0" * 64},  # no file
    ],
)
def test_a_malformed_manifest_entry_is_reported_as_a_corrupt_checkpoint(
    monkeypatch, tmp_path: Path, entry
) -> None:
    # The documented error naming the checkpoint, not a bare TypeError/KeyError.
    monkeypatch.setenv("ADAPTRAIN_CHECKPOINT_PATH", str(tmp_path))
    checkpoint.reset()
    try:
        ckpt = tmp_path / "checkpoint-000000"
        ckpt.mkdir()
        (ckpt / "state-m").write_bytes(pickle.dumps(1))
        (ckpt / "MANIFEST.json").write_text(json.dumps({"format": 1, "states": {"m": entry}}))
        with pytest.raises(RuntimeError, match=f"corrupt checkpoint manifest {ckpt}.*'m'"):
            checkpoint.load_state(_Plain("m", 0))
    finally:
        checkpoint.reset()
