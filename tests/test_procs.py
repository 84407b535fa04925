"""adaptrain.procs: children that end with their parent, and SIGTERM handled as a Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

import adaptrain.procs as procs

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")

# A parent that starts CHILD (with its own pid as the argument), prints the child's pid, and
# sleeps until it is killed.
PARENT = """
import subprocess, sys, time, os
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], str(os.getpid())])
print(child.pid, flush=True)
time.sleep(120)
"""

CHILD = """
import os, signal, sys, time
import adaptrain.procs as procs
{setup}
procs.die_with_parent(int(sys.argv[1]){kwargs})
time.sleep(120)
"""


def _gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True  # dead, not yet reaped
        except FileNotFoundError:
            return True
        except OSError:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
        time.sleep(0.05)
    return False


def _orphan_after_parent_killed(setup: str = "", kwargs: str = "", wait: float = 5.0) -> bool:
    """Start parent and child, SIGKILL the parent once the child has asked to die with it: True
    if the child is gone within ``wait`` seconds."""
    child_code = CHILD.format(setup=setup, kwargs=kwargs)
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, child_code], stdout=subprocess.PIPE, text=True
    )
    child_pid = None
    try:
        child_pid = int(parent.stdout.readline())
        time.sleep(1.5)  # the child has imported and made its request
        parent.kill()
        parent.wait(timeout=10)
        return _gone(child_pid, wait)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(timeout=10)
        if child_pid is not None:
            try:
                os.kill(child_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
@pytest.mark.timeout(60)
def test_child_ends_when_its_parent_is_killed():
    assert _orphan_after_parent_killed()


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
@pytest.mark.timeout(60)
def test_watch_thread_where_prctl_is_missing():
    assert _orphan_after_parent_killed(setup="procs._prctl_pdeathsig = lambda sig: False")


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
@pytest.mark.timeout(60)
def test_kill_after_ends_a_child_that_ignores_the_signal():
    setup = "signal.signal(signal.SIGTERM, signal.SIG_IGN)"
    assert not _orphan_after_parent_killed(setup=setup, wait=2.0)  # SIGTERM ignored
    assert _orphan_after_parent_killed(setup=setup, kwargs=", kill_after=0.5")


@pytest.mark.timeout(60)
def test_a_parent_already_gone_signals_at_once():
    # the expected parent is not this process's parent: it died before the request
    code = "import adaptrain.procs as p, time; p.die_with_parent(-1); time.sleep(30)"
    res = subprocess.run([sys.executable, "-c", code], timeout=30)
    assert res.returncode == -signal.SIGTERM


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")
def test_prctl_is_used_on_linux():
    assert procs._prctl_pdeathsig(0)  # 0: clears the request of this (test) process


SIGTERM_IN_BLOCK = """
import os, signal, sys, time
from adaptrain.procs import sigterm_as_interrupt
signal.signal(signal.SIGINT, getattr(signal, sys.argv[1]))
try:
    with sigterm_as_interrupt() as got:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(20)
except KeyboardInterrupt:
    print("interrupted", got, signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, flush=True)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sigint", ["default_int_handler", "SIG_IGN", "SIG_DFL"])
def test_sigterm_as_interrupt(sigint):
    """A SIGTERM in the block raises KeyboardInterrupt (also where SIGINT is ignored, as in a
    background job), is recorded, and the SIGTERM handler is put back after the block."""
    res = subprocess.run(
        [sys.executable, "-c", SIGTERM_IN_BLOCK, sigint],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["interrupted", f"[{int(signal.SIGTERM)}]", "True"]


SIGTERM_WHILE_HELD = """
import os, signal, sys
from adaptrain.procs import sigterm_as_interrupt
from adaptrain.sim.fitworkers import _sigint_held
signal.signal(signal.SIGINT, getattr(signal, sys.argv[1]))
steps = []
try:
    with sigterm_as_interrupt() as got:
        with _sigint_held() as held:
            os.kill(os.getpid(), signal.SIGTERM)
            steps.append(list(held))  # held, not raised, while workers start or stop
except KeyboardInterrupt:
    print("interrupted", steps, got, flush=True)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sigint", ["default_int_handler", "SIG_IGN"])
def test_sigterm_is_held_while_fit_workers_start_then_interrupts(sigint):
    """The fit workers' guard holds a SIGTERM as it holds a Ctrl-C, and delivers it at its end,
    also where SIGINT is ignored."""
    res = subprocess.run(
        [sys.executable, "-c", SIGTERM_WHILE_HELD, sigint],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert res.returncode == 0, res.stderr
    term = int(signal.SIGTERM)
    assert res.stdout.strip() == f"interrupted [[{term}]] [{term}, {term}]"


DROPPED_IN_DEL = """
import signal, sys
from adaptrain.procs import raise_if_interrupted, recorded_interrupts, sigterm_as_interrupt

class Interrupting:
    def __del__(self):
        signal.raise_signal(getattr(signal, sys.argv[1]))

with sigterm_as_interrupt(), recorded_interrupts() as got:
    Interrupting()  # freed at once: the handler's KeyboardInterrupt lands in its __del__
    print("ran on", got, flush=True)  # Python dropped it
    try:
        raise_if_interrupted(got)
    except KeyboardInterrupt:
        print("raised again", flush=True)
print(signal.getsignal(signal.SIGINT) is signal.default_int_handler,
      sys.unraisablehook is sys.__unraisablehook__)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_an_interrupt_python_drops_in_a_del_is_recorded_and_not_printed(sig):
    """A KeyboardInterrupt that lands in a ``__del__`` is dropped by Python (the program runs
    on): recorded_interrupts keeps it, so a loop can raise it again, prints no traceback for it,
    and puts the handler and hook back after the block."""
    res = subprocess.run(
        [sys.executable, "-c", DROPPED_IN_DEL, sig], capture_output=True, text=True, timeout=30
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == [
        f"ran on [{int(getattr(signal, sig))}]",
        "raised again",
        "True True",
    ]
    assert res.stderr == ""  # no "Exception ignored in ... KeyboardInterrupt"
