"""PowerSGD compression cost vs torch's own DDP hook, and bytes sent per step per compressor.

Run: ``python benchmarks/bench_compression.py [--reps 7] [--steps 20] [--world-size 2]
[--ranks 1 2 4]``; to time another checkout of the library against torch's hook with this script,
put its ``src`` first on ``PYTHONPATH`` (the workers print which ``adaptrain`` they imported).

Part 1 (time): for a set of gradient shapes, one "step" = one PowerSGD compress + all-reduce +
decompress of all tensors (error feedback on, same rank, same seedless warm state), on
``--world-size`` gloo processes on 127.0.0.1. Ours: :func:`adaptrain.dist.hooks.powersgd_hook`;
torch's: ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.powerSGD_hook``
(non-batched, ``min_compression_rate=0`` so every matrix is compressed, past its
``start_powerSGD_iter`` warm-up). Both are driven by the same duck-typed GradBucket over the
same flat buffer, in alternating order; the figure is the median over paired repetitions of
(ours / torch) time — a ratio from the same run, as the machine is shared and noisy.
``batched_powerSGD_hook`` is tried too and its failure (if any) reported.

Part 2 (bytes): payload bytes each worker hands to collectives per step for each compressor,
vs a dense fp32 all-reduce of the same gradients, measured by counting the communicator's
payloads; plus ring-algorithm bytes on the wire per worker at n workers (all-reduce
``2(n−1)/n·B``, all-gather ``(n−1)·B``).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time

import torch

from adaptrain.core.compress import (
    LocalCommunicator,
    powersgd_init,
    powersgd_update,
    sign_init,
    sign_update,
    sparse_init,
    sparse_update,
)
from adaptrain.dist.spawn import spawn

MODELS = {
    # DigitsNet (adaptrain.workloads.digits, conv, hidden 64)
    "digits_cnn": [(16, 1, 3, 3), (16,), (32, 16, 3, 3), (32,), (64, 512), (64,), (10, 64), (10,)],
    # MNIST-sized MLP 784-512-512-10
    "mlp_784_512": [(512, 784), (512,), (512, 512), (512,), (10, 512), (10,)],
}


class _Bucket:
    """Minimal duck-typed ``dist.GradBucket`` over one flat buffer (both hooks use only these)."""

    def __init__(self, shapes, generator):
        self.shapes = shapes
        sizes = [math.prod(s) for s in shapes]
        self.source = torch.randn(sum(sizes), generator=generator)
        self.buf = self.source.clone()
        self.sizes = sizes

    def reset(self):
        self.buf.copy_(self.source)

    def buffer(self):
        return self.buf

    def gradients(self):
        out, off = [], 0
        for s, n in zip(self.shapes, self.sizes):
            out.append(self.buf[off : off + n].view(s))
            off += n
        return out

    def index(self):
        return 0

    def is_last(self):
        return True

    def parameters(self):
        return []


def _time_worker(rank, ws, shapes, rank_r, reps, steps):
    import torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook as th

    from adaptrain.dist.hooks import PowerSGDHookState, powersgd_hook

    g = torch.Generator().manual_seed(100 + rank)
    bucket = _Bucket(shapes, g)
    ours = PowerSGDHookState(
        rank=rank_r, reuse_query=True, error_feedback=True, min_compression_rate=0
    )
    theirs = th.PowerSGDState(
        process_group=None,
        matrix_approximation_rank=rank_r,
        start_powerSGD_iter=2,
        min_compression_rate=0,
        use_error_feedback=True,
        warm_start=True,
        random_seed=0,
    )

    def run_ours():
        bucket.reset()
        t = time.perf_counter()
        powersgd_hook(ours, bucket).wait()
        return time.perf_counter() - t

    def run_theirs():
        bucket.reset()
        t = time.perf_counter()
        th.powerSGD_hook(theirs, bucket).wait()
        return time.perf_counter() - t

    for _ in range(3):  # warm-up (torch: past start_powerSGD_iter; both: allocate state)
        run_ours()
        run_theirs()
    ratios, t_ours, t_theirs = [], [], []
    for rep in range(reps):
        a = b = 0.0
        for s in range(steps):
            if (rep + s) % 2 == 0:
                a += run_ours()
                b += run_theirs()
            else:
                b += run_theirs()
                a += run_ours()
        ratios.append(a / b)
        t_ours.append(a / steps)
        t_theirs.append(b / steps)
    batched = "ok"
    try:
        st = th.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=rank_r,
            start_powerSGD_iter=2,
            min_compression_rate=0,
        )
        for _ in range(3):
            bucket.reset()
            th.batched_powerSGD_hook(st, bucket).wait()
    except Exception as e:  # noqa: BLE001 - we report whatever it raises
        import traceback

        frame = traceback.extract_tb(e.__traceback__)[-1]
        batched = (
            f"fails: {type(e).__name__}({str(e)[:80]!r}) raised in {frame.name}() "
            f"at {frame.filename.split('site-packages/')[-1]}:{frame.lineno}"
        )
    import adaptrain

    return {
        "adaptrain": adaptrain.__file__.rsplit("/adaptrain/", 1)[0],
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "ours_ms": 1e3 * statistics.median(t_ours),
        "torch_ms": 1e3 * statistics.median(t_theirs),
        "batched": batched,
    }


def _bytes_table(shapes, world_sizes=(2, 8)):
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(s, generator=g) for s in shapes]
    flat = torch.cat([x.reshape(-1) for x in grads])
    dense = flat.numel() * 4
    local = LocalCommunicator()
    rows = []

    def add(name, sent, collective):
        rows.append((name, sent, collective))

    add("dense all-reduce (fp32)", dense, "all_reduce")
    for r in (1, 2, 4):
        res, _ = powersgd_update(grads, powersgd_init(shapes, r), local)
        add(f"PowerSGD rank {r}", res.sent_bytes, "all_reduce")
    for method in ("topk", "randomk", "block"):
        k = max(1, math.ceil(0.01 * flat.numel()))
        res, _ = sparse_update(flat, sparse_init(flat.shape), local, k=k, method=method)
        add(
            f"{method} 1% (k={k}) + memory",
            res.sent_bytes,
            "all_gather" if method == "topk" else "all_reduce",
        )
    res, _ = sign_update(flat, sign_init(flat.shape), local, error_feedback=True)
    add("EF-SignSGD (1 bit + scale)", res.sent_bytes, "all_gather")
    res, _ = sign_update(flat, sign_init(flat.shape), local, majority=True)
    add("signSGD majority vote (2 bits: ternary sign)", res.sent_bytes, "all_gather")
    out = []
    for name, sent, coll in rows:
        wire = {
            n: (2 * (n - 1) / n * sent if coll == "all_reduce" else (n - 1) * sent)
            for n in world_sizes
        }
        dense_wire = {n: 2 * (n - 1) / n * dense for n in world_sizes}
        out.append(
            {
                "compressor": name,
                "payload_bytes": int(sent),
                "payload_vs_dense": sent / dense,
                "collective": coll,
                **{f"wire_vs_dense_n{n}": wire[n] / dense_wire[n] for n in world_sizes},
            }
        )
    return dense, out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print(
        f"# machine: {platform.platform()}, {platform.processor() or 'cpu'}, "
        f"torch {torch.__version__}, python {sys.version.split()[0]}"
    )
    print(
        f"# world size {args.world_size} (gloo, 127.0.0.1), reps {args.reps} × steps {args.steps}\n"
    )
    results = {"time": [], "bytes": {}}
    print("## PowerSGD hook time per step: ours / torch powerSGD_hook (median of paired reps)\n")
    print("| gradients | rank | ours ms | torch ms | ratio median [min, max] |")
    print("|---|---|---|---|---|")
    batched_msgs = set()
    for model, shapes in MODELS.items():
        for r in args.ranks:
            res = spawn(
                _time_worker, args.world_size, args=(shapes, r, args.reps, args.steps), timeout=540
            )[0]
            batched_msgs.add(res["batched"])
            results["time"].append({"model": model, "rank": r, **res})
            print(
                f"| {model} | {r} | {res['ours_ms']:.3f} | {res['torch_ms']:.3f} | "
                f"{res['ratio_median']:.2f} [{res['ratio_min']:.2f}, {res['ratio_max']:.2f}] |",
                flush=True,
            )
    print(f"\nbatched_powerSGD_hook: {'; '.join(sorted(batched_msgs))}")
    print(
        f"adaptrain imported from: {', '.join(sorted({t['adaptrain'] for t in results['time']}))}\n"
    )
    for model, shapes in MODELS.items():
        dense, rows = _bytes_table(shapes)
        results["bytes"][model] = rows
        print(f"## Bytes per worker per step, {model} ({dense} B dense fp32)\n")
        print(
            "| compressor | collective | payload B | payload / dense | wire / dense n=2 | wire / dense n=8 |"
        )
        print("|---|---|---|---|---|---|")
        for row in rows:
            print(
                f"| {row['compressor']} | {row['collective']} | {row['payload_bytes']} | "
                f"{row['payload_vs_dense']:.4f} | {row['wire_vs_dense_n2']:.4f} | "
                f"{row['wire_vs_dense_n8']:.4f} |"
            )
        print()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
