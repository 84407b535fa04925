"""A training job whose compute is emulated from a Pollux trace (run as a service replica by
``bench_service.py emulated``; not imported by it).

    python _emulated_job.py APP --scale S [--batch-size B]

A real adaptrain.torch training loop (AdaptiveDataParallel, AdaptiveDataLoader with
``autoscale_batch_size`` within the trace's batch limits, ``remaining_epochs_until``,
checkpoint-restart under the service's ``ADAPTRAIN_*`` environment) on a tiny linear model and
synthetic data, where:

- emulated compute: sleep. Each optimizer step is stretched by a ``time.sleep`` to the step time
  the trace ``APP`` (``adaptrain/sim/data/traces/APP``) gives for the job's placement (its
  replicas over its nodes, at most 2 per node as on the benchmark's cluster) and local batch;
  the real work (a few ms) is part of that time, not added to it;
- emulated statistics: the trace's gradient statistics at the job's batch size and trace epoch
  replace the tiny model's in what the job reports (its hints), so the batch-size choice and the
  policy's speedup see the trace's statistical efficiency;
- the work is the trace's: each step adds ``gain = (var + sqr) / (var / s + sqr)`` (``s`` = batch
  over the initial one) to the job's progress, as the simulator counts it, and the job ends when
  its progress reaches the trace's total over ``S`` (``--scale``); the progress is a checkpointed
  :class:`adaptrain.checkpoint.State`, so it survives every rescale.

``--batch-size B`` fixes the batch size (no autoscaling), as the simulator does for ncf.
Rank 0 writes ``$ADAPTRAIN_SHARE_PATH/done.json`` at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import time

import numpy as np
import torch
import torch.nn.functional as F

import adaptrain.torch as adl
from adaptrain.checkpoint import State, load_state
from adaptrain.sim.traces import default_traces_dir, load_applications
from adaptrain.torch import _metrics


class Synthetic(torch.utils.data.Dataset):
    """Random features and labels, fetched a whole batch at a time (``__getitems__``)."""

    def __init__(self, size: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(size, 16, generator=g)
        self.y = torch.randint(0, 4, (size,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]

    def __getitems__(self, idx):
        idx = torch.as_tensor(idx)
        return self.x[idx], self.y[idx]


class Progress(State):
    def __init__(self) -> None:
        super().__init__("emulated-progress")
        self.value = 0.0

    def save(self, fileobj) -> None:
        pickle.dump(self.value, fileobj)

    def load(self, fileobj) -> None:
        self.value = pickle.load(fileobj)


def placement(nodes: int, replicas: int) -> tuple[int, ...]:
    """Replicas per node when ``replicas`` lie on ``nodes`` nodes of 2 slots each (the only
    split, up to order); on larger nodes an even split."""
    if replicas <= 2 * nodes:
        twos = max(0, replicas - nodes)
        return (2,) * twos + (1,) * (nodes - twos)
    base, extra = divmod(replicas, nodes)
    return tuple(base + (i < extra) for i in range(nodes))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("app")
    p.add_argument("--scale", type=float, required=True)
    p.add_argument("--batch-size", type=int)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(1)
    app = load_applications(default_traces_dir(), [args.app])[args.app]
    total = app.get_progress(app.max_epochs) / args.scale  # init-batch steps to do
    epoch_progress = np.array([app.get_progress(e) for e in range(app.max_epochs + 1)])
    adl.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    replicas = torch.distributed.get_world_size()
    nodes = int(os.environ.get("ADAPTRAIN_NUM_NODES", "1"))
    place = placement(nodes, replicas)
    progress = Progress()
    load_state(progress)
    max_bsz = args.batch_size or app.max_batch_size
    data = Synthetic(max(8 * max_bsz, 4096))
    loader = adl.AdaptiveDataLoader(
        data, batch_size=args.batch_size or app.init_batch_size, shuffle=True,
        collate_fn=lambda batch: batch,
    )  # fmt: skip
    if args.batch_size is None:
        loader.autoscale_batch_size(
            app.max_batch_size, local_bsz_bounds=(app.min_local_bsz, app.max_local_bsz)
        )
    model = torch.nn.Linear(16, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model = adl.AdaptiveDataParallel(model, optimizer)
    share = os.environ.get("ADAPTRAIN_SHARE_PATH", ".")
    print(f"{args.app} on {place}: progress {progress.value:.1f} of {total:.1f}", flush=True)
    done = progress.value >= total
    last = time.perf_counter()
    for _ in adl.remaining_epochs_until(1_000_000):
        if done:
            break
        for x, y in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            local = loader.current_local_bsz
            bsz = local * replicas
            epoch = int(np.searchsorted(epoch_progress, progress.value * args.scale, "right")) - 1
            epoch = min(max(epoch, 0), app.max_epochs - 1)
            sqr, var = app.get_grad_stats(min(max(bsz, app.init_batch_size),
                                              app.max_batch_size), epoch)  # fmt: skip
            _metrics.update_grad_params(sqr, var)  # emulated statistics: the trace's
            # emulated compute: sleep until the step has taken the trace's step time
            step_time, _ = app.get_throughput(
                place, min(max(local, app.min_local_bsz), app.max_local_bsz)
            )
            left = step_time - (time.perf_counter() - last)
            if left > 0:
                time.sleep(left)
            last = time.perf_counter()
            scale = bsz / app.init_batch_size
            progress.value += (var + sqr) / (var / scale + sqr)
            if progress.value >= total:
                done = True
                break
    if rank == 0:
        with open(os.path.join(share, "done.json"), "w") as f:
            json.dump({"app": args.app, "progress": progress.value, "total": total}, f)
        print(f"{args.app} done: progress {progress.value:.1f}", flush=True)


main()
