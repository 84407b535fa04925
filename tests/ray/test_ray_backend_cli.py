"""``adaptrain server --backend ray``'s flags, without a cluster: Ray missing says how to
install it, an address where no cluster answers is an error at once, and the local backend's
flags are refused with it (and ``--ray-address`` without it). Each case is a real
``adaptrain`` process; none starts a server."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "src")

#: ``adaptrain`` in a Python where ``import ray`` fails, as where the extra is not installed
NO_RAY = "import sys; sys.modules['ray'] = None; from adaptrain.cli import main; sys.exit(main())"


def _server(tmp_path, *args: str, no_ray: bool = False) -> subprocess.CompletedProcess:
    prog = ["-c", NO_RAY] if no_ray else ["-m", "adaptrain"]
    return subprocess.run(
        [sys.executable, *prog, "server", "--port", "0", "--state-dir", str(tmp_path / "s"),
         *args],
        capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": SRC},
    )  # fmt: skip


@pytest.mark.timeout(90)
def test_without_ray_the_ray_backend_says_how_to_install_it(tmp_path):
    proc = _server(tmp_path, "--backend", "ray", no_ray=True)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "pip install 'adaptrain[ray]'" in proc.stderr, proc.stderr
    assert "listening" not in proc.stdout


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "args, message",
    [
        (["--backend", "ray", "--slots", "2"], "--backend ray the cluster's nodes are Ray's"),
        (["--backend", "ray", "--nodes", "2", "--slots-per-node", "1"], "are the local backend"),
        (["--ray-address", "127.0.0.1:6379"], "--ray-address goes with --backend ray"),
    ],
)
def test_flags_of_the_other_backend_are_refused(tmp_path, args, message):
    proc = _server(tmp_path, *args)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert message in proc.stderr, proc.stderr
    assert "listening" not in proc.stdout


@pytest.mark.timeout(60)
def test_backend_choices_are_validated(tmp_path):
    proc = _server(tmp_path, "--backend", "kubernetes")
    assert proc.returncode == 2
    assert "invalid choice" in proc.stderr and "'ray'" in proc.stderr, proc.stderr


@pytest.mark.timeout(90)
def test_an_address_where_no_cluster_answers_is_an_error_at_once(tmp_path):
    pytest.importorskip("ray", reason="needs `pip install adaptrain[ray]`")
    import socket

    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = _server(tmp_path, "--backend", "ray", "--ray-address", f"127.0.0.1:{port}")
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert f"no Ray cluster answers at 127.0.0.1:{port}" in proc.stderr, proc.stderr
