"""Digits tutorial, step 3: adaptive batch size.

Changes from step 2: ``train_loader.autoscale_batch_size(512, local_bsz_bounds=(32, 128))``
lets adaptrain grow the global batch size (up to 512) when its goodput model predicts faster
statistical progress; the learning rate follows the scaling rule of AdaptiveDataParallel.

    python examples/digits/step_3.py --epochs 3
    torchrun --nproc-per-node=2 examples/digits/step_3.py --epochs 3
"""

import argparse

import torch
import torch.nn.functional as F
from torch.optim.lr_scheduler import StepLR

import adaptrain.env
import adaptrain.torch as adl
from adaptrain.workloads import DigitsNet, digits_datasets


def is_rank0():
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def train(args, model, device, train_loader, optimizer, epoch):
    model.train()
    for batch_idx, (data, target) in enumerate(train_loader):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        output = model(data)
        loss = F.cross_entropy(output, target)
        loss.backward()
        optimizer.step()
        if batch_idx % args.log_interval == 0 and is_rank0():
            print(
                f"Train Epoch: {epoch} [{batch_idx * len(data)}/{len(train_loader.dataset)}]"
                f"\tLoss: {loss.item():.6f}"
                f"\tbatch size {train_loader.current_batch_size}"
            )  # Changed
        if args.max_steps and batch_idx + 1 >= args.max_steps:
            break


def test(model, device, test_loader):
    model.eval()
    test_loss = 0
    correct = 0
    seen = 0
    with torch.no_grad():
        for data, target in test_loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            test_loss += F.cross_entropy(output, target, reduction="sum").item()
            correct += output.argmax(dim=1).eq(target).sum().item()
            seen += len(target)
    # With several replicas each evaluates (and prints) only its share of the test set;
    # step 5 sums the replicas' figures with an Accumulator.
    test_loss /= max(seen, 1)
    share = (
        ""
        if seen == len(test_loader.dataset)
        else f" (replica {adaptrain.env.replica_rank()}'s share)"
    )
    print(
        f"\nTest set{share}: Average loss: {test_loss:.4f}, Accuracy: {correct}/"
        f"{seen} ({100.0 * correct / max(seen, 1):.0f}%)\n"
    )


def parse_args():
    parser = argparse.ArgumentParser(description="adaptrain digits tutorial")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--test-batch-size", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--gamma", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument(
        "--max-steps",
        type=int,
        default=0,
        help="smoke tests: stop each training pass after this many batches (0: all; a pass resumed "
        "after a restart counts again)",
    )
    return parser.parse_args()


def main():
    args = parse_args()
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    dataset1, dataset2 = digits_datasets()
    train_loader = adl.AdaptiveDataLoader(
        dataset1, batch_size=args.batch_size, shuffle=True
    )  # Changed
    test_loader = adl.AdaptiveDataLoader(dataset2, batch_size=args.test_batch_size)
    train_loader.autoscale_batch_size(512, local_bsz_bounds=(32, 128))  # Changed

    model = DigitsNet().to(device)
    optimizer = torch.optim.Adadelta(model.parameters(), lr=args.lr)

    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    adl.init_process_group("nccl" if torch.cuda.is_available() else "gloo")  # Changed
    model = adl.AdaptiveDataParallel(model, optimizer, scheduler)  # Changed
    for epoch in range(1, args.epochs + 1):
        train(args, model, device, train_loader, optimizer, epoch)
        test(model, device, test_loader)
        scheduler.step()


if __name__ == "__main__":
    main()
