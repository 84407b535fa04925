"""``adaptrain demo``: the main job — a character LM on local replicas with autoscaled batch size.
(``adaptrain demo --cluster``: the scheduler service with three jobs, :mod:`._cluster_demo`.)

Launches ``torchrun`` (``python -m torch.distributed.run``) with ``--replicas`` gloo workers running
:mod:`adaptrain.cli._demo_worker`. torchrun runs in its own session, so Ctrl-C in the terminal
reaches this launcher only; the launcher forwards one SIGTERM to torchrun, which forwards it to
every worker: they agree on a step, write one checkpoint under ``--out`` and exit. A launcher killed
outright (SIGKILL) forwards nothing: torchrun then gets that SIGTERM from the kernel as the launcher
dies, and each worker gets one if torchrun dies (:func:`_agent`). Running the same
command again resumes from that checkpoint (a job interrupted in its final validation runs that
validation again, where it stopped, and trains no further). A finished job in ``--out`` is only
reported again, under the budget it ran with.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from adaptrain.dist.spawn import free_port
from adaptrain.procs import die_with_parent

NAME = "demo"
HELP = "train the character LM of the stdlib's text on local replicas with autoscaled batch size"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--minutes",
        type=float,
        default=3.0,
        help="training time budget, summed over restarts (default 3). A rerun of an unfinished "
        "job in --out trains to the budget it gives (it may extend or shorten the job; one "
        "already past it only runs its final validation); a finished job keeps its budget and "
        "is only reported: give another --out, or --fresh, to train anew",
    )
    parser.add_argument("--replicas", type=int, default=2, help="local replicas (default 2)")
    parser.add_argument(
        "--out", help="output folder (default out/demo; out/demo-cluster with --cluster)"
    )
    parser.add_argument(
        "--cluster",
        action="store_true",
        help="instead: an embedded scheduler server with emulated nodes, its web dashboard, "
        "and three small jobs submitted a few seconds apart, re-divided by the policy over "
        "--minutes; a summary and a PNG of the allocations at the end",
    )
    parser.add_argument(
        "--nodes", type=int, default=2, help="with --cluster: emulated nodes (default 2)"
    )
    parser.add_argument(
        "--slots-per-node", type=int, default=2, help="with --cluster: slots per node (default 2)"
    )
    parser.add_argument(
        "--port", type=int, default=0, help="with --cluster: the dashboard's port (0: any free)"
    )
    parser.add_argument(
        "--max-batch-size", type=int, default=512, help="largest global batch autoscaling may pick"
    )
    parser.add_argument("--batch-size", type=int, default=32, help="initial global batch size")
    parser.add_argument("--fresh", action="store_true", help="delete a previous checkpoint first")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG plot at the end")
    parser.add_argument(
        "--no-bar", action="store_true", help="plain log lines instead of the tqdm progress bar"
    )
    parser.add_argument(
        "--max-chars", type=int, default=2_000_000, help="corpus size in characters (default 2M)"
    )


def _worker_command(args: argparse.Namespace) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "adaptrain.cli.demo",  # torchrun, quiet on the forwarded SIGTERM (see _torchrun)
        f"{LAUNCHER_FLAG}={os.getpid()}",  # it ends with this launcher (see _agent)
        f"--nproc-per-node={args.replicas}",
        "--nnodes=1",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        "-m",
        "adaptrain.cli._demo_worker",
        f"--minutes={args.minutes}",
        f"--out={args.out}",
        f"--batch-size={args.batch_size}",
        f"--max-batch-size={args.max_batch_size}",
    ]
    if args.no_plot:
        cmd.append("--no-plot")
    if args.no_bar or not sys.stderr.isatty():  # a log file gets lines, not a bar's \r updates
        cmd.append("--no-bar")
    cmd.append(f"--max-chars={args.max_chars}")
    return cmd


def _torchrun(argv: list[str]) -> int:
    """``torchrun argv`` that exits quietly with 143 when the launcher forwards SIGTERM.

    Plain torchrun answers SIGTERM by stopping its workers (each checkpoints and exits 143) and
    then dies with a SignalException traceback and warnings: correct, but alarming in a demo.
    """
    import logging

    from torch.distributed import run as torch_run
    from torch.distributed.elastic.multiprocessing.api import SignalException

    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.ERROR)
    try:
        torch_run.main(argv)
    except SignalException as exc:
        return 128 + int(exc.sigval)
    return 0


#: The first argument of the launcher's child (:func:`_agent`): the launcher's process id.
LAUNCHER_FLAG = "--launcher-pid"


def _agent(argv: list[str]) -> int:
    """The launcher's child: :func:`_torchrun` of ``argv`` less its first argument,
    ``--launcher-pid=PID``, in a process that ends with the launcher, with replicas that end
    with it.

    torchrun runs in a session of its own, out of reach of the launcher's terminal; so that a
    launcher killed with SIGKILL leaves nothing running, torchrun gets a SIGTERM when the
    launcher dies (it then stops its replicas, which checkpoint, as after a forwarded SIGTERM),
    and every replica gets one when torchrun dies: its argument ``--agent-pid`` names torchrun's
    process (:func:`adaptrain.procs.die_with_parent`).
    """
    if argv and argv[0].startswith(LAUNCHER_FLAG + "="):
        die_with_parent(int(argv[0].split("=", 1)[1]))
        argv = argv[1:]
    return _torchrun([*argv, f"--agent-pid={os.getpid()}"])


def _descendants(pid: int) -> list[int]:
    """Process ids below ``pid`` (Linux ``/proc``; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _kill_tree(pid: int) -> None:
    """SIGKILL torchrun and its workers (torchrun starts each worker in a session of its own)."""
    for p in [pid, *_descendants(pid)]:
        for kill in (lambda q: os.killpg(q, signal.SIGKILL), lambda q: os.kill(q, signal.SIGKILL)):
            try:
                kill(p)
            except (ProcessLookupError, PermissionError):
                pass


#: Smallest local batch autoscaling may pick (the worker's ``local_bsz_bounds`` minimum).
MIN_LOCAL_BSZ = 8
#: The worker's window length; the 5% validation split must hold one window plus a character.
SEQ_LEN = 64
MIN_CHARS = math.ceil((SEQ_LEN + 1) / 0.05)


def _check_arguments(args: argparse.Namespace) -> str | None:
    """The first bad argument and its fix, or None (checked before torchrun starts: a bad value
    would otherwise end in a traceback from every replica)."""
    if args.replicas < 1:
        return f"--replicas={args.replicas}: give at least 1"
    if not (math.isfinite(args.minutes) and args.minutes > 0):
        return f"--minutes={args.minutes}: give a positive, finite time budget (e.g. --minutes 3)"
    if args.batch_size < 1:
        return f"--batch-size={args.batch_size}: give a positive initial global batch size"
    if args.max_batch_size < max(args.batch_size, MIN_LOCAL_BSZ):
        return (
            f"--max-batch-size={args.max_batch_size}: give at least the initial "
            f"--batch-size={args.batch_size} and at least {MIN_LOCAL_BSZ} (the smallest local "
            "batch autoscaling uses)"
        )
    if args.max_chars < MIN_CHARS:
        return (
            f"--max-chars={args.max_chars}: give at least {MIN_CHARS} (the 5% validation split "
            f"needs one {SEQ_LEN}-character window)"
        )
    return None


def _lock(out: Path) -> int | None:
    """An exclusive lock on ``out/.lock`` held by this launcher and its torchrun (the file
    descriptor is passed on), so that a second demo started on the same ``--out`` stops with a
    message instead of sharing the checkpoint folder. None where ``fcntl`` is missing;
    ``BlockingIOError`` if another demo holds the lock."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        return None
    fd = os.open(out / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise
    except OSError:  # a file system without locks: go on unguarded
        os.close(fd)
        return None
    return fd


def run(args: argparse.Namespace) -> int:
    cluster = getattr(args, "cluster", False)
    if args.out is None:
        args.out = "out/demo-cluster" if cluster else "out/demo"
    if cluster:
        from ._cluster_demo import check_arguments

        problem = check_arguments(args)
    else:
        problem = _check_arguments(args)
    if problem is not None:
        print(f"adaptrain demo: {problem}", file=sys.stderr)
        return 2
    out = Path(args.out)
    ckpt = out / "checkpoint"
    try:
        out.mkdir(parents=True, exist_ok=True)
        lock_fd = _lock(out)
    except BlockingIOError:
        print(
            f"adaptrain demo: another adaptrain demo is running with --out {out}; wait for it "
            "to end or give another --out",
            file=sys.stderr,
        )
        return 2
    except OSError as exc:
        print(
            f"adaptrain demo: --out {out}: cannot use it as the output folder ({exc})",
            file=sys.stderr,
        )
        return 2
    try:
        if cluster:
            from ._cluster_demo import run as run_cluster

            return run_cluster(args, out)
        return _run_locked(args, out, ckpt, lock_fd)
    finally:
        if lock_fd is not None:
            os.close(lock_fd)


def _run_locked(args: argparse.Namespace, out: Path, ckpt: Path, lock_fd: int | None) -> int:
    if args.fresh and ckpt.exists():
        import shutil

        shutil.rmtree(ckpt)
    ckpt.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env["ADAPTRAIN_CHECKPOINT_PATH"] = str(ckpt)
    env["ADAPTRAIN_TENSORBOARD_LOGDIR"] = str(out / "tensorboard")
    env.setdefault("OMP_NUM_THREADS", "1")
    from adaptrain.dist.checkpoint import latest_checkpoint

    before = latest_checkpoint(str(ckpt))
    started = time.time()
    received: list[int] = []  # the signals that stopped the wait, first one first

    def _stop(signum: int, frame: object) -> None:
        received.append(signum)
        raise KeyboardInterrupt

    # torchrun runs in a session of its own, so a SIGTERM or SIGHUP to the launcher (kill,
    # timeout, a CI runner, a closed terminal) would leave it training unseen: handle them as
    # a Ctrl-C is handled.
    previous = {
        sig: signal.signal(sig, _stop)
        for sig in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None))
        if sig is not None
    }
    proc = subprocess.Popen(
        _worker_command(args),
        env=env,
        start_new_session=True,
        pass_fds=() if lock_fd is None else (lock_fd,),
    )
    interrupted = False
    try:
        while True:
            try:
                code = proc.wait()
                break
            except KeyboardInterrupt:
                if interrupted:  # a second signal: stop waiting for the checkpoint
                    _kill_tree(proc.pid)
                    continue
                interrupted = True
                print(
                    "\nadaptrain demo: interrupted, checkpointing... (Ctrl-C again to kill)",
                    file=sys.stderr,
                )
                proc.send_signal(signal.SIGTERM)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    summary = out / "summary.json"
    if interrupted and summary.exists() and summary.stat().st_mtime >= started:
        # The job had finished (final validation, summary) when the signal came.
        print(f"adaptrain demo: the job had finished; outputs in {out}", file=sys.stderr)
        return 0
    if interrupted:
        after = latest_checkpoint(str(ckpt))
        if after is not None and after != before:
            msg = f"checkpoint in {after}; run the same command again to resume"
        elif before is not None:  # stopped before the workers could save: the last one stands
            msg = f"no new checkpoint was written; a rerun resumes from {before}"
        else:
            msg = "stopped before the first checkpoint; a rerun starts afresh"
        print(f"adaptrain demo: {msg}", file=sys.stderr)
        return 128 + (received[0] if received else signal.SIGINT)
    return code if code >= 0 else 128 - code  # torchrun killed by a signal: as a shell says


if __name__ == "__main__":  # the launcher's child: torchrun in its own session
    sys.exit(_agent(sys.argv[1:]))
