"""Trial functions of the Tune tests (a module of their own: the Ray workers import it)."""

from __future__ import annotations


def digits_trial(config: dict) -> None:
    """A Tune trial of the digits ConvNet with adaptrain.torch; every epoch (``repeat`` passes
    over the training set) reports the test accuracy and what the replicas see of their job:
    the process group's size and how many distinct processes it has."""
    import os

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn

    import adaptrain.torch as adl
    from adaptrain.ray.tune import report
    from adaptrain.workloads.digits import digits_datasets

    torch.manual_seed(0)
    train_set, test_set = digits_datasets()
    train_set = torch.utils.data.ConcatDataset([train_set] * config.get("repeat", 1))
    loader = adl.AdaptiveDataLoader(train_set, batch_size=32, shuffle=True)
    loader.autoscale_batch_size(512, local_bsz_bounds=(16, 128))
    test_loader = adl.AdaptiveDataLoader(test_set, batch_size=128)
    model = nn.Sequential(
        nn.Conv2d(1, 3, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(192, 10)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.5)
    model = adl.AdaptiveDataParallel(model, optimizer)
    for epoch in adl.remaining_epochs_until(config["epochs"]):
        model.train()
        for x, y in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
        model.eval()
        stats = adl.Accumulator()
        with torch.no_grad():
            for x, y in test_loader:
                stats["correct"] += (model(x).argmax(1) == y).sum().item()
                stats["total"] += len(y)
        pids = [None] * dist.get_world_size()
        dist.all_gather_object(pids, os.getpid())
        with stats.synchronized():
            accuracy = stats["correct"] / stats["total"]
        report(
            mean_accuracy=accuracy,
            epoch=epoch,
            world_size=dist.get_world_size(),
            processes=len(set(pids)),
        )
