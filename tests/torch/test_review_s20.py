"""Review of the distributed glue: failures that must reach every replica alike (real gloo
processes on 127.0.0.1), and the spawn helper's own timeouts."""

from __future__ import annotations

import os
import pickle
import time
from pathlib import Path

import pytest

from adaptrain import checkpoint, collective
from adaptrain.dist.spawn import SpawnError, spawn


class _Count(checkpoint.State):
    """A State whose sync() is collective; rank 0 fails to write the one named ``broken``."""

    def __init__(self, name: str, value: int) -> None:
        super().__init__(name)
        self.value = value

    def sync(self) -> None:
        self.value = collective.allreduce(self.value)

    def save(self, fileobj) -> None:
        if self.name == "broken":
            raise OSError("disk full")
        pickle.dump(self.value, fileobj)

    def load(self, fileobj) -> None:
        self.value = pickle.load(fileobj)


def _save_fails_on_rank_0(rank: int, world_size: int, root: str) -> tuple:
    os.environ["ADAPTRAIN_CHECKPOINT_PATH"] = root
    checkpoint.reset()
    _Count("a-ok", 1)
    _Count("broken", 1)  # written second: the checkpoint is half done when it fails
    later = _Count("c-later", rank + 1)  # synced after the failure
    try:
        outcome = ("returned", checkpoint.save_all_states())
    except Exception as exc:  # noqa: BLE001 - what each replica was told
        outcome = ("raised", f"{type(exc).__name__}: {exc}")
    # A job that catches the error goes on: its collectives must still pair up.
    after = collective.allreduce([rank])
    return outcome, later.value, after


def test_a_checkpoint_rank_0_cannot_write_fails_on_every_replica(tmp_path: Path) -> None:
    # Before, rank 0 raised at once and skipped the remaining States' (collective) syncs while
    # the others went on syncing and returned True: a caught error left the replicas' object
    # collectives mismatched (rank 0's next allreduce paired with another's sync), and the
    # others only ever saw gloo's "Connection closed" when rank 0 ended.
    out = spawn(_save_fails_on_rank_0, 3, args=(str(tmp_path),), timeout=60)
    assert out[0][0] == ("raised", "OSError: disk full")
    for outcome, _, _ in out[1:]:
        assert outcome[0] == "raised" and "rank 0 could not write the checkpoint" in outcome[1]
        assert "OSError: disk full" in outcome[1]
    assert [later for _, later, _ in out] == [6, 6, 6]  # every State was synced alike
    assert [after for _, _, after in out] == [[0, 1, 2]] * 3
    assert not any(p.name.startswith("checkpoint-") for p in tmp_path.iterdir())


def _init_with(rank: int, world_size: int, roots: list) -> str:
    if roots[rank] is None:
        os.environ.pop("ADAPTRAIN_CHECKPOINT_PATH", None)
    else:
        os.environ["ADAPTRAIN_CHECKPOINT_PATH"] = roots[rank]
    import adaptrain.torch as adl

    try:
        adl.init_process_group("gloo")
    except RuntimeError as exc:
        return f"raised: {exc}"
    return "ok"


def test_checkpointing_on_some_replicas_only_is_refused_on_every_replica(tmp_path: Path) -> None:
    # Before, the replica without ADAPTRAIN_CHECKPOINT_PATH restored nothing while rank 0
    # restored checkpoint 0 (different epochs and positions), and at the first checkpoint it
    # returned at once while the others waited in save_all_states' collectives.
    ckpt = tmp_path / "checkpoint-000000"
    ckpt.mkdir()
    (ckpt / "MANIFEST.json").write_text('{"format": 1, "states": {}}')
    out = spawn(_init_with, 2, args=([str(tmp_path), None],), init=False, timeout=60)
    for text in out:
        assert text.startswith("raised: ADAPTRAIN_CHECKPOINT_PATH is set on rank(s) [0]"), text
        assert "not on rank(s) [1]" in text


def test_a_missing_folder_on_rank_0_is_reported_on_every_replica(tmp_path: Path) -> None:
    # Before, rank 0 raised alone, before the collective that hands out its choice: the other
    # replica saw only gloo's "Connection closed" once rank 0 had ended.
    missing = str(tmp_path / "nope")
    out = spawn(_init_with, 2, args=([missing, str(tmp_path)],), init=False, timeout=60)
    for text in out:
        assert text.startswith("raised: rank 0 cannot use its checkpoint folder"), text
        assert "nope" in text and "mkdir" in text


def test_checkpointing_on_everywhere_or_nowhere_still_initialises(tmp_path: Path) -> None:
    assert spawn(_init_with, 2, args=([None, None],), init=False, timeout=60) == ["ok", "ok"]
    roots = [str(tmp_path), str(tmp_path)]
    assert spawn(_init_with, 2, args=(roots,), init=False, timeout=60) == ["ok", "ok"]


def _one_hangs(rank: int, world_size: int) -> int:
    if rank == 0:
        time.sleep(60)
    return rank


def _one_dies(rank: int, world_size: int) -> int:
    if rank == 1:
        os._exit(3)
    time.sleep(60)
    return rank


@pytest.mark.parametrize(
    ("fn", "match", "within"),
    [(_one_hangs, "timed out", 4 + 3.0), (_one_dies, r"died with exit code\(s\) \[3\]", 4.0)],
)
def test_spawn_kills_a_stuck_group_without_further_waits(fn, match, within) -> None:
    # Before, the cleanup joined each process still running for 5 s before killing it: a
    # timeout of 4 s took 9 s, a death noticed after ~1 s took 6 s.
    t0 = time.monotonic()
    with pytest.raises(SpawnError, match=match):
        spawn(fn, 2, timeout=4, init=False)
    assert time.monotonic() - t0 < within


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
    # Before, a bare TypeError/KeyError instead of the documented error naming the checkpoint.
    import json

    monkeypatch.setenv("ADAPTRAIN_CHECKPOINT_PATH", str(tmp_path))
    checkpoint.reset()
    try:
        ckpt = tmp_path / "checkpoint-000000"
        ckpt.mkdir()
        (ckpt / "state-m").write_bytes(pickle.dumps(1))
        (ckpt / "MANIFEST.json").write_text(json.dumps({"format": 1, "states": {"m": entry}}))
        with pytest.raises(RuntimeError, match=f"corrupt checkpoint manifest {ckpt}.*'m'"):
            checkpoint.load_state(_Count("m", 0))
    finally:
        checkpoint.reset()


def test_a_stray_variable_under_torchrun_is_warned_of_once(monkeypatch, caplog) -> None:
    # Before, every micro-batch's step-time profile (num_nodes() -> num_replicas()) logged
    # the same warning again.
    from adaptrain import env
    from adaptrain.torch import _metrics

    monkeypatch.setattr(env, "_warned", set(), raising=False)
    monkeypatch.delenv("ADAPTRAIN_NUM_NODES", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("ADAPTRAIN_NUM_REPLICAS", "5")
    checkpoint.reset()
    try:
        with caplog.at_level("WARNING", logger="adaptrain.env"):
            for _ in range(20):
                _metrics.profile_step_start(8)
                _metrics.profile_step_commit()
            assert env.num_replicas() == 2
        warned = [r for r in caplog.records if "ADAPTRAIN_NUM_REPLICAS=5 ignored" in r.message]
        assert len(warned) == 1
        # Another stray value is news: warned of too.
        monkeypatch.setenv("ADAPTRAIN_NUM_REPLICAS", "6")
        with caplog.at_level("WARNING", logger="adaptrain.env"):
            env.num_replicas()
        assert "ADAPTRAIN_NUM_REPLICAS=6 ignored" in caplog.text
    finally:
        checkpoint.reset()
