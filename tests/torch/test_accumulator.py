"""Accumulator: accumulation/synchronized modes, operators, replicas, restarts and replays."""

from __future__ import annotations

import pytest

from adaptrain import checkpoint
from adaptrain.dist.spawn import spawn
from adaptrain.torch import Accumulator, remaining_epochs_until


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.delenv("ADAPTRAIN_CHECKPOINT_PATH", raising=False)
    checkpoint.reset()
    yield
    checkpoint.reset()


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
    with acc.synchronized():
        assert dict(acc) == {"base": 10, "a": 6, "b": -1.5, "c": 3, "d": 5}
        acc["ratio"] = acc["a"] / acc["d"]
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
    acc = Accumulator()
    acc["loss"] += 1.25
    checkpoint.save_all_states()  # pending updates are folded in before the save
    checkpoint.reset()
    acc = Accumulator()
    acc["loss"] += 0.5
    with acc.synchronized():
        assert acc["loss"] == 1.75


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
