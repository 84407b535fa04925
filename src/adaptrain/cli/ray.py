"""``adaptrain ray submit -f code.py [-u ray://HOST:PORT] -m MAX_WORKERS [options] -- ARGS``.

One elastic job on a Ray cluster (:mod:`adaptrain.ray.launcher`): it asks Ray's autoscaler for
the replicas its goodput is worth, uses the nodes that arrive, checkpoints and moves off nodes
that are drained or get a spot notice, and restarts from its last checkpoint after failures.
The training script is an ordinary adaptrain script (``python code.py ARGS`` must run it);
it makes no Ray calls. The command returns the job's status: 0 when it finished.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time

NAME = "ray"
HELP = "run one elastic job on a Ray cluster (adaptrain ray submit -f code.py -m N -- ARGS)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION")
    submit = sub.add_parser(
        "submit",
        help="run a training script as one elastic job on a Ray cluster",
        description=(
            "Run FILE as an elastic job on a Ray cluster: its replica count follows its "
            "goodput (up to -m), Ray's autoscaler is asked for the nodes, and drained or "
            "spot-interrupted nodes are left after a checkpoint."
        ),
    )
    submit.add_argument("-f", "--file", required=True, help="the training script")
    submit.add_argument(
        "-u", "--address", default=None, help="the Ray cluster: ray://HOST:PORT (Ray Client)"
    )
    submit.add_argument(
        "-m", "--max-workers", type=int, required=True, help="the most replicas to run"
    )
    submit.add_argument("--cpus", type=float, default=1.0, help="CPUs per replica (default 1)")
    submit.add_argument("--gpus", type=float, default=0.0, help="GPUs per replica (default 0)")
    submit.add_argument(
        "--working-dir",
        default=None,
        help="folder shipped to the nodes (default: the script's); -f is relative to it",
    )
    submit.add_argument(
        "--checkpoint-timeout",
        type=float,
        default=120.0,
        help="seconds for rank 0's checkpoint to arrive after SIGTERM (default 120)",
    )
    submit.add_argument(
        "--cluster-rescale-timeout",
        type=float,
        default=60.0,
        help="seconds to wait for requested nodes before using those there (default 60)",
    )
    submit.add_argument("--name", default=None, help="the job's name (ADAPTRAIN_JOB_ID)")
    submit.add_argument(
        "--checkpoint-dir",
        default=None,
        help="keep each checkpoint here (checkpoint-SEQ.tar); a rerun resumes from it",
    )
    submit.add_argument(
        "--spot",
        choices=["auto", "aws", "gcp", "off"],
        default="auto",
        help="cloud spot notices to watch on each node (default auto: AWS and GCP)",
    )
    submit.add_argument(
        "-e", "--env", action="append", default=[], metavar="KEY=VALUE", help="replica env"
    )
    submit.add_argument("args", nargs=argparse.REMAINDER, help="-- ARGS for the script")


def _fail(message: str, code: int = 2) -> int:
    print(f"adaptrain ray: {message}", file=sys.stderr)
    return code


def run(args: argparse.Namespace) -> int:
    if args.action != "submit":
        return _fail("an action is required: adaptrain ray submit -f code.py -m N -- ARGS")
    script_args = args.args[1:] if args.args[:1] == ["--"] else args.args
    env = {}
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            return _fail(f"--env {item!r}: expected KEY=VALUE")
        env[key] = value
    try:
        from adaptrain.ray.launcher import RayLauncher
    except ImportError as exc:
        return _fail(f"{exc}: install Ray with `pip install adaptrain[ray]`", 1)
    try:
        launcher = RayLauncher(
            args.file,
            script_args,
            max_workers=args.max_workers,
            address=args.address,
            cpus=args.cpus,
            gpus=args.gpus,
            working_dir=args.working_dir,
            checkpoint_timeout=args.checkpoint_timeout,
            cluster_rescale_timeout=args.cluster_rescale_timeout,
            name=args.name,
            env=env,
            checkpoint_dir=os.path.abspath(args.checkpoint_dir) if args.checkpoint_dir else None,
            spot=args.spot,
        )
    except ValueError as exc:
        return _fail(str(exc))
    # the launcher's progress is what this command prints
    logging.getLogger("adaptrain.ray").setLevel(logging.INFO)
    if not logging.getLogger().handlers:
        logging.basicConfig(format="%(levelname)s:%(name)s:%(message)s")

    import ray

    terminated = []

    def terminate(signum: int, frame: object) -> None:
        terminated.append(signum)
        raise KeyboardInterrupt  # the same graceful stop as Ctrl-C: checkpoint, then end

    # Ray's driver installs its own SIGTERM handler (exit at once) when it connects: connect
    # first, then take SIGTERM back
    try:
        _connect(ray, args.address)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        return _fail(f"cannot connect to the Ray cluster {args.address or '(default)'}: {exc}", 1)
    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        code = launcher.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
        ray.shutdown()
    if code == 130 and terminated:
        code = 128 + signal.SIGTERM
    print(f"adaptrain ray: job {launcher.name} ended with status {code}", file=sys.stderr)
    return code


# a Ray Client server that answered but could not start this driver's own server process (a
# transient failure on a loaded head): asked again this many times, this many seconds apart
CLIENT_TRIES = 3
CLIENT_RETRY_DELAY = 2.0
# what Ray Client raises then: the server's reply to the driver's init, or, where the server
# closed the session's stream before that reply was read, a client already disconnected
CLIENT_TRANSIENT = (
    "Initialization failure from server",
    "Ray client has already been disconnected",
)


def _connect(ray, address: str | None, **init_kwargs) -> None:
    """``ray.init(address, **init_kwargs)``; through Ray Client, tried again when the cluster's
    client server answered but failed to start this driver (:data:`CLIENT_TRANSIENT`; a
    cluster that does not answer fails at once)."""
    log = logging.getLogger("adaptrain.ray")
    for attempt in range(1, CLIENT_TRIES + 1):
        try:
            ray.init(address=address, **init_kwargs)
            return
        except (ConnectionError, RuntimeError) as exc:
            transient = any(text in str(exc) for text in CLIENT_TRANSIENT)
            if not (address or "").startswith("ray://") or not transient or attempt == CLIENT_TRIES:
                raise
            log.warning(
                "the Ray Client server at %s failed to start this driver's server "
                "(try %d of %d): trying again in %g s",
                address, attempt, CLIENT_TRIES, CLIENT_RETRY_DELAY,
            )  # fmt: skip
            time.sleep(CLIENT_RETRY_DELAY)
