"""Checkpoint-restart of named pieces of state (``adaptdl.checkpoint`` equivalent; distributed glue).

A :class:`State` is any piece of a job's state (model, optimizer, epoch counter, data-loader
position, accumulator, batch-size statistics...) with ``save(fileobj)``, ``load(fileobj)`` and
``sync()``. Every State constructed is registered by its unique name. :func:`save_all_states`
syncs every registered State on every replica, then rank 0 writes them all; :func:`load_state`
restores one State from the newest complete checkpoint.

On-disk layout under the checkpoint directory (``adaptrain.env.checkpoint_path()``, i.e.
``ADAPTRAIN_CHECKPOINT_PATH``; unset means checkpointing is off)::

    <root>/checkpoint-000004/MANIFEST.json   {"format": 1, "states": {name: {"file", "sha256", "size"}}}
    <root>/checkpoint-000004/state-<quoted name>   (state-%sha256-<hex> if too long for a file)
    <root>/.tmp-checkpoint-000005-<pid>/     a checkpoint being written: never read

:func:`save_state` (one State into a directory of the caller's) names the file
``state-<quoted name>%v<8 hex digits>``, a fresh name on every save; a reader goes by the
manifest's ``file`` field only, so any plain file name of the directory loads.

Atomicity: rank 0 writes every file into a temporary directory, fsyncs them, writes the manifest
last, then ``os.rename``\\ s the directory to ``checkpoint-<seq>`` (atomic on POSIX) and only then
deletes older checkpoints. A reader takes the highest-numbered ``checkpoint-*`` directory, so a
crash at any moment leaves either the old or the new checkpoint, never a half-written one.
:func:`save_state` updates a directory in place: it writes the state under a fresh file name,
fsyncs it, atomically replaces the manifest that points at it, and only then deletes the
State's previous file, so a crash leaves the manifest pointing at a whole file, old or new.
Every file's SHA-256 is checked on load; a mismatch, a bad manifest or a ``load`` that raises
gives a :class:`RuntimeError` naming the file.

Every replica must construct the same States, whose ``sync`` may be collective: before
syncing, :func:`save_all_states` compares (one collective, which also hands out the
checkpoint's number) the names of the States that override ``sync`` across replicas and makes
every replica raise on a mismatch, naming them, instead of letting the syncs go out of step
and hang the job. States that keep the default no-op ``sync`` may differ between replicas
(say, a logger's State on rank 0 only); rank 0 saves those it holds.

One directory per job: checkpoints carry no job identity, so a job restores the newest
``checkpoint-*`` in its directory whoever wrote it, and each save deletes the older ones.

Periodic checkpoints (``save_all_states(background=True)``, taken every
``ADAPTRAIN_CHECKPOINT_INTERVAL`` seconds by :mod:`adaptrain.dist.signals`): the replicas sync
as above, then rank 0 serialises every State into memory (the only cost the step pays beyond the
syncs) and a daemon thread writes, fsyncs and publishes the checkpoint exactly as above
(temporary folder, manifest last, atomic rename), so a ``kill -9`` at any moment leaves the
previous checkpoint whole. The checkpoint this process restored from is kept (States created
later still load from it); older ones go. Any later save, and :func:`reset`, first waits for a
write still running, so checkpoint numbers never collide.

Speed (rescale latency): a State is serialised straight into its file through a writer that
hashes what passes through (no in-memory copy, no second pass), the manifest is written once per
checkpoint, and on restart the checksums are verified by a background thread started as soon as
the checkpoint is chosen (:func:`restore_dir`, called by ``init_process_group``), so that reading
and hashing overlap the model's construction; :func:`load_state` waits for its file's verdict
and then hands ``State.load`` the open file (``torch.load`` reads storages straight from it).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import secrets
import shutil
import threading
import time
import urllib.parse
from collections.abc import Callable
from concurrent.futures import Future
from typing import BinaryIO, NoReturn

import torch.distributed as dist

from adaptrain import env
from adaptrain.dist import collective

__all__ = [
    "State",
    "checkpoint_root",
    "latest_checkpoint",
    "load_state",
    "register_reset_hook",
    "restore_dir",
    "reset",
    "save_all_states",
    "save_state",
    "wait_for_background_save",
]

logger = logging.getLogger(__name__)

_MANIFEST = "MANIFEST.json"
_FORMAT = 1
_CKPT_RE = re.compile(r"^checkpoint-(\d+)$")

_registry: dict[str, State] = {}
_reset_hooks: list[Callable[[], None]] = []
_loaded_from: str | None = None  # checkpoint dir this process restores from (fixed once chosen)
_loaded_from_chosen = False
_verdicts: dict[str, Future] = {}  # file path -> Future of its SHA-256 (background verification)
_CHUNK = 1 << 22
_writer: threading.Thread | None = None  # rank 0's background write of a checkpoint, if any
_last_write: dict[str, float] = {}  # the last background write: its number and timings


class _HashingWriter(io.RawIOBase):
    """Write-only binary stream that forwards to ``raw`` and hashes (SHA-256) what it writes."""

    def __init__(self, raw: BinaryIO) -> None:
        super().__init__()
        self._raw = raw
        self._sha = hashlib.sha256()
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:  # noqa: ANN001 - any bytes-like object
        view = memoryview(b).cast("B")
        self._sha.update(view)
        self._raw.write(view)
        self.size += len(view)
        return len(view)

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        if not self._raw.closed:
            self._raw.flush()

    def hexdigest(self) -> str:
        return self._sha.hexdigest()


def _entry_file(entry: object) -> str | None:
    """The file name of a manifest entry, or None if the entry is malformed (not a dict with a
    plain file name of the checkpoint's own directory and a SHA-256 string)."""
    if not isinstance(entry, dict):
        return None
    fname, digest = entry.get("file"), entry.get("sha256")
    if not isinstance(fname, str) or not isinstance(digest, str):
        return None
    if fname in ("", ".", "..", _MANIFEST) or "/" in fname or os.sep in fname:
        return None
    return fname


def _sha256_file(path: str) -> str:
    sha = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_CHUNK):
            sha.update(chunk)
    return sha.hexdigest()


def _verify_in_background(ckpt_dir: str) -> None:
    """Start hashing every file of ``ckpt_dir``'s manifest on a daemon thread (best effort)."""
    try:
        entries = _read_manifest(ckpt_dir)["states"].values()
    except RuntimeError:
        return  # load_state reports the problem when a State asks for its entry
    # (a malformed entry is left to load_state too)
    paths = [os.path.join(ckpt_dir, f) for f in map(_entry_file, entries) if f is not None]
    jobs = []
    for path in paths:
        fut: Future = Future()
        _verdicts[path] = fut
        jobs.append((path, fut))

    def work() -> None:
        for path, fut in jobs:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(_sha256_file(path))
                except BaseException as exc:  # noqa: BLE001 - handed to load_state
                    fut.set_exception(exc)

    threading.Thread(target=work, name="adaptrain-checkpoint-verify", daemon=True).start()


class State:
    """A named piece of state saved and restored across checkpoint-restarts.

    Subclass it and override :meth:`save`, :meth:`load` and (if replicas hold different
    values that must be combined before saving) :meth:`sync`. Constructing a State registers
    it; names are unique per process (a duplicate raises ``ValueError``).

    Args:
        name: unique name, also the key in the checkpoint.
    """

    def __init__(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"State name must be a non-empty string, got {name!r}")
        if name in _registry:
            raise ValueError(
                f"a State named {name!r} already exists; State names must be unique "
                "(give this one another name)"
            )
        self.name = name
        _registry[name] = self

    def save(self, fileobj: BinaryIO) -> None:
        """Write this state to the binary file ``fileobj`` (override)."""
        raise NotImplementedError(f"{type(self).__name__}.save is not implemented")

    def load(self, fileobj: BinaryIO) -> None:
        """Read this state back from the binary file ``fileobj`` (override)."""
        raise NotImplementedError(f"{type(self).__name__}.load is not implemented")

    def sync(self) -> None:
        """Make the state consistent across replicas before saving (collective; default no-op)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def register_reset_hook(fn: Callable[[], None]) -> None:
    """Call ``fn`` from :func:`reset` (modules holding global States forget them there)."""
    if fn not in _reset_hooks:
        _reset_hooks.append(fn)


def reset() -> None:
    """Forget every registered State and the chosen checkpoint, as in a freshly started process.

    Used by tests and by in-process restarts; the files on disk are untouched.
    """
    global _loaded_from, _loaded_from_chosen
    wait_for_background_save()
    for hook in list(_reset_hooks):
        hook()
    _registry.clear()
    _verdicts.clear()
    _loaded_from = None
    _loaded_from_chosen = False


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


#: Longest file name (in bytes) most filesystems take (NAME_MAX).
_NAME_MAX = 255


def _file_name(name: str, reserve: int = len(".tmp")) -> str:
    """``state-<quoted name>``, or ``state-%sha256-<digest of the name>`` when that would not
    fit one file name with ``reserve`` more bytes (its ``.tmp`` suffix, or :func:`save_state`'s
    version suffix). The manifest maps names to files; a quoted name never holds ``%`` before
    a non-hex letter, so the two forms cannot collide."""
    fname = "state-" + urllib.parse.quote(name, safe="")
    if len(fname.encode()) + reserve > _NAME_MAX:
        fname = "state-%sha256-" + hashlib.sha256(name.encode()).hexdigest()
    return fname


#: Separates :func:`save_state`'s version token from the file name (``%v``: never in a quoted
#: name, where ``%`` is followed by two hex digits, nor in the digest form).
_VERSION_SEP = "%v"
_VERSION_LEN = 8  # hex digits of the token


def _version_prefix(name: str) -> str:
    """The beginning of every file :func:`save_state` writes for the State ``name`` (and of no
    other State's file: see :data:`_VERSION_SEP`)."""
    return _file_name(name, reserve=len(_VERSION_SEP) + _VERSION_LEN) + _VERSION_SEP


def checkpoint_root() -> str | None:
    """The checkpoint directory from ``ADAPTRAIN_CHECKPOINT_PATH``, or None (checkpointing off).

    Raises:
        RuntimeError: if the variable names a path that is not an existing directory.
    """
    root = env.checkpoint_path()
    if root is None:
        return None
    if not os.path.isdir(root):
        raise RuntimeError(
            f"checkpoint directory ADAPTRAIN_CHECKPOINT_PATH={root!r} does not exist or is not a "
            f"directory; create it first (mkdir -p {root}) or unset the variable"
        )
    return root


def _seq_dirs(root: str) -> list[tuple[int, str]]:
    out = []
    for entry in os.listdir(root):
        m = _CKPT_RE.match(entry)
        if m and os.path.isdir(os.path.join(root, entry)):
            out.append((int(m.group(1)), os.path.join(root, entry)))
    return sorted(out)


def latest_checkpoint(root: str) -> str | None:
    """Path of the newest complete checkpoint under ``root``, or None if there is none."""
    dirs = _seq_dirs(root)
    return dirs[-1][1] if dirs else None


def _read_manifest(ckpt_dir: str) -> dict:
    path = os.path.join(ckpt_dir, _MANIFEST)
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise RuntimeError(
            f"corrupt checkpoint: {path} is missing (checkpoints are renamed into place only "
            "after their manifest is written); delete the directory "
            f"{ckpt_dir} to start afresh (older checkpoints are removed after each save)"
        ) from None
    except (OSError, ValueError) as exc:
        raise RuntimeError(
            f"corrupt checkpoint manifest {path}: {exc}; delete {ckpt_dir} to start afresh "
            "(older checkpoints are removed after each save)"
        ) from exc
    if not isinstance(manifest, dict) or not isinstance(manifest.get("states"), dict):
        raise RuntimeError(f"corrupt checkpoint manifest {path}: no 'states' table")
    return manifest


def _write_manifest(ckpt_dir: str, manifest: dict) -> None:
    path = os.path.join(ckpt_dir, _MANIFEST)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def restore_dir(*, agree: bool = False) -> str | None:
    """The checkpoint directory this process restores from (chosen once, on first call), or None.

    With ``agree`` (a collective: every replica calls it at the same point, as
    :func:`adaptrain.torch.init_process_group` does) only rank 0 lists the checkpoint folder and
    every replica adopts its choice, by name (``checkpoint-<seq>`` under its own
    ``ADAPTRAIN_CHECKPOINT_PATH``, which may be mounted elsewhere). A replica whose view of a
    shared folder lags behind (NFS caches directory listings) then restores the same
    checkpoint as rank 0, or fails loudly reading it, instead of silently restoring an older
    one.

    Checkpointing must be on everywhere or nowhere: with ``agree``, a replica without
    ``ADAPTRAIN_CHECKPOINT_PATH`` beside one with it (it would restore nothing, and leave the
    others waiting in the first checkpoint's collectives), or one whose folder is missing,
    makes every replica raise, naming the ranks.

    Raises:
        RuntimeError: with ``agree``, this replica had already chosen another checkpoint (a
            State loaded before ``init_process_group``), or the replicas disagree on whether
            checkpointing is on, or a replica's checkpoint folder does not exist.
    """
    if agree and collective.is_distributed():
        chosen = _loaded_from_chosen
        ours = problem = None
        try:
            ours = _loaded_from if chosen or _rank() != 0 else _newest()
            checkpoint_root()  # every replica's own folder must exist
        except RuntimeError as exc:
            problem = str(exc)
        mine = None if ours is None else os.path.basename(ours)
        # Everybody's view, in rank order: (checkpointing on, problem, choice).
        views = collective.allreduce([(env.checkpoint_path() is not None, problem, mine)])
        _check_views(views)
        name = views[0][2]
        root = checkpoint_root()
        if not chosen:
            _choose(None if name is None or root is None else os.path.join(root, name))
        elif name != mine:
            raise RuntimeError(
                f"this replica restored from {ours!r} but rank 0 chose {name!r}: load States "
                "only after adaptrain.torch.init_process_group, which makes every replica "
                "restore rank 0's choice"
            )
    elif not _loaded_from_chosen:
        _choose(_newest())
    return _loaded_from


def _check_views(views: list) -> None:
    """Raise (on every replica alike) unless every replica's checkpoint folder is usable and
    checkpointing is on everywhere or nowhere."""
    problems = [(r, p) for r, (_, p, _) in enumerate(views) if p]
    if problems:
        rank, problem = problems[0]
        raise RuntimeError(
            f"rank {rank} cannot use its checkpoint folder: {problem}"
            + (
                f" (ranks {[r for r, _ in problems]} have the same kind of problem)"
                if len(problems) > 1
                else ""
            )
        )
    on = [r for r, (is_on, _, _) in enumerate(views) if is_on]
    if on and len(on) != len(views):
        off = [r for r in range(len(views)) if r not in on]
        raise RuntimeError(
            f"ADAPTRAIN_CHECKPOINT_PATH is set on rank(s) {on} but not on rank(s) {off}: set it "
            "on every replica (the same folder, wherever it is mounted) or on none; a replica "
            "without it would neither restore nor take part in checkpoints"
        )


def _newest() -> str | None:
    root = checkpoint_root()
    return latest_checkpoint(root) if root is not None else None


def _choose(path: str | None) -> None:
    global _loaded_from, _loaded_from_chosen
    _loaded_from, _loaded_from_chosen = path, True
    if path is not None:
        logger.info("restoring from checkpoint %s", path)
        _verify_in_background(path)


def load_state(state: State) -> bool:
    """Restore ``state`` from the newest checkpoint; True if it was there and ``load`` ran.

    Returns False when checkpointing is off, no checkpoint exists yet, or the checkpoint has no
    entry for ``state.name``.

    Raises:
        RuntimeError: the checkpoint directory is missing, or the entry is corrupt (names the path).
    """
    ckpt_dir = restore_dir()
    if ckpt_dir is None:
        return False
    entry = _read_manifest(ckpt_dir)["states"].get(state.name)
    if entry is None:
        return False
    fname = _entry_file(entry)
    if fname is None:
        raise RuntimeError(
            f"corrupt checkpoint manifest {os.path.join(ckpt_dir, _MANIFEST)}: the entry of "
            f"state {state.name!r} is {entry!r:.200}, not {{'file': <a file name in {ckpt_dir}>, "
            f"'sha256': ...}}; delete {ckpt_dir} to start afresh (older checkpoints are removed "
            "after each save)"
        )
    path = os.path.join(ckpt_dir, fname)
    verdict = _verdicts.pop(path, None)
    try:
        digest = verdict.result() if verdict is not None else _sha256_file(path)
        f = open(path, "rb")
    except OSError as exc:
        raise RuntimeError(f"corrupt checkpoint: cannot read {path}: {exc}") from exc
    with f:
        if digest != entry.get("sha256"):
            raise RuntimeError(
                f"corrupt checkpoint file {path}: SHA-256 {digest[:12]}... does not match the "
                f"manifest's {str(entry.get('sha256'))[:12]}...; delete {ckpt_dir} to start "
                "afresh (older checkpoints are removed after each save)"
            )
        try:
            state.load(f)
        except Exception as exc:
            raise RuntimeError(
                f"could not load state {state.name!r} from checkpoint file {path}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
    return True


def save_state(state: State, checkpoint_dir: str, sync: bool = True) -> None:
    """Save ``state`` into ``checkpoint_dir`` (collective when ``sync``).

    Every replica runs ``state.sync()`` (if ``sync``); then rank 0 writes the state under a
    fresh file name (``state-<quoted name>%v<token>``), fsyncs it, atomically replaces
    ``checkpoint_dir``'s manifest with one that records the new file and its checksum, and only
    then deletes the state's previous file (and any left by an earlier save that crashed
    before its manifest was written). A crash at any moment leaves a manifest whose files are
    whole: the previous version or the new one.

    Raises:
        ValueError: ``checkpoint_dir`` does not exist.
        RuntimeError: ``checkpoint_dir`` holds a corrupt manifest (nothing is written).
    """
    if sync:
        state.sync()
    if _rank() != 0:
        return
    if not os.path.isdir(checkpoint_dir):
        raise ValueError(
            f"checkpoint_dir={checkpoint_dir!r} does not exist; create it before saving"
        )
    mpath = os.path.join(checkpoint_dir, _MANIFEST)
    manifest = (
        _read_manifest(checkpoint_dir)
        if os.path.exists(mpath)
        else {"format": _FORMAT, "states": {}}
    )
    previous = _entry_file(manifest["states"].get(state.name))
    fname, entry = _write_fresh_state_file(state, checkpoint_dir)
    _fsync_dir(checkpoint_dir)  # the new file's name is durable before a manifest names it
    manifest["states"][state.name] = entry
    _write_manifest(checkpoint_dir, manifest)
    _fsync_dir(checkpoint_dir)  # the new manifest is durable before the old file goes
    # The manifest no longer names them: the previous file, and debris of crashed saves.
    keep = {_entry_file(e) for e in manifest["states"].values()}
    prefix = _version_prefix(state.name)
    try:
        stale = [f for f in os.listdir(checkpoint_dir) if f.startswith(prefix)]
        if previous is not None:
            stale.append(previous)
        for f in set(stale) - keep:
            path = os.path.join(checkpoint_dir, f)
            _verdicts.pop(path, None)
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
    except OSError as exc:  # the state is saved: a failed clean-up is no failed save
        logger.warning(
            "state %r saved to %s, but its older files were not removed: %s",
            state.name,
            os.path.join(checkpoint_dir, fname),
            exc,
        )


def _serialise(state: State, f: BinaryIO) -> dict:
    """Write ``state`` into the open file ``f`` and fsync it; its checksum and size."""
    writer = _HashingWriter(f)
    state.save(writer)
    f.flush()
    os.fsync(f.fileno())
    return {"sha256": writer.hexdigest(), "size": writer.size}


def _write_state_file(state: State, checkpoint_dir: str) -> tuple[str, dict]:
    """Serialise ``state`` into its (fsynced) file in ``checkpoint_dir``; its manifest entry."""
    fname = _file_name(state.name)
    path = os.path.join(checkpoint_dir, fname)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        entry = _serialise(state, f)
    os.replace(tmp, path)
    return fname, {"file": fname, **entry}


def _write_fresh_state_file(state: State, checkpoint_dir: str) -> tuple[str, dict]:
    """Serialise ``state`` into a new (fsynced) file of ``checkpoint_dir`` whose name no file
    there has (``state-<quoted name>%v<random hex>``); its name and manifest entry. A failed
    ``save`` removes the partial file."""
    prefix = _version_prefix(state.name)
    while True:
        fname = prefix + secrets.token_hex(_VERSION_LEN // 2)
        path = os.path.join(checkpoint_dir, fname)
        try:
            f = open(path, "xb")  # never an existing file, e.g. the one the manifest names
        except FileExistsError:
            continue
        break
    try:
        with f:
            entry = _serialise(state, f)
    except BaseException:
        try:
            os.remove(path)
        except OSError:
            pass
        raise
    return fname, {"file": fname, **entry}


def _writer_alive(entry: str) -> bool:
    """Whether the temporary folder ``entry`` (``.tmp-checkpoint-SEQ-PID``) belongs to another
    process of this host that is still running (another job saving into the same root): its
    save is in progress and must not be deleted. Debris of this process or of a dead one is
    not. (A writer on another host cannot be seen; only rank 0 writes.)"""
    try:
        pid = int(entry.rsplit("-", 1)[1])
    except (IndexError, ValueError):
        return False
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        pass
    return True


def save_all_states(*, background: bool = False) -> bool:
    """Checkpoint every registered State (collective: call on every replica at the same point).

    Returns False (and does nothing) when checkpointing is off, True once the new checkpoint is
    in place; every replica returns only after rank 0 has finished writing.

    With ``background`` (periodic checkpoints): every replica syncs its States as usual, rank 0
    serialises them into memory and a daemon thread writes and publishes the checkpoint; every
    replica returns as soon as that is handed over (True; on rank 0 False when the checkpoint
    could not be started: logged, the previous checkpoint is kept). A failed write is logged as
    a warning by rank 0 and leaves the previous checkpoint in place; nobody raises for it.

    Raises:
        RuntimeError: on every replica, before any State is synced, when the replicas hold
            different States with a ``sync`` of their own (naming which ranks lack which);
            or on every replica but rank 0, when rank 0 could not write the checkpoint
            (rank 0 raises its own error). In the latter case every State is synced all the
            same; either way the replicas' collectives stay in step and a caught error leaves
            them able to go on.
    """
    global _loaded_from, _loaded_from_chosen
    if env.checkpoint_path() is None:
        return False
    rank0 = _rank() == 0
    error: Exception | None = None
    seq = tmp = None
    if rank0:
        wait_for_background_save()  # its number is taken: the next one follows it
        try:
            root = checkpoint_root()
            dirs = _seq_dirs(root)
            seq = dirs[-1][0] + 1 if dirs else 0
            tmp = os.path.join(root, f".tmp-checkpoint-{seq:06d}-{os.getpid()}")
            if not background:  # else the writer thread makes it
                shutil.rmtree(tmp, ignore_errors=True)
                os.makedirs(tmp)
        except Exception as exc:  # noqa: BLE001 - every replica hears of it below
            error = exc
    if collective.is_distributed():
        # One collective hands out rank 0's number and checks that every replica syncs the
        # same States: one that some replicas lack would pair their syncs' collectives with
        # other ones and hang the job (or fail far from the cause).
        synced = _synced_names()
        views = collective.allreduce([(_digest(synced), seq)])
        seq = views[0][1]
        if any(digest != views[0][0] for digest, _ in views):
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            _raise_mismatch(collective.allreduce([synced]))  # on every replica alike
    manifest: dict = {"format": _FORMAT, "states": {}}
    blobs: list[tuple[str, io.BytesIO]] = []  # background: the States serialised in memory
    started = time.perf_counter()
    for name in sorted(_registry):  # same order on every replica: sync() may be collective
        state = _registry[name]
        state.sync()
        if rank0 and error is None:
            try:
                if background:
                    buf = io.BytesIO()
                    state.save(buf)
                    blobs.append((name, buf))
                else:
                    manifest["states"][name] = _write_state_file(state, tmp)[1]
            except Exception as exc:  # noqa: BLE001 - the other States still sync
                error = exc
    if background:
        if not rank0:
            return True
        if error is not None:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            logger.warning("periodic checkpoint not started: %s: %s", type(error).__name__, error)
            return False
        _start_writer(root, tmp, seq, blobs, time.perf_counter() - started)
        return True
    final = None
    if rank0 and error is None:
        try:
            final = _publish(root, tmp, seq, manifest)
        except Exception as exc:  # noqa: BLE001
            error = exc
    # Rank 0's verdict doubles as the barrier: nobody returns before the checkpoint is whole.
    failed = collective.broadcast(None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    if failed is not None:
        raise RuntimeError(
            f"rank 0 could not write the checkpoint ({failed}); no checkpoint was saved and the "
            "previous one, if any, is kept"
        )
    if final is None:
        final = os.path.join(checkpoint_root(), f"checkpoint-{seq:06d}")
    # Later load_state calls in this process see what was just saved.
    _loaded_from, _loaded_from_chosen = final, True
    _verdicts.clear()
    return True


def wait_for_background_save() -> dict[str, float]:
    """Wait for rank 0's background checkpoint write, if one is running; what the last one
    took: ``{"seq", "serialise_s", "write_s", "ok"}`` (empty before the first, and on the
    other ranks).

    ``serialise_s``: the States' serialisation into memory, on the step that took the
    checkpoint (its syncs included); ``write_s``: the write, fsyncs and rename in the
    background; ``ok``: 1.0 if the checkpoint was published, else 0.0.
    """
    writer = _writer
    if writer is not None:
        writer.join()
    return dict(_last_write)


def _start_writer(
    root: str, tmp: str, seq: int, blobs: list[tuple[str, io.BytesIO]], serialise_s: float
) -> None:
    """Rank 0: write ``blobs`` into ``tmp`` and publish it as ``checkpoint-<seq>`` on a daemon
    thread (the checkpoint this process restored from is kept)."""
    global _writer
    keep = None if _loaded_from is None else os.path.basename(_loaded_from)

    def write() -> None:
        t0 = time.perf_counter()
        ok = 0.0
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
            manifest: dict = {"format": _FORMAT, "states": {}}
            for name, buf in blobs:
                manifest["states"][name] = _write_bytes_file(name, buf.getbuffer(), tmp)
            blobs.clear()  # the memory goes before the rename's fsyncs
            _publish(root, tmp, seq, manifest, keep=keep)
            ok = 1.0
        except Exception as exc:  # noqa: BLE001 - logged; the previous checkpoint stays
            shutil.rmtree(tmp, ignore_errors=True)
            logger.warning(
                "periodic checkpoint %d not written (%s: %s); the previous one is kept",
                seq,
                type(exc).__name__,
                exc,
            )
        _last_write.update(
            seq=float(seq), serialise_s=serialise_s, write_s=time.perf_counter() - t0, ok=ok
        )

    _writer = threading.Thread(target=write, name="adaptrain-checkpoint-write", daemon=True)
    _writer.start()


def _write_bytes_file(name: str, data: memoryview, checkpoint_dir: str) -> dict:
    """Write the serialised State ``name`` into its (fsynced) file of ``checkpoint_dir``; its
    manifest entry."""
    fname = _file_name(name)
    path = os.path.join(checkpoint_dir, fname)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        writer = _HashingWriter(f)
        writer.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return {"file": fname, "sha256": writer.hexdigest(), "size": writer.size}


def _synced_names() -> list[str]:
    """Sorted names of the registered States whose ``sync`` is their own (may be collective):
    those every replica must hold. The default no-op ``sync`` cannot go out of step."""
    return sorted(
        name
        for name, state in _registry.items()
        if getattr(state.sync, "__func__", None) is not State.sync
    )


def _digest(names: list[str]) -> bytes:
    return hashlib.sha256(json.dumps(names).encode()).digest()


def _raise_mismatch(held: list[list[str]]) -> NoReturn:
    """Raise the error of replicas holding different States; ``held[r]``: rank r's names."""
    every = sorted(set().union(*held))
    missing = [(n, [r for r, names in enumerate(held) if n not in names]) for n in every]
    missing = [(n, ranks) for n, ranks in missing if ranks]
    shown = "; ".join(f"{n!r:.80} is missing on rank(s) {ranks}" for n, ranks in missing[:10])
    if len(missing) > 10:
        shown += f"; and {len(missing) - 10} more"
    raise RuntimeError(
        f"the replicas hold different States, whose sync() may be collective: {shown}; "
        "construct the same State objects on every replica before saving (no checkpoint was "
        "saved; the previous one, if any, is kept)"
    )


def _publish(root: str, tmp: str, seq: int, manifest: dict, keep: str | None = None) -> str:
    """Rank 0: manifest last, rename ``tmp`` into place, then delete older checkpoints (but
    ``keep``, a checkpoint's folder name) and dead writers' debris. Returns the checkpoint's
    path."""
    final = os.path.join(root, f"checkpoint-{seq:06d}")
    _write_manifest(tmp, manifest)  # last: a directory without it is never renamed
    _fsync_dir(tmp)
    os.rename(tmp, final)
    _fsync_dir(root)
    logger.info("saved %d states to %s", len(manifest["states"]), final)
    try:  # the checkpoint is in place: a failed clean-up is no failed save
        for _, old in _seq_dirs(root)[:-1]:
            if os.path.basename(old) != keep:
                shutil.rmtree(old, ignore_errors=True)
        for entry in os.listdir(root):
            if entry.startswith(".tmp-checkpoint-") and not _writer_alive(entry):
                shutil.rmtree(os.path.join(root, entry), ignore_errors=True)
    except OSError as exc:
        logger.warning("checkpoint %s saved, but older ones were not cleaned up: %s", final, exc)
    return final
