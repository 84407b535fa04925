"""Where the scheduler benchmarks find the Pollux artifact's data: ``../shared/data/pollux``
beside the checkout (its traces, workloads and the authors' stored results)."""

from __future__ import annotations

import os

HERE = os.path.dirname(os.path.abspath(__file__))
SHARED_TRACES = os.path.normpath(
    os.path.join(HERE, "..", "..", "shared", "data", "pollux", "traces")
)


def default_traces_dir() -> str | None:
    """``../shared/data/pollux/traces`` beside the checkout (with the workloads and stored
    results in its parent folder), or None."""
    return SHARED_TRACES if os.path.isdir(SHARED_TRACES) else None
