"""Goodput refits computed ahead in a worker process: the same simulation, bit for bit."""

from __future__ import annotations

import logging
import os

import pytest

from adaptrain.sched import Search, WaterfillPolicy
from adaptrain.sim import SimJob, Simulator, WorkloadJob, load_applications, load_workload
from adaptrain.sim.fitworkers import FitPrefetcher
from adaptrain.sim.job import GoodputMemos


def _job_state(job: SimJob) -> dict:
    state = job.state_dict()
    state["perf_params"] = None if job.perf_params is None else tuple(job.perf_params)
    return state


def test_fits_computed_ahead_change_nothing(real_data):
    # Workload-6's first 12 jobs on 16 GPUs for 2 hours (the policy's local search alone, to
    # bound the test's time), with every memo empty before each run, so that the workers' fits
    # are the ones the jobs use.
    apps = load_applications(os.path.join(real_data, "traces"))
    work = load_workload(os.path.join(real_data, "workloads", "workload-6.csv"))[:12]

    def run(workers: int) -> tuple[Simulator, object]:
        policy = WaterfillPolicy(search=Search(method="local"))
        memos = GoodputMemos()  # empty: the workers' fits are the ones the jobs use
        sim = Simulator(work, apps, policy, num_nodes=4, fit_workers=workers, memos=memos)
        return sim, sim.run(max_time=2 * 3600)

    ref_sim, ref = run(0)
    sim, res = run(1)
    assert ref_sim.prefetch_stats == {}
    stats = sim.prefetch_stats
    # the workers did fits the jobs then found in the memo, and the caller took some tasks
    assert stats["fits_taken"] > 10, stats
    assert stats["tasks_taken"] > 0 and stats["tasks_submitted"] > stats["tasks_taken"], stats
    assert res.jcts == ref.jcts and len(ref.jcts) >= 5
    assert res.restarts == ref.restarts
    assert res.timeline == ref.timeline
    for a, b in zip(sim.jobs, ref_sim.jobs):
        assert _job_state(a) == _job_state(b), a.name


def test_a_failing_worker_stops_prefetching_and_every_job_still_steps(tiny_traces, caplog):
    apps = load_applications(tiny_traces)
    jobs = [SimJob(name, apps["toy"], 0.0, adaptive=True) for name in "abc"]
    for job in jobs:
        job.reallocate([1])
    # the worker knows no application: its task fails
    with FitPrefetcher({}, GoodputMemos(), workers=1) as prefetch, caplog.at_level(logging.WARNING):
        prefetch.submit(jobs[:2], 60.0, lambda j: 0.0)
        prefetch._receive(block=True)  # a worker ran a task (else the caller claims both)
        order = [j.name for j in prefetch.order(jobs)]
        assert not prefetch.active
    assert sorted(order) == ["a", "b", "c"] and order[0] == "c"  # no task: first
    assert "prefetching stopped" in caplog.text and "KeyError" in caplog.text


def test_discarded_and_claimed_tasks_are_not_taken(tiny_traces):
    apps = load_applications(tiny_traces)
    memos = GoodputMemos()
    jobs = [SimJob(name, apps["toy"], 0.0, adaptive=True, memos=memos) for name in "abcd"]
    for job in jobs:
        job.reallocate([1])
    with FitPrefetcher(apps, memos, workers=1) as prefetch:
        prefetch.submit(jobs, 60.0, lambda j: 0.0)
        prefetch.discard(["b"])
        stepped = []
        for job in prefetch.order(jobs):
            job.step(60.0)
            stepped.append(job.name)
        stats = prefetch.stats()
    assert sorted(stepped) == ["a", "b", "c", "d"]
    assert stats["tasks_submitted"] == 4
    # the tasks of a, c and d were each taken from the worker or claimed by the caller; b's
    # was dropped, so neither
    assert stats["tasks_taken"] + stats["tasks_claimed"] == 3, stats


@pytest.mark.parametrize("workers", [-1, 1.5, True])
def test_bad_fit_workers_are_rejected(tiny_traces, workers):
    apps = load_applications(tiny_traces)
    with pytest.raises(ValueError, match="fit_workers"):
        Simulator([], apps, WaterfillPolicy(), fit_workers=workers)


def test_workers_that_cannot_start_leave_a_serial_run(tiny_traces, monkeypatch, caplog):
    # e.g. inside a daemonic process, which may not have children: a warning, the same run
    import adaptrain.sim.simulator as prefetch_mod

    class Refused:
        def __init__(self, *args, **kwargs):
            raise AssertionError("daemonic processes are not allowed to have children")

    apps = load_applications(tiny_traces)
    work = [WorkloadJob(name, 60.0 * i, "toy", 1, 8) for i, name in enumerate("ab")]

    def run(workers):
        policy = WaterfillPolicy(search=Search(method="local"))
        return Simulator(work, apps, policy, num_nodes=1, fit_workers=workers).run()

    ref = run(0)
    monkeypatch.setattr(prefetch_mod, "FitPrefetcher", Refused)
    with caplog.at_level(logging.WARNING):
        res = run(1)
    assert "could not start 1 fit worker" in caplog.text and "daemonic" in caplog.text
    assert res.jcts == ref.jcts and len(res.jcts) == 2


# A Ctrl-C while the workers start or stop. A KeyboardInterrupt in the middle of starting a
# spawned worker would cut the pickled arguments it reads, and the worker would die with a
# traceback ("pickle data was truncated", or "No such file or directory" for a semaphore its
# parent had already unlinked) after the parent's own message. Real SIGINTs, raised at the exact
# point by wrapping the function that spawns the worker (after the child exists, before its
# arguments are written).
_START_SCRIPT = """
import multiprocessing, signal, sys
from multiprocessing import util
from adaptrain.sim import GoodputMemos, load_applications
from adaptrain.sim.fitworkers import FitPrefetcher

spawn = util.spawnv_passfds

def spawn_then_interrupt(path, args, passfds):
    pid = spawn(path, args, passfds)
    if "--multiprocessing-fork" in args:  # a worker (not the resource tracker)
        signal.raise_signal(signal.SIGINT)
    return pid

if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with SIGINT ignored
    apps = load_applications(sys.argv[1])
    util.spawnv_passfds = spawn_then_interrupt
    try:
        FitPrefetcher(apps, GoodputMemos(), 1)
        print("not interrupted")
    except KeyboardInterrupt:
        print("interrupted;", len(multiprocessing.active_children()), "children")
"""


@pytest.mark.timeout(120)
def test_a_ctrl_c_while_the_workers_start_stops_them_then_interrupts(tiny_traces, tmp_path):
    import subprocess
    import sys

    script = tmp_path / "start.py"
    script.write_text(_START_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), tiny_traces],
        capture_output=True,  # to the end: also what the worker and the tracker write
        text=True,
        timeout=100,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "interrupted; 0 children"
    assert proc.stderr == ""  # no worker's traceback, no tracker's warning


@pytest.mark.timeout(60)
def test_a_ctrl_c_while_the_workers_stop_still_stops_them(tiny_traces, monkeypatch, sigint_raises):
    import multiprocessing
    import signal

    prefetcher = FitPrefetcher(load_applications(tiny_traces), GoodputMemos(), 1)
    procs = list(prefetcher._procs)
    join = multiprocessing.process.BaseProcess.join
    raised = []

    def join_then_interrupt(self, timeout=None):
        if not raised:  # the first wait for a worker to end
            raised.append(True)
            signal.raise_signal(signal.SIGINT)
        return join(self, timeout)

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "join", join_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        prefetcher.close()
    assert raised and not prefetcher.active
    assert all(p.exitcode is not None for p in procs)  # stopped and reaped, not left running
    assert prefetcher._tasks._closed and prefetcher._results._closed


@pytest.mark.timeout(60)
def test_close_ends_the_workers_even_with_the_claims_lock_left_held(tiny_traces):
    # A KeyboardInterrupt that lands just as the caller takes the lock (inside `with`, before
    # its block) leaves it held: close() waited for it for ever (a hang after a Ctrl-C).
    prefetcher = FitPrefetcher(load_applications(tiny_traces), GoodputMemos(), 1)
    procs = list(prefetcher._procs)
    assert prefetcher._lock.acquire(timeout=5)  # held, and never released
    prefetcher.close()
    assert not prefetcher.active
    assert all(p.exitcode is not None for p in procs)


def test_sigint_held_delivers_one_at_the_end_and_a_second_at_once(sigint_raises):
    import signal

    from adaptrain.sim.fitworkers import _sigint_held

    before = signal.getsignal(signal.SIGINT)
    steps = []
    with pytest.raises(KeyboardInterrupt):
        with _sigint_held() as held:
            signal.raise_signal(signal.SIGINT)
            steps.append(list(held))  # recorded, not raised
    assert steps == [[signal.SIGINT]]
    assert signal.getsignal(signal.SIGINT) is before
    with pytest.raises(KeyboardInterrupt):
        with _sigint_held():
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)  # insists: raised here
            steps.append("not reached")
    assert steps == [[signal.SIGINT]]
    assert signal.getsignal(signal.SIGINT) is before
    with _sigint_held() as held:  # none: nothing raised
        pass
    assert held == []


# The task queue's feeder thread must never be what frees the queue. Whoever drops a
# multiprocessing semaphore last unlinks it, then tells the resource tracker; a daemon thread
# doing so as the interpreter exits is stopped between the two, and the tracker then warns of a
# "leaked" semaphore it cannot find (seen after a SIGTERM of `adaptrain simulate`). Recorded
# here: the thread that runs each semaphore's clean-up, after a close that does not wait (an
# interrupt) and one that does.
_FREE_SCRIPT = """
import gc, sys, threading, time
from multiprocessing import synchronize
from adaptrain.sim import SimJob, load_applications
from adaptrain.sim.fitworkers import FitPrefetcher
from adaptrain.sim.job import GoodputMemos

cleanup = synchronize.SemLock._cleanup
threads = []

def recorded(name):
    threads.append(threading.current_thread().name)
    cleanup(name)

synchronize.SemLock._cleanup = staticmethod(recorded)

if __name__ == "__main__":
    apps = load_applications(sys.argv[1])
    for wait in (False, True):
        memos = GoodputMemos()
        jobs = [SimJob(str(i), apps["toy"], 0.0, adaptive=True, memos=memos) for i in range(50)]
        for job in jobs:
            job.reallocate([1])
        prefetch = FitPrefetcher(apps, memos, workers=1)
        prefetch.submit(jobs, 600.0, lambda j: 0.0)  # more than the worker takes at once
        prefetch.close(wait=wait)
        del prefetch
        gc.collect()
    time.sleep(1.0)  # a feeder thread left running has long finished
    print(sorted(set(threads)))
"""


@pytest.mark.timeout(120)
def test_the_task_queue_is_never_freed_by_its_feeder_thread(tiny_traces, tmp_path):
    import subprocess
    import sys

    script = tmp_path / "free.py"
    script.write_text(_FREE_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), tiny_traces], capture_output=True, text=True, timeout=100
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "['MainThread']", proc.stdout
    assert proc.stderr == ""  # in particular no "leaked" semaphore from the tracker
