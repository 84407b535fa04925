"""Time to target: autoscaled batch size vs a sweep of fixed batch sizes vs the user's default.

For each task, 2 gloo replicas train until a validation target is reached; the figure is the
*training* wall time (evaluation pauses the clock), median over repetitions:

* ``fixed-B``: plain ``DistributedDataParallel`` at global batch ``B`` with the learning rate
  scaled linearly from the base (``lr0 · B / B0``, ``B0 = 32`` unless ``--b0``); the **oracle** is the
  member of the sweep with the lowest median time (the batch size tuning would pick), the
  **default** is ``B = B0`` (what a user who does not tune the batch size runs). The table also
  gives each variant's ratio to the fastest sweep member *of each repetition*; that minimum over
  several noisy runs is biased low by the run-to-run scatter (the oracle's own ratio to it shows
  by how much), so it is the stricter and less stable reference.
* ``adaptrain``: ``adaptrain.torch`` with ``autoscale_batch_size`` (initial batch ``B0``, gradient
  accumulation allowed), the scaling rule AdaptiveDataParallel picks (AdamScale for Adam,
  AdaScale for SGD, as AdaptDL 0.2.11); ``adaptrain-adascale`` (Adam tasks): the same with
  ``scaling_rule=AdaScale()``, the learning rate multiplied by the gain itself, not its square
  root; ``adaptrain-linear``: the same with ``scaling_rule=LinearScale()``, the learning rate
  multiplied by ``B / B0`` as in the sweep, so the only difference from the sweep is the
  batch-size schedule.
* ``adaptdl``: AdaptDL 0.2.11's ``autoscale_batch_size`` on the same task, when it installs
  (``_adaptdl_ref.py``).

Tasks (real data):

* ``charlm``: CharLM (GRU 128) on the standard library's source, Adam ``lr0 = 3e-3``; target:
  validation loss ≤ ``--charlm-target`` bits/char.
* ``digits``: DigitsNet CNN on sklearn's digits, SGD+momentum ``lr0 = 0.02``; target: test
  accuracy ≥ ``--digits-target``.

Each repetition ``k`` shuffles with seed ``k``: the sweep's ``DistributedSampler`` and
adaptrain's ``ElasticSampler``; AdaptDL's sampler is seeded by the epoch only.

A run that misses the target within ``--limit`` seconds of training counts as ``inf``.
Every run collects Python's garbage once (``gc.collect()``) just before its clock starts. A
full collection takes ~0.2 s in these processes (torch, ``torch._dynamo`` and scipy imported),
as long as 20–30% of a digits run, and whether setup's allocations trigger it just before or
just after the clock starts depends on a few thousand objects more or less: it would fall
inside the timed window of some variants and not others (as ``gc.callbacks`` shows).
Collections that a variant's own training causes stay in its time.
Ratios (``autoscale / oracle``, ``autoscale / default``) are taken within each repetition, whose
variants run back to back in a rotating order, then the median over repetitions is reported;
a repetition whose reference missed the target gives no ratio and is left out (the table then
says over how many repetitions the median is).

    python benchmarks/bench_time_to_target.py                      # both tasks, 3 repetitions
    python benchmarks/bench_time_to_target.py --tasks digits --reps 1
    python benchmarks/bench_time_to_target.py --tasks charlm --b0 8 --lr0 3e-3  # small default

``--variants`` also takes ``fixed-B@LR``: batch ``B`` at the absolute learning rate ``LR`` (a
point tuned by hand); it joins the sweep, so the oracle is the best of both. And
``adaptrain-explore-T``: autoscale with the exploration tolerance ``T`` of
``_metrics.suggest_batch_size`` (default 0.5), and ``adaptrain-stall-F``:
autoscale with the step-time fit's stall threshold ``_metrics.STALL_FACTOR`` set to ``F``
(default 3; ``inf`` keeps every step: the plain mean).
``--b0`` changes the user's default batch (autoscale's initial batch and the base of the linear
rule); the sweep keeps its multiples of it (``--sweep`` overrides) and the smallest local batch
autoscale may use is lowered to ``B0 / 2`` when needed.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

B0 = 32
TASKS = {
    "charlm": {
        "sweep": [32, 64, 128, 256],
        "max_batch": 512,
        "bounds": (8, 128),
        "lr0": 3e-3,
        "eval_every": 0.5,
        "optimizer": "adam",
    },
    "digits": {
        "sweep": [16, 32, 64, 128, 256],
        "max_batch": 512,
        "bounds": (4, 256),
        "lr0": 0.02,
        "eval_every": 0.1,
        "optimizer": "sgd",
    },
}


def _setup(task: str, seed: int, cache: str):
    import torch

    from adaptrain.workloads import (
        CharLM,
        DigitsNet,
        charlm_datasets,
        charlm_loss,
        digits_datasets,
        digits_loss,
    )

    if task == "charlm":
        train, valid = charlm_datasets(
            seq_len=64, max_chars=400_000, valid_fraction=0.05, cache_dir=cache
        )
        n = min(len(valid), 256)
        vx, vy = valid[list(range(n))]
        model = CharLM(hidden=128, seed=seed)

        def metric(m: torch.nn.Module) -> float:  # bits/char, lower is better
            with torch.no_grad():
                return float(charlm_loss(m, (vx, vy))) / math.log(2)

        return train, model, charlm_loss, metric, "adam"
    train, test = digits_datasets()
    tx, ty = test.tensors
    model = DigitsNet(seed=seed)

    def metric(m: torch.nn.Module) -> float:  # test accuracy, higher is better
        with torch.no_grad():
            return float((m(tx).argmax(1) == ty).float().mean())

    return train, model, digits_loss, metric, "sgd"


def _optimizer(kind: str, params, lr: float):
    import torch

    if kind == "adam":
        return torch.optim.Adam(params, lr=lr)
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


def _run(
    rank: int,
    world: int,
    port: int,
    task: str,
    variant: str,
    seed: int,
    target: float,
    limit: float,
    eval_every: float,
    cache: str,
    lr0: float | None = None,
    log_decisions: bool = False,
    b0: int = B0,
) -> dict:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    cfg = dict(TASKS[task])
    if lr0 is not None:
        cfg["lr0"] = lr0
    lo, hi = cfg["bounds"]
    cfg["bounds"] = (max(min(lo, b0 // world), 1), hi)
    lower_better = task == "charlm"
    adaptdl_torch = None
    if variant == "adaptdl":
        import _adaptdl_ref

        os.environ.update(
            {
                "ADAPTDL_MASTER_ADDR": "127.0.0.1",
                "ADAPTDL_MASTER_PORT": str(port),
                "ADAPTDL_NUM_REPLICAS": str(world),
                "ADAPTDL_REPLICA_RANK": str(rank),
            }
        )
        adaptdl_torch = _adaptdl_ref.import_adaptdl()
        adaptdl_torch.init_process_group("gloo")
    elif variant.startswith("adaptrain"):
        import adaptrain.torch as adl

        if log_decisions and rank == 0:
            import logging

            handler = logging.StreamHandler(sys.stdout)
            handler.setFormatter(logging.Formatter("    [decision] %(message)s"))
            decisions = logging.getLogger("adaptrain.torch._metrics")
            decisions.addHandler(handler)
            decisions.setLevel(logging.INFO)

        adl.init_process_group("gloo")
        if variant.startswith("adaptrain-explore-"):  # the loader with another tolerance
            from adaptrain.torch import _metrics

            tolerance = float(variant.rsplit("-", 1)[1])
            _metrics.suggest_batch_size.__kwdefaults__["explore_tolerance"] = tolerance
        if variant.startswith("adaptrain-stall-"):  # another stall threshold in the fit
            from adaptrain.torch import _metrics

            _metrics.STALL_FACTOR = float(variant.rsplit("-", 1)[1])
    else:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
        )
    train, model, loss_fn, metric, opt_kind = _setup(task, seed, cache)
    module = model

    if variant.startswith("fixed-"):
        from torch.utils.data import DataLoader, DistributedSampler

        size, _, lr = variant.removeprefix("fixed-").partition("@")
        bsz = int(size)
        lr = float(lr) if lr else cfg["lr0"] * bsz / b0
        opt = _optimizer(opt_kind, model.parameters(), lr)
        model = torch.nn.parallel.DistributedDataParallel(model)
        sampler = DistributedSampler(train, shuffle=True, seed=seed)
        loader = DataLoader(train, batch_size=max(bsz // world, 1), sampler=sampler)

        def epochs():
            e = 0
            while True:
                sampler.set_epoch(e)
                yield e
                e += 1

        def batch_size() -> int:
            return bsz
    else:
        lib = adaptdl_torch if variant == "adaptdl" else adl
        opt = _optimizer(opt_kind, model.parameters(), cfg["lr0"])
        kwargs = {}
        if variant == "adaptrain-adascale":  # AdaScale's gain on the lr for any optimizer
            kwargs["scaling_rule"] = lib.scaling_rules.AdaScale()
        elif variant == "adaptrain-linear":  # the sweep's rule: lr0 * B / B0
            kwargs["scaling_rule"] = lib.scaling_rules.LinearScale()
        model = lib.AdaptiveDataParallel(model, opt, **kwargs)
        loader = lib.AdaptiveDataLoader(train, batch_size=b0, shuffle=True)
        if variant != "adaptdl":  # the repetition's data order, as the sweep's sampler
            loader.sampler.seed = seed  # (AdaptDL's sampler has no seed: epoch-seeded only)
        loader.autoscale_batch_size(
            cfg["max_batch"], local_bsz_bounds=cfg["bounds"], gradient_accumulation=True
        )

        def epochs():
            return lib.remaining_epochs_until(1_000_000)

        def batch_size() -> int:
            return int(loader.current_batch_size or b0)

    gc.collect()  # setup's garbage is not any variant's training time (module docstring)
    train_time, next_eval, steps = 0.0, 0.0, 0
    reached, value = math.inf, math.nan
    trace: list[tuple[float, int, float]] = []  # (training s, batch, metric)
    last_bs = b0
    flags = torch.zeros(2)
    stop = False
    for _epoch in epochs():
        t0 = time.perf_counter()
        for batch in loader:
            loss = loss_fn(model, batch)
            opt.zero_grad()
            loss.backward()
            opt.step()
            steps += 1
            last_bs = batch_size()
            now = time.perf_counter()
            train_time += now - t0
            if rank == 0:
                flags[0] = float(train_time >= next_eval)
                flags[1] = float(train_time >= limit)
            dist.broadcast(flags, src=0)
            if flags[0]:
                module.eval()
                value = metric(module)
                module.train()
                next_eval = train_time + eval_every
                trace.append((round(train_time, 2), last_bs, round(value, 4)))
                done = value <= target if lower_better else value >= target
                if rank == 0:
                    flags[0] = float(done)
                dist.broadcast(flags, src=0)
                if flags[0]:
                    reached = train_time
                    stop = True
            if stop or flags[1]:
                stop = True
                break
            t0 = time.perf_counter()
        if stop:
            break
    return {
        "time": reached,
        "value": value,
        "steps": steps,
        "final_batch": last_bs,
        "max_batch": max((b for _, b, _ in trace), default=last_bs),
        "trace": trace,
    }


def _changes(out: dict) -> str:
    """Batch-size changes seen at the evaluations: ``32@0.0s → 64@3.1s ...``."""
    seen: list[str] = []
    last = None
    for t, b, _ in out["trace"]:
        if b != last:
            seen.append(f"{b}@{t}s")
            last = b
    return " → ".join(seen) or "-"


def _curve(out: dict, every: float) -> str:
    """The metric at the first evaluation past each multiple of ``every`` seconds."""
    pts, nxt = [], 0.0
    for t, _, v in out["trace"]:
        if t >= nxt:
            pts.append(f"{v:.3f}@{t:.0f}s")
            nxt = (t // every + 1) * every
    return " ".join(pts)


def _fmt(t: float) -> str:
    return f"{t:.2f}" if math.isfinite(t) else "inf"


def _ratio(times: list[float], refs: list[float]) -> str:
    """Median over repetitions of ``time / reference``, leaving out the repetitions where the
    reference missed the target (``inf``: no ratio), and saying how many remain."""
    pairs = [(t, r) for t, r in zip(times, refs) if math.isfinite(r)]
    if not pairs:
        return "n/a"
    out = f"{statistics.median(t / r for t, r in pairs):.2f}"
    return out if len(pairs) == len(times) else f"{out} ({len(pairs)} of {len(times)})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", nargs="+", default=["digits", "charlm"])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--charlm-target", type=float, default=2.0, help="validation bits/char")
    p.add_argument("--digits-target", type=float, default=0.98, help="test accuracy")
    p.add_argument("--limit", type=float, default=150.0, help="training seconds per run")
    p.add_argument(
        "--eval-every",
        type=float,
        default=None,
        help="training seconds between evaluations (default: 0.1 digits, 0.5 charlm)",
    )
    p.add_argument("--variants", nargs="+", default=None, help="subset, e.g. fixed-32 adaptrain")
    p.add_argument("--no-adaptdl", action="store_true")
    p.add_argument(
        "--log-decisions", action="store_true", help="print adaptrain's batch-size decisions"
    )
    p.add_argument(
        "--lr0", type=float, default=None, help="override the task's base learning rate (at B0)"
    )
    p.add_argument(
        "--b0", type=int, default=B0, help="the user's default (and autoscale's initial) batch"
    )
    p.add_argument(
        "--sweep", type=int, nargs="+", default=None, help="fixed batch sizes (default: 1-8x B0)"
    )
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument(
        "--curve-every",
        type=float,
        default=0.0,
        help="also print each run's metric every this many training seconds (0: off)",
    )
    args = p.parse_args()

    from adaptrain.dist.spawn import free_port, spawn

    with_adaptdl = False
    if not args.no_adaptdl:
        import _adaptdl_ref

        with_adaptdl = _adaptdl_ref.install()
    import tempfile

    import torch

    cache = tempfile.mkdtemp(prefix="bench-ttt-")
    if "charlm" in args.tasks:  # encode the corpus once, before the replicas read the cache
        from adaptrain.workloads import charlm_datasets

        charlm_datasets(seq_len=64, max_chars=400_000, valid_fraction=0.05, cache_dir=cache)
    print(
        f"2 gloo replicas, torch {torch.__version__}, {os.cpu_count()} CPUs, load "
        f"{os.getloadavg()[0]:.1f}, {args.reps} repetitions; AdaptDL "
        f"{'0.2.11' if with_adaptdl else 'not available'}",
        flush=True,
    )
    for task in args.tasks:
        target = args.charlm_target if task == "charlm" else args.digits_target
        sweep_sizes = args.sweep or [b * args.b0 // B0 for b in TASKS[task]["sweep"]]
        if args.b0 not in sweep_sizes:
            sweep_sizes = [args.b0, *sweep_sizes]
        variants = [f"fixed-{b}" for b in sweep_sizes] + ["adaptrain", "adaptrain-linear"]
        if TASKS[task]["optimizer"] == "adam":
            variants.append("adaptrain-adascale")
        if with_adaptdl:
            variants.append("adaptdl")
        if args.variants:
            extra = [
                v
                for v in args.variants
                if ("@" in v and v.startswith("fixed-"))
                or v.startswith(("adaptrain-explore-", "adaptrain-stall-"))
            ]
            variants = [v for v in variants if v in args.variants or v == f"fixed-{args.b0}"]
            variants = [*[v for v in variants if v.startswith("fixed-")], *extra] + [
                v for v in variants if not v.startswith("fixed-")
            ]
        eval_every = args.eval_every or TASKS[task]["eval_every"]
        per_rep: list[dict[str, dict]] = []
        for rep in range(args.reps):
            order = variants[rep % len(variants) :] + variants[: rep % len(variants)]
            res = {}
            for v in order:
                out = spawn(
                    _run,
                    2,
                    args=(
                        free_port(),
                        task,
                        v,
                        rep,
                        target,
                        args.limit,
                        eval_every,
                        cache,
                        args.lr0,
                        args.log_decisions,
                        args.b0,
                    ),
                    timeout=args.timeout,
                    init=False,
                )[0]
                res[v] = out
                print(
                    f"  {task} rep {rep} {v:10s}: {_fmt(out['time'])} s, {out['steps']} "
                    f"steps, batch {out['final_batch']} (max {out['max_batch']})"
                    + ("" if v.startswith("fixed-") else f", batch at evals: {_changes(out)}"),
                    flush=True,
                )
                if args.curve_every > 0:
                    print(f"    metric: {_curve(out, args.curve_every)}", flush=True)
            per_rep.append(res)
        unit = "bits/char ≤" if task == "charlm" else "accuracy ≥"
        print(f"\n### {task}: training seconds to {unit} {target} (median of {args.reps})")
        sweep = [v for v in variants if v.startswith("fixed-")]
        # The oracle is the sweep member with the lowest median time (what tuning would pick);
        # the fastest member of each repetition is also shown, but that minimum over several
        # noisy runs is biased low by the run-to-run scatter (see the oracle's own ratio to it).
        oracle_v = min(sweep, key=lambda b: statistics.median(r[b]["time"] for r in per_rep))
        oracle = [r[oracle_v]["time"] for r in per_rep]
        best_each = [min(r[b]["time"] for b in sweep) for r in per_rep]
        default = [r[f"fixed-{args.b0}"]["time"] for r in per_rep]
        print(
            f"| variant | time (s) | / oracle ({oracle_v}) | / fastest of each repetition "
            f"| / default (fixed-{args.b0}) | median steps | final batch |"
        )
        print("|---|---|---|---|---|---|---|")
        for v in variants:
            times = [r[v]["time"] for r in per_rep]
            ratio_o, ratio_b = _ratio(times, oracle), _ratio(times, best_each)
            ratio_d = _ratio(times, default)
            finals = [r[v]["final_batch"] for r in per_rep]
            steps = statistics.median(r[v]["steps"] for r in per_rep)
            print(
                f"| {v} | {_fmt(statistics.median(times))} | {ratio_o} | {ratio_b} | "
                f"{ratio_d} | {steps:.0f} | {'/'.join(map(str, finals))} |"
            )
        best = [min(sweep, key=lambda b, r=r: r[b]["time"]) for r in per_rep]
        print(f"fastest fixed batch per repetition: {best}\n", flush=True)


if __name__ == "__main__":
    main()
