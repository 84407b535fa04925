"""The service on Ray: ``adaptrain server --backend ray`` on a real multi-node Ray cluster.

A Ray cluster of a head (no CPUs) and two worker nodes of 2 CPUs on 127.0.0.1 (every node the
same IP: the service keys them by node ID); a real server process joins it. Two real training
jobs (AdaptDL's digits tutorial and a tiny character LM) are submitted; once both train, the
worker node holding most of their replicas is removed without warning, and once the service
has dropped it another node is added.
Both jobs finish; the node loss restarted them from their last checkpoints without counting
against their restart budgets; the new node was offered; and, over the history each job's final
model comes from (each restart group up to the checkpoint the next one restored), every training
sample was seen exactly once per epoch.
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict

import httpx
import psutil
import pytest
from _ray_cluster import add_worker, local_ray_cluster

pytestmark = pytest.mark.slow

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "src")

#: ``python train.py digits|charlm --epochs N [--step-sleep S]``: the end-to-end test's training
#: jobs, whose log of sample ids also says which of them each checkpoint covers. Every replica
#: appends one JSON line per micro-batch to ``$ADAPTRAIN_SHARE_PATH/ids-g{GROUP}-r{RANK}.jsonl``
#: (epoch, sample ids, the group's micro-batch count ``step``); a checkpointed State records the
#: group and how many micro-batches it had logged, and rank 0 writes ``restored-g{GROUP}.json``
#: with the one the group restored (null when it started afresh), and ``final.json`` at the end.
SCRIPT = r'''
import argparse, json, os, pickle

import torch
import torch.nn.functional as F

import adaptrain.torch as adl
from adaptrain.checkpoint import State, load_state

GROUP = int(os.environ.get("ADAPTRAIN_NUM_RESTARTS", "0"))
STEPS = [0]


class Indexed(torch.utils.data.Dataset):
    def __init__(self, base):
        self.base = base

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        return (*self.base[i], i)


class Committed(State):
    """The restart group that took a checkpoint and how many micro-batches it had logged."""

    def __init__(self):
        super().__init__("committed-log")
        self.value = None

    def save(self, f):
        pickle.dump({"group": GROUP, "steps": STEPS[0]}, f)

    def load(self, f):
        self.value = pickle.load(f)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("workload", choices=["digits", "charlm"])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--step-sleep", type=float, default=0.0)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(1)
    share = os.environ["ADAPTRAIN_SHARE_PATH"]
    adl.init_process_group("gloo")
    committed = Committed()
    load_state(committed)
    rank = torch.distributed.get_rank()
    replicas = torch.distributed.get_world_size()
    if rank == 0:
        with open(os.path.join(share, f"restored-g{GROUP}.json"), "w") as f:
            json.dump({"from": committed.value}, f)
    print(f"group {GROUP} rank {rank} of {replicas} on {os.environ['ADAPTRAIN_RAY_NODE_ID']}",
          flush=True)
    if args.workload == "digits":
        from adaptrain.workloads import DigitsNet, digits_datasets

        train_set, _ = digits_datasets()
        model = DigitsNet()
        optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
        loader = adl.AdaptiveDataLoader(Indexed(train_set), batch_size=64, shuffle=True)
        loader.autoscale_batch_size(512, local_bsz_bounds=(32, 128))

        def loss_of(x, y):
            return F.cross_entropy(model(x), y)
    else:
        from adaptrain.workloads import CharLM, charlm_datasets

        train_set, _ = charlm_datasets(seq_len=32, max_chars=12_000)
        model = CharLM(hidden=32)
        optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
        loader = adl.AdaptiveDataLoader(Indexed(train_set), batch_size=32, shuffle=True)
        loader.autoscale_batch_size(512, local_bsz_bounds=(16, 128))

        def loss_of(x, y):
            logits = model(x)
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    model = adl.AdaptiveDataParallel(model, optimizer)
    log = open(os.path.join(share, f"ids-g{GROUP}-r{rank}.jsonl"), "a", buffering=1)
    for epoch in adl.remaining_epochs_until(args.epochs):
        for x, y, ids in loader:
            optimizer.zero_grad()
            loss_of(x, y).backward()
            optimizer.step()
            if args.step_sleep:
                import time

                time.sleep(args.step_sleep)
            log.write(json.dumps({"epoch": epoch, "ids": ids.tolist(), "step": STEPS[0],
                                  "replicas": replicas}) + "\n")
            STEPS[0] += 1
    if rank == 0:
        with open(os.path.join(share, "final.json"), "w") as f:
            json.dump({"group": GROUP, "epochs": args.epochs, "samples": len(train_set)}, f)
        print(f"{args.workload} done", flush=True)


main()
'''

JOBS = {  # name -> the training script's arguments
    "digits": ["digits", "--epochs", "8", "--step-sleep", "0.15"],
    "charlm": ["charlm", "--epochs", "6", "--step-sleep", "0.15"],
}


class RayServer:
    """``adaptrain server --backend ray`` in a process of its own, stopped by :meth:`stop`
    (SIGTERM: its jobs checkpoint, its agents go), then killed if need be."""

    def __init__(self, state_dir: str, address: str, args: list[str], log_suffix: str = "") -> None:
        self.state_dir = state_dir
        self.log = f"{state_dir}-server{log_suffix}.log"
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "adaptrain", "server", "--backend", "ray",
                 "--ray-address", address, "--port", "0", "--state-dir", state_dir, *args],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, "PYTHONPATH": SRC},
            )  # fmt: skip
        self.url = ""
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            found = re.findall(r"listening on (http://\S+)", self.text())
            if found:
                self.url = found[-1]
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}: {self.text()}")
            time.sleep(0.2)
        raise RuntimeError(f"server did not start: {self.text()}")

    def text(self) -> str:
        with open(self.log) as f:
            return f.read()[-6000:]

    def get(self, path: str) -> dict:
        with httpx.Client(base_url=self.url, timeout=30) as c:
            resp = c.get(path)
        resp.raise_for_status()
        return resp.json()

    def submit(self, spec: dict) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as c:
            c.post("/jobs", json=spec).raise_for_status()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)


def kill_replicas(state_dir: str) -> list[int]:
    """SIGKILL the sessions of this state directory's replicas still alive (their launchers
    name a status file under it); their pids."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info.get("cmdline") or []
        if "adaptrain.service.launcher" in cmd and any(state_dir in c for c in cmd):
            found.append(proc.pid)
            try:
                os.killpg(os.getpgid(proc.pid), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    return found


def wait_for(predicate, timeout: float, what: str, step: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


def committed_history(share: str) -> tuple[dict[int, Counter], list[tuple[int, float]]]:
    """Per epoch, how often each sample was trained on in the history the job's final model
    comes from: the final restart group whole, the group it restored from up to that
    checkpoint, and so on back to the group that started afresh. Also that chain."""
    records: dict[int, list[dict]] = defaultdict(list)
    for path in glob.glob(os.path.join(share, "ids-g*-r*.jsonl")):
        group = int(re.search(r"ids-g(\d+)-r\d+", path).group(1))
        with open(path) as f:
            records[group].extend(json.loads(line) for line in f)
    with open(os.path.join(share, "final.json")) as f:
        group, upto = json.load(f)["group"], math.inf
    chain = []
    while True:
        chain.append((group, upto))
        with open(os.path.join(share, f"restored-g{group}.json")) as f:
            restored = json.load(f)["from"]
        if restored is None:
            break
        assert restored["group"] < group, (group, restored)
        group, upto = restored["group"], restored["steps"]
    seen: dict[int, Counter] = defaultdict(Counter)
    for group, upto in chain:
        for record in records[group]:
            if record["step"] < upto:
                seen[record["epoch"]].update(record["ids"])
    return seen, chain


@pytest.mark.timeout(300)
def test_two_jobs_survive_a_node_leaving_and_use_one_joining(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "train.py").write_text(SCRIPT)
    state = str(tmp_path / "state")
    server = None
    with local_ray_cluster(workers=[{"num_cpus": 2}, {"num_cpus": 2}], connect=False) as cluster:
        try:
            server = RayServer(
                state,
                cluster.address,
                ["--interval", "3", "--restart-delay", "3", "--checkpoint-interval", "2",
                 "--hints-interval", "1", "--grace", "30", "--max-restarts", "0"],
            )  # fmt: skip
            workers = {n.node_id: n for n in cluster.worker_nodes}
            assert set(server.get("/cluster")["nodes"]) == set(workers)
            for name, args in JOBS.items():
                server.submit(
                    {"name": name, "command": [sys.executable, str(work / "train.py"), *args],
                     "max_replicas": 4}
                )  # fmt: skip

            def training() -> dict | None:
                details = {n: server.get(f"/jobs/{n}") for n in JOBS}
                shares = [os.path.join(state, "jobs", n, "share") for n in JOBS]
                stepped = all(glob.glob(os.path.join(s, "ids-g*.jsonl")) for s in shares)
                ckpt = all(
                    glob.glob(os.path.join(state, "jobs", n, "checkpoint", "*checkpoint-*"))
                    for n in JOBS
                )
                running = all(d["status"] == "Running" for d in details.values())
                return details if stepped and ckpt and running else None

            details = wait_for(training, 120, "both jobs training, with a checkpoint")
            held = Counter(node for d in details.values() for node in d["allocation"])
            victim = max(workers, key=lambda n: (held[n], n))
            t_lost = time.time()
            cluster.remove_node(workers[victim], allow_graceful=False)
            wait_for(
                lambda: victim not in server.get("/cluster")["nodes"],
                30,
                "the lost node to leave the service's cluster",
            )
            new = add_worker(cluster, num_cpus=2).node_id  # once the jobs are on what remains
            wait_for(
                lambda: new in server.get("/cluster")["nodes"],
                60,
                "the new node to join the service's cluster",
            )

            def ended() -> dict | None:
                details = {n: server.get(f"/jobs/{n}") for n in JOBS}
                done = all(d["status"] in ("Succeeded", "Failed") for d in details.values())
                return details if done else None

            ended = wait_for(ended, 150, "both jobs to end")
        finally:
            if server is not None:
                server.stop()
            left = kill_replicas(state)
    log = server.text()
    assert not left, f"replicas left running: {left}"
    for name, d in ended.items():
        assert d["status"] == "Succeeded", (name, d, log)
        assert d["failures"] == 0, (name, d["events"])
    lost_events = [e for d in ended.values() for e in d["events"] if e["kind"] == "NodeLost"]
    assert lost_events and all(victim in e["message"] for e in lost_events), lost_events
    restarted = [e for e in lost_events if e["time"] >= t_lost]
    assert restarted, lost_events
    for name in JOBS:
        share = os.path.join(state, "jobs", name, "share")
        with open(os.path.join(share, "final.json")) as f:
            final = json.load(f)
        seen, chain = committed_history(share)
        assert sorted(seen) == list(range(final["epochs"])), (name, sorted(seen), chain)
        for epoch, counts in seen.items():
            missing = set(range(final["samples"])) - set(counts)
            twice = {i: k for i, k in counts.items() if k > 1}
            assert not missing and not twice, (
                f"{name} epoch {epoch}: {len(missing)} samples missing, {len(twice)} seen more "
                f"than once (history {chain})"
            )
    # the node that joined was offered at a round, and taken by a job
    started = [e["message"] for d in ended.values() for e in d["events"] if e["kind"] == "Started"]
    assert any(new in m for m in started), started


#: ``python count.py N DELAY``: counts to N, a step each DELAY seconds, every rank writing each
#: step it begins to ``steps-RANK.log`` in the share folder.
COUNT = """
import os, sys, time
n, delay = int(sys.argv[1]), float(sys.argv[2])
rank = os.environ["ADAPTRAIN_REPLICA_RANK"]
with open(os.path.join(os.environ["ADAPTRAIN_SHARE_PATH"], f"steps-{rank}.log"), "a") as f:
    for step in range(n):
        f.write(f"{step} {os.getpid()}\\n")
        f.flush()
        time.sleep(delay)
"""


@pytest.mark.timeout(150)
def test_replicas_outlive_a_killed_server_and_are_adopted_by_the_next(tmp_path):
    import ray

    script = tmp_path / "count.py"
    script.write_text(COUNT)
    state = str(tmp_path / "state")
    servers = []
    with local_ray_cluster(workers=[{"num_cpus": 2}], connect=True) as cluster:
        try:
            args = ["--interval", "3", "--grace", "10"]
            servers.append(RayServer(state, cluster.address, args))
            servers[0].submit(
                {"name": "count", "command": [sys.executable, str(script), "24", "0.5"],
                 "max_replicas": 2}
            )  # fmt: skip
            share = os.path.join(state, "jobs", "count", "share")
            wait_for(lambda: os.path.exists(os.path.join(share, "steps-1.log")), 60, "steps")
            servers[0].proc.kill()  # kill -9: no shutdown, the replicas run on
            servers[0].proc.wait(timeout=30)
            servers.append(RayServer(state, cluster.address, args, log_suffix="2"))
            detail = wait_for(
                lambda: (
                    (d := servers[1].get("/jobs/count"))["status"] in ("Succeeded", "Failed") and d
                ),
                90,
                "the job to end",
            )
            pgs_before_stop = [
                pg for pg in ray.util.placement_group_table().values() if pg["state"] != "REMOVED"
            ]
        finally:
            for srv in servers:
                srv.stop()
            left = kill_replicas(state)
        pgs = [pg for pg in ray.util.placement_group_table().values() if pg["state"] != "REMOVED"]
        agents = ray.util.list_named_actors(all_namespaces=True)
    assert not left, f"replicas left running: {left}"
    assert detail["status"] == "Succeeded", detail
    events = [(e["kind"], e["message"]) for e in detail["events"]]
    assert ("Recovered", "server restarted: 2 of 2 replicas re-adopted") in events, events
    assert detail["restarts"] == 0, events  # never restarted: the same processes went on
    for rank in (0, 1):
        with open(os.path.join(share, f"steps-{rank}.log")) as f:
            lines = [line.split() for line in f]
        assert [int(step) for step, _ in lines] == list(range(24)), lines
        assert len({pid for _, pid in lines}) == 1, lines
    # the allocation's placement group was found again and removed with the job; the agents
    # went with the server
    assert not pgs_before_stop and not pgs, (pgs_before_stop, pgs)
    assert not agents, agents


@pytest.mark.timeout(150)
def test_without_their_server_replicas_stop_after_the_orphan_timeout(tmp_path):
    import ray

    script = tmp_path / "count.py"
    script.write_text(COUNT)
    state = str(tmp_path / "state")
    server = None
    with local_ray_cluster(workers=[{"num_cpus": 2}], connect=True) as cluster:
        try:
            server = RayServer(state, cluster.address, ["--orphan-timeout", "3", "--grace", "10"])
            server.submit(
                {"name": "count", "command": [sys.executable, str(script), "600", "0.2"],
                 "max_replicas": 2}
            )  # fmt: skip
            share = os.path.join(state, "jobs", "count", "share")
            wait_for(lambda: os.path.exists(os.path.join(share, "steps-1.log")), 60, "steps")
            launchers = [
                p.pid
                for p in psutil.process_iter(["cmdline"])
                if "adaptrain.service.launcher" in (p.info.get("cmdline") or [])
                and any(state in c for c in p.info["cmdline"])
            ]
            assert len(launchers) == 2, launchers
            server.proc.kill()  # kill -9: nobody watches the replicas any more
            server.proc.wait(timeout=30)
            t_killed = time.monotonic()
            wait_for(
                lambda: not any(psutil.pid_exists(p) for p in launchers), 30, "the replicas to stop"
            )
            stopped_after = time.monotonic() - t_killed
            wait_for(
                lambda: not ray.util.list_named_actors(all_namespaces=True),
                30,
                "the agent to exit",
            )
            statuses = [
                json.loads(open(os.path.join(state, "runs", "count", f"g0-r{r}.status")).read())
                for r in (0, 1)
            ]
        finally:
            if server is not None:
                server.stop()
            left = kill_replicas(state)
    assert not left, f"replicas left running: {left}"
    # SIGTERM after the 3 s orphan timeout (count.py has no handler: 128 + 15)
    assert [s["exit_code"] for s in statuses] == [143, 143], statuses
    assert 3.0 <= stopped_after <= 20.0, stopped_after
