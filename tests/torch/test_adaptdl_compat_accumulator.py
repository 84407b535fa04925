"""Accumulator across restarts with AdaptDL's idiom for code that must run once.

AdaptDL programs guard such code with ``if env.num_restarts() == 0:``. After a restart the
replayed, unguarded updates made before the checkpoint are dropped (AdaptDL counts them twice);
they are recognised by where they are made, so a guarded update skipped on replay does not make
a later, genuine update be dropped in its place.
"""

from __future__ import annotations

import pytest

from adaptrain import checkpoint, env
from adaptrain.dist.spawn import spawn
from adaptrain.torch import Accumulator, remaining_epochs_until

pytestmark = pytest.mark.usefixtures("fresh_checkpoints")


def _add(acc: Accumulator, key: str, value: int) -> None:
    acc[key] += value  # one line for every call: told apart by their order and loop position


def _guarded_program(rank: int, interrupt_at: int | None) -> dict | None:
    """One epoch: guarded and unguarded updates before a loader loop, more after it; a
    checkpoint (and stop) at the loop's ``interrupt_at``-th batch of this run."""
    import torch
    from torch.utils.data import TensorDataset

    from adaptrain.torch import AdaptiveDataLoader

    acc = Accumulator()
    loader = AdaptiveDataLoader(TensorDataset(torch.arange(12)), batch_size=4)
    for _epoch in remaining_epochs_until(1):
        if env.num_restarts() == 0:
            acc["b"] += 3  # runs once: skipped when the restart replays this code
        acc["a"] += 5  # replayed after a restart: already counted
        _add(acc, "h", 1)  # replayed too, through a helper
        if rank == 1:
            acc["r"] += 1  # one replica's update, replayed on that replica
        for i, (x,) in enumerate(loader):
            if i == interrupt_at:
                checkpoint.save_all_states()
                return None
            acc["seen"] += len(x)
        acc["a"] += 3  # after the loop: never made before a checkpoint, always counts
        _add(acc, "h", 10)  # the helper's later call counts too
    with acc.synchronized():
        return dict(acc)


def _replica(rank: int, world_size: int, interrupt_at: int | None) -> dict | None:
    return _guarded_program(rank, interrupt_at)


_EXPECTED = {"a": 2 * (5 + 3), "b": 2 * 3, "h": 2 * (1 + 10), "r": 1, "seen": 12}


def _run(path, restarts: int, interrupt_at: int | None) -> list:
    env_ = {"ADAPTRAIN_CHECKPOINT_PATH": str(path), "ADAPTRAIN_NUM_RESTARTS": str(restarts)}
    return spawn(_replica, 2, args=(interrupt_at,), env=env_, timeout=180)


def test_guarded_and_unguarded_updates_across_a_restart_on_two_replicas(tmp_path):
    assert _run(tmp_path, 0, 1) == [None, None]  # 4 samples seen, then a checkpoint
    assert _run(tmp_path, 1, None) == [_EXPECTED] * 2  # as AdaptDL's program without restarts


def test_guarded_and_unguarded_updates_across_two_restarts_on_two_replicas(tmp_path):
    assert _run(tmp_path, 0, 1) == [None, None]
    assert _run(tmp_path, 1, 1) == [None, None]  # a restart in the same epoch: 4 more, again
    assert _run(tmp_path, 2, None) == [_EXPECTED] * 2


def test_guarded_update_in_one_process(monkeypatch, tmp_path):
    monkeypatch.setenv("ADAPTRAIN_CHECKPOINT_PATH", str(tmp_path))
    monkeypatch.setenv("ADAPTRAIN_NUM_RESTARTS", "0")
    assert _guarded_program(0, interrupt_at=2) is None
    checkpoint.reset()
    monkeypatch.setenv("ADAPTRAIN_NUM_RESTARTS", "1")
    assert _guarded_program(0, interrupt_at=None) == {"a": 8, "b": 3, "h": 11, "seen": 12}


def _sync_then_loop(interrupt_at: int | None) -> list:
    import torch
    from torch.utils.data import TensorDataset

    from adaptrain.torch import AdaptiveDataLoader

    acc = Accumulator()
    loader = AdaptiveDataLoader(TensorDataset(torch.arange(8)), batch_size=2)
    out = []
    for _epoch in remaining_epochs_until(1):
        if env.num_restarts() > 0:
            acc["restarted"] += 1  # made only after a restart: a new update
        acc["x"] += 1  # replayed after a restart: dropped
        with acc.synchronized():  # recorded: replayed after a restart
            out.append(dict(acc))
        for i, (x,) in enumerate(loader):
            if i == interrupt_at:
                checkpoint.save_all_states()
                return out
            acc["seen"] += len(x)
        with acc.synchronized():
            out.append(dict(acc))
    return out


def test_replayed_sync_keeps_new_pending_updates(monkeypatch, tmp_path):
    """A replayed synchronization shows its recorded result; an update the replay makes anew
    before it stays pending for the next one (the replayed updates were dropped as made)."""
    monkeypatch.setenv("ADAPTRAIN_CHECKPOINT_PATH", str(tmp_path))
    monkeypatch.setenv("ADAPTRAIN_NUM_RESTARTS", "0")
    assert _sync_then_loop(interrupt_at=1) == [{"x": 1}]
    checkpoint.reset()
    monkeypatch.setenv("ADAPTRAIN_NUM_RESTARTS", "1")
    assert _sync_then_loop(interrupt_at=None) == [
        {"x": 1},
        {"x": 1, "seen": 8, "restarted": 1},
    ]
