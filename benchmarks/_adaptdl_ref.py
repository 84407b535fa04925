"""AdaptDL 0.2.11 as a reference for the benchmarks: installed privately, patched at run time.

``import_adaptdl()`` makes ``import adaptdl`` work without touching the environment adaptrain runs
in: AdaptDL and its small pure-Python dependencies (autograd, portpicker, semver) are installed
with ``pip install --no-deps --target /tmp/adaptdl-ref`` (torch, numpy, scipy are the ones already
installed; pandas and redis, which AdaptDL declares but the modules used here never import, are
skipped). Two incompatibilities with today's numpy/torch are patched **in that private copy**:

* ``adaptdl/goodput.py`` uses ``np.int`` (removed in numpy 1.24) → ``int``;
* ``adaptdl/torch/parallel.py`` calls ``torch.load(fileobj)``, which torch ≥ 2.6 refuses for its
  pickled tuple → ``torch.load(fileobj, weights_only=False)``.

``pkg_resources`` (only used by AdaptDL when a scheduler supervisor is configured) is stubbed if
setuptools does not provide it. Nothing of AdaptDL is part of adaptrain; it is only benchmarked.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import types
from pathlib import Path

TARGET = Path("/tmp/adaptdl-ref")
PACKAGES = ["adaptdl==0.2.11", "autograd", "portpicker", "semver"]

_PATCHES = {
    "adaptdl/goodput.py": [("dtype=np.int)", "dtype=int)")],
    "adaptdl/torch/parallel.py": [
        ("torch.load(fileobj)", "torch.load(fileobj, weights_only=False)")
    ],
}


def install(target: Path = TARGET) -> bool:
    """Install AdaptDL and its pure deps into ``target`` (no-op if present); True on success."""
    if (target / "adaptdl" / "__init__.py").exists() and (target / "autograd").exists():
        return True
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--quiet",
        "--no-deps",
        "--target",
        str(target),
        *PACKAGES,
    ]
    try:
        subprocess.run(cmd, check=True, timeout=600, capture_output=True)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
        print(f"adaptdl reference not available: {exc}", file=sys.stderr)
        return False
    return (target / "adaptdl" / "__init__.py").exists()


def patch(target: Path = TARGET) -> None:
    """Apply the compatibility patches to the private copy (idempotent)."""
    for rel, edits in _PATCHES.items():
        path = target / rel
        text = path.read_text()
        new = text
        for old, repl in edits:
            if repl not in new:
                new = new.replace(old, repl)
        if new != text:
            path.write_text(new)


def import_adaptdl(target: Path = TARGET) -> types.ModuleType | None:
    """Install, patch and import ``adaptdl.torch``; None if AdaptDL cannot be installed."""
    if not install(target):
        return None
    patch(target)
    if str(target) not in sys.path:
        sys.path.insert(0, str(target))
    try:
        importlib.import_module("pkg_resources")
    except ImportError:
        stub = types.ModuleType("pkg_resources")

        def get_distribution(name: str) -> types.SimpleNamespace:
            return types.SimpleNamespace(version="0.2.11" if name == "adaptdl" else "0.0.0")

        stub.get_distribution = get_distribution  # type: ignore[attr-defined]
        sys.modules["pkg_resources"] = stub
    import logging

    module = importlib.import_module("adaptdl.torch")
    # adaptdl.torch calls logging.basicConfig(level=INFO) on import; keep benchmarks quiet.
    logging.getLogger().setLevel(logging.WARNING)
    for name in ["adaptdl", *logging.root.manager.loggerDict]:
        if name.startswith("adaptdl"):
            logging.getLogger(name).setLevel(logging.WARNING)
    return module


if __name__ == "__main__":
    mod = import_adaptdl()
    print("adaptdl:", None if mod is None else mod.__file__)
