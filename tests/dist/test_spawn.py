import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from adaptrain.dist.spawn import SpawnError, spawn


def _allreduce(rank, world_size, x):
    t = torch.tensor([x * (rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _raise_on_one(rank, world_size):
    if rank == 1:
        raise ValueError("boom from rank 1")
    dist.barrier()
    return rank


def _hang(rank, world_size):
    if rank == 0:
        import time

        time.sleep(60)
    return rank


def test_spawn_allreduce_results_by_rank():
    assert spawn(_allreduce, 3, args=(1.0,), timeout=60) == [6.0, 6.0, 6.0]


def test_spawn_surfaces_child_traceback():
    with pytest.raises(SpawnError, match="boom from rank 1"):
        spawn(_raise_on_one, 2, timeout=60)


def test_spawn_times_out():
    with pytest.raises(SpawnError, match="timed out"):
        spawn(_hang, 2, timeout=8, init=False)


def _return_tensor(rank, world_size):
    t = torch.arange(4, dtype=torch.float32) * (rank + 1)
    dist.all_reduce(t)
    return t


def test_spawn_returns_tensors():
    out = spawn(_return_tensor, 2, timeout=60)
    for t in out:
        torch.testing.assert_close(t, torch.arange(4, dtype=torch.float32) * 3)


def _exit_quietly(rank, world_size):
    if rank == 1:
        import os

        os._exit(0)  # ends cleanly without reporting a result
    return rank


def test_spawn_reports_a_clean_exit_without_result_promptly():
    import time

    t0 = time.monotonic()
    with pytest.raises(SpawnError, match=r"rank\(s\) \[1\] died with exit code\(s\) \[0\]"):
        spawn(_exit_quietly, 2, timeout=60, init=False)
    assert time.monotonic() - t0 < 30


def _read_env(rank, world_size):
    import os

    return os.environ.get("ADAPTRAIN_TEST_SPAWN_ENV"), os.environ.get("ADAPTRAIN_TEST_EXTRA")


def test_children_see_the_parent_environment_of_the_call(monkeypatch):
    # The fork server started at an earlier call holds that call's environment; the children
    # still see the parent's at this call, variables removed since included.
    monkeypatch.setenv("ADAPTRAIN_TEST_SPAWN_ENV", "first")
    assert spawn(_read_env, 1, timeout=60, init=False) == [("first", None)]
    monkeypatch.setenv("ADAPTRAIN_TEST_SPAWN_ENV", "second")
    extra = {"ADAPTRAIN_TEST_EXTRA": "x"}
    assert spawn(_read_env, 1, timeout=60, init=False, env=extra) == [("second", "x")]
    monkeypatch.delenv("ADAPTRAIN_TEST_SPAWN_ENV")
    assert spawn(_read_env, 1, timeout=60, init=False) == [(None, None)]


def test_preload_must_list_module_names():
    with pytest.raises(TypeError, match=r"preload='sklearn.datasets' must be a sequence"):
        spawn(_read_env, 1, init=False, preload="sklearn.datasets")


_PROBE = """
import sys


def imported(rank, world_size, names):
    return [name in sys.modules for name in names]
"""

_FIRST_CALL = """
import probe
from adaptrain.dist.spawn import spawn

names = ["torch._dynamo", "mailbox", "netrc"]
print(spawn(probe.imported, 1, args=(names,), init=False, preload=["mailbox"]))
print(spawn(probe.imported, 1, args=(names,), init=False, preload=["netrc"]))
"""


def test_the_fork_server_imports_torch_dynamo_and_the_first_calls_preload(tmp_path):
    # A fresh interpreter: this session's fork server was started long ago. The children
    # find DDP's torch._dynamo and the first call's extra module imported before they run;
    # a later call's extra module is not (the server, once started, serves every call).
    (tmp_path / "probe.py").write_text(_PROBE)  # the children import their function from it
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    out = subprocess.run(
        [sys.executable, "-c", _FIRST_CALL],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.split("\n")
    assert out[:2] == ["[[True, True, False]]", "[[True, True, False]]"]


# ----- a stuck or dying group is killed at once -------------------------------------------------


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
