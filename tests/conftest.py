"""Suite-wide test settings.

Hypothesis draws new examples on every local run (``default`` profile), so property tests keep
exploring while the code is developed; ``.ci/run`` sets ``HYPOTHESIS_PROFILE=ci``, which draws
the same examples on every run, so a landing never depends on the luck of a draw.
"""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
