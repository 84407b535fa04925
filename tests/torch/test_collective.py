"""adaptrain.collective: python-object allreduce/broadcast over torch.distributed (gloo)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from adaptrain import collective
from adaptrain.dist.spawn import spawn


def _collectives(rank: int, world_size: int) -> dict:
    out = {}
    out["sum"] = collective.allreduce(rank + 1)
    out["max"] = collective.allreduce(rank * 10, max)
    # Non-commutative reduction: applied left to right in rank order on every replica.
    out["concat"] = collective.allreduce([rank], lambda a, b: a + b)
    out["dict"] = collective.allreduce(
        {"n": rank, f"k{rank}": 1}, lambda a, b: {k: a.get(k, 0) + b.get(k, 0) for k in a | b}
    )
    out["bcast"] = collective.broadcast({"from": rank, "bsz": (8 * (rank + 1), 2)})
    # Several async reductions in flight, interleaved with a default-group tensor collective.
    futs = [collective.allreduce_async(rank + i) for i in range(5)]
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    out["tensor"] = t.item()
    out["async"] = [f.result(timeout=30) for f in futs]
    collective.barrier()
    return out


def test_collectives_three_processes() -> None:
    res = spawn(_collectives, 3, timeout=120)
    for r in res:
        assert r["sum"] == 6
        assert r["max"] == 20
        assert r["concat"] == [0, 1, 2]
        assert r["dict"] == {"n": 3, "k0": 1, "k1": 1, "k2": 1}
        assert r["bcast"] == {"from": 0, "bsz": (8, 2)}
        assert r["tensor"] == 3.0
        assert r["async"] == [sum(rr + i for rr in range(3)) for i in range(5)]


def test_single_process_returns_value() -> None:
    assert not dist.is_initialized()
    assert collective.allreduce(5) == 5
    assert collective.allreduce_async([1, 2], max).result() == [1, 2]
    assert collective.broadcast("x") == "x"
    collective.barrier()


# ----- init_process_group: no environment, torchrun variables, ADAPTRAIN_* variables ----------
_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _init(rank: int, world_size: int, mode: str, port: int) -> tuple:
    import os

    from adaptrain.torch import init_process_group

    if mode == "none":
        for k in _VARS:
            os.environ.pop(k, None)
    elif mode == "adaptrain":
        # ADAPTRAIN_* take precedence over torchrun's variables (set to a bogus world here).
        os.environ.update(
            ADAPTRAIN_MASTER_ADDR="127.0.0.1",
            ADAPTRAIN_MASTER_PORT=str(port),
            ADAPTRAIN_NUM_REPLICAS=str(world_size),
            ADAPTRAIN_REPLICA_RANK=str(world_size - 1 - rank),
            WORLD_SIZE="99",
        )
    init_process_group("gloo")
    try:
        return dist.get_rank(), dist.get_world_size(), collective.allreduce([dist.get_rank()])
    finally:
        collective.teardown()
        dist.destroy_process_group()


def test_init_single_process_without_environment():
    assert spawn(_init, 1, args=("none", 0), init=False, timeout=60) == [(0, 1, [0])]


def test_init_from_torchrun_variables():
    res = spawn(_init, 2, args=("torchrun", 0), init=False, timeout=60)
    assert res == [(0, 2, [0, 1]), (1, 2, [0, 1])]


def test_init_from_adaptrain_variables():
    from adaptrain.dist.spawn import free_port

    res = spawn(_init, 3, args=("adaptrain", free_port()), init=False, timeout=60)
    # Ranks come from ADAPTRAIN_REPLICA_RANK (reversed), not from RANK.
    assert res == [(2, 3, [0, 1, 2]), (1, 3, [0, 1, 2]), (0, 3, [0, 1, 2])]


def test_init_bad_environment(monkeypatch):
    import pytest

    from adaptrain.torch import init_process_group

    for k in _VARS:
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(ValueError, match="rank=3 world_size=2"):
        init_process_group("gloo", world_size=2, rank=3)
    monkeypatch.setenv("ADAPTRAIN_NUM_REPLICAS", "2")
    with pytest.raises(ValueError, match="ADAPTRAIN_MASTER_PORT"):
        init_process_group("gloo")
    assert not dist.is_initialized()


def _adaptdl_initialize(rank: int, world_size: int, port: int) -> tuple:
    import os

    for k in _VARS:
        os.environ.pop(k, None)
    # AdaptDL's call: the collectives set up from explicit arguments, no process group yet.
    collective.initialize("127.0.0.1", port, rank, world_size)
    collective.initialize("127.0.0.1", port, rank, world_size)  # a second call: no-op
    try:
        return dist.get_world_size(), collective.allreduce(rank + 1), collective.broadcast(rank)
    finally:
        collective.teardown()
        dist.destroy_process_group()


def test_initialize_with_adaptdl_arguments():
    from adaptrain.dist.spawn import free_port

    res = spawn(_adaptdl_initialize, 2, args=(free_port(),), init=False, timeout=60)
    assert res == [(2, 3, 0), (2, 3, 0)]


def _ipv6_loopback() -> bool:
    import socket

    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_rendezvous_url_brackets_an_ipv6_address():
    from adaptrain.dist.collective import rendezvous_url

    assert rendezvous_url(2, "::1", 29500) == "tcp://[::1]:29500"
    assert rendezvous_url(2, "[fd00::1]", 29500) == "tcp://[fd00::1]:29500"
    assert rendezvous_url(2, "node-3", 29500) == "tcp://node-3:29500"


def test_init_on_an_ipv6_master_address():
    import pytest

    if not _ipv6_loopback():
        pytest.skip("no IPv6 loopback on this host")
    res = spawn(
        _init, 2, args=("torchrun", 0), init=False, timeout=60, env={"ADAPTRAIN_MASTER_ADDR": "::1"}
    )
    assert res == [(0, 2, [0, 1]), (1, 2, [0, 1])]


def _late_peer(rank: int, world_size: int, timeout_s: float | None) -> tuple:
    import datetime
    import time

    from adaptrain.dist.collective import group_timeout
    from adaptrain.torch import init_process_group

    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    init_process_group("gloo", timeout=timeout)
    out = (group_timeout(), None)
    if rank == 1:
        time.sleep(8.0)  # alive, but late for the barrier
        return out
    t0 = time.monotonic()
    try:
        collective.barrier()
    except Exception as exc:  # noqa: BLE001 - gloo's timeout error
        return out[0], (type(exc).__name__, time.monotonic() - t0)
    return out[0], ("returned", time.monotonic() - t0)


def test_init_timeout_bounds_adaptrain_s_own_collectives():
    import datetime

    res = spawn(_late_peer, 2, args=(2.0,), init=False, timeout=60)
    assert res[0][0] == res[1][0] == datetime.timedelta(seconds=2)
    kind, waited = res[0][1]
    assert kind != "returned" and waited < 6.0  # not the 8 s the peer took (nor 30 min)
