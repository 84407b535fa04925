"""Step-time overhead of AdaptDL 0.2.11's AdaptiveDataParallel vs plain DDP (and adaptrain's), same run.

The AdaptDL column of the overhead benchmark (``bench_overhead.py`` measures adaptrain alone).
Two gloo processes on 127.0.0.1 hold three copies of the same model (same initial weights):

* ``ddp``:       ``torch.nn.parallel.DistributedDataParallel`` + ``DataLoader``/``DistributedSampler``
* ``adaptrain``: ``adaptrain.torch.AdaptiveDataParallel`` + ``adaptrain.torch.AdaptiveDataLoader``
* ``adaptdl``:   ``adaptdl.torch.AdaptiveDataParallel`` + ``adaptdl.torch.AdaptiveDataLoader``
  (installed privately and patched by ``_adaptdl_ref.py``)

all at a fixed global batch size (no autoscaling; both adaptive wrappers still collect their
gradient statistics: AdaptDL on every step, adaptrain on sampled steps, one in 62 at the initial batch size once past its
early every-step phase, which its warm-up covers). A *round* runs ``--steps`` timed steps (after
warm-up) of each variant, in a rotating order; a step is one loop iteration (next batch,
forward, backward, all-reduce, optimizer step), timed with ``perf_counter`` on rank 0. The
figure is the median over rounds of (mean step time of the variant / mean step time of ``ddp``
in the same round): the mean, so that adaptrain's slower sampled steps count.

Workloads (real data): ``digits`` = DigitsNet CNN (≈ 40k parameters) on sklearn's digits,
``charlm`` = CharLM (GRU 256, ≈ 0.3M parameters, 32-character windows) on the stdlib's source.

    python benchmarks/bench_overhead_adaptdl.py                  # batch 32 and 256, 5 rounds
    python benchmarks/bench_overhead_adaptdl.py --batch-sizes 32 --rounds 3
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

VARIANTS = ("ddp", "adaptrain", "adaptdl")


def _workload(name: str):
    from adaptrain.workloads import (
        CharLM,
        DigitsNet,
        charlm_datasets,
        charlm_loss,
        digits_datasets,
        digits_loss,
    )

    if name == "digits":
        train, _ = digits_datasets()
        return train, (lambda: DigitsNet(seed=0)), digits_loss
    if name == "charlm":
        train, _ = charlm_datasets(seq_len=32, max_chars=300_000)
        return train, (lambda: CharLM(hidden=256, seed=0)), charlm_loss
    raise ValueError(f"workload={name!r}: use 'digits' or 'charlm'")


def _run(
    rank: int,
    world_size: int,
    port: int,
    workload: str,
    batch_sizes: list[int],
    rounds: int,
    steps: int,
    warmup: int,
    with_adaptdl: bool,
) -> dict:
    import torch

    torch.set_num_threads(1)
    adaptdl_torch = None
    if with_adaptdl:
        import _adaptdl_ref

        os.environ.update(
            {
                "ADAPTDL_MASTER_ADDR": "127.0.0.1",
                "ADAPTDL_MASTER_PORT": str(port),
                "ADAPTDL_NUM_REPLICAS": str(world_size),
                "ADAPTDL_REPLICA_RANK": str(rank),
            }
        )
        adaptdl_torch = _adaptdl_ref.import_adaptdl()
        adaptdl_torch.init_process_group("gloo")  # creates the default torch.distributed group
    import adaptrain.torch as adl

    adl.init_process_group("gloo")  # reuses AdaptDL's group when it exists
    from torch.utils.data import DataLoader, DistributedSampler

    dataset, make_model, loss_fn = _workload(workload)
    results: dict = {}
    for bsz in batch_sizes:
        base = make_model()
        setups = {}

        def sgd(m: torch.nn.Module) -> torch.optim.Optimizer:
            return torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)

        m = copy.deepcopy(base)
        opt = sgd(m)
        sampler = DistributedSampler(dataset, shuffle=True, seed=0)
        setups["ddp"] = (
            torch.nn.parallel.DistributedDataParallel(m),
            opt,
            DataLoader(dataset, batch_size=bsz // world_size, sampler=sampler),
        )
        m = copy.deepcopy(base)
        opt = sgd(m)
        setups["adaptrain"] = (
            adl.AdaptiveDataParallel(m, opt, name=f"adaptrain-{bsz}"),
            opt,
            adl.AdaptiveDataLoader(dataset, batch_size=bsz, shuffle=True),
        )
        if adaptdl_torch is not None:
            m = copy.deepcopy(base)
            opt = sgd(m)
            setups["adaptdl"] = (
                adaptdl_torch.AdaptiveDataParallel(m, opt, name=f"adaptdl-{bsz}"),
                opt,
                adaptdl_torch.AdaptiveDataLoader(dataset, batch_size=bsz, shuffle=True),
            )
        results[bsz] = _measure(setups, loss_fn, rounds, steps, warmup)
    return results if rank == 0 else {}


def _measure(setups: dict, loss_fn, rounds: int, steps: int, warmup: int) -> list[dict]:
    """Per round, the mean step time of each variant (rotating order)."""
    import time

    iters: dict = dict.fromkeys(setups)

    def next_batch(name: str):
        # Loop over the loader again whenever a pass ends (one generator per variant).
        while True:
            if iters[name] is None:
                iters[name] = iter(setups[name][2])
            try:
                return next(iters[name])
            except StopIteration:
                iters[name] = None

    def step(name: str) -> tuple[float, float]:
        """(whole loop iteration, forward+backward+step only) in seconds."""
        model, opt, _ = setups[name]
        t0 = time.perf_counter()
        batch = next_batch(name)
        t1 = time.perf_counter()
        loss = loss_fn(model, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        t2 = time.perf_counter()
        return t2 - t0, t2 - t1

    for name in setups:
        for _ in range(warmup):
            step(name)
    adp = setups["adaptrain"][0] if "adaptrain" in setups else None
    while adp is not None and adp.gns.sample_interval() < adp.gns.settled_interval():
        step("adaptrain")  # past the every-step phase: the steady state of a longer run
    per_round: list[dict[str, float]] = []
    names = list(setups)
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        times = {}
        for n in order:
            samples = [step(n) for _ in range(steps)]
            times[n] = statistics.fmean(t for t, _ in samples)
            times[n + ":model"] = statistics.fmean(c for _, c in samples)
        per_round.append(times)
    iters.clear()  # close the loaders' generators (and their iteration contexts)
    return per_round


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", nargs="+", default=["digits", "charlm"])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[32, 256])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--no-adaptdl", action="store_true", help="skip the AdaptDL column")
    p.add_argument("--timeout", type=float, default=1200)
    args = p.parse_args()

    from adaptrain.dist.spawn import free_port, spawn

    with_adaptdl = not args.no_adaptdl
    if with_adaptdl:
        import _adaptdl_ref

        with_adaptdl = _adaptdl_ref.install()
        if not with_adaptdl:
            print("AdaptDL 0.2.11 could not be installed: its column is omitted")
    import torch

    print(
        f"2 gloo processes, torch {torch.__version__}, {os.cpu_count()} CPUs, "
        f"load {os.getloadavg()[0]:.1f}; {args.rounds} rounds × {args.steps} steps per variant"
    )
    print("Whole loop iteration (loader + step), then forward+backward+step only;")
    print("median over rounds of the per-round ratio of mean step times (min–max over rounds).")
    print(
        "| workload | global batch | ddp step (ms) | adaptrain / ddp | adaptdl / ddp |"
        " adaptrain / ddp, model only | adaptdl / ddp, model only |"
    )
    print("|---|---|---|---|---|---|---|")
    for workload in args.workloads:
        res = spawn(
            _run,
            2,
            args=(
                free_port(),
                workload,
                args.batch_sizes,
                args.rounds,
                args.steps,
                args.warmup,
                with_adaptdl,
            ),
            timeout=args.timeout,
            init=False,
        )[0]
        for bsz, rounds in res.items():
            ddp = statistics.median(r["ddp"] for r in rounds)
            cols = []
            for suffix in ("", ":model"):
                for name in ("adaptrain", "adaptdl"):
                    if name in rounds[0]:
                        ratios = [r[name + suffix] / r["ddp" + suffix] for r in rounds]
                        cols.append(
                            f"{statistics.median(ratios):.2f}× "
                            f"({min(ratios):.2f}–{max(ratios):.2f})"
                        )
                    else:
                        cols.append("n/a")
            print(
                f"| {workload} | {bsz} | {ddp * 1e3:.1f} | " + " | ".join(cols) + " |", flush=True
            )


if __name__ == "__main__":
    main()
