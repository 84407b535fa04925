"""What a sampled step of ADP's gradient statistics costs, on 2 gloo processes (early training).

ADP samples its noise-scale statistics on every step for roughly the first hundred steps (then
one step in up to 64): on a short job, such as the digits time-to-target task (~150-250 steps),
nearly every step is sampled. This measures that cost on the digits CNN (DigitsNet, 38k
parameters, a fixed batch of ``--batch`` per replica from sklearn's digits): chunks of
``--steps`` steps of each variant in a rotating order, paired per round, median over rounds.

Variants (same model, weights and batch; no data loader, so only the step differs):

* ``ddp``: plain ``DistributedDataParallel``;
* ``never``: ADP with no step sampled (its bookkeeping and the scaling rule's hooks);
* ``every``: ADP with every step sampled (each sample's local norm² all-reduced on its own,
  folded in at the next step).

The figures are ``every`` minus ``never`` (what a sampled step costs) and each ADP variant over
``ddp``, paired per round. Steps are a few milliseconds here and this host's two processes on two cores
scatter by ~10% between chunks: read the medians over many rounds, not single chunks.

``--deep L`` times a narrow MLP of ``L`` hidden layers instead (``2L + 2`` parameter tensors):
what the per-step hooks cost on a model of many tensors.

    python benchmarks/bench_sampled_step.py [--rounds 120] [--steps 30] [--batch 16] [--deep L]
"""

from __future__ import annotations

import argparse
import statistics
import time

from adaptrain.dist.spawn import spawn

VARIANTS = ("ddp", "never", "every")


def _deep_mlp(layers: int):
    """A narrow MLP of many layers: 2 parameter tensors per layer, few parameters each."""
    import torch

    torch.manual_seed(0)
    mods = [torch.nn.Flatten()]
    for _ in range(layers):
        mods += [torch.nn.Linear(64, 64), torch.nn.Tanh()]
    return torch.nn.Sequential(*mods, torch.nn.Linear(64, 10))


def _worker(rank: int, ws: int, batch: int, rounds: int, steps: int, deep: int) -> dict:
    import torch
    import torch.nn.functional as F

    from adaptrain.torch.parallel import AdaptiveDataParallel
    from adaptrain.workloads import DigitsNet, digits_datasets

    torch.set_num_threads(1)
    train, _ = digits_datasets()
    idx = range(rank * batch, (rank + 1) * batch)
    x = torch.stack([train[i][0] for i in idx])
    y = torch.tensor([int(train[i][1]) for i in idx])
    models = {}
    for name in VARIANTS:
        m = _deep_mlp(deep) if deep else DigitsNet(seed=0)
        opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
        if name == "ddp":
            models[name] = (torch.nn.parallel.DistributedDataParallel(m), opt)
            continue
        adp = AdaptiveDataParallel(m, opt, name=f"bench-{name}")
        interval = 10**9 if name == "never" else 1
        adp.gns.sample_interval = lambda scale=None, k=interval: k  # a fixed schedule
        models[name] = (adp, opt)

    def step(model, opt) -> float:
        t0 = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        return time.perf_counter() - t0

    for model, opt in models.values():
        for _ in range(20):
            step(model, opt)
    chunks: dict[str, list[float]] = {n: [] for n in VARIANTS}
    names = list(VARIANTS)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            model, opt = models[name]
            chunks[name].append(statistics.fmean(step(model, opt) for _ in range(steps)))
    return chunks


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=120)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=16, help="samples per replica")
    ap.add_argument(
        "--deep",
        type=int,
        default=0,
        metavar="L",
        help="time an MLP of L hidden 64x64 layers (2L+2 parameter tensors) instead of DigitsNet",
    )
    args = ap.parse_args(argv)
    if args.rounds < 3 or args.steps < 1 or args.deep < 0:
        ap.error("--rounds must be ≥ 3 (a median of paired rounds), --steps ≥ 1, --deep ≥ 0")
    ch = spawn(_worker, 2, args=(args.batch, args.rounds, args.steps, args.deep), timeout=1200)[0]
    base = statistics.median(ch["ddp"]) * 1e3
    model = (
        f"MLP of {args.deep} hidden layers ({2 * args.deep + 2} tensors)"
        if args.deep
        else "DigitsNet"
    )
    print(
        f"2 gloo processes, {model}, batch {args.batch} per replica, {args.rounds} rounds x "
        f"{args.steps} steps; DDP step {base:.2f} ms (median chunk)"
    )
    print("| variant | step − never (sampling cost) | step / DDP |")
    print("|---|---|---|")
    for name in VARIANTS[1:]:
        cost = statistics.median((a - b) * 1e6 for a, b in zip(ch[name], ch["never"]))
        ratio = statistics.median(a / b for a, b in zip(ch[name], ch["ddp"]))
        cell = "(the reference)" if name == "never" else f"{cost:+.0f} us"
        print(f"| {name} | {cell} | {ratio:.3f}× |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
