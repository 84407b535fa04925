"""The training script of the service's end-to-end test, written to the job's working folder
by the test (run as a replica's command, never imported by pytest).

``python train.py digits|charlm --epochs N [--step-sleep S]``: AdaptDL's digits tutorial
(``examples/digits/step_5.py``: Adadelta, StepLR, autoscale_batch_size, an exact test pass
with an Accumulator) or a tiny character LM, on a dataset that yields each sample's index
with it. Every replica appends one JSON line per micro-batch to
``$ADAPTRAIN_SHARE_PATH/ids-g{GROUP}-r{RANK}.jsonl`` (epoch, sample ids, replicas, batch size),
flushed at once; rank 0 writes ``first-step-g{GROUP}.json`` (when the first step of the
restart group ended, with the times of its imports and process-group set-up) and, at the end,
``final.json``. ``--step-sleep`` stretches each step (so that a job lives long enough to be
rescaled on a loaded machine).
"""

SCRIPT = r'''
import time

T0 = time.time()
import argparse, json, os, sys

import torch
import torch.nn.functional as F

T_TORCH = time.time()
import adaptrain.torch as adl

T_LIB = time.time()


class Indexed(torch.utils.data.Dataset):
    """The wrapped dataset's samples, each with its index."""

    def __init__(self, base):
        self.base = base

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        return (*self.base[i], i)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("workload", choices=["digits", "charlm"])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--step-sleep", type=float, default=0.0)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(1)
    group = os.environ.get("ADAPTRAIN_NUM_RESTARTS", "0")
    share = os.environ.get("ADAPTRAIN_SHARE_PATH", ".")
    adl.init_process_group("gloo")
    t_pg = time.time()
    rank = torch.distributed.get_rank()
    replicas = torch.distributed.get_world_size()
    print(f"group {group} rank {rank} of {replicas}: {args.workload} starts", flush=True)
    if args.workload == "digits":
        from torch.optim.lr_scheduler import StepLR

        from adaptrain.workloads import DigitsNet, digits_datasets

        train_set, test_set = digits_datasets()
        model = DigitsNet()
        optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
        scheduler = StepLR(optimizer, step_size=1, gamma=0.7)
        loader = adl.AdaptiveDataLoader(Indexed(train_set), batch_size=64, shuffle=True)
        loader.autoscale_batch_size(512, local_bsz_bounds=(32, 128))

        def loss_of(x, y):
            return F.cross_entropy(model(x), y)
    else:
        from adaptrain.workloads import CharLM, charlm_datasets

        train_set, test_set = charlm_datasets(seq_len=32, max_chars=24_000)
        model = CharLM(hidden=32)
        optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
        scheduler = None
        loader = adl.AdaptiveDataLoader(Indexed(train_set), batch_size=32, shuffle=True)
        loader.autoscale_batch_size(512, local_bsz_bounds=(16, 128))

        def loss_of(x, y):
            logits = model(x)
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    test_loader = adl.AdaptiveDataLoader(test_set, batch_size=256)
    model = adl.AdaptiveDataParallel(model, optimizer, scheduler)
    log = open(os.path.join(share, f"ids-g{group}-r{rank}.jsonl"), "a", buffering=1)
    first = True
    for epoch in adl.remaining_epochs_until(args.epochs):
        model.train()
        for x, y, ids in loader:
            optimizer.zero_grad()
            loss = loss_of(x, y)
            loss.backward()
            optimizer.step()
            if args.step_sleep:
                time.sleep(args.step_sleep)
            log.write(json.dumps({"epoch": epoch, "ids": ids.tolist(), "replicas": replicas,
                                  "bsz": loader.current_batch_size, "t": time.time()}) + "\n")
            if first and rank == 0:
                first = False
                with open(os.path.join(share, f"first-step-g{group}.json"), "w") as f:
                    json.dump({"start": T0, "torch": T_TORCH, "lib": T_LIB, "pg": t_pg,
                               "step": time.time(), "replicas": replicas}, f)
        model.eval()
        stats = adl.Accumulator()
        with torch.no_grad():
            for x, y in test_loader:
                out = model(x)
                stats["loss"] += F.cross_entropy(
                    out.reshape(-1, out.shape[-1]), y.reshape(-1), reduction="sum").item()
                stats["n"] += y.numel()
        with stats.synchronized():
            if rank == 0:
                print(f"group {group} epoch {epoch}: test loss {stats['loss'] / stats['n']:.4f}"
                      f" batch size {loader.current_batch_size} on {replicas}", flush=True)
        if scheduler is not None:
            scheduler.step()
    if rank == 0:
        with open(os.path.join(share, "final.json"), "w") as f:
            json.dump({"workload": args.workload, "epochs": args.epochs,
                       "samples": len(train_set)}, f)
        print(f"{args.workload} done", flush=True)


main()
'''
