"""Accumulator: accumulation/synchronized modes, operators, replicas, restarts and replays."""

from __future__ import annotations

import pytest

from adaptrain import checkpoint
from adaptrain.dist.spawn import spawn
from adaptrain.torch import Accumulator, remaining_epochs_until

pytestmark = pytest.mark.usefixtures("fresh_checkpoints")


def test_operators_and_modes():
    acc = Accumulator(base=10)
    acc["a"] += 2
    acc["a"] += 3
    acc["b"] -= 1.5
    acc.update(a=1, c=4)
    acc.subtract({"c": 1})
    acc += {"d": 7}
    acc -= {"d": 2}
    # Accumulation mode reads as an empty dict.
    assert len(acc) == 0 and "a" not in acc and list(acc) == [] and repr(acc) == "{}"
    with pytest.raises(TypeError, match="accumulation mode"):
        acc["a"] = 5
    assert acc.get("a") is None and acc.get("a", 0) == 0
    assert acc.pop("a", 0) == 0
    with pytest.raises(KeyError):
        acc.pop("a")
    with pytest.raises(TypeError, match="synchronized"):
        acc.setdefault("a", 0)
    with acc.synchronized():
        assert dict(acc) == {"base": 10, "a": 6, "b": -1.5, "c": 3, "d": 5}
        acc["ratio"] = acc["a"] / acc["d"]
        assert acc.get("a") == 6 and acc.get("zz", -1) == -1
        assert acc.setdefault("e", 1) == 1 and acc.pop("e") == 1 and acc.pop("e", 2) == 2
        del acc["base"]
        with acc.synchronized():  # re-entrant
            assert acc["ratio"] == 6 / 5
    acc["a"] += 1
    with acc.synchronized():
        assert acc["a"] == 7 and "base" not in acc
        acc.clear()
    with acc.synchronized():
        assert dict(acc) == {}


def _replicas(rank: int, world_size: int) -> tuple[dict, dict]:
    acc = Accumulator()
    acc["n"] += rank + 1
    acc[f"only{rank}"] += 1
    with acc.synchronized():
        first = dict(acc)
        acc.clear()
    acc.update(n=10)
    with acc.synchronized():
        second = dict(acc)
    return first, second


def test_sums_over_three_replicas():
    res = spawn(_replicas, 3, timeout=120)
    first = {"n": 6, "only0": 1, "only1": 1, "only2": 1}
    assert res == [(first, {"n": 30})] * 3


def test_updates_survive_restart(monkeypatch, tmp_path):
    monkeypatch.setenv("ADAPTRAIN_CHECKPOINT_PATH", str(tmp_path))

    def program(restarted: bool) -> float | None:
        acc = Accumulator()
        acc["loss"] += 1.25  # the restarted program replays the code before the checkpoint...
        if not restarted:
            checkpoint.save_all_states()  # pending updates are folded in before the save
            return None
        acc["loss"] += 0.5  # ...and goes on past it
        with acc.synchronized():
            return acc["loss"]

    assert program(restarted=False) is None
    checkpoint.reset()
    assert program(restarted=True) == 1.75


def _outside_update_then_loop(interrupt_at: int | None) -> dict | None:
    """An update outside the loader loop, with no synchronization between it and a checkpoint
    taken inside the loop (AdaptDL counts it twice after the restart)."""
    import torch
    from torch.utils.data import TensorDataset

    from adaptrain.torch import AdaptiveDataLoader

    acc = Accumulator()
    loader = AdaptiveDataLoader(TensorDataset(torch.arange(12)), batch_size=2)
    for epoch in remaining_epochs_until(2):
        acc["epochs"] += 1  # replayed after a restart inside this epoch
        for i, (x,) in enumerate(loader):
            if epoch == 1 and i == interrupt_at:
                checkpoint.save_all_states()
                return None
            acc["seen"] += len(x)
    with acc.synchronized():
        return dict(acc)


def test_replayed_updates_outside_loops_count_once(monkeypatch, tmp_path):
    monkeypatch.setenv("ADAPTRAIN_CHECKPOINT_PATH", str(tmp_path))
    assert _outside_update_then_loop(interrupt_at=2) is None
    checkpoint.reset()
    assert _outside_update_then_loop(interrupt_at=1) is None  # a second restart, same epoch
    checkpoint.reset()
    assert _outside_update_then_loop(interrupt_at=None) == {"epochs": 2, "seen": 24}


def _replicas_outside_update_then_loop(rank: int, world_size: int, interrupt_at):
    return _outside_update_then_loop(interrupt_at)


def test_replayed_updates_outside_loops_count_once_across_replica_counts(tmp_path):
    env = {"ADAPTRAIN_CHECKPOINT_PATH": str(tmp_path)}
    first = spawn(_replicas_outside_update_then_loop, 2, args=(1,), env=env, timeout=120)
    assert first == [None, None]
    # 2 replicas counted 2 epochs each before the checkpoint; 3 replicas replay epoch 1
    res = spawn(_replicas_outside_update_then_loop, 3, args=(None,), env=env, timeout=120)
    assert res == [{"epochs": 4, "seen": 24}] * 3


def test_replayed_code_after_restart_does_not_double_count(monkeypatch, tmp_path):
    """A restart after a synchronization replays the code before it: the recorded result wins."""
    monkeypatch.setenv("ADAPTRAIN_CHECKPOINT_PATH", str(tmp_path))

    def program(interrupt: bool) -> list:
        acc = Accumulator()
        seen = []
        for _epoch in remaining_epochs_until(2):
            acc["x"] += 1  # replayed after a restart inside this epoch
            with acc.synchronized():
                seen.append(acc["x"])
            if interrupt:
                checkpoint.save_all_states()
                return seen
        return seen

    assert program(interrupt=True) == [1]
    checkpoint.reset()
    assert program(interrupt=False) == [1, 2]


def _train_then_validate(interrupt_at: int | None) -> list:
    """Sync after "training", then a validation loop; checkpoint (as graceful_exit does at a step
    boundary) at its ``interrupt_at``-th iteration of this run and stop."""
    import torch
    from torch.utils.data import TensorDataset

    from adaptrain.torch import AdaptiveDataLoader

    acc = Accumulator()
    valid = AdaptiveDataLoader(TensorDataset(torch.arange(10)), batch_size=2)
    out = []
    for _epoch in remaining_epochs_until(1):
        acc["train_loss"] += 5  # replayed after a restart inside this epoch
        with acc.synchronized():  # recorded: replayed after a restart
            out.append(dict(acc))
            acc.clear()  # replayed too: must not wipe the sums collected after it
        for i, (x,) in enumerate(valid):
            if i == interrupt_at:
                checkpoint.save_all_states()
                return out
            acc["seen"] += len(x)
            acc["sum"] += int(x.sum())
        with acc.synchronized():
            out.append(dict(acc))
    return out


def test_replayed_sync_keeps_sums_collected_after_it(monkeypatch, tmp_path):
    """A restart mid-validation replays the sync after training: it shows the recorded result,
    but the validation sums checkpointed before the restart survive (and a second restart in the
    same epoch replays the same recorded result, not the one the replayed clear() emptied)."""
    monkeypatch.setenv("ADAPTRAIN_CHECKPOINT_PATH", str(tmp_path))
    assert _train_then_validate(interrupt_at=2) == [{"train_loss": 5}]  # 4 samples seen
    checkpoint.reset()
    assert _train_then_validate(interrupt_at=1) == [{"train_loss": 5}]  # 2 more
    checkpoint.reset()
    assert _train_then_validate(interrupt_at=None) == [{"train_loss": 5}, {"seen": 10, "sum": 45}]


def _replicas_train_then_validate(rank: int, world_size: int, interrupt_at: int | None) -> list:
    return _train_then_validate(interrupt_at)


def test_replayed_sync_keeps_sums_across_replica_counts(tmp_path):
    """Same on real replicas: checkpoint mid-validation on 2, resume on 3; every sample counts
    once and the replicas' updates of the replayed code are not summed again."""
    env = {"ADAPTRAIN_CHECKPOINT_PATH": str(tmp_path)}
    first = spawn(_replicas_train_then_validate, 2, args=(2,), env=env, timeout=120)
    assert first == [[{"train_loss": 10}]] * 2  # 2 replicas × 5
    res = spawn(_replicas_train_then_validate, 3, args=(None,), env=env, timeout=120)
    assert res == [[{"train_loss": 10}, {"seen": 10, "sum": 45}]] * 3
