"""Cost of the scheduler's side of training: hints posted to a supervisor, periodic checkpoints.

One process trains the digits MLP (``adaptrain.workloads.digits.DigitsNet(conv=False)``, hidden
``--hidden``) with ``AdaptiveDataParallel`` and an ``AdaptiveDataLoader`` (autoscaling on, with
``max_batch_size`` = the batch, so the goodput model is fitted but the batch stays put) on a
1-member gloo group. A real supervisor (FastAPI on uvicorn, 127.0.0.1, in a process of its own,
answering 204 and counting the PUTs) receives the hints. Variants, in interleaved blocks of
``--steps`` optimizer steps (rotating order, ``--reps`` repetitions, one launch):

``off``   standalone: no supervisor, no periodic checkpoint (the baseline);
``on``    hints every ``ADAPTRAIN_HINTS_INTERVAL`` = 30 s (the default) and a periodic
          checkpoint every 600 s (none falls due: the cost is the clock check on each poll);
``on1s``  the same with hints every second (a stress case: ~60× the default rate).

Each block's mean step time over the adjacent ``off`` block's is one paired ratio; the median
over repetitions is printed with a 95% interval (binomial order statistics). Goal: ≤ 1.005×.

Then the cost of one periodic checkpoint, at two model sizes: training with a 0.3 s interval,
the step that takes the checkpoint (syncs and serialisation into memory, on the training path)
against the median step, and the background write (files, fsyncs, rename), from
``checkpoint.wait_for_background_save()``.

    python benchmarks/bench_hints.py [--reps 15] [--steps 400] [--hidden 256]
                                     [--big-hidden 65536] [--checkpoints 8]
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import adaptrain.torch as at
from adaptrain.dist import checkpoint, signals
from adaptrain.torch import _hints
from adaptrain.workloads.digits import DigitsNet, digits_datasets

SERVER = r"""
import sys, threading, os, uvicorn
from fastapi import FastAPI, Request, Response
app = FastAPI()
count = [0]
@app.put("/hints/{job_id}")
async def hints(job_id: str, request: Request) -> Response:
    await request.body()
    count[0] += 1
    return Response(status_code=204)
@app.get("/count")
async def get_count() -> dict:
    return {"count": count[0]}
threading.Timer(float(sys.argv[2]), lambda: os._exit(0)).start()  # a time limit in any case
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(limit: float) -> tuple[subprocess.Popen, str]:
    import httpx

    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(port), str(limit)])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            httpx.get(url + "/count", timeout=1.0)
            return proc, url
        except httpx.HTTPError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("the supervisor did not start") from None
            time.sleep(0.1)


def _posts(url: str) -> int:
    import httpx

    return int(httpx.get(url + "/count", timeout=5.0).json()["count"])


_names = itertools.count()


class Trainer:
    """The training loop, one optimizer step per ``next()``."""

    def __init__(self, hidden: int, batch: int) -> None:
        torch.manual_seed(0)
        train_set, _ = digits_datasets()
        model = DigitsNet(hidden=hidden, conv=False, seed=0)
        self.optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        self.model = at.AdaptiveDataParallel(model, self.optimizer, name=f"model-{next(_names)}")
        self.loader = at.AdaptiveDataLoader(train_set, batch_size=batch, shuffle=True)
        self.loader.autoscale_batch_size(batch)  # the model is fitted; the batch stays
        self._it = self._steps()

    def _steps(self) -> Iterator[None]:
        while True:
            for xb, yb in self.loader:
                loss = F.cross_entropy(self.model(xb), yb)
                self.optimizer.zero_grad()
                loss.backward()
                self.optimizer.step()
                yield

    def block(self, steps: int) -> list[float]:
        times = []
        it = self._it
        for _ in range(steps):
            t0 = time.perf_counter()
            next(it)
            times.append(time.perf_counter() - t0)
        return times


def _set_variant(name: str, url: str, reporters: dict[str, Any]) -> None:
    """Switch this process between the variants (what the environment would set at start)."""
    if name.startswith("off"):
        _hints._reporter, _hints.active = None, False
        signals.set_checkpoint_interval(0.0)
    else:
        _hints._reporter, _hints.active = reporters[name], True
        signals.set_checkpoint_interval(600.0)


def _median_ci(xs: list[float]) -> tuple[float, float, float]:
    """Median and a ~95% interval (binomial order statistics)."""
    xs = sorted(xs)
    n = len(xs)
    k = max(0, int(n / 2 - 0.98 * n**0.5))
    return statistics.median(xs), xs[k], xs[min(n - 1, n - 1 - k)]


def _per_call(fn: Any, n: int = 20000) -> float:
    """Seconds per call of ``fn()`` (best of 5 runs of ``n`` calls)."""
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return best


def overhead(args: argparse.Namespace, url: str) -> None:
    trainer = Trainer(args.hidden, args.batch)
    reporters = {
        "on": _hints.HintsReporter(url, "bench", "tok", 30.0),
        "on1s": _hints.HintsReporter(url, "bench", "tok", 1.0),
    }
    variants = ["off", "off2", "on", "on1s"]  # off2: the A/A control, the noise floor
    _set_variant("off", url, reporters)
    trainer.block(args.warmup)  # past the first steps, the fit and the every-step statistics
    for name in variants[2:]:
        _set_variant(name, url, reporters)
        trainer.block(50)
    # Per block: the mean step (every cost included) and the median step (robust to the
    # host's preemption spikes, blind to a rare post); each paired with the adjacent "off".
    ratios: dict[str, dict[str, list[float]]] = {
        k: {v: [] for v in variants[1:]} for k in ("mean", "median")
    }
    offs: list[float] = []
    posts0 = _posts(url)
    seconds = dict.fromkeys(variants, 0.0)
    for rep in range(args.reps):
        k = rep % len(variants)
        order = variants[k:] + variants[:k]
        block: dict[str, list[float]] = {}
        for name in order:
            _set_variant(name, url, reporters)
            block[name] = trainer.block(args.steps)
            seconds[name] += sum(block[name])
        offs.append(statistics.fmean(block["off"]))
        for stat, f in (("mean", statistics.fmean), ("median", statistics.median)):
            for name in variants[1:]:
                ratios[stat][name].append(f(block[name]) / f(block["off"]))
    _set_variant("off", url, reporters)
    time.sleep(1.0)  # the last posts land
    posts = _posts(url) - posts0
    print(f"\n## Step time with a supervisor over without ({args.reps} reps x {args.steps} steps)")
    print(f"digits MLP hidden {args.hidden}, batch {args.batch}, 1 process (gloo)")
    print(f"off: mean step {1e3 * statistics.median(offs):.3f} ms (median of blocks)")
    for name in variants[1:]:
        line = f"{name:5s}:"
        for stat in ("mean", "median"):
            med, lo, hi = _median_ci(ratios[stat][name])
            line += f"  {stat} ratio {med:.4f}x (95% CI {lo:.4f}-{hi:.4f})"
        r = reporters.get(name)
        if r is not None:
            line += (
                f"; {r.offered} bodies offered (warm-up included) in {seconds[name]:.0f} s of "
                f"its blocks, "
                f"{r.posted} posted, {r.failures} failed"
            )
        print(line)
    print(f"PUTs received by the supervisor during the blocks: {posts}")
    # The same costs measured directly, free of the host's noise: what a step pays when no
    # post is due (the loader's check, the reporter's clock, the checkpoint clock on a poll),
    # and what the step that offers a body pays (building it, handing it over).
    helper = trainer.loader._elastic
    quiet = _hints.HintsReporter(url, "bench", "tok", 1e9)
    quiet.next_due = float("inf")
    _hints._reporter, _hints.active = quiet, True
    signals.set_checkpoint_interval(600.0)
    now = time.perf_counter()
    t_check = _per_call(lambda: _hints.active and helper.training and _hints.tick(helper))
    t_clock = _per_call(lambda: signals._checkpoint_due(now))
    t_snapshot = _per_call(lambda: _hints.snapshot(helper), 2000)
    _set_variant("off", url, reporters)
    step = statistics.median(offs)
    for name, interval in (("on", 30.0), ("on1s", 1.0)):
        per_step = t_check + t_clock + t_snapshot * step / interval
        print(
            f"{name:5s}: direct cost {1e6 * per_step:.2f} us per step = "
            f"{1 + per_step / step:.5f}x (check {1e6 * t_check:.2f} us, checkpoint clock "
            f"{1e6 * t_clock:.2f} us per poll, body {1e6 * t_snapshot:.0f} us every "
            f"{interval:.0f} s); the thread's post runs beside the step"
        )
    trainer._it.close()  # leaves the loader's loop: the next trainer's loader may start


def checkpoint_cost(hidden: int, batch: int, count: int) -> None:
    _hints._reporter, _hints.active = None, False
    trainer = Trainer(hidden, batch)
    params = sum(p.numel() for p in trainer.model.parameters())
    trainer.block(30)
    signals.set_checkpoint_interval(0.3)
    trigger, normal, serialise, write = [], [], [], []
    last = checkpoint.wait_for_background_save().get("seq", -1.0)
    deadline = time.monotonic() + 120
    while len(trigger) < count and time.monotonic() < deadline:
        t0 = time.perf_counter()
        next(trainer._it)
        dt = time.perf_counter() - t0
        info = checkpoint._last_write  # updated by the writer thread when it finishes
        writer = checkpoint._writer
        started = writer is not None and writer.is_alive() or info.get("seq", -1.0) != last
        if started:
            info = checkpoint.wait_for_background_save()  # (outside the timed step)
            if info.get("seq", -1.0) != last:
                last = info["seq"]
                trigger.append(dt)
                serialise.append(info["serialise_s"])
                write.append(info["write_s"])
                continue
        normal.append(dt)
    signals.set_checkpoint_interval(0.0)
    trainer._it.close()
    size = sum(
        os.path.getsize(os.path.join(d, f))
        for d in [checkpoint.latest_checkpoint(checkpoint.checkpoint_root())]
        for f in os.listdir(d)
    )
    med = statistics.median(normal)
    print(
        f"\n## One periodic checkpoint: MLP hidden {hidden} ({params / 1e6:.2f} M params, "
        f"checkpoint {size / 2**20:.1f} MiB), {len(trigger)} checkpoints"
    )
    print(
        f"median step {1e3 * med:.2f} ms; the step that takes the checkpoint: median "
        f"{1e3 * statistics.median(trigger):.2f} ms (+{1e3 * (statistics.median(trigger) - med):.2f}"
        f" ms; max {1e3 * max(trigger):.2f} ms), of which syncs + serialisation into memory "
        f"{1e3 * statistics.median(serialise):.2f} ms"
    )
    print(
        f"background write (files, fsyncs, rename): median {1e3 * statistics.median(write):.1f} ms"
        f" (max {1e3 * max(write):.1f} ms)"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--warmup", type=int, default=300)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--big-hidden", type=int, default=65536)
    p.add_argument("--checkpoints", type=int, default=8)
    args = p.parse_args()
    torch.set_num_threads(1)
    print(f"# bench_hints on {platform.node()}, {os.cpu_count()} CPUs, torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as root:
        os.environ["ADAPTRAIN_CHECKPOINT_PATH"] = root  # before anything reads it
        at.init_process_group("gloo", world_size=1, rank=0)
        server, url = _start_server(limit=3600)
        try:
            overhead(args, url)
        finally:
            server.kill()
            server.wait()
        checkpoint_cost(args.hidden, args.batch, args.checkpoints)
        checkpoint_cost(args.big_hidden, args.batch, args.checkpoints)


if __name__ == "__main__":
    main()
