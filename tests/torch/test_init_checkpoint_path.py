"""``init_process_group`` refuses checkpointing on some replicas only, and reports a checkpoint
folder rank 0 cannot use on every replica (real gloo processes on 127.0.0.1)."""

from __future__ import annotations

import os
from pathlib import Path

from adaptrain.dist.spawn import spawn


def _init_with(rank: int, world_size: int, roots: list) -> str:
    if roots[rank] is None:
        os.environ.pop("ADAPTRAIN_CHECKPOINT_PATH", None)
    else:
        os.environ["ADAPTRAIN_CHECKPOINT_PATH"] = roots[rank]
    import adaptrain.torch as adl

    try:
        adl.init_process_group("gloo")
    except RuntimeError as exc:
        return f"raised: {exc}"
    return "ok"


def test_checkpointing_on_some_replicas_only_is_refused_on_every_replica(tmp_path: Path) -> None:
    # Before, the replica without ADAPTRAIN_CHECKPOINT_PATH restored nothing while rank 0
    # restored checkpoint 0 (different epochs and positions), and at the first checkpoint it
    # returned at once while the others waited in save_all_states' collectives.
    ckpt = tmp_path / "checkpoint-000000"
    ckpt.mkdir()
    (ckpt / "MANIFEST.json").write_text('{"format": 1, "states": {}}')
    out = spawn(_init_with, 2, args=([str(tmp_path), None],), init=False, timeout=60)
    for text in out:
        assert text.startswith("raised: ADAPTRAIN_CHECKPOINT_PATH is set on rank(s) [0]"), text
        assert "not on rank(s) [1]" in text


def test_a_missing_folder_on_rank_0_is_reported_on_every_replica(tmp_path: Path) -> None:
    # Before, rank 0 raised alone, before the collective that hands out its choice: the other
    # replica saw only gloo's "Connection closed" once rank 0 had ended.
    missing = str(tmp_path / "nope")
    out = spawn(_init_with, 2, args=([missing, str(tmp_path)],), init=False, timeout=60)
    for text in out:
        assert text.startswith("raised: rank 0 cannot use its checkpoint folder"), text
        assert "nope" in text and "mkdir" in text


def test_checkpointing_on_everywhere_or_nowhere_still_initialises(tmp_path: Path) -> None:
    assert spawn(_init_with, 2, args=([None, None],), init=False, timeout=60) == ["ok", "ok"]
    roots = [str(tmp_path), str(tmp_path)]
    assert spawn(_init_with, 2, args=(roots,), init=False, timeout=60) == ["ok", "ok"]
