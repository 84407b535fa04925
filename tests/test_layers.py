"""The layer rule (docs/architecture.md), checked with import-linter's contracts in
``.importlinter``: lower layers never import higher ones, ``sched`` and ``sim`` never import
torch or the training glue, and nothing but the CLI imports ``sim``."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINT = shutil.which("lint-imports")

pytestmark = pytest.mark.skipif(LINT is None, reason="import-linter is not installed")


def _lint(src: str, cwd: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": src}
    return subprocess.run(
        [LINT, "--config", os.path.join(ROOT, ".importlinter"), "--no-cache"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_code_keeps_every_layer_contract(tmp_path):
    proc = _lint(os.path.join(ROOT, "src"), str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "4 kept, 0 broken" in proc.stdout


@pytest.mark.parametrize(
    ("module", "line", "contract"),
    [
        ("sched/jobs.py", "import torch", "sched, sim and the service import neither torch"),
        ("core/scaling.py", "import adaptrain.sched", "core imports nothing"),
        ("dist/spawn.py", "import adaptrain.sim", "nothing but the CLI imports sim"),
        ("service/api.py", "import adaptrain.ray.backend", "Layers: cli over ray over service"),
    ],
)
def test_an_import_across_the_layers_is_caught(tmp_path, module, line, contract):
    src = tmp_path / "src"
    shutil.copytree(os.path.join(ROOT, "src", "adaptrain"), src / "adaptrain",
                    ignore=shutil.ignore_patterns("__pycache__", "data"))  # fmt: skip
    path = src / "adaptrain" / module
    path.write_text(path.read_text() + f"\n{line}  # a layer broken on purpose\n")
    proc = _lint(str(src), str(tmp_path))
    assert proc.returncode != 0
    assert contract in proc.stdout and "BROKEN" in proc.stdout, proc.stdout[-3000:]
