"""Checkpoints across replicas (real gloo processes on 127.0.0.1): a failure on one replica, or
States held by some replicas only, reach every replica alike, and the collectives stay in step.
"""

from __future__ import annotations

import os
import pickle
import time
from pathlib import Path

import pytest

from adaptrain import checkpoint, collective
from adaptrain.dist.spawn import spawn

pytestmark = pytest.mark.usefixtures("fresh_checkpoints")


class _Count(checkpoint.State):
    """A State whose sync() is collective (sums the replicas' values); rank 0 fails to write
    the one named ``broken``."""

    def __init__(self, name: str, value: object = 0) -> None:
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


class _Plain(checkpoint.State):
    """A State with the default (no-op) sync."""

    def __init__(self, name: str, value: object = None) -> None:
        super().__init__(name)
        self.value = value

    def save(self, fileobj) -> None:
        pickle.dump(self.value, fileobj)

    def load(self, fileobj) -> None:
        self.value = pickle.load(fileobj)


# ----- a replica that cannot write ------------------------------------------------------------


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
