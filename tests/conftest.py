"""Suite-wide test settings.

Hypothesis draws new examples on every local run (``default`` profile), so property tests keep
exploring while the code is developed; ``.ci/run`` sets ``HYPOTHESIS_PROFILE=ci``, which draws
the same examples on every run, so a landing never depends on the luck of a draw.
"""

from __future__ import annotations

import os

from hypothesis import settings

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
