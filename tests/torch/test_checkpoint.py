"""adaptrain.checkpoint: State registry, atomic save, load, corruption and bad-input errors."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch

from adaptrain import checkpoint, collective
from adaptrain.dist import checkpoint as dckpt
from adaptrain.dist.spawn import spawn


class Blob(checkpoint.State):
    def __init__(self, name: str, value: object = None) -> None:
        super().__init__(name)
        self.value = value

    def save(self, fileobj):
        torch.save({"value": self.value}, fileobj)

    def load(self, fileobj):
        self.value = torch.load(fileobj)["value"]


pytestmark = pytest.mark.usefixtures("fresh_checkpoints")


def _ckpt(monkeypatch, tmp_path: Path) -> Path:
    monkeypatch.setenv("ADAPTRAIN_CHECKPOINT_PATH", str(tmp_path))
    return tmp_path


def test_save_load_replay_roundtrip(monkeypatch, tmp_path):
    _ckpt(monkeypatch, tmp_path)
    value = {"w": torch.randn(3, 4), "step": 7, "lr": 0.125}
    a = Blob("a", value)
    Blob("b", [1, 2, 3])
    assert checkpoint.load_state(a) is False  # nothing saved yet
    assert checkpoint.save_all_states() is True
    checkpoint.reset()  # as a restarted process
    a2, b2, c2 = Blob("a"), Blob("b"), Blob("c", "fresh")
    assert checkpoint.load_state(a2) and checkpoint.load_state(b2)
    assert checkpoint.load_state(c2) is False and c2.value == "fresh"
    torch.testing.assert_close(a2.value["w"], value["w"])
    assert a2.value["step"] == 7 and b2.value == [1, 2, 3]
    # Replay: saving the restored states again gives identical files.
    first = sorted(p.name for p in tmp_path.iterdir())
    checkpoint.save_all_states()
    checkpoint.reset()
    a3 = Blob("a")
    checkpoint.load_state(a3)
    torch.testing.assert_close(a3.value["w"], value["w"])
    assert first == ["checkpoint-000000"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-000001"]


def test_a_name_too_long_for_a_file_name_round_trips(monkeypatch, tmp_path):
    # "state-" + the quoted name would pass the 255-byte limit of a file name (ENAMETOOLONG
    # at the first save, before): such a state's file is named by a digest of its name.
    _ckpt(monkeypatch, tmp_path)
    long_ascii, long_utf8 = "x" * 300, "é" * 60  # quoted: 300 bytes, 360 bytes
    Blob(long_ascii, 1)
    Blob(long_utf8, 2)
    Blob("y" * 245, 3)  # 251 bytes as "state-" + name: fits, and with ".tmp" it would not
    Blob("sha256-" + "0" * 64, 4)  # a short name that looks like a digest
    assert checkpoint.save_all_states() is True
    files = sorted(p.name for p in (tmp_path / "checkpoint-000000").iterdir())
    assert max(len(f.encode()) for f in files) <= 255 - len(".tmp")
    assert len(set(files)) == len(files) == 5  # 4 states and the manifest
    checkpoint.reset()
    states = [Blob(n) for n in (long_ascii, long_utf8, "y" * 245, "sha256-" + "0" * 64)]
    assert all(checkpoint.load_state(s) for s in states)
    assert [s.value for s in states] == [1, 2, 3, 4]


def test_checkpointing_off_is_noop():
    s = Blob("x", 1)
    assert checkpoint.save_all_states() is False
    assert checkpoint.load_state(s) is False


def test_duplicate_name_rejected():
    Blob("dup")
    with pytest.raises(ValueError, match="dup"):
        Blob("dup")
    with pytest.raises(ValueError):
        Blob("")


def test_missing_checkpoint_dir_clear_error(monkeypatch, tmp_path):
    missing = tmp_path / "nope"
    monkeypatch.setenv("ADAPTRAIN_CHECKPOINT_PATH", str(missing))
    s = Blob("s", 1)
    with pytest.raises(RuntimeError, match="nope.*mkdir"):
        checkpoint.load_state(s)
    with pytest.raises(RuntimeError, match="nope"):
        checkpoint.save_all_states()
    with pytest.raises(ValueError, match="nope"):
        checkpoint.save_state(s, str(missing))


def test_corrupt_file_names_path(monkeypatch, tmp_path):
    _ckpt(monkeypatch, tmp_path)
    Blob("model", torch.arange(100))
    checkpoint.save_all_states()
    path = tmp_path / "checkpoint-000000" / "state-model"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    checkpoint.reset()
    with pytest.raises(RuntimeError, match=f"corrupt checkpoint file {path}"):
        checkpoint.load_state(Blob("model"))


def test_corrupt_manifest_names_path(monkeypatch, tmp_path):
    _ckpt(monkeypatch, tmp_path)
    Blob("m", 1)
    checkpoint.save_all_states()
    manifest = tmp_path / "checkpoint-000000" / "MANIFEST.json"
    manifest.write_text("{not json")
    checkpoint.reset()
    with pytest.raises(RuntimeError, match=str(manifest)):
        checkpoint.load_state(Blob("m"))


def test_load_that_fails_names_path(monkeypatch, tmp_path):
    _ckpt(monkeypatch, tmp_path)

    class Picky(Blob):
        def load(self, fileobj):
            raise KeyError("missing_field")

    Blob("p", 1)
    checkpoint.save_all_states()
    checkpoint.reset()
    with pytest.raises(RuntimeError, match="state-p.*missing_field"):
        checkpoint.load_state(Picky("p"))


def test_half_written_checkpoint_never_loaded(monkeypatch, tmp_path):
    _ckpt(monkeypatch, tmp_path)
    a = Blob("a", "old")
    checkpoint.save_all_states()

    class Crashing(Blob):
        def save(self, fileobj):
            fileobj.write(b"partial")
            raise OSError("disk full")

    a.value = "new"
    Crashing("z", 0)  # saved after "a" (sorted order): the new checkpoint is half written
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save_all_states()
    leftovers = [p.name for p in tmp_path.iterdir()]
    assert "checkpoint-000000" in leftovers and any(n.startswith(".tmp-") for n in leftovers)
    checkpoint.reset()
    a2 = Blob("a")
    assert checkpoint.load_state(a2) and a2.value == "old"
    # The next successful save cleans the debris up.
    checkpoint.save_all_states()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-000001"]


class Counter(checkpoint.State):
    """Replicas hold different counts; sync() sums them before the save."""

    def __init__(self, value: int) -> None:
        super().__init__("counter")
        self.value = value

    def sync(self):
        self.value = collective.allreduce(self.value)

    def save(self, fileobj):
        pickle.dump(self.value, fileobj)

    def load(self, fileobj):
        self.value = pickle.load(fileobj)


def _save_then_load(rank: int, world_size: int, root: str) -> tuple[int, list[str], int]:
    os.environ["ADAPTRAIN_CHECKPOINT_PATH"] = root
    checkpoint.reset()
    c = Counter(rank + 1)
    assert checkpoint.save_all_states()
    # Every replica returns only once rank 0's checkpoint is complete.
    names = sorted(os.listdir(root))
    checkpoint.reset()
    c2 = Counter(-1)
    checkpoint.load_state(c2)
    return c.value, names, c2.value


def test_save_all_states_three_replicas(tmp_path):
    res = spawn(_save_then_load, 3, args=(str(tmp_path),), timeout=120)
    assert res == [(6, ["checkpoint-000000"], 6)] * 3
    assert dckpt.latest_checkpoint(str(tmp_path)).endswith("checkpoint-000000")


def test_a_live_writers_temporary_folder_is_left_alone(monkeypatch, tmp_path):
    # Another job saving into the same root: its in-progress folder must survive our cleanup;
    # debris of a dead writer goes.
    import subprocess
    import sys

    _ckpt(monkeypatch, tmp_path)
    Blob("a", 1)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = tmp_path / f".tmp-checkpoint-000007-{other.pid}"
        live.mkdir()
        dead = subprocess.run(
            [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
        ).stdout.strip()
        debris = tmp_path / f".tmp-checkpoint-000003-{dead}"
        debris.mkdir()
        assert checkpoint.save_all_states()
        assert live.is_dir() and not debris.exists()
    finally:
        other.kill()
        other.wait()


def _restore_choice(rank, ws, roots, early):
    os.environ["ADAPTRAIN_CHECKPOINT_PATH"] = roots[rank]
    import adaptrain.torch as adl

    if early:  # a State loading before init_process_group chooses on its own
        dckpt.restore_dir()
    try:
        adl.init_process_group("gloo")
    except RuntimeError as exc:
        return f"raised: {exc}"
    chosen = dckpt.restore_dir()
    try:
        checkpoint.load_state(Blob("anything"))
    except RuntimeError as exc:
        return chosen, f"raised: {exc}"
    return chosen, "ok"  # read its manifest (no entry of that name: nothing to load)


def _roots(tmp_path: Path, rank1: str) -> list[str]:
    """Rank 0's folder holds checkpoint 3; rank 1's folder is either a stale view of it (only
    checkpoint 1) or the same folder mounted elsewhere (a symlink)."""
    fresh = tmp_path / "fresh" / "checkpoint-000003"
    fresh.mkdir(parents=True)
    (fresh / "MANIFEST.json").write_text('{"format": 1, "states": {}}')
    other = tmp_path / "other"
    if rank1 == "stale":
        (other / "checkpoint-000001").mkdir(parents=True)
        (other / "checkpoint-000001" / "MANIFEST.json").write_text('{"format": 1, "states": {}}')
    else:
        other.symlink_to(tmp_path / "fresh", target_is_directory=True)
    return [str(tmp_path / "fresh"), str(other)]


def test_every_replica_restores_rank_0s_choice(tmp_path):
    # Only rank 0 lists the folder, in init_process_group; every replica takes its choice by
    # name under its own root. A replica whose listing lags (NFS) fails loudly on the missing
    # checkpoint instead of restoring checkpoint 1; one with another mount point restores it.
    out = spawn(_restore_choice, 2, args=(_roots(tmp_path, "stale"), False), init=False)
    assert out[0] == (str(tmp_path / "fresh" / "checkpoint-000003"), "ok")
    assert out[1][0] == str(tmp_path / "other" / "checkpoint-000003")
    assert out[1][1].startswith("raised: corrupt checkpoint") and "checkpoint-000003" in out[1][1]


def test_every_replica_restores_rank_0s_choice_under_its_own_mount_point(tmp_path):
    out = spawn(_restore_choice, 2, args=(_roots(tmp_path / "m", "mounted"), False), init=False)
    assert out == [
        (str(tmp_path / "m" / "fresh" / "checkpoint-000003"), "ok"),
        (str(tmp_path / "m" / "other" / "checkpoint-000003"), "ok"),
    ]


def test_a_replica_that_chose_before_init_process_group_raises(tmp_path):
    out = spawn(_restore_choice, 2, args=(_roots(tmp_path, "stale"), True), init=False)
    assert out[0] == (str(tmp_path / "fresh" / "checkpoint-000003"), "ok")
    assert out[1].startswith("raised: this replica restored from") and "checkpoint-000001" in out[1]
