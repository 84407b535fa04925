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
    restore  model/optimizer/loader built and their States loaded from the checkpoint
    step     the first training step (forward, backward, all-reduce, optimizer)

Usage::

    python benchmarks/bench_rescale.py                # 2→1 and 1→2, 3 repetitions each
    python benchmarks/bench_rescale.py --reps 1 --transitions 2:3
"""

from __future__ import annotations

import time

_T_START = time.time()  # before any heavy import: "python is running the script"

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

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
    from adaptrain.workloads import CharLM, charlm_datasets, charlm_loss

    torch.set_num_threads(1)
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
# Driver


def _launch(n: int, share: Path, ckpt: Path, port: int, first_step_only: bool) -> list:
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


def one_rescale(n_from: int, n_to: int, warm_steps: int, timeout: float) -> dict[str, float]:
    from adaptrain.dist.spawn import free_port

    root = Path(tempfile.mkdtemp(prefix="bench-rescale-"))
    try:
        old, new, ckpt = root / "old", root / "new", root / "ckpt"
        for d in (old, new, ckpt):
            d.mkdir()
        from adaptrain.workloads import charlm_datasets

        charlm_datasets(seq_len=16, max_chars=200_000, cache_dir=root / "cache")
        procs = _launch(n_from, old, ckpt, free_port(), first_step_only=False)
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
    args = p.parse_args()
    if args.worker:
        worker(args)
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
            r = one_rescale(a, b, args.warm_steps, args.timeout)
            results.setdefault(tr, []).append(r)
            print(
                f"{a}→{b} rep {rep}: total {r['total']:.2f}s  "
                + "  ".join(f"{k} {v:.2f}" for k, v in r.items() if k != "total"),
                flush=True,
            )
    print("\nmedian seconds per phase (goal: total ≤ 5 s)")
    header = (
        "| transition | " + " | ".join(PHASES) + " | total | checkpoint MB | exit: interpreter |"
    )
    print(header)
    print("|" + "---|" * (len(PHASES) + 4))
    for tr, rows in results.items():
        med = {
            k: statistics.median(r[k] for r in rows)
            for k in (*PHASES, "total", "checkpoint_mb", "exit.interpreter")
        }
        print(
            f"| {tr.replace(':', '→')} | "
            + " | ".join(f"{med[k]:.2f}" for k in PHASES)
            + f" | **{med['total']:.2f}** | {med['checkpoint_mb']:.0f} |"
            + f" {med['exit.interpreter']:.2f} |"
        )


if __name__ == "__main__":
    main()
