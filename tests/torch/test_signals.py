"""SIGINT/SIGTERM: all replicas agree on the stop step, checkpoint once, exit 143/130."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from adaptrain.dist import signals
from adaptrain.dist.spawn import spawn

SCRIPT = str(Path(__file__).with_name("_elastic_train.py"))


def _agree(rank: int, world_size: int, signal_rank: int, signal_step: int) -> int:
    signals.reset()
    assert signals.install()
    period = signals.POLL_PERIOD
    signals.POLL_PERIOD = 0.0  # every step polls, as with steps slower than the period
    try:
        for step in range(50):
            if rank == signal_rank and step == signal_step:
                os.kill(os.getpid(), signal.SIGTERM)
            agreed = signals.poll_stop()
            if agreed:
                return step * 1000 + agreed
        return -1
    finally:
        signals.POLL_PERIOD = period
        signals.reset()


def test_all_replicas_stop_at_the_same_step() -> None:
    # Rank 2 alone gets SIGTERM at step 4 just before its poll; the flag travels in the
    # allreduce started by that poll and everybody reads it at the poll of step 5.
    assert spawn(_agree, 3, args=(2, 4), timeout=120) == [5000 + signal.SIGTERM] * 3


def _agree_fast(rank: int, world_size: int, signal_rank: int, signal_step: int) -> tuple:
    """2 ms steps: far faster than the poll period, so most steps skip the allreduce."""
    import time

    signals.reset()
    assert signals.install()
    reduces = 0
    all_reduce = signals.dist.all_reduce

    def counting(*args, **kwargs):
        nonlocal reduces
        reduces += 1
        return all_reduce(*args, **kwargs)

    signals.dist.all_reduce = counting
    try:
        for step in range(600):
            time.sleep(0.002 * (1 + rank))  # replicas of different speeds still agree
            if rank == signal_rank and step == signal_step:
                os.kill(os.getpid(), signal.SIGTERM)
            agreed = signals.poll_stop()
            if agreed:
                return step, agreed, reduces
        return -1, 0, reduces
    finally:
        signals.dist.all_reduce = all_reduce
        signals.reset()


def test_fast_steps_poll_every_few_steps_and_all_stop_at_the_same_step() -> None:
    out = spawn(_agree_fast, 2, args=(1, 100), timeout=120)
    steps = {step for step, _, _ in out}
    assert len(steps) == 1, out  # the same step on every replica
    (stop,) = steps
    assert all(agreed == signal.SIGTERM for _, agreed, _ in out)
    # Within two poll intervals (each at most MAX_POLL_STEPS steps) after the signal...
    assert 100 < stop <= 100 + 2 * signals.MAX_POLL_STEPS + 1, stop
    # ...and the allreduce ran on a fraction of the steps (every step before this change).
    assert all(reduces < stop / 3 for _, _, reduces in out), out


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ADAPTRAIN_", "RANK"))}
    env.pop("WORLD_SIZE", None)
    env.pop("MASTER_PORT", None)
    env["ADAPTRAIN_CHECKPOINT_PATH"] = str(tmp_path)
    return env


def test_sigint_checkpoints_once_and_exits_130(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    p = subprocess.run(
        [
            sys.executable,
            SCRIPT,
            "--out",
            str(out),
            "--tag",
            "s",
            "--stop-after",
            "3",
            "--signal",
            "SIGINT",
            "--epochs",
            "1",
        ],
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 130, p.stdout + p.stderr
    assert sorted(x.name for x in tmp_path.iterdir()) == ["checkpoint-000000", "out"]
    # Stopped two micro-batches later: 4 recorded steps.
    assert len((out / "s-rank0.jsonl").read_text().splitlines()) == 4


def test_second_signal_forces_exit(tmp_path: Path) -> None:
    code = textwrap.dedent(
        """
        import os, signal, time
        from adaptrain.dist import signals
        signals.install()
        os.kill(os.getpid(), signal.SIGTERM)   # graceful request: recorded only
        assert signals.exit_flag() == signal.SIGTERM
        print("still alive", flush=True)
        os.kill(os.getpid(), signal.SIGTERM)   # second one: default action
        time.sleep(30)
        print("not reached", flush=True)
        """
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "still alive" in p.stdout and "not reached" not in p.stdout
    assert p.returncode == -signal.SIGTERM


@pytest.mark.parametrize("case", ["sigint_ignored", "sigterm_replaced_then_reinstall"])
def test_second_sigint_forces_exit_whatever_was_installed_before(case: str) -> None:
    # An inherited SIG_IGN (a job started with `cmd &`), or another library's SIGTERM handler
    # followed by install() again (every loop over a loader calls it): the second Ctrl-C must
    # still end the process by SIGINT, not be ignored or recurse into our own handler.
    code = textwrap.dedent(
        f"""
        import os, signal, time
        from adaptrain.dist import signals
        case = {case!r}
        if case == "sigint_ignored":
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        signals.install()
        if case == "sigterm_replaced_then_reinstall":
            library = lambda s, f: None
            signal.signal(signal.SIGTERM, library)
            signals.install()
            assert signal.getsignal(signal.SIGTERM) is signals._handler
            assert signals._previous[signal.SIGTERM] is library
            assert signals._previous[signal.SIGINT] is not signals._handler
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)
        assert signals.exit_flag() == signal.SIGINT
        print("still alive", flush=True)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(30)
        print("not reached", flush=True)
        """
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "still alive" in p.stdout and "not reached" not in p.stdout, p.stderr[-2000:]
    # SIG_DFL kills by SIGINT; Python's default handler raises KeyboardInterrupt (exit 1)
    assert p.returncode == -signal.SIGINT or (
        p.returncode == 1 and "KeyboardInterrupt" in p.stderr
    ), p.stderr[-2000:]
    assert "RecursionError" not in p.stderr


_WORKERS_SCRIPT = textwrap.dedent(
    """
    import sys, time
    import torch
    from torch.utils.data import TensorDataset
    import adaptrain.torch as adl

    class Slow(TensorDataset):
        def __getitem__(self, i):
            time.sleep(0.005)
            return super().__getitem__(i)

    if __name__ == "__main__":
        adl.init_process_group("gloo")
        ds = Slow(torch.randn(4000, 4), torch.randn(4000, 1))
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        model = adl.AdaptiveDataParallel(model, opt)
        loader = adl.AdaptiveDataLoader(
            ds, batch_size=8, num_workers=2, multiprocessing_context=sys.argv[1]
        )
        for epoch in adl.remaining_epochs_until(1):
            for step, (x, y) in enumerate(loader):
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                if step == 3:
                    print("training", flush=True)
        print("finished", flush=True)
    """
)


_SHIELDABLE = hasattr(signal, "sigwaitinfo") and os.path.isdir("/proc/self/task")


def _run_and_signal_group(tmp_path: Path, context: str, signum: int) -> tuple[int, str]:
    """Run the workers script in a session of its own; send ``signum`` to its whole process
    group at step 3. Returns the exit code and the output; fails if a process of the group
    outlives the job's main process by more than a few seconds."""
    script = tmp_path / "job.py"
    script.write_text(_WORKERS_SCRIPT)
    p = subprocess.Popen(
        [sys.executable, str(script), context],
        env=_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    out = []
    try:
        for line in p.stdout:
            out.append(line)
            if "training" in line:
                os.killpg(p.pid, signum)
                break
        out.append(p.stdout.read())
        p.wait(timeout=90)
        for _ in range(50):  # the workers leave with the main process
            try:
                os.killpg(p.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            pytest.fail("loader workers outlived the job by 5 s")
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return p.returncode, "".join(out)


@pytest.mark.skipif(not _SHIELDABLE, reason="needs sigwaitinfo and /proc (Linux)")
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_sigterm_to_the_process_group_with_loader_workers(tmp_path: Path, context: str) -> None:
    # Slurm's scancel (and its preemption) sends SIGTERM to every process of the job step,
    # DataLoader workers included. Before, torch's worker handler let it kill them and the
    # main process died on the lost workers before the replicas agreed to stop: exit 1, no
    # checkpoint. Shielded workers serve on until the main process has checkpointed. (Spawned
    # ones were not shielded at first: starting multiprocessing's resource tracker, on the
    # first spawn, lifted the block they were to inherit.)
    code, text = _run_and_signal_group(tmp_path, context, signal.SIGTERM)
    assert code == 143, text[-3000:]
    assert "finished" not in text and "killed by signal" not in text, text[-3000:]
    assert (tmp_path / "checkpoint-000000").is_dir()


def _shielded_child(queue) -> None:
    queue.put(signals.shield_loader_worker())
    time.sleep(60)


@pytest.mark.skipif(not _SHIELDABLE, reason="needs sigwaitinfo and /proc (Linux)")
def test_a_shielded_worker_ends_on_its_parents_sigterm_only() -> None:
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    with signals.loader_workers_starting():
        child = ctx.Process(target=_shielded_child, args=(queue,), daemon=True)
        child.start()
    try:
        assert queue.get(timeout=30) is True
        # From another process (as a group signal from Slurm or a shell): ignored.
        subprocess.run(["kill", "-TERM", str(child.pid)], check=True)
        child.join(1.0)
        assert child.is_alive()
        # From the parent (the loader's shutdown, multiprocessing's at exit): ends it.
        child.terminate()
        child.join(10)
        assert child.exitcode == 0
    finally:
        if child.is_alive():
            child.kill()


def test_the_shield_is_refused_off_the_main_thread() -> None:
    import threading

    result = []
    t = threading.Thread(target=lambda: result.append(signals.shield_loader_worker()))
    t.start()
    t.join()
    assert result == [False]
    assert signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, [])


def test_ctrl_c_to_the_process_group_with_spawned_loader_workers(tmp_path: Path) -> None:
    # Ctrl-C reaches every process of the terminal's foreground group, DataLoader workers
    # included. Spawned workers (macOS's default; forkserver from Python 3.14) must not die of
    # it before the main process has agreed on a stop and checkpointed.
    code, text = _run_and_signal_group(tmp_path, "spawn", signal.SIGINT)
    assert code == 130, text[-3000:]
    assert "finished" not in text
    assert (tmp_path / "checkpoint-000000").is_dir()


_FORKSERVER_SCRIPT = textwrap.dedent(
    """
    import logging, multiprocessing, signal, sys, time
    from multiprocessing import forkserver
    from adaptrain.dist import signals

    logging.basicConfig(level=logging.WARNING)

    def blocked(pid):
        with open(f"/proc/{pid}/status") as f:
            mask = next(int(x.split()[1], 16) for x in f if x.startswith("SigBlk:"))
        return bool(mask & (1 << (signal.SIGTERM - 1)))

    if __name__ == "__main__":
        ctx = multiprocessing.get_context(sys.argv[1])
        with signals.loader_workers_starting(sys.argv[1]):
            p = ctx.Process(target=time.sleep, args=(60,), daemon=True)
            p.start()
        child = blocked(p.pid)
        p.kill()
        p.join(30)
        server = forkserver._forkserver._forkserver_pid
        print(child, None if server is None else blocked(server))
    """
)


@pytest.mark.skipif(not _SHIELDABLE, reason="needs sigwaitinfo and /proc (Linux)")
@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_workers_inherit_the_block_but_a_fork_server_does_not(tmp_path: Path, context: str) -> None:
    # A spawned child inherits the block through exec (multiprocessing's resource tracker,
    # started on first use, lifts it in the calling thread: it must be running before). A fork
    # server started inside the block would hand it to every process it forks later, the
    # user's own included (whose terminate() would then hang): it is started before it.
    script = tmp_path / "fs.py"
    script.write_text(_FORKSERVER_SCRIPT)
    out = subprocess.run(
        [sys.executable, str(script), context],
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    expected = {"spawn": "True None", "forkserver": "False False"}[context]
    assert out.stdout.split("\n")[0] == expected
    # Forkserver workers cannot be shielded: the user is told, and how to keep them.
    assert ("multiprocessing_context='spawn'" in out.stderr) == (context == "forkserver")
