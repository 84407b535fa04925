"""Review of checkpointing: States held by some replicas only (real gloo processes on
127.0.0.1), ``save_state``'s crash safety, and what an epoch loop counts as finished."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import time
from pathlib import Path

import pytest

from adaptrain import checkpoint, collective
from adaptrain.dist import checkpoint as dckpt
from adaptrain.dist.spawn import spawn
from adaptrain.torch import current_epoch, finished_epochs, remaining_epochs_until


class _Count(checkpoint.State):
    """A State whose sync() is collective (sums the replicas' values)."""

    def __init__(self, name: str, value: object = 0) -> None:
        super().__init__(name)
        self.value = value

    def sync(self) -> None:
        self.value = collective.allreduce(self.value)

    def save(self, fileobj) -> None:
        pickle.dump(self.value, fileobj)

    def load(self, fileobj) -> None:
        self.value = pickle.load(fileobj)


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


# ----- a State registered on some replicas only ------------------------------------------------


def _extra_state_on_rank_1(rank: int, world_size: int, root: str) -> tuple:
    os.environ["ADAPTRAIN_CHECKPOINT_PATH"] = root
    checkpoint.reset()
    shared = _Count("shared", rank + 1)
    if rank == 1:
        _Count("rank-1-only", 5)  # sorts after "shared": its sync would pair with nothing
    t0 = time.monotonic()
    try:
        outcome = ("returned", checkpoint.save_all_states())
    except Exception as exc:  # noqa: BLE001 - what each replica was told
        outcome = ("raised", f"{type(exc).__name__}: {exc}")
    took = time.monotonic() - t0
    # A job that catches the error goes on: its collectives must still pair up.
    after = collective.allreduce([rank])
    return outcome, shared.value, after, took


def test_a_state_on_some_replicas_only_fails_the_save_on_every_replica(tmp_path: Path) -> None:
    # Before, rank 1's sync of "rank-1-only" paired its all-gather with rank 0's broadcast of
    # the save's verdict: the replicas' collectives went out of step and the job hung (or
    # failed far from the cause).
    out = spawn(_extra_state_on_rank_1, 2, args=(str(tmp_path),), timeout=30)
    for outcome, _, after, took in out:
        assert outcome[0] == "raised", outcome
        assert outcome[1].startswith("RuntimeError: the replicas hold different States"), outcome
        assert "'rank-1-only' is missing on rank(s) [0]" in outcome[1]
        assert "construct the same State objects on every replica" in outcome[1]
        assert after == [0, 1]
        assert took < 10
    assert [shared for _, shared, _, _ in out] == [1, 2]  # refused before any sync
    assert list(tmp_path.iterdir()) == []  # no checkpoint, no temporary folder left behind


def _different_states_then_the_same(rank: int, world_size: int, root: str) -> tuple:
    os.environ["ADAPTRAIN_CHECKPOINT_PATH"] = root
    checkpoint.reset()
    _Count(f"only-on-{rank}", 1)
    try:
        checkpoint.save_all_states()
        first = "returned"
    except RuntimeError as exc:
        first = str(exc)
    checkpoint.reset()
    _Count("shared", rank + 1)
    if rank == 0:
        _Plain("rank-0-logger", "steps=12")  # no-op sync: may live on rank 0 alone
    second = checkpoint.save_all_states()
    checkpoint.reset()
    shared, logger_state = _Count("shared"), _Plain("rank-0-logger")
    loaded = (checkpoint.load_state(shared), checkpoint.load_state(logger_state))
    return first, second, loaded, shared.value, logger_state.value


def test_each_replicas_missing_states_are_named_and_no_op_syncs_may_differ(
    tmp_path: Path,
) -> None:
    out = spawn(_different_states_then_the_same, 2, args=(str(tmp_path),), timeout=30)
    for first, second, loaded, shared, logger_state in out:
        assert "'only-on-0' is missing on rank(s) [1]" in first, first
        assert "'only-on-1' is missing on rank(s) [0]" in first, first
        # A State whose sync is the default no-op cannot put the collectives out of step.
        assert second is True
        assert loaded == (True, True) and shared == 3 and logger_state == "steps=12"


def test_a_single_process_saves_without_collectives(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ADAPTRAIN_CHECKPOINT_PATH", str(tmp_path))

    def no_collective(*args, **kwargs):
        raise AssertionError("a single process ran a collective")

    monkeypatch.setattr(collective, "allreduce", no_collective)
    monkeypatch.setattr(collective, "broadcast", lambda value: value)  # a no-op here anyway
    _Plain("a", 1)
    assert checkpoint.save_all_states() is True
    checkpoint.reset()
    a = _Plain("a")
    assert checkpoint.load_state(a) and a.value == 1


# ----- save_state: crash safety, naming, old names ---------------------------------------------


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


# ----- what an epoch loop counts as finished ---------------------------------------------------


def test_an_exception_leaving_the_loop_finishes_the_epoch_as_documented(
    monkeypatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("ADAPTRAIN_CHECKPOINT_PATH", str(tmp_path))
    # Saved outside the loop after an error: the interrupted epoch 1 counts as finished.
    with pytest.raises(ZeroDivisionError):
        try:
            for e in remaining_epochs_until(5):
                if e == 1:
                    1 / 0  # noqa: B018
        finally:
            assert current_epoch() is None and finished_epochs() == 2
            checkpoint.save_all_states()
    checkpoint.reset()
    assert finished_epochs() == 2
    # Saved inside the loop body: the epoch is still current and is resumed after a restart.
    checkpoint.reset()
    with pytest.raises(ZeroDivisionError):
        for e in remaining_epochs_until(5):
            try:
                if e == 3:
                    1 / 0  # noqa: B018
            except ZeroDivisionError:
                checkpoint.save_all_states()
                raise
    checkpoint.reset()
    assert finished_epochs() == 3
    assert list(remaining_epochs_until(5)) == [3, 4]
