"""Suite-wide test settings, and the fixtures that tests of several packages share.

The tests mirror the packages (``tests/sched`` for ``adaptrain.sched``, ``tests/sim`` for
``adaptrain.sim``, ...) in folders without ``__init__.py``, imported in pytest's default
``prepend`` mode: each test file is a top-level module named after its file, so basenames are
unique across the whole tree (``spawn`` pickles test functions by that module name, and its
children import it again). A test module never imports another: helpers shared by several
files are fixtures (here, or in a folder's ``conftest.py``) or live in a helper module whose
name starts with ``_`` beside them (``sched/_sched_cases.py``, ``optim/_threadcomm.py``).

Hypothesis draws new examples on every local run (``default`` profile), so property tests keep
exploring while the code is developed; ``.ci/run`` sets ``HYPOTHESIS_PROFILE=ci``, which draws
the same examples on every run, so a landing never depends on the luck of a draw.
"""

from __future__ import annotations

import os
import signal
import threading

import pytest
from hypothesis import settings

from adaptrain.dist import checkpoint
from adaptrain.dist.spawn import spawn

settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

_fork_server_started = False


def pytest_runtest_setup(item):
    """Before the first test of a module that uses ``spawn``: start its fork server with
    sklearn's datasets preloaded. Most spawned test functions load the bundled digits, and
    importing sklearn took 1-2 s in every child; the server then serves the whole session."""
    global _fork_server_started
    if _fork_server_started or getattr(getattr(item, "module", None), "spawn", None) is not spawn:
        return
    _fork_server_started = True
    assert spawn(max, 1, init=False, preload=["sklearn.datasets"]) == [1]  # max(rank, size)


# ----- the Pollux artifact's traces and tiny hand-made ones (sched, sim, cli, benchmarks) -----

REAL_TRACES = os.path.normpath(
    os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "pollux")
)


def write_tiny_app(root, name="toy", step=1.0, sync=0.0, epochs=(60.0, 120.0)):
    """One model: 1-4 replicas on one node, two validated batch sizes (8 and 16).

    Step time is ``step`` at every local batch and placement, so with ``grad_var = 0`` (gain 1)
    a job progresses exactly 1/step per second at batch size 8.
    """
    d = os.path.join(str(root), name)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "placements.csv"), "w") as f:
        f.write("placement,local_bsz,step_time,sync_time\n")
        for p in ("1", "2", "3", "4", "11", "22", "44"):
            for b in (4, 8, 16):
                f.write(f"{p},{b},{step},{sync}\n")
    with open(os.path.join(d, "scalability.csv"), "w") as f:
        f.write("num_nodes,num_replicas,local_bsz,step_time,sync_time\n")
        for n, r in ((1, 1), (2, 8), (4, 16), (16, 64)):
            for b in (4, 16):
                f.write(f"{n},{r},{b},{step},{sync}\n")
    for bsz in (8, 16):
        with open(os.path.join(d, f"validation-{bsz}.csv"), "w") as f:
            f.write("progress,iteration,metric,grad_sqr,grad_var\n")
            for e, prog in enumerate(epochs):
                f.write(f"{prog},{int(prog / 8) * (e + 1)},{0.5 + 0.1 * e},1.0,0.0\n")
    return d


@pytest.fixture
def tiny_app_writer():
    """:func:`write_tiny_app`: ``tiny_app_writer(root, name="toy", step=1.0, ...)``."""
    return write_tiny_app


@pytest.fixture
def real_data():
    """The artifact's data folder (``traces/``, ``workloads/``), or skip."""
    if not os.path.isdir(os.path.join(REAL_TRACES, "traces")):
        pytest.skip("artifact traces not present")
    return REAL_TRACES


@pytest.fixture
def tiny_traces(tmp_path):
    """A traces folder holding one tiny application, ``toy``."""
    traces = tmp_path / "traces"
    traces.mkdir()
    write_tiny_app(traces)
    return str(traces)


# ----- process state: SIGINT, the checkpoint registry ------------------------------------------


@pytest.fixture
def sigint_raises():
    """SIGINT raises KeyboardInterrupt during the test, as in a terminal, even in a run started
    as a background job (``cmd &``), which inherits SIGINT ignored and so gets no handler."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("needs the main thread, to handle SIGINT")
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture
def fresh_checkpoints(monkeypatch):
    """No checkpoint directory, and an empty State registry before and after the test."""
    monkeypatch.delenv("ADAPTRAIN_CHECKPOINT_PATH", raising=False)
    checkpoint.reset()
    yield
    checkpoint.reset()
