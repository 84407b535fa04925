"""graceful_exit's exit modes (fast/full/immediate) and the checkpoint's fast save/verify path."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from adaptrain import checkpoint
from adaptrain.dist import checkpoint as dckpt
from adaptrain.dist import signals

SCRIPT = textwrap.dedent(
    """
    import atexit, signal, sys
    atexit.register(lambda: print("early hook", flush=True))   # before adaptrain's import
    from adaptrain.dist import signals
    atexit.register(lambda: print("late hook", flush=True))
    text = open(sys.argv[2], "w"); text.write("text-unflushed")     # never closed
    raw = open(sys.argv[3], "wb"); raw.write(b"bytes-unflushed")    # never closed

    class Finaliser:
        def __del__(self):
            print("finaliser", flush=True)

    keep = Finaliser()
    catch = sys.argv[4] == "catch"
    try:
        signals.graceful_exit(signal.SIGTERM, mode=sys.argv[1])
    except SystemExit:
        if not catch:
            raise
        print("caught", flush=True)
        signals.poll_stop()   # training goes on: the fast exit is disarmed
    finally:
        print("finally", flush=True)
    """
)


def _run(tmp_path: Path, mode: str, catch: bool = False) -> tuple[int, list[str], str, bytes]:
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    text, raw = tmp_path / "t.txt", tmp_path / "b.bin"
    p = subprocess.run(
        [sys.executable, str(script), mode, str(text), str(raw), "catch" if catch else "-"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return p.returncode, p.stdout.split("\n")[:-1], text.read_text(), raw.read_bytes()


def test_fast_mode_runs_finally_and_atexit_skips_finalisation(tmp_path: Path) -> None:
    code, lines, text, raw = _run(tmp_path, "fast")
    assert code == 143
    # finally, then every atexit hook in LIFO order; object finalisers are not run.
    assert lines == ["finally", "late hook", "early hook"]
    assert text == "text-unflushed" and raw == b"bytes-unflushed"


def test_full_mode_is_a_normal_interpreter_exit(tmp_path: Path) -> None:
    code, lines, text, raw = _run(tmp_path, "full")
    assert code == 143
    assert lines == ["finally", "late hook", "early hook", "finaliser"]
    assert text == "text-unflushed" and raw == b"bytes-unflushed"


def test_immediate_mode_leaves_at_once_but_flushes_files(tmp_path: Path) -> None:
    code, lines, text, raw = _run(tmp_path, "immediate")
    assert code == 143
    assert lines == []
    assert text == "text-unflushed" and raw == b"bytes-unflushed"


def test_caught_exit_then_training_disarms_fast_exit(tmp_path: Path) -> None:
    code, lines, _, _ = _run(tmp_path, "fast", catch=True)
    assert code == 0
    assert lines[:2] == ["caught", "finally"] and "finaliser" in lines


def test_exit_mode_validation() -> None:
    with pytest.raises(ValueError, match="'fastest'"):
        signals.set_exit_mode("fastest")
    with pytest.raises(ValueError, match="'nope'"):
        signals.graceful_exit(15, mode="nope")
    old = signals.set_exit_mode("full")
    try:
        assert signals.exit_mode() == "full"
    finally:
        signals.set_exit_mode(old)
    assert signals.exit_mode() == old == "fast"


# ---- checkpoint: hash-while-writing, background verification, file handed to load ----------


class Tensorish(checkpoint.State):
    def __init__(self, name: str, value=None) -> None:
        super().__init__(name)
        self.value = value

    def save(self, fileobj):
        torch.save(self.value, fileobj)

    def load(self, fileobj):
        self.value = torch.load(fileobj, weights_only=True)


class RawArray(checkpoint.State):
    """Writes a float64 numpy array's buffer directly (a non-byte memoryview format)."""

    def __init__(self, name: str, value=None) -> None:
        super().__init__(name)
        self.value = value

    def save(self, fileobj):
        fileobj.write(self.value)

    def load(self, fileobj):
        self.value = np.frombuffer(fileobj.read(), dtype=np.float64)


@pytest.fixture()
def ckpt_root(monkeypatch, tmp_path: Path):
    monkeypatch.setenv("ADAPTRAIN_CHECKPOINT_PATH", str(tmp_path))
    checkpoint.reset()
    yield tmp_path
    checkpoint.reset()


def test_manifest_hash_and_size_match_the_files(ckpt_root: Path) -> None:
    Tensorish("t", {"w": torch.randn(300, 70), "n": 3})
    RawArray("r", np.linspace(0.0, 1.0, 1001))
    assert checkpoint.save_all_states()
    ckpt = ckpt_root / "checkpoint-000000"
    manifest = json.loads((ckpt / "MANIFEST.json").read_text())
    assert sorted(manifest["states"]) == ["r", "t"]
    for entry in manifest["states"].values():
        data = (ckpt / entry["file"]).read_bytes()
        assert entry["size"] == len(data)
        assert entry["sha256"] == hashlib.sha256(data).hexdigest()
    assert manifest["states"]["r"]["size"] == 1001 * 8
    assert sorted(p.name for p in ckpt.iterdir()) == ["MANIFEST.json", "state-r", "state-t"]


def test_background_verification_then_load_replays(ckpt_root: Path) -> None:
    value = {"w": torch.randn(64, 33), "step": 5}
    arr = np.arange(17, dtype=np.float64) / 3
    Tensorish("t", value)
    RawArray("r", arr)
    checkpoint.save_all_states()
    checkpoint.reset()  # as a restarted process
    ckpt = dckpt.restore_dir()  # chooses the checkpoint and starts verifying in the background
    assert ckpt is not None and ckpt.endswith("checkpoint-000000")
    pending = dict(dckpt._verdicts)
    assert sorted(Path(p).name for p in pending) == ["state-r", "state-t"]
    for path, fut in pending.items():
        assert fut.result(timeout=60) == hashlib.sha256(Path(path).read_bytes()).hexdigest()
    t2, r2 = Tensorish("t"), RawArray("r")
    assert checkpoint.load_state(t2) and checkpoint.load_state(r2)
    assert dckpt._verdicts == {}  # each verdict is used once
    torch.testing.assert_close(t2.value["w"], value["w"])
    assert t2.value["step"] == 5
    np.testing.assert_array_equal(r2.value, arr)
    # Replay: saving the restored states gives byte-identical state files.
    checkpoint.save_all_states()
    a = (ckpt_root / "checkpoint-000001" / "state-r").read_bytes()
    assert a == arr.tobytes()


def test_corruption_after_verification_started_is_reported(ckpt_root: Path) -> None:
    Tensorish("t", torch.arange(1000))
    checkpoint.save_all_states()
    path = ckpt_root / "checkpoint-000000" / "state-t"
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x55
    path.write_bytes(bytes(data))
    checkpoint.reset()
    with pytest.raises(RuntimeError, match=f"corrupt checkpoint file {path}"):
        checkpoint.load_state(Tensorish("t"))


def test_missing_state_file_is_reported(ckpt_root: Path) -> None:
    Tensorish("t", torch.arange(10))
    checkpoint.save_all_states()
    (ckpt_root / "checkpoint-000000" / "state-t").unlink()
    checkpoint.reset()
    with pytest.raises(RuntimeError, match="cannot read .*state-t"):
        checkpoint.load_state(Tensorish("t"))


def test_a_sigterm_while_a_finished_run_exits_leaves_exit_status_0(tmp_path):
    """A scheduler's SIGTERM that lands in the exit of a run that did all its work (after
    adaptrain's own atexit clean-up) must not kill it with 143: a scheduler would take that for
    a stop and resume the run from its last periodic checkpoint, training again on what came
    after it."""
    script = tmp_path / "s.py"
    script.write_text(
        textwrap.dedent(
            """
            import atexit, os, signal, time
            def late():  # registered first, so it runs after adaptrain's clean-up
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.5)
                print("after", flush=True)
            atexit.register(late)
            import adaptrain.torch as adl
            adl.init_process_group("gloo")
            print("done", flush=True)
            """
        )
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("ADAPTRAIN_")}
    env.update(ADAPTRAIN_NUM_REPLICAS="1")
    p = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["done", "after"]
