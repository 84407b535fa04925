"""Rescale latency: from SIGTERM to the first training step on a different replica count.

A ~10M-parameter character LM (embedding 512 → GRU 1536 → linear) trains with
``AdaptiveDataParallel`` + ``AdaptiveDataLoader`` on ``N`` gloo processes (real data: the standard
library's source). The benchmark sends SIGTERM to every replica (as a scheduler or torchrun
does), waits for them to checkpoint and exit, immediately starts ``M`` ≠ ``N`` replicas on the same
checkpoint directory and measures until the first optimizer step of the new job has finished.

Every phase is timestamped (wall clock, same machine) so the total splits into::

    stop     SIGTERM → every replica agreed to stop at a step boundary (checkpoint begins)
    save     checkpoint written (all States synced, rank 0 wrote and renamed the directory)
    exit     checkpoint done → last old process exited (barrier, group teardown, interpreter exit)
    spawn    new processes launched → Python running the script
    import   ``import torch`` + adaptrain
    group    ``init_process_group`` (rendezvous of the new replicas)
    restore  model/optimizer/loader built and their States loaded from the checkpoint; split into
             ``restore.build`` (model + optimizer construction: the first ``torch.optim``
             optimizer imports ``torch._dynamo``, ~40 % of torch's import cost) and
             ``restore.load`` (wrapper + loader construction, checkpoint verified and loaded)
    step     the first training step (forward, backward, all-reduce, optimizer)

``--exit-mode`` picks how the old replicas leave (``adaptrain.dist.signals.set_exit_mode``):
``fast`` (default: finally blocks and atexit hooks run, interpreter finalisation skipped),
``full`` (normal interpreter shutdown, the behaviour before) or ``immediate``.

Usage::

    python benchmarks/bench_rescale.py                # 2→1 and 1→2, 3 repetitions each
    python benchmarks/bench_rescale.py --reps 1 --transitions 2:3
    python benchmarks/bench_rescale.py --exit-modes full fast   # paired comparison
    python benchmarks/bench_rescale.py --io-only --reps 7   # checkpoint save/load path alone

``--io-only`` times, in one process, saving and restoring the same model + Adam state (110 MB)
through ``adaptrain.dist.checkpoint`` against the previous path re-implemented here (serialise
into memory, write, fsync, hash in a second pass; on load read everything, hash, ``torch.load``
from memory), paired and alternated in each repetition.
"""

from __future__ import annotations

import time

_T_START = time.time()  # before any heavy import: "python is running the script"

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

PHASES = ("stop", "save", "exit", "spawn", "import", "group", "restore", "step")


def _mark(share: Path, rank: int, key: str, t: float | None = None) -> None:
    """Append ``key: time`` to this rank's timestamp file (one JSON object per line)."""
    with open(share / f"times-{os.getpid()}-{rank}.jsonl", "a") as f:
        f.write(json.dumps({"key": key, "t": time.time() if t is None else t, "rank": rank}) + "\n")


# ------------------------------------------------------------------------------------------------
# Worker (one replica)


def worker(args: argparse.Namespace) -> None:
    share = Path(args.share)
    rank = int(os.environ["RANK"])
    _mark(share, rank, "start", _T_START)
    import atexit

    atexit.register(lambda: _mark(share, rank, "atexit_last"))  # LIFO: runs after every hook
    import torch

    import adaptrain.checkpoint as checkpoint
    import adaptrain.torch as adl
    from adaptrain.dist import signals
    from adaptrain.workloads import CharLM, charlm_datasets, charlm_loss

    torch.set_num_threads(1)
    signals.set_exit_mode(args.exit_mode)
    _mark(share, rank, "imported")

    class Timer(checkpoint.State):
        """Timestamps the checkpoint: its name sorts first (sync → begin) or last (save → end)."""

        def __init__(self, name: str, key: str) -> None:
            super().__init__(name)
            self.key = key

        def sync(self) -> None:
            if self.key == "save_begin":
                _mark(share, rank, self.key)

        def save(self, fileobj) -> None:
            if self.key == "save_end":
                _mark(share, rank, self.key)
            fileobj.write(b"0")

        def load(self, fileobj) -> None:
            fileobj.read()

    adl.init_process_group("gloo")
    _mark(share, rank, "group")
    Timer("!!bench-begin", "save_begin")
    Timer("~~bench-end", "save_end")
    train_set, _ = charlm_datasets(seq_len=16, max_chars=200_000, cache_dir=share.parent / "cache")
    model = CharLM(embed_dim=512, hidden=1536, seed=0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    _mark(share, rank, "built")
    model = adl.AdaptiveDataParallel(model, optimizer)
    loader = adl.AdaptiveDataLoader(
        train_set, batch_size=4 * int(os.environ["WORLD_SIZE"]), shuffle=True
    )
    _mark(share, rank, "restored")
    atexit.register(lambda: _mark(share, rank, "atexit"))  # runs before adaptrain's exit hook
    try:
        _train(args, share, rank, adl, model, optimizer, loader, charlm_loss)
    except SystemExit:
        _mark(share, rank, "sysexit")
        raise


def _train(args, share, rank, adl, model, optimizer, loader, charlm_loss) -> None:
    first = True
    for _epoch in adl.remaining_epochs_until(1000):
        for batch in loader:
            loss = charlm_loss(model, batch)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if first:
                _mark(share, rank, "first_step")
                first = False
                if args.first_step_only:
                    return
            _mark(share, rank, "step")


# ------------------------------------------------------------------------------------------------
# Checkpoint I/O alone (--io-only)


def _old_save(state_dict: dict, path: str) -> str:
    import hashlib
    import io

    import torch

    buf = io.BytesIO()
    torch.save(state_dict, buf)
    data = buf.getvalue()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return hashlib.sha256(data).hexdigest()


def _old_load(path: str, sha: str) -> dict:
    import hashlib
    import io

    import torch

    with open(path, "rb") as f:
        data = f.read()
    if hashlib.sha256(data).hexdigest() != sha:
        raise RuntimeError(f"{path}: checksum mismatch")
    return torch.load(io.BytesIO(data), weights_only=True)


def io_only(reps: int) -> None:
    import torch

    from adaptrain import checkpoint
    from adaptrain.workloads import CharLM

    torch.set_num_threads(1)
    model = CharLM(embed_dim=512, hidden=1536, seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    model(torch.zeros(2, 4, dtype=torch.int64)).sum().backward()
    opt.step()
    sd = {"model": model.state_dict(), "optimizer": opt.state_dict()}

    class Whole(checkpoint.State):
        def __init__(self) -> None:
            super().__init__("whole")
            self.value = sd

        def save(self, fileobj) -> None:
            torch.save(self.value, fileobj)

        def load(self, fileobj) -> None:
            self.value = torch.load(fileobj, weights_only=True)

    root = Path(tempfile.mkdtemp(prefix="bench-rescale-io-"))
    os.environ["ADAPTRAIN_CHECKPOINT_PATH"] = str(root)  # the variable adaptrain.env reads
    rows = []
    try:
        for rep in range(reps):
            times = {}
            for variant in ("old", "new") if rep % 2 == 0 else ("new", "old"):
                if variant == "old":
                    t0 = time.perf_counter()
                    sha = _old_save(sd, str(root / "old.pt"))
                    t1 = time.perf_counter()
                    _old_load(str(root / "old.pt"), sha)
                    t2 = time.perf_counter()
                else:
                    checkpoint.reset()
                    Whole()
                    t0 = time.perf_counter()
                    checkpoint.save_all_states()
                    t1 = time.perf_counter()
                    checkpoint.reset()
                    state = Whole()
                    checkpoint.load_state(state)
                    t2 = time.perf_counter()
                times[variant] = (t1 - t0, t2 - t1)
            rows.append(times)
            print(
                f"rep {rep}: save old {times['old'][0]:.3f} new {times['new'][0]:.3f}  "
                f"load old {times['old'][1]:.3f} new {times['new'][1]:.3f}",
                flush=True,
            )
    finally:
        checkpoint.reset()
        shutil.rmtree(root, ignore_errors=True)
    for i, what in enumerate(("save", "load")):
        ratio = statistics.median(r["new"][i] / r["old"][i] for r in rows)
        old = statistics.median(r["old"][i] for r in rows)
        new = statistics.median(r["new"][i] for r in rows)
        print(
            f"{what}: new/old = {ratio:.2f} (median of {reps} paired reps; "
            f"medians old {old:.3f} s, new {new:.3f} s)"
        )


# ------------------------------------------------------------------------------------------------
# Driver


def _launch(
    n: int, share: Path, ckpt: Path, port: int, first_step_only: bool, exit_mode: str = "fast"
) -> list:
    procs = []
    for rank in range(n):
        env = dict(os.environ)
        env.update(
            {
                "RANK": str(rank),
                "WORLD_SIZE": str(n),
                "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(n),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "ADAPTRAIN_CHECKPOINT_PATH": str(ckpt),
                "OMP_NUM_THREADS": "1",
            }
        )
        cmd = [sys.executable, __file__, "--worker", "--share", str(share)]
        cmd += ["--exit-mode", exit_mode]
        if first_step_only:
            cmd.append("--first-step-only")
        procs.append(
            subprocess.Popen(
                cmd,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=open(share / f"stderr-{n}-{rank}.log", "a"),
            )
        )
    return procs


def _times(share: Path) -> list[dict]:
    rows = []
    for f in share.glob("times-*.jsonl"):
        rows += [json.loads(line) for line in f.read_text().splitlines() if line]
    return rows


def _wait_all(procs: list, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(deadline - time.monotonic(), 0.1)))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise RuntimeError(f"replicas did not finish within {timeout:.0f}s") from None
    return codes


def one_rescale(
    n_from: int, n_to: int, warm_steps: int, timeout: float, exit_mode: str = "fast"
) -> dict[str, float]:
    from adaptrain.dist.spawn import free_port

    root = Path(tempfile.mkdtemp(prefix="bench-rescale-"))
    try:
        old, new, ckpt = root / "old", root / "new", root / "ckpt"
        for d in (old, new, ckpt):
            d.mkdir()
        from adaptrain.workloads import charlm_datasets

        charlm_datasets(seq_len=16, max_chars=200_000, cache_dir=root / "cache")
        procs = _launch(n_from, old, ckpt, free_port(), False, exit_mode)
        deadline = time.monotonic() + timeout
        while sum(r["key"] == "step" and r["rank"] == 0 for r in _times(old)) < warm_steps:
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                for p in procs:
                    p.kill()
                raise RuntimeError(f"old job did not train; see {old}/stderr-*.log")
            time.sleep(0.2)
        t_sig = time.time()
        for p in procs:
            p.send_signal(signal.SIGTERM)
        codes = _wait_all(procs, timeout)
        t_exit = time.time()
        if any(c != 143 for c in codes):
            raise RuntimeError(f"old replicas exited with {codes}, expected 143 (checkpointed)")
        t_launch = time.time()
        procs = _launch(n_to, new, ckpt, free_port(), first_step_only=True)
        codes = _wait_all(procs, timeout)
        if any(c != 0 for c in codes):
            raise RuntimeError(f"new replicas exited with {codes}; see {new}/stderr-*.log")
        o, nw = _times(old), _times(new)

        def first(rows: list[dict], key: str) -> float:
            return min(r["t"] for r in rows if r["key"] == key)

        def last(rows: list[dict], key: str) -> float:
            return max(r["t"] for r in rows if r["key"] == key)

        detail = {
            "exit.teardown": last(o, "sysexit") - last(o, "save_end"),
            "exit.atexit_hooks": last(o, "atexit_last") - last(o, "sysexit"),
            "exit.interpreter": t_exit - last(o, "atexit_last"),
            "restore.build": last(nw, "built") - last(nw, "group"),
            "restore.load": last(nw, "restored") - last(nw, "built"),
        }
        marks = [
            t_sig,
            first(o, "save_begin"),
            last(o, "save_end"),
            t_exit,
            t_launch,
            last(nw, "start"),
            last(nw, "imported"),
            last(nw, "group"),
            last(nw, "restored"),
            last(nw, "first_step"),
        ]
        # spawn = launch → the slowest new process is running python (t_exit→t_launch is ~0).
        out = {
            "stop": marks[1] - marks[0],
            "save": marks[2] - marks[1],
            "exit": marks[3] - marks[2],
            "spawn": marks[5] - marks[4],
            "import": marks[6] - marks[5],
            "group": marks[7] - marks[6],
            "restore": marks[8] - marks[7],
            "step": marks[9] - marks[8],
        }
        out["total"] = marks[9] - marks[0]
        out.update(detail)
        ckpt_files = list(ckpt.rglob("*"))
        out["checkpoint_mb"] = sum(f.stat().st_size for f in ckpt_files if f.is_file()) / 2**20
        return out
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--share", help=argparse.SUPPRESS)
    p.add_argument("--first-step-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument(
        "--transitions", nargs="+", default=["2:1", "1:2"], help="replica counts FROM:TO to measure"
    )
    p.add_argument("--warm-steps", type=int, default=3, help="steps before the SIGTERM")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--exit-mode", default="fast", help=argparse.SUPPRESS)
    p.add_argument("--io-only", action="store_true", help="time the checkpoint save/load path only")
    p.add_argument(
        "--exit-modes",
        nargs="+",
        default=["fast"],
        choices=["fast", "full", "immediate"],
        help="exit modes of the old replicas; several are run paired, in turn, per repetition",
    )
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    if args.io_only:
        print(f"checkpoint I/O of CharLM(512, GRU 1536) + Adam; load {os.getloadavg()[0]:.1f}")
        io_only(args.reps)
        return
    import torch

    from adaptrain.workloads import CharLM

    n_params = sum(q.numel() for q in CharLM(embed_dim=512, hidden=1536).parameters())
    print(
        f"model: CharLM(embed 512, GRU 1536), {n_params / 1e6:.2f}M parameters; "
        f"torch {torch.__version__}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}"
    )
    results: dict[str, list[dict[str, float]]] = {}
    for tr in args.transitions:
        a, b = (int(x) for x in tr.split(":"))
        for rep in range(args.reps):
            for mode in args.exit_modes:  # paired: every mode once per repetition
                r = one_rescale(a, b, args.warm_steps, args.timeout, mode)
                results.setdefault(f"{tr} {mode}", []).append(r)
                print(
                    f"{a}→{b} [{mode}] rep {rep}: total {r['total']:.2f}s  "
                    + "  ".join(f"{k} {v:.2f}" for k, v in r.items() if k != "total"),
                    flush=True,
                )
    print(f"\nmedian seconds per phase (goal: total ≤ 5 s); load now {os.getloadavg()[0]:.1f}")
    extra = ("exit.interpreter", "restore.build", "restore.load")
    header = (
        "| transition | exit mode | "
        + " | ".join(PHASES)
        + " | total | checkpoint MB | "
        + " | ".join(extra)
        + " |"
    )
    print(header)
    print("|" + "---|" * (len(PHASES) + 4 + len(extra)))
    for key, rows in results.items():
        tr, mode = key.split()
        med = {
            k: statistics.median(r[k] for r in rows)
            for k in (*PHASES, "total", "checkpoint_mb", *extra)
        }
        print(
            f"| {tr.replace(':', '→')} | {mode} | "
            + " | ".join(f"{med[k]:.2f}" for k in PHASES)
            + f" | **{med['total']:.2f}** | {med['checkpoint_mb']:.0f} | "
            + " | ".join(f"{med[k]:.2f}" for k in extra)
            + " |"
        )
    if len(args.exit_modes) > 1:
        base = args.exit_modes[0]
        for tr in args.transitions:
            for mode in args.exit_modes[1:]:
                ratios = [
                    r["total"] / r0["total"]
                    for r, r0 in zip(results[f"{tr} {mode}"], results[f"{tr} {base}"], strict=True)
                ]
                print(
                    f"{tr.replace(':', '→')}: total {mode}/{base} = "
                    f"{statistics.median(ratios):.2f} (median of {len(ratios)} paired reps)"
                )


if __name__ == "__main__":
    main()
