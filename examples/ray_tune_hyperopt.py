"""HyperOpt search on Ray Tune with adaptive trials: AdaptDL's ``hyperopt_example.py`` on adaptrain.

HyperOpt tunes the learning rate and momentum of a small ConvNet on handwritten digits
(scikit-learn's bundled 8x8 digits, no download, in place of MNIST). Every trial is a
data-parallel adaptrain job (one process per replica, gloo); the adaptive trial scheduler
re-decides the trials' replica counts from their goodput as they run, growing and shrinking them
through Tune's pause and restore. Trial names read ``AdaptDLTrainable_<replicas>_<restarts>_<id>``.

    python examples/ray_tune_hyperopt.py                       # a 2-node Ray cluster on this machine
    python examples/ray_tune_hyperopt.py --scheduler fifo      # Tune's FIFO, fixed replicas
    ray start --head ...; python examples/ray_tune_hyperopt.py --address auto

Migrating from AdaptDL: ``import adaptdl.torch as adl`` becomes ``import adaptrain.torch as adl``,
``from adaptdl_ray.tune.adaptdl_trial_sched import AdaptDLScheduler`` and
``adaptdl_ray.tune.adaptdl_trainable.AdaptDLTrainableCreator`` come from ``adaptrain.ray.tune``,
and the trial reports with ``adaptrain.ray.tune.report`` (Ray 2's ``tune.report`` only works in
Tune's own function trainables).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

# A multi-node cluster on one machine: every node on 127.0.0.1 (read by Ray at import).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import ray  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch.optim as optim  # noqa: E402
from hyperopt import hp  # noqa: E402
from ray import tune  # noqa: E402
from ray.tune.schedulers import FIFOScheduler  # noqa: E402
from ray.tune.search.hyperopt import HyperOptSearch  # noqa: E402

import adaptrain.torch as adl  # noqa: E402
from adaptrain.ray.tune import AdaptDLScheduler, AdaptDLTrainableCreator, report  # noqa: E402
from adaptrain.workloads.digits import digits_datasets  # noqa: E402


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        # The seed's network, for 8x8 digits: 3 channels of 8x8 are its 192 features.
        self.conv1 = nn.Conv2d(1, 3, kernel_size=3, padding=1)
        self.fc = nn.Linear(192, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = x.view(-1, 192)
        x = self.fc(x)
        return F.log_softmax(x, dim=1)


def train(model, optimizer, train_loader):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.train()
    for data, target in train_loader:
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.step()


def test(model, data_loader):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.eval()
    stats = adl.Accumulator()  # each test sample is evaluated by one replica: sum them all
    with torch.no_grad():
        for data, target in data_loader:
            data, target = data.to(device), target.to(device)
            outputs = model(data)
            _, predicted = torch.max(outputs.data, 1)
            stats["total"] += target.size(0)
            stats["correct"] += (predicted == target).sum().item()
    with stats.synchronized():
        return stats["correct"] / stats["total"]


def train_digits(config):
    train_set, test_set = digits_datasets()
    train_loader = adl.AdaptiveDataLoader(train_set, batch_size=64, shuffle=True)
    # Autoscale batch size
    train_loader.autoscale_batch_size(512, local_bsz_bounds=(16, 128))
    test_loader = adl.AdaptiveDataLoader(test_set, batch_size=64, shuffle=True)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    model = ConvNet()
    optimizer = optim.SGD(
        model.parameters(), lr=config.get("lr", 0.01), momentum=config.get("momentum", 0.79)
    )

    model.to(device)
    model = adl.AdaptiveDataParallel(model, optimizer)

    for _epoch in adl.remaining_epochs_until(config.get("epochs", 10)):
        train(model, optimizer, train_loader)
        acc = test(model, test_loader)
        # Send the current training result back to Tune
        report(mean_accuracy=acc)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scheduler", choices=("adaptive", "fifo"), default="adaptive")
    p.add_argument("--num-samples", type=int, default=4, help="HyperOpt trials")
    p.add_argument("--epochs", type=int, default=100, help="epochs of every trial")
    p.add_argument("--replicas", type=int, default=1, help="replicas a trial starts with")
    p.add_argument("--seed", type=int, default=0, help="HyperOpt's seed (the trials' configs)")
    p.add_argument("--interval", type=float, default=10.0, help="seconds between policy rounds")
    p.add_argument(
        "--restart-delay", type=float, default=15.0, help="seconds a resize costs a trial"
    )
    p.add_argument("--address", default=None, help="an existing Ray cluster (e.g. auto)")
    p.add_argument("--nodes", type=int, default=2, help="worker nodes of the local cluster")
    p.add_argument("--cpus-per-node", type=int, default=2)
    p.add_argument("--json", default=None, help="write a summary of the run to this file")
    return p.parse_args(argv)


def start_local_cluster(nodes, cpus_per_node):
    """A head without CPUs and ``nodes`` worker nodes on 127.0.0.1 (all on this machine)."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "node_ip_address": "127.0.0.1", "include_dashboard": False},
    )
    for _ in range(nodes):
        cluster.add_node(num_cpus=cpus_per_node, node_ip_address="127.0.0.1")
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, _node_ip_address="127.0.0.1")
    return cluster


def run(args):
    """One HyperOpt search; a summary of it (wall time, the best trial, every trial)."""
    trainable_cls = AdaptDLTrainableCreator(train_digits, num_workers=args.replicas)
    space = {
        "lr": hp.uniform("lr", 0.01, 0.1),
        "momentum": hp.uniform("momentum", 0.1, 0.9),
        "epochs": args.epochs,
    }
    hyperopt_search = HyperOptSearch(
        space, metric="mean_accuracy", mode="max", random_state_seed=args.seed
    )
    if args.scheduler == "adaptive":
        scheduler = AdaptDLScheduler(interval=args.interval, restart_delay=args.restart_delay)
    else:
        scheduler = FIFOScheduler()
    storage = tempfile.mkdtemp(prefix="adaptrain-tune-hyperopt-")
    tuner = tune.Tuner(
        trainable_cls,
        param_space={},
        tune_config=tune.TuneConfig(
            num_samples=args.num_samples,  # total trials
            scheduler=scheduler,
            search_alg=hyperopt_search,
        ),
        run_config=tune.RunConfig(
            storage_path=storage,
            name=f"hyperopt-{args.scheduler}",
            verbose=1,
        ),
    )
    started = time.monotonic()
    try:
        results = tuner.fit()
    finally:
        wall = time.monotonic() - started
    try:
        best = results.get_best_result(metric="mean_accuracy", mode="max")
        trials = [
            {
                "config": {k: r.config[k] for k in ("lr", "momentum", "epochs")},
                "mean_accuracy": r.metrics.get("mean_accuracy"),
                "iterations": r.metrics.get("training_iteration"),
                "time_total_s": r.metrics.get("time_total_s"),
                "num_replicas": r.metrics.get("num_replicas"),
                "num_restarts": r.metrics.get("num_restarts"),
                "error": None if r.error is None else str(r.error),
            }
            for r in results
        ]
        return {
            "scheduler": args.scheduler,
            "wall_s": wall,
            "best_config": {k: best.config[k] for k in ("lr", "momentum", "epochs")},
            "best_accuracy": best.metrics["mean_accuracy"],
            "trials": trials,
            "resizes": [r._asdict() for r in getattr(scheduler, "resizes", [])],
        }
    finally:
        shutil.rmtree(storage, ignore_errors=True)


def main(argv=None):
    args = parse_args(argv)
    cluster = None
    if args.address:
        ray.init(address=args.address)
    else:
        cluster = start_local_cluster(args.nodes, args.cpus_per_node)
    try:
        summary = run(args)
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
    print(f"Best trial config: {summary['best_config']}")
    print(f"Best trial mean_accuracy: {summary['best_accuracy']}")
    print(
        f"{args.scheduler}: {len(summary['trials'])} trials in {summary['wall_s']:.1f} s, "
        f"{len(summary['resizes'])} resizes"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0 if all(t["error"] is None for t in summary["trials"]) else 1


if __name__ == "__main__":
    sys.exit(main())
