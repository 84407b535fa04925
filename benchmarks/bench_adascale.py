"""Per-step overhead of adaptrain's AdaScale wrapper against the bare optimizer.

One process, gradient accumulation (AdaScale needs ≥ 2 gradients per step), SGD with momentum.
For each model size, every repetition times the same number of training steps (forward,
backward × accumulation, step) three ways, back to back on identical copies of the model and
data: bare SGD, ``adaptrain.optim.adascale.AdaScale(SGD)`` and, when installed, fairscale
0.4.13's ``AdaScale(SGD)``. The figure reported is the median over repetitions of the paired
ratio time(wrapper) / time(bare), for wall-clock time and for the process's CPU time (less
sensitive to other processes on a shared machine); absolute times there are noise. The last
column is the median number of minor page faults per step (Linux/macOS): a gradient-sized
temporary that the allocator maps fresh costs one fault per 4 KiB page touched.

    python benchmarks/bench_adascale.py                 # small + medium, 7 repetitions
    python benchmarks/bench_adascale.py --reps 11 --steps 40 --accum 4
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import time

try:
    import resource
except ImportError:  # Windows
    resource = None

import torch
import torch.nn.functional as F

from adaptrain.optim.adascale import AdaScale


def make_model(kind: str) -> tuple[torch.nn.Module, int, int]:
    """(model, input features, micro-batch size)."""
    torch.manual_seed(0)
    if kind == "small":  # 64-32-10 MLP, ~2.4k parameters (sklearn digits-sized)
        return (
            torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 10)),
            64,
            16,
        )
    if kind == "medium":  # 784-1024-1024-10 MLP, ~1.9M parameters
        return (
            torch.nn.Sequential(
                torch.nn.Linear(784, 1024),
                torch.nn.ReLU(),
                torch.nn.Linear(1024, 1024),
                torch.nn.ReLU(),
                torch.nn.Linear(1024, 10),
            ),
            784,
            64,
        )
    raise ValueError(f"unknown model kind {kind!r}: use small or medium")


def wrappers() -> dict[str, object]:
    out: dict[str, object] = {
        "bare": None,
        "adaptrain": lambda opt, c: AdaScale(opt, world_size=1, num_gradients_to_accumulate=c),
    }
    try:
        from fairscale.optim.adascale import AdaScale as FairscaleAdaScale

        out["fairscale"] = lambda opt, c: FairscaleAdaScale(
            opt, world_size=1, num_gradients_to_accumulate=c
        )
    except ImportError:
        pass
    return out


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt if resource is not None else 0


def time_steps(model, wrap, data, steps: int, accum: int) -> tuple[float, float, int]:
    """(wall seconds, process CPU seconds, minor page faults) for ``steps`` training steps
    after one warm-up."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if wrap is not None:
        opt = wrap(opt, accum)
    gains = 0.0

    def one_step(s: int) -> None:
        nonlocal gains
        opt.zero_grad()
        for i in range(accum):
            x, y = data[(s * accum + i) % len(data)]
            (F.cross_entropy(model(x), y) / accum).backward()
        if wrap is not None:
            gains += float(opt.gain())
        opt.step()

    one_step(0)  # warm-up (allocations, hooks)
    t, c, f = time.perf_counter(), time.process_time(), _minor_faults()
    for s in range(1, steps + 1):
        one_step(s)
    elapsed = (time.perf_counter() - t, time.process_time() - c, _minor_faults() - f)
    if wrap is not None and hasattr(opt, "unhook"):
        opt.unhook()
    return elapsed


def run(kind: str, reps: int, steps: int, accum: int) -> dict[str, list[float]]:
    base, features, batch = make_model(kind)
    g = torch.Generator().manual_seed(1)
    data = [
        (torch.randn(batch, features, generator=g), torch.randint(0, 10, (batch,), generator=g))
        for _ in range(16)
    ]
    ratios: dict[str, list[float]] = {}
    cpu_ratios: dict[str, list[float]] = {}
    cpu_ms: dict[str, list[float]] = {}
    faults: dict[str, list[float]] = {}
    ws = wrappers()
    for rep in range(reps):
        times = {}
        names = list(ws)
        if rep % 2:  # alternate the order so drift in machine load does not favour one side
            names.reverse()
        for name in names:
            times[name] = time_steps(copy.deepcopy(base), ws[name], data, steps, accum)
        for name, (wall, cpu, flt) in times.items():
            cpu_ms.setdefault(name, []).append(cpu / steps * 1e3)
            faults.setdefault(name, []).append(flt / steps)
            if name != "bare":
                ratios.setdefault(name, []).append(wall / times["bare"][0])
                cpu_ratios.setdefault(name, []).append(cpu / times["bare"][1])
    return {"wall": ratios, "cpu": cpu_ratios, "cpu_ms": cpu_ms, "faults": faults}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--accum", type=int, default=2)
    parser.add_argument("--models", nargs="+", default=["small", "medium"])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"# torch {torch.__version__}, {platform.processor() or platform.machine()}, "
        f"threads={args.threads}, reps={args.reps}, steps={args.steps}, accum={args.accum}"
    )
    print(
        "| model | wrapper | median wall ratio (min–max) | median CPU ratio (min–max) "
        "| median CPU ms/step: bare → wrapper | median page faults/step: bare → wrapper |"
    )
    print("|---|---|---|---|---|---|")
    med = statistics.median
    for kind in args.models:
        res = run(kind, args.reps, args.steps, args.accum)
        for name, rs in res["wall"].items():
            cs = res["cpu"][name]
            print(
                f"| {kind} | {name} | {med(rs):.3f} ({min(rs):.2f}–{max(rs):.2f}) "
                f"| {med(cs):.3f} ({min(cs):.2f}–{max(cs):.2f}) "
                f"| {med(res['cpu_ms']['bare']):.2f} → {med(res['cpu_ms'][name]):.2f} "
                f"| {med(res['faults']['bare']):.0f} → {med(res['faults'][name]):.0f} |"
            )


if __name__ == "__main__":
    main()
