"""The emulated-compute job of ``bench_ray_service.py vs-train`` as a Ray Train v2 run (run as
a process by it; not imported by it).

    python _emulated_ray_train.py APP --scale S --max-workers M --storage DIR --name NAME
                                  [--batch-size B] [--monitor S] [--checkpoint-every S]

Rank 0 appends a line to ``STORAGE/NAME.starts`` as each worker group starts (its placement).

The same emulation as ``_emulated_job.py`` (the trace ``APP``'s step time for the workers'
placement and local batch, by a sleep; the trace's statistical progress, its total over
``--scale``), as a Ray Train user writes it: ``TorchTrainer`` with an elastic
``ScalingConfig(num_workers=(1, M))`` (one CPU per worker; the worker group resized as the
cluster's free resources change, every ``--monitor`` s at most), a ``DistributedDataParallel``
model (``ray.train.torch.prepare_model``, gloo) on synthetic data, the global batch fixed at the
trace's initial batch size (``--batch-size`` where given), split over the workers, and the
progress checkpointed through ``ray.train.report`` about every ``--checkpoint-every`` s (Ray
Train restarts the worker group from the last one on a resize or a failure).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def train_loop(config: dict) -> None:
    import tempfile
    from collections import Counter

    import numpy as np
    import ray
    import ray.train
    import ray.train.torch
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from adaptrain.sim.traces import default_traces_dir, load_applications

    torch.set_num_threads(1)
    app = load_applications(default_traces_dir(), [config["app"]])[config["app"]]
    total = app.get_progress(app.max_epochs) / config["scale"]
    epoch_progress = np.array([app.get_progress(e) for e in range(app.max_epochs + 1)])
    ctx = ray.train.get_context()
    workers, rank = ctx.get_world_size(), ctx.get_world_rank()
    nodes: list = [ray.get_runtime_context().get_node_id()] * workers  # workers per node
    if dist.is_initialized() and workers > 1:
        dist.all_gather_object(nodes, nodes[0])
    place = tuple(sorted(Counter(nodes).values(), reverse=True))
    bsz = config["batch_size"] or app.init_batch_size
    local = max(1, bsz // workers)
    progress = 0.0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d, open(os.path.join(d, "progress.json")) as f:
            progress = json.load(f)["progress"]
    model = ray.train.torch.prepare_model(torch.nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(4096, 16, generator=g), torch.randint(0, 4, (4096,), generator=g)
    step_time, _ = app.get_throughput(place, min(max(local, app.min_local_bsz), app.max_local_bsz))
    every = max(1, round(config["checkpoint_every"] / step_time))  # steps between reports
    if rank == 0:  # each worker group's start, for the benchmark's count of restarts
        with open(config["starts"], "a") as f:
            f.write(json.dumps({"time": time.time(), "placement": place, "local_bsz": local,
                                "progress": progress, "total": total}) + "\n")  # fmt: skip
    step, last = 0, time.perf_counter()
    while progress < total:
        idx = torch.randint(0, len(x), (min(local, len(x)),))
        optimizer.zero_grad()
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        optimizer.step()
        epoch = int(np.searchsorted(epoch_progress, progress * config["scale"], "right")) - 1
        epoch = min(max(epoch, 0), app.max_epochs - 1)
        sqr, var = app.get_grad_stats(min(max(bsz, app.init_batch_size), app.max_batch_size),
                                      epoch)  # fmt: skip
        left = step_time - (time.perf_counter() - last)
        if left > 0:
            time.sleep(left)  # emulated compute
        last = time.perf_counter()
        scale = bsz / app.init_batch_size
        progress += (var + sqr) / (var / scale + sqr)
        step += 1
        if step % every == 0 or progress >= total:
            with tempfile.TemporaryDirectory() as d:
                ckpt = None
                if rank == 0:
                    with open(os.path.join(d, "progress.json"), "w") as f:
                        json.dump({"progress": progress}, f)
                    ckpt = ray.train.Checkpoint.from_directory(d)
                ray.train.report({"progress": progress, "workers": workers}, checkpoint=ckpt)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("app")
    p.add_argument("--scale", type=float, required=True)
    p.add_argument("--max-workers", type=int, required=True)
    p.add_argument("--storage", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--batch-size", type=int)
    p.add_argument("--monitor", type=float, default=10.0)
    p.add_argument("--checkpoint-every", type=float, default=5.0)
    args = p.parse_args()
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    ray.init(log_to_driver=False)  # RAY_ADDRESS: the benchmark's cluster
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"app": args.app, "scale": args.scale, "batch_size": args.batch_size,
                           "checkpoint_every": args.checkpoint_every,
                           "starts": os.path.join(args.storage, f"{args.name}.starts")},
        scaling_config=ScalingConfig(
            num_workers=(1, args.max_workers), use_gpu=False, resources_per_worker={"CPU": 1},
            elastic_resize_monitor_interval_s=args.monitor,
        ),
        run_config=RunConfig(
            name=args.name, storage_path=args.storage,
            failure_config=FailureConfig(max_failures=-1),
            checkpoint_config=CheckpointConfig(num_to_keep=2),
        ),
    )  # fmt: skip
    t0 = time.time()
    result = trainer.fit()
    print(json.dumps({"name": args.name, "seconds": time.time() - t0,
                      "metrics": result.metrics}), flush=True)  # fmt: skip
    return 0 if result.error is None else 1


if __name__ == "__main__":
    sys.exit(main())
