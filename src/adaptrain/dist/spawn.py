"""Run a function on N real gloo processes on 127.0.0.1, with a hard timeout (distributed glue).

Used by the test-suite and the benchmarks, and handy for users' own tests::

    from adaptrain.dist.spawn import spawn

    def work(rank, world_size, x):
        t = torch.tensor([x * (rank + 1)])
        torch.distributed.all_reduce(t)
        return t.item()

    assert spawn(work, 3, args=(1.0,)) == [6.0, 6.0, 6.0]

Each child gets ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` set, joins
a gloo process group (unless ``init=False``), runs ``fn(rank, world_size, *args)`` and sends its
return value (which must pickle; tensors are fine) back. A child that raises makes :func:`spawn` raise
:class:`SpawnError` carrying the child's traceback; a group that runs past ``timeout`` seconds is
killed and :class:`SpawnError` says so. ``fn`` must be importable (defined at module level).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

__all__ = ["spawn", "free_port", "SpawnError"]

# Imported once by the fork server, so that its children start with them. DDP's constructor
# imports torch._dynamo (about 1.3 s on a 2-core machine, more when two children import it side
# by side); preloaded, a child that wraps a model in DDP starts at once.
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "numpy"]


class SpawnError(RuntimeError):
    """A spawned process failed or the group timed out."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    args: Sequence[Any],
    env: dict[str, str],
    init: bool,
    backend: str,
    pg_timeout: float,
    queue: Any,
) -> None:
    # The parent's environment at the call (a fork server's children would otherwise see the
    # one it had when the server started), with the caller's additions.
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
        }
    )
    try:
        import torch

        torch.set_num_threads(1)
        if init:
            import torch.distributed as dist

            # The parent holds the store's listening socket (bound to port 0, so no other
            # process can take the port between choosing and binding it); we are clients.
            store = dist.TCPStore(
                "127.0.0.1",
                port,
                world_size,
                is_master=False,
                timeout=timedelta(seconds=pg_timeout),
            )
            dist.init_process_group(
                backend,
                store=store,
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=pg_timeout),
            )
        try:
            result = fn(rank, world_size, *args)
        finally:
            if init:
                import torch.distributed as dist

                if dist.is_initialized():
                    dist.destroy_process_group()
        # Plain pickle to bytes: torch's multiprocessing reducers would send tensors as shared
        # memory handles, which die with this process before the parent opens them.
        queue.put((rank, True, pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        queue.put((rank, False, traceback.format_exc()))


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    *,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
    init: bool = True,
    backend: str = "gloo",
    start_method: str = "forkserver",
    preload: Sequence[str] = (),
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return results by rank.

    Args:
        fn: module-level function to run in each process.
        world_size: number of processes (≥ 1).
        args: extra positional arguments (picklable).
        timeout: seconds before the whole group is killed and :class:`SpawnError` raised.
        env: environment variables for the children on top of the parent's environment at the
            call (the children see that, not the one a fork server started with).
        init: whether to initialise a process group before calling ``fn``.
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (GPU).
        start_method: multiprocessing start method; ``forkserver`` imports torch once.
        preload: further modules for the fork server to import (e.g. ``["sklearn.datasets"]``
            for children that load a bundled dataset), on top of torch, torch.distributed,
            torch._dynamo and numpy. A process starts its fork server once (at its first
            ``forkserver`` start, this function's or another's) and it then serves every later
            call, so only the ``preload`` of the call that starts it takes effect; the children
            import any other module themselves, as usual.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be at least 1")
    if isinstance(preload, str):
        raise TypeError(f"preload={preload!r} must be a sequence of module names: [{preload!r}]")
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload([*_PRELOAD, *(m for m in preload if m not in _PRELOAD)])
    queue = ctx.Queue()
    store = None
    if init:
        import torch.distributed as dist

        store = dist.TCPStore(
            "127.0.0.1",
            0,
            world_size,
            is_master=True,
            timeout=timedelta(seconds=timeout),
            wait_for_workers=False,
        )
        port = store.port
    else:
        port = free_port()
    procs = [
        ctx.Process(
            target=_child,
            args=(
                fn,
                r,
                world_size,
                port,
                tuple(args),
                {**os.environ, **(env or {})},
                init,
                backend,
                max(timeout, 1.0),
                queue,
            ),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failures: list[tuple[int, str]] = []
    exited: dict[int, float] = {}  # rank -> when it was first seen ended without a result
    deadline = time.monotonic() + timeout
    finished = False  # every rank reported a result: the processes are on their way out
    try:
        while len(results) + len(failures) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise SpawnError(
                    f"spawned group of {world_size} timed out after {timeout:.0f}s; "
                    f"finished ranks: {sorted(results)}; failed: {[r for r, _ in failures]}"
                )
            try:
                rank, ok, payload = queue.get(timeout=min(remaining, 0.5))
            except Exception:  # queue.Empty: check for children that died without reporting
                now = time.monotonic()
                gone = [
                    i
                    for i, p in enumerate(procs)
                    if not p.is_alive() and i not in results and i not in dict(failures)
                ]
                # A clean exit's result may still be in flight through the queue: one that
                # has not arrived 2 s later never will (the child ended with os._exit(0), say).
                for i in gone:
                    exited.setdefault(i, now)
                dead = [i for i in gone if procs[i].exitcode != 0 or now - exited[i] > 2.0]
                if dead:
                    # give a dying sibling's message a moment to arrive
                    time.sleep(0.2)
                    if queue.empty():
                        raise SpawnError(
                            f"rank(s) {dead} died with exit code(s) "
                            f"{[procs[i].exitcode for i in dead]} without reporting"
                        ) from None
                continue
            if ok:
                results[rank] = pickle.loads(payload)
            else:
                failures.append((rank, payload))
                # The others are likely failing too, or blocked in a collective: give them a
                # moment to report (the root cause may arrive second), then stop.
                grace = time.monotonic() + 3.0
                while len(results) + len(failures) < world_size and time.monotonic() < grace:
                    try:
                        r2, ok2, p2 = queue.get(timeout=0.2)
                    except Exception:
                        continue
                    if ok2:
                        results[r2] = pickle.loads(p2)
                    else:
                        failures.append((r2, p2))
                break
        if failures:
            report = "\n".join(f"--- rank {r} of {world_size} raised:\n{tb}" for r, tb in failures)
            raise SpawnError(report)
        finished = True
        return [results[r] for r in range(world_size)]
    finally:
        # Only a group that finished gets time to exit; after a failure, a timeout or a death
        # the rest are likely blocked (in a collective, or hung) and are killed at once.
        for p in procs:
            p.join(timeout=5 if finished else 0)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        queue.close()
        del store
