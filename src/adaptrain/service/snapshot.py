"""The working copy a job runs in: ``adaptrain submit`` packs the submit directory (what
``.gitignore`` excludes left out, ``.git`` too) into a gzip'd tar, size-capped, so that edits
made after submitting do not change a running job."""

from __future__ import annotations

import io
import os
import tarfile

import pathspec

__all__ = ["DEFAULT_CAP", "pack"]

DEFAULT_CAP = 64 * 1024 * 1024


def _ignored(root: str) -> pathspec.PathSpec:
    lines = [".git/"]
    path = os.path.join(root, ".gitignore")
    if os.path.isfile(path):
        with open(path, encoding="utf-8", errors="replace") as f:
            lines.extend(f.read().splitlines())
    return pathspec.PathSpec.from_lines("gitwildmatch", lines)


def pack(root: str, cap: int = DEFAULT_CAP) -> bytes:
    """``root`` as a gzip'd tar (paths relative to it); ``ValueError`` naming the size and the
    fix when the files to pack exceed ``cap`` bytes."""
    root = os.path.abspath(root)
    spec = _ignored(root)
    files, total = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        rel_dir = "" if rel_dir == "." else rel_dir + "/"
        dirnames[:] = sorted(d for d in dirnames if not spec.match_file(rel_dir + d + "/"))
        for name in sorted(filenames):
            rel = rel_dir + name
            full = os.path.join(dirpath, name)
            if spec.match_file(rel) or not os.path.isfile(full) or os.path.islink(full):
                continue
            total += os.path.getsize(full)
            if total > cap:
                raise ValueError(
                    f"the submit directory {root} holds more than {cap // (1024 * 1024)} MiB of "
                    f"files to copy (at {rel}); list data and outputs in its .gitignore, or "
                    "submit from a smaller directory"
                )
            files.append((full, rel))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for full, rel in files:
            tar.add(full, arcname=rel, recursive=False)
    return buf.getvalue()
