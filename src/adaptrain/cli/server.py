"""``adaptrain server``: run the scheduler service in the foreground until SIGINT/SIGTERM.

``--backend local`` (the default) runs the replicas on this machine; ``--backend ray`` on the
nodes of a Ray cluster (``--ray-address``), whose state directory every node must see.
"""

from __future__ import annotations

import argparse
import sys

from ._client import DEFAULT_PORT, read_token_file

NAME = "server"
HELP = "run the scheduler service: many elastic jobs on this machine's or a Ray cluster's slots"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to bind (loopback unless a token is given)"
    )
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="port (0: any free port)")
    parser.add_argument("--state-dir", default="adaptrain-state", help="jobs, logs, checkpoints")
    parser.add_argument(
        "--backend",
        choices=("local", "ray"),
        default="local",
        help="ray: the nodes and GPUs (or CPUs) of a Ray cluster, with --state-dir on a "
        "filesystem every node sees; needs pip install adaptrain[ray]",
    )
    parser.add_argument(
        "--ray-address",
        help="the Ray cluster to join (default: RAY_ADDRESS, else a cluster running here)",
    )
    parser.add_argument("--slots", type=int, help="CPU slots (default: the GPUs, else the cores)")
    parser.add_argument("--nodes", type=int, help="emulate this many nodes on this machine")
    parser.add_argument("--slots-per-node", type=int, help="slots of each emulated node")
    parser.add_argument("--interval", type=float, default=60.0, help="seconds between rounds")
    parser.add_argument(
        "--policy",
        choices=("waterfill", "pollux", "fifo"),
        default="waterfill",
        help="fifo: a baseline, each job at its --max-replicas in submission order",
    )
    parser.add_argument(
        "--policy-in-process",
        action="store_true",
        help="run the policy's rounds in the server's process, not in a worker process",
    )
    parser.add_argument("--token-file", help="a file holding the token every client must give")
    parser.add_argument("--max-restarts", type=int, default=3, help="default restart budget")
    parser.add_argument(
        "--rescale-rounds", type=int, default=1, help="rounds a moved job keeps its allocation"
    )
    parser.add_argument("--grace", type=float, default=60.0, help="seconds to checkpoint on stop")
    parser.add_argument(
        "--restart-delay",
        type=float,
        default=30.0,
        help="seconds a job loses per rescale, as the policy prices it",
    )
    parser.add_argument(
        "--checkpoint-interval", type=float, default=600.0, help="periodic checkpoints, s (0: off)"
    )
    parser.add_argument("--hints-interval", type=float, default=30.0, help="hint posts, s")
    parser.add_argument(
        "--orphan-timeout",
        type=float,
        default=600.0,
        help="replicas stop this long after the server dies",
    )


def run(args: argparse.Namespace) -> int:
    from adaptrain.service.config import ServerConfig
    from adaptrain.service.local import make_nodes
    from adaptrain.service.server import Server

    backend = None
    try:
        token = read_token_file(args.token_file) if args.token_file else None
        config = ServerConfig(
            host=args.host,
            port=args.port,
            state_dir=args.state_dir,
            interval=args.interval,
            policy=args.policy,
            policy_in_process=args.policy_in_process,
            token=token,
            max_restarts=args.max_restarts,
            rescale_rounds=args.rescale_rounds,
            grace=args.grace,
            restart_delay=args.restart_delay,
            checkpoint_interval=args.checkpoint_interval,
            hints_interval=args.hints_interval,
            orphan_timeout=args.orphan_timeout,
        )
        if args.backend == "local":
            if args.ray_address:
                raise ValueError("--ray-address goes with --backend ray")
            server = Server(config, make_nodes(args.slots, args.nodes, args.slots_per_node))
        else:
            if args.slots is not None or args.nodes is not None or args.slots_per_node:
                raise ValueError(
                    "--slots, --nodes and --slots-per-node are the local backend's: with "
                    "--backend ray the cluster's nodes are Ray's"
                )
            backend = _ray_backend(config, args.ray_address)
            try:
                server = Server(config, backend=backend)
            except BaseException:
                backend.close()
                raise
    except (ValueError, RuntimeError, OSError, ImportError) as exc:
        print(f"adaptrain server: {exc}", file=sys.stderr)
        return 2
    nodes = server.controller.backend.nodes.values()
    slots = ", ".join(f"{n.name}: {len(n.slots)}" for n in nodes)
    where = "Ray nodes " if backend is not None else ""
    print(
        f"adaptrain server: {config.policy} policy every {config.interval:g} s on {where}{slots}",
        flush=True,
    )
    try:
        return server.run_until_signalled()
    finally:
        if backend is not None:
            backend.close()


def _ray_backend(config, address: str | None):
    """The Ray backend for ``config``'s state directory, once no other server holds it (its
    agents are named after it, and a second server would take over the first one's)."""
    import fcntl
    import os

    from adaptrain.service.server import Server

    os.makedirs(config.state_dir, exist_ok=True)
    with open(os.path.join(config.state_dir, "server.lock"), "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise RuntimeError(
                f"another adaptrain server runs on state directory {config.state_dir!r}"
            ) from None
        fcntl.flock(lock, fcntl.LOCK_UN)
    from adaptrain.ray.backend import RayBackend

    return RayBackend(
        Server.runs_dir(config),
        address,
        key=config.state_dir,
        orphan_timeout=config.orphan_timeout,
    )
