"""One replica of ``adaptrain demo`` (started by torchrun; see :mod:`adaptrain.cli.demo`).

Trains :class:`~adaptrain.workloads.CharLM` on the standard library's source with
``AdaptiveDataParallel`` and an ``AdaptiveDataLoader`` whose batch size autoscales (with gradient
accumulation), for a wall-clock budget of ``--minutes``. Rank 0 shows a tqdm bar (loss, batch
size, gain, predicted goodput), writes TensorBoard scalars under ``ADAPTRAIN_TENSORBOARD_LOGDIR``
and, at the end, a PNG plot and a one-screen summary under ``--out``.

Restarts: the elapsed training time, step counters, the budget and the plotted history are the
checkpoint State ``"adaptrain-demo"``, so the time budget and the plot survive Ctrl-C + rerun. Rank 0
alone decides when the budget is spent and broadcasts the decision after every optimizer step
(:func:`adaptrain.collective.broadcast`), so all replicas stop after the same step.

A rerun whose checkpoint has the budget spent (a Ctrl-C or SIGTERM during the final validation,
which polls the stop flag like any loader loop, or just after the last step) trains no further but
runs that final validation: the validation loader resumes its pass where the checkpoint left it and
the epoch's :class:`~adaptrain.torch.Accumulator` keeps the sums of the part already done, so the
rerun records exactly the result the interrupted run would have. Only then is the job marked done.

The outputs (plot, ``summary.txt``, then ``summary.json``, whose presence tells the launcher the
job finished) are each written under a temporary name and renamed into place, so a kill while
they are written (a second Ctrl-C) leaves either the complete file or none, never a truncated
one; the job is already marked done in its checkpoint, and a rerun writes them again.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import pickle
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import torch
import torch.distributed as dist

import adaptrain.checkpoint as checkpoint
import adaptrain.collective as collective
import adaptrain.torch as adl
from adaptrain import env
from adaptrain.cli.demo import MIN_LOCAL_BSZ, SEQ_LEN
from adaptrain.procs import die_with_parent
from adaptrain.torch import _metrics
from adaptrain.workloads import CharLM, charlm_datasets, charlm_loss

logger = logging.getLogger(__name__)

#: Seconds a replica whose torchrun died has to checkpoint and end before it is killed.
AGENT_GONE_KILL_AFTER = 20.0

#: Columns of the per-step history kept in the checkpoint and plotted at the end.
HISTORY_FIELDS = (
    "elapsed",  # training seconds so far (summed over restarts)
    "step",  # optimizer steps so far
    "loss",  # training loss of the step (nats/char, rank 0's micro-batch)
    "batch_size",  # global batch per optimizer step
    "accum_steps",  # micro-batches per optimizer step
    "gain",  # AdaScale gain of the step
    "sqr",  # |G|^2 estimate
    "var",  # tr(Sigma)/B0 estimate
    "goodput",  # predicted goodput of the current configuration (nan until fitted)
    "throughput",  # measured samples/s since the previous record
)


class DemoState(checkpoint.State):
    """Elapsed training time, counters and history of the demo (checkpointed).

    ``elapsed()`` is the time spent before this process started (restored from the checkpoint)
    plus the time since :meth:`start_clock`; rank 0's value is the one saved.
    """

    def __init__(self) -> None:
        super().__init__("adaptrain-demo")
        self.elapsed_before = 0.0
        self.steps = 0
        self.samples = 0
        self.restarts = 0
        self.done = False
        self.minutes: float | None = None  # the budget the job trains (or trained) under
        self.history: list[tuple[float, ...]] = []
        self.valid: list[tuple[float, int, float]] = []  # (elapsed, step, bits/char)
        self._t0: float | None = None

    def start_clock(self) -> None:
        self._t0 = time.monotonic()

    def stop_clock(self) -> None:
        self.elapsed_before = self.elapsed()
        self._t0 = None

    def elapsed(self) -> float:
        running = 0.0 if self._t0 is None else time.monotonic() - self._t0
        return self.elapsed_before + running

    def save(self, fileobj: BinaryIO) -> None:
        pickle.dump(
            {
                "elapsed": float(self.elapsed()),
                "steps": int(self.steps),
                "samples": int(self.samples),
                "restarts": int(self.restarts),
                "done": bool(self.done),
                "minutes": None if self.minutes is None else float(self.minutes),
                "history": [tuple(float(v) for v in row) for row in self.history],
                "valid": [tuple(float(v) for v in row) for row in self.valid],
            },
            fileobj,
        )

    def load(self, fileobj: BinaryIO) -> None:
        d = pickle.load(fileobj)
        self.elapsed_before = float(d["elapsed"])
        self.steps = int(d["steps"])
        self.samples = int(d["samples"])
        self.done = bool(d["done"])
        # A rerun of a finished job trains nothing: it reports the job, it is no restart.
        self.restarts = int(d["restarts"]) + (0 if self.done else 1)
        minutes = d.get("minutes")  # None in checkpoints written before the budget was kept
        self.minutes = None if minutes is None else float(minutes)
        self.history = [tuple(r) for r in d["history"]]
        self.valid = [tuple(r) for r in d["valid"]]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="adaptrain._demo_worker", description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=3.0)
    p.add_argument("--out", default="out/demo")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-batch-size", type=int, default=512)
    p.add_argument("--max-local-bsz", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--max-chars", type=int, default=2_000_000)
    p.add_argument("--seq-len", type=int, default=SEQ_LEN)
    p.add_argument("--reoptimize-every", type=int, default=25)
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--no-bar", action="store_true", help="plain log lines instead of a tqdm bar")
    p.add_argument(
        "--agent-pid",
        type=int,
        default=None,
        help="torchrun's process id: this replica ends when it dies (given by the demo's agent)",
    )
    return p.parse_args(argv)


def _goodput(loader: Any) -> float:
    """Predicted goodput (samples/s × efficiency) of the loader's current configuration."""
    fn = _metrics.get_goodput_fn()
    if fn is None:
        return math.nan
    replicas = dist.get_world_size()
    nodes = min(max(env.num_nodes(), 1), replicas)
    try:
        value = fn.evaluate(
            nodes, replicas, loader.current_local_bsz, loader.accumulation_steps - 1
        )
    except ValueError:  # batch below the initial one at the end of a pass
        return math.nan
    return float(value)


def _validate(model: torch.nn.Module, loader: Any) -> float:
    """Exact validation loss in bits/char over all replicas."""
    model.eval()
    stats = adl.Accumulator()
    with torch.no_grad():
        for batch in loader:
            loss = charlm_loss(model, batch)
            stats["loss_sum"] += loss.item() * batch[1].numel()
            stats["chars"] += batch[1].numel()
    with stats.synchronized():
        bpc = stats["loss_sum"] / max(stats["chars"], 1) / math.log(2)
    model.train()
    return float(bpc)


def _finite(obj: Any) -> Any:
    """``obj`` with NaN/inf floats replaced by None (strict JSON)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _say(bar: Any, msg: str) -> None:
    """A line of rank 0's log: above the bar, or printed (and flushed) without one."""
    if bar is not None:
        bar.write(msg)
    else:
        print(msg, flush=True)


def write_atomic(path: Path, write: Callable[[Path], None]) -> None:
    """Call ``write(tmp)`` to write ``path``'s content to a temporary file next to it, then
    flush it to disk and rename it over ``path``: readers (and a process killed half-way) see
    the old file or the new one, never a part. A failed ``write`` leaves ``path`` untouched."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _fmt_time(seconds: float) -> str:
    return f"{int(seconds // 60)}:{seconds % 60:04.1f}"


def _budget_minutes(state: DemoState, args: argparse.Namespace) -> float:
    """The budget the job trains (or trained) under: the checkpointed one, else ``--minutes``."""
    return args.minutes if state.minutes is None else state.minutes


def summary_lines(state: DemoState, args: argparse.Namespace, replicas: int) -> list[str]:
    """The one-screen summary printed (and saved) at the end."""
    h = state.history
    lines = [
        "adaptrain demo — character LM on the Python standard library's source",
        f"  replicas             {replicas} (gloo, CPU)",
        f"  training time        {_fmt_time(state.elapsed())} of "
        f"{_budget_minutes(state, args):g} min budget"
        f" ({state.restarts} restart(s))",
        f"  optimizer steps      {state.steps}   samples {state.samples}",
    ]
    if h:
        first, last = h[0], h[-1]
        bs = [r[3] for r in h]
        lines += [
            f"  batch size           {int(first[3])} → {int(last[3])} (max seen {int(max(bs))}, "
            f"accumulation steps {int(last[4])})",
            f"  train loss           {first[2]:.3f} → {last[2]:.3f} nats/char",
            f"  gain (last)          {last[5]:.3f}   sqr {last[6]:.3g}   var {last[7]:.3g}",
        ]
        gp = [r[8] for r in h if math.isfinite(r[8])]
        if gp:
            lines.append(f"  predicted goodput    {gp[-1]:.1f} (first fitted {gp[0]:.1f})")
        tp = [r[9] for r in h[len(h) // 2 :] if math.isfinite(r[9]) and r[9] > 0]
        if tp:
            lines.append(
                f"  throughput           {sorted(tp)[len(tp) // 2]:.0f} samples/s "
                "(median, second half)"
            )
    if state.valid:
        v0, v1 = state.valid[0], state.valid[-1]
        lines.append(
            f"  validation           {v0[2]:.3f} → {v1[2]:.3f} bits/char "
            f"({len(state.valid)} evaluations)"
        )
    out = Path(args.out)
    outputs = [] if args.no_plot or not h else [out / "demo.png"]
    outputs += [out / "summary.json", out / "tensorboard"]
    lines.append(f"  outputs              {', '.join(map(str, outputs))}")
    return lines


def plot(state: DemoState, path: Path) -> None:
    """PNG of loss, batch size, accumulation, gain, sqr/var, goodput, throughput over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = {name: [row[i] for row in state.history] for i, name in enumerate(HISTORY_FIELDS)}
    minutes = [t / 60 for t in cols["elapsed"]]
    fig, axes = plt.subplots(2, 4, figsize=(16, 7), sharex=True)
    panels = [
        ("loss", "train loss (nats/char)"),
        ("batch_size", "global batch size"),
        ("accum_steps", "accumulation steps"),
        ("gain", "gain"),
        ("sqr", "|G|² (sqr)"),
        ("var", "tr Σ / B0 (var)"),
        ("goodput", "predicted goodput"),
        ("throughput", "throughput (samples/s)"),
    ]
    for ax, (key, title) in zip(axes.flat, panels):
        ax.plot(minutes, cols[key], lw=1)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        if key in ("sqr", "var") and any(v > 0 for v in cols[key]):
            ax.set_yscale("log")
    if state.valid:
        ax = axes.flat[0]
        ax.plot(
            [v[0] / 60 for v in state.valid],
            [v[2] * math.log(2) for v in state.valid],
            "o-",
            label="validation",
            color="C3",
        )
        ax.legend(fontsize=8)
    for ax in axes[-1]:
        ax.set_xlabel("training time (min)")
    fig.suptitle("adaptrain demo: char LM, autoscaled batch size")
    fig.tight_layout()
    try:
        write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=80, format="png"))
    finally:
        plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.agent_pid is not None:
        # torchrun gone (SIGKILLed, crashed): SIGTERM, a graceful stop with a checkpoint, and
        # SIGKILL if that has not ended the replica in AGENT_GONE_KILL_AFTER seconds
        die_with_parent(args.agent_pid, kill_after=AGENT_GONE_KILL_AFTER)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    adl.init_process_group("gloo")
    rank, replicas = dist.get_rank(), dist.get_world_size()
    out = Path(args.out)

    # Rank 0 encodes the corpus into the cache first; the others then read it.
    cache = out / "cache"
    if rank == 0:
        charlm_datasets(args.seq_len, args.max_chars, valid_fraction=0.05, cache_dir=cache)
    collective.barrier()
    train_set, valid_set = charlm_datasets(
        args.seq_len, args.max_chars, valid_fraction=0.05, cache_dir=cache
    )

    model = CharLM(hidden=args.hidden, seed=0)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    model = adl.AdaptiveDataParallel(model, optimizer)
    train_loader = adl.AdaptiveDataLoader(train_set, batch_size=args.batch_size, shuffle=True)
    train_loader.autoscale_batch_size(
        args.max_batch_size,
        local_bsz_bounds=(MIN_LOCAL_BSZ, args.max_local_bsz),
        gradient_accumulation=True,
        reoptimize_every=args.reoptimize_every,
    )
    valid_loader = adl.AdaptiveDataLoader(valid_set, batch_size=256)

    state = DemoState()
    checkpoint.load_state(state)
    earlier = state.minutes
    if not state.done:
        # An unfinished job trains to the budget given now (a rerun may extend or shorten it);
        # a finished one keeps the budget it ran under.
        state.minutes = args.minutes
    budget = _budget_minutes(state, args) * 60.0

    writer = bar = None
    if rank == 0:
        tb = env.tensorboard_path()
        if tb is not None:
            from torch.utils.tensorboard import SummaryWriter

            # Steps are numbered from 1: events of an earlier run at this step or later (steps
            # trained after the checkpoint, or a whole run before --fresh or before a first
            # checkpoint) are dropped by TensorBoard instead of mixed with this run's.
            writer = SummaryWriter(tb, purge_step=state.steps + 1)
        if not args.no_bar:
            from tqdm import tqdm

            bar = tqdm(
                total=round(budget),
                unit="s",
                dynamic_ncols=True,
                initial=min(round(state.elapsed_before), round(budget)),
                bar_format="{l_bar}{bar}| {n:.0f}/{total_fmt}s{postfix}",
            )
        if state.done:
            _say(bar, f"the job in {out} is finished ({state.steps} steps); its summary follows")
            if state.minutes is not None and state.minutes != args.minutes:
                _say(
                    bar,
                    f"the job in {out} already finished under a {state.minutes:g} min budget; "
                    f"--minutes {args.minutes:g} applies to a new job: give another --out (or "
                    "--fresh to start this one over)",
                )
        elif state.restarts:
            msg = (
                f"resuming after {_fmt_time(state.elapsed_before)} of training "
                f"({state.steps} steps, restart {state.restarts})"
            )
            if earlier is not None and earlier != args.minutes:
                msg += f"; budget now {args.minutes:g} min (was {earlier:g})"
            _say(bar, msg)

    state.start_clock()
    # Budget spent at the (re)start of an unfinished job: the checkpoint was taken in the final
    # validation or just after the last step. No more training, but that validation (resumed
    # where it stopped; see the module docstring), unless the model of this step already has one.
    spent = state.elapsed_before >= budget
    validated = spent and bool(state.valid) and int(state.valid[-1][1]) == state.steps
    last_t, last_samples = state.elapsed(), state.samples
    record_every = 2.0  # seconds between history rows
    for epoch in adl.remaining_epochs_until(1_000_000):
        if state.done or validated:
            break
        stop = spent
        for inputs, targets in () if spent else train_loader:  # spent: validate only
            loss = charlm_loss(model, (inputs, targets))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            helper = adl.current_dataloader()
            if helper is None or not helper.is_optim_step():
                continue
            state.steps += 1
            state.samples += train_loader.current_batch_size
            if rank == 0:
                now = state.elapsed()
                if now - last_t >= record_every or not state.history:
                    thr = (state.samples - last_samples) / max(now - last_t, 1e-9)
                    last_t, last_samples = now, state.samples
                    gp = _goodput(train_loader)
                    row = (
                        now,
                        state.steps,
                        loss.item(),
                        train_loader.current_batch_size,
                        train_loader.accumulation_steps,
                        model.gain,
                        model.gns.sqr_avg(),
                        model.gns.var_avg(),
                        gp,
                        thr if state.history else math.nan,
                    )
                    state.history.append(row)
                    if writer is not None:
                        for name, value in zip(HISTORY_FIELDS[2:], row[2:]):
                            if math.isfinite(value):
                                writer.add_scalar(f"demo/{name}", value, state.steps)
                        model.to_tensorboard(writer, state.steps, "adaptdl")
                        train_loader.to_tensorboard(writer, state.steps, "adaptdl")
                    if bar is not None:
                        bar.n = min(now, bar.total)  # total: the budget, rounded
                        bar.set_postfix_str(
                            f"ep {epoch} loss {row[2]:.3f} bs {row[3]} (acc {row[4]}) "
                            f"gain {row[5]:.2f} goodput {gp:.0f}",
                            refresh=True,
                        )
                    else:
                        print(
                            f"[{_fmt_time(now)}] epoch {epoch} step {state.steps} "
                            f"loss {row[2]:.3f} batch {row[3]} accum {row[4]} "
                            f"gain {row[5]:.3f} goodput {gp:.1f}",
                            flush=True,
                        )
                stop = now >= budget
            stop = bool(collective.broadcast(stop))
            if stop:
                break
        if stop and rank == 0:  # tells a Ctrl-C from now on from one during training
            _say(bar, f"training budget spent after {state.steps} steps: final validation")
        bpc = _validate(model, valid_loader)
        if rank == 0:
            state.valid.append((state.elapsed(), state.steps, bpc))
            if writer is not None:
                writer.add_scalar("demo/valid_bits_per_char", bpc, state.steps)
            _say(bar, f"epoch {epoch}: validation {bpc:.3f} bits/char after {state.steps} steps")
        stop = bool(collective.broadcast(stop or state.elapsed() >= budget))
        if stop:
            break

    state.stop_clock()
    if not state.done:
        state.done = True
        checkpoint.save_all_states()  # a rerun reports the finished job instead of training
    if rank == 0:
        if bar is not None:
            bar.n = min(state.elapsed(), bar.total)
            bar.close()
        if writer is not None:
            writer.close()
        out.mkdir(parents=True, exist_ok=True)
        if not args.no_plot and state.history:
            plot(state, out / "demo.png")
        lines = summary_lines(state, args, replicas)
        text = "\n".join(lines) + "\n"
        write_atomic(out / "summary.txt", lambda tmp: tmp.write_text(text))
        record = json.dumps(
            _finite(
                {
                    "elapsed_s": state.elapsed(),
                    "steps": state.steps,
                    "samples": state.samples,
                    "restarts": state.restarts,
                    "budget_min": _budget_minutes(state, args),
                    "replicas": replicas,
                    "history_fields": list(HISTORY_FIELDS),
                    "history": state.history,
                    "valid": state.valid,
                }
            ),
            indent=1,
        )
        # Last: its presence tells the launcher (and a reader) that every output is complete.
        write_atomic(out / "summary.json", lambda tmp: tmp.write_text(record))
        print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
