"""Tiny hand-made traces for the scheduler tests."""

from __future__ import annotations

import os
import signal
import threading

import pytest

REAL_TRACES = os.path.normpath(
    os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data", "pollux")
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
    return write_tiny_app


@pytest.fixture
def real_data():
    """The artifact's data folder, or skip."""
    if not os.path.isdir(os.path.join(REAL_TRACES, "traces")):
        pytest.skip("artifact traces not present")
    return REAL_TRACES


@pytest.fixture
def tiny_traces(tmp_path):
    traces = tmp_path / "traces"
    traces.mkdir()
    write_tiny_app(traces)
    return str(traces)


@pytest.fixture
def sigint_raises():
    """SIGINT raises KeyboardInterrupt during the test, as in a terminal, even in a run started
    as a background job (``cmd &``), which inherits SIGINT ignored and so gets no handler."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("needs the main thread, to handle SIGINT")
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)
