"""The service on Ray (``adaptrain server --backend ray``): node loss, and against Ray Train.

Both commands start a Ray cluster on this machine (:class:`ray.cluster_utils.Cluster`: a head
with no CPUs and worker nodes of 2 CPUs, every node on 127.0.0.1, health checks every second,
a node dead after 3 missed ones) and a real ``adaptrain server --backend ray`` joined to it.

    python benchmarks/bench_ray_service.py nodeloss [--repeat 3]

Node loss -> training resumed on the remaining nodes. A training job of 3 replicas (a
1M-parameter MLP on random data, AdaptiveDataParallel, AdaptiveDataLoader, periodic checkpoints
every 2 s; it stamps the end of the first optimizer step of each restart group) runs on a
cluster of 3 worker nodes, 2 replicas on one node and 1 on another; once it has trained and
checkpointed, the node holding 2 of its replicas is
removed without warning (``remove_node(allow_graceful=False)``: its raylet and Ray workers,
the agent among them, are killed) and a fresh node added, so the next repetition has one to
lose. Two ways the node goes:

- ``failure``: the node's replica processes are frozen (SIGSTOP) as it goes, as when a
  machine dies: their peers get no FIN or RST and may hang in a collective until they are
  killed; they are SIGKILLed once Ray has declared the node dead;
- ``drain``: only Ray's processes go; the replicas, on a machine that lives on, see their
  agent go and checkpoint on the SIGTERM their launcher passes on (a drained node).

Timed from the removal to the end of the first optimizer step of the restart group on the
remaining nodes, with the split: until Ray declares the node dead (``ray.nodes()``, polled
every 0.1 s by this script), until the service relaunches the job (its ``Started`` event), and
the new replicas' start-up, restore and first step. Median over ``--repeat`` losses per way.
Goal <= 15 s with 1 s health checks. For reference, the same job's cold start on the same
cluster (submit -> first step), measured in the same run.

    python benchmarks/bench_ray_service.py vs-train [--jobs 6] [--span 120] [--one-slot 90]

against the peer users would pick on Ray, Ray Train v2 with an elastic
``ScalingConfig(num_workers=(1, max))``: the first ``--jobs`` jobs of the Pollux workload (as
``bench_service.py emulated``: real adaptrain.torch training loops whose compute is emulated
from the job's trace by a sleep, arrivals compressed into ``--span`` s), once through the
service on Ray and once as Ray Train v2 runs on the same cluster (4 worker nodes x 2 CPUs),
one after the other; average JCT and makespan. The service's jobs may take up to
``--max-workers`` (8) replicas, and so may Ray Train's (``--ray-train-max same``), or each at
most its size in the workload (``--ray-train-max requested``). Goal: the service's average JCT
<= 0.8 x Ray Train's.

Everything it started (clusters, servers, jobs) is stopped at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

# Ray reads this when imported: with it, every node of the local cluster is 127.0.0.1
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import httpx  # noqa: E402
import psutil  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_service import _event, _median_row, _read_json, _wait  # noqa: E402  (the service bench's helpers)

SRC = os.path.join(HERE, "..", "src")
HEALTH = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}


@contextlib.contextmanager
def ray_cluster(workers: int, cpus: int = 2):
    """A head with no CPUs and ``workers`` nodes of ``cpus`` CPUs on 127.0.0.1; shut down on
    exit."""
    import ray
    from ray.cluster_utils import Cluster

    tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # Ray's socket paths must be short
    os.environ["RAY_TMPDIR"] = tmp
    cluster = None
    try:
        cluster = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 0, "node_ip_address": "127.0.0.1",
                            "include_dashboard": False, "_system_config": HEALTH},
        )  # fmt: skip
        for _ in range(workers):
            cluster.add_node(num_cpus=cpus, node_ip_address="127.0.0.1")
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, _node_ip_address="127.0.0.1", log_to_driver=False)
        yield cluster
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


def start_server(state: str, address: str, args: list[str]) -> tuple[subprocess.Popen, str]:
    log = open(state + ".log", "w")  # noqa: SIM115 - the child writes it
    env = {**os.environ, "PYTHONPATH": SRC}
    proc = subprocess.Popen(
        [sys.executable, "-m", "adaptrain", "server", "--backend", "ray", "--ray-address",
         address, "--port", "0", "--state-dir", state, *args],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
    )  # fmt: skip
    for _ in range(900):
        with open(state + ".log") as f:
            found = re.findall(r"listening on (http://\S+)", f.read())
        if found:
            return proc, found[-1]
        if proc.poll() is not None:
            raise RuntimeError(open(state + ".log").read()[-3000:])
        time.sleep(0.1)
    raise RuntimeError("the server did not start")


def stop_server(proc: subprocess.Popen, state: str) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    for p in psutil.process_iter(["cmdline"]):  # any replica left: its whole session
        cmd = p.info.get("cmdline") or []
        if "adaptrain.service.launcher" in cmd and any(state in c for c in cmd):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(os.getpgid(p.pid), signal.SIGKILL)


# ---- node loss ---------------------------------------------------------------------------------

#: a 1M-parameter MLP on random data, stamping each restart group's first step
#: (``first-step-gG.json`` in the share folder) until it is deleted
LOSS_JOB = r"""
import json, os, time
import torch
import torch.nn.functional as F
import adaptrain.torch as adl

torch.set_num_threads(1)
adl.init_process_group("gloo")
group = os.environ["ADAPTRAIN_NUM_RESTARTS"]
rank = torch.distributed.get_rank()
g = torch.Generator().manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(4096, 256, generator=g),
                                      torch.randint(0, 10, (4096,), generator=g))
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(),
                          torch.nn.Linear(1024, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
model = adl.AdaptiveDataParallel(net, optimizer)
loader = adl.AdaptiveDataLoader(data, batch_size=64, shuffle=True)
first = True
for epoch in adl.remaining_epochs_until(100_000):
    for x, y in loader:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        time.sleep(0.05)
        if first and rank == 0:
            first = False
            path = os.path.join(os.environ["ADAPTRAIN_SHARE_PATH"], f"first-step-g{group}.json")
            with open(path + ".tmp", "w") as f:
                json.dump({"step": time.time(), "replicas": torch.distributed.get_world_size(),
                           "node": os.environ["ADAPTRAIN_RAY_NODE_ID"]}, f)
            os.replace(path + ".tmp", path)
"""


def _signal_node_replicas(node: str, sig: int) -> int:
    """``sig`` to every replica session started on Ray node ``node``; how many."""
    killed = 0
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info.get("cmdline") or []
        if "adaptrain.service.launcher" not in cmd:
            continue
        try:
            if p.environ().get("ADAPTRAIN_RAY_NODE_ID") == node:
                os.killpg(os.getpgid(p.pid), sig)
                killed += 1
        except (psutil.Error, ProcessLookupError, PermissionError):
            pass
    return killed


def nodeloss(args: argparse.Namespace) -> None:
    import ray

    rows: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp, ray_cluster(workers=3) as cluster:
        script = os.path.join(tmp, "loss_job.py")
        with open(script, "w") as f:
            f.write(LOSS_JOB)
        state = os.path.join(tmp, "state")
        proc, url = start_server(
            state,
            cluster.address,
            ["--interval", "5", "--restart-delay", "3", "--checkpoint-interval", "2",
             "--hints-interval", "1", "--grace", "30"],
        )  # fmt: skip
        try:
            with httpx.Client(base_url=url, timeout=60) as http:
                runs = [(way, i) for i in range(args.repeat) for way in ("failure", "drain")]
                for way, i in runs:
                    name = f"{way}-{i}"
                    spec = {"name": name, "command": [sys.executable, script],
                            "min_replicas": 3, "max_replicas": 3,
                            "env": {"OMP_NUM_THREADS": "1"}}  # fmt: skip
                    t_submit = time.time()
                    http.post("/jobs", json=spec).raise_for_status()
                    share = os.path.join(state, "jobs", name, "share")
                    ckpt = os.path.join(state, "jobs", name, "checkpoint")
                    cold = _wait(
                        lambda s=share: _read_json(os.path.join(s, "first-step-g0.json")),
                        120, f"{name}'s first step",
                    )  # fmt: skip
                    _wait(lambda c=ckpt: glob.glob(os.path.join(c, "*checkpoint-*")), 60,
                          f"{name}'s first checkpoint")  # fmt: skip
                    detail = http.get(f"/jobs/{name}").json()
                    group = detail["restarts"]
                    held = {n: detail["allocation"].count(n) for n in detail["allocation"]}
                    victim = max(held, key=lambda n: (held[n], n))
                    node = next(n for n in cluster.worker_nodes if n.node_id == victim)
                    t0 = time.time()
                    if way == "failure":  # the machine stops answering: no FIN, no RST
                        _signal_node_replicas(victim, signal.SIGSTOP)
                    cluster.remove_node(node, allow_graceful=False)
                    dead = _wait(
                        lambda v=victim: (
                            not any(n["Alive"] for n in ray.nodes() if n["NodeID"] == v)
                            and time.time()
                        ),
                        60,
                        "Ray to declare the node dead",
                        0.1,
                    )
                    if way == "failure":  # gone for good
                        _signal_node_replicas(victim, signal.SIGKILL)
                    path = os.path.join(share, f"first-step-g{group + 1}.json")
                    stamp = _wait(lambda p=path: _read_json(p), 120, f"{name}'s restart", 0.05)
                    cluster.add_node(num_cpus=2, node_ip_address="127.0.0.1")  # for the next
                    detail = http.get(f"/jobs/{name}").json()
                    if args.verbose:
                        for e in detail["events"]:
                            if e["time"] >= t0:
                                print(f"    {e['time'] - t0:6.2f} {e['kind']}: {e['message']}")
                    started = _event(detail, "Started", t0, f"group {group + 1}:")
                    lost = _event(detail, "NodeLost", t0)
                    if lost is None:
                        raise RuntimeError(f"{name}: no NodeLost event: {detail['events']}")
                    if stamp["node"] == victim:
                        raise RuntimeError(f"{name} restarted on the lost node")
                    phases = {
                        "node lost -> first step on the remaining nodes": stamp["step"] - t0,
                        "  -> Ray declares the node dead": dead - t0,
                        "  -> the service relaunches the job (Started)": started - dead,
                        "  -> first step (start-up, restore, step)": stamp["step"] - started,
                        "reference: submit -> first step (its cold start)": cold["step"] - t_submit,
                    }
                    for k, v in phases.items():
                        rows.setdefault(way, {}).setdefault(k, []).append(v)
                    print(f"  {name}: {phases[next(iter(phases))]:.2f} s "
                          f"({held[victim]} of {sum(held.values())} replicas lost, resumed on "
                          f"{stamp['replicas']})", flush=True)  # fmt: skip
                    http.delete(f"/jobs/{name}").raise_for_status()
                    _wait(lambda n=name: http.get(f"/jobs/{n}").json()["status"] == "Cancelled",
                          120, f"{name}'s end")  # fmt: skip
                    _wait(lambda: len(http.get("/cluster").json()["nodes"]) == 3, 60,
                          "the new node to join the service")  # fmt: skip
        finally:
            stop_server(proc, state)
    print(f"nodeloss: node lost -> training resumed, Ray health checks every 1 s (dead after 3 "
          f"missed), {os.cpu_count()} CPU cores (goal <= 15 s); median (each value)")  # fmt: skip
    for way, phases in rows.items():
        print(f"{way} ({len(next(iter(phases.values())))}):")
        for k, v in phases.items():
            print(_median_row(k, v))


# ---- against Ray Train --------------------------------------------------------------------------


def _service_run(args, cluster, jobs, scales, fixed: dict, tmp: str) -> dict[str, tuple]:
    """The jobs through ``adaptrain server --backend ray``; each one's (submitted, finished)."""
    script = os.path.join(HERE, "_emulated_job.py")
    state = os.path.join(tmp, "service")
    proc, url = start_server(
        state,
        cluster.address,
        ["--interval", str(args.interval), "--restart-delay", str(args.restart_delay),
         "--hints-interval", "2", "--checkpoint-interval", "0", "--grace", "60"],
    )  # fmt: skip
    try:
        with httpx.Client(base_url=url, timeout=60) as http:
            start = time.time()
            for name, at, app, _ in jobs:
                time.sleep(max(0.0, start + at - time.time()))
                command = [sys.executable, script, app, "--scale", str(scales[app])]
                if app in fixed:
                    command += ["--batch-size", str(fixed[app])]
                spec = {"name": name, "command": command, "max_replicas": args.max_workers,
                        "env": {"OMP_NUM_THREADS": "1", "PYTHONPATH": SRC}}  # fmt: skip
                http.post("/jobs", json=spec).raise_for_status()
                print(f"  [service] t={time.time() - start:6.1f} s submitted {name}", flush=True)
            names = [j[0] for j in jobs]
            ended = {}
            for n in names:
                ended[n] = _wait(
                    lambda n=n: (d := http.get(f"/jobs/{n}").json())["status"]
                    in ("Succeeded", "Failed", "Cancelled") and d,
                    7200, f"{n}'s end", 1.0,
                )  # fmt: skip
            bad = {n: d["status"] for n, d in ended.items() if d["status"] != "Succeeded"}
            if bad:
                raise RuntimeError(f"jobs did not succeed: {bad} (log: {state}.log)")
            return {n: (d["submitted"], d["finished"], d["restarts"]) for n, d in ended.items()}
    finally:
        stop_server(proc, state)


def _ray_train_run(args, cluster, jobs, scales, fixed: dict, tmp: str) -> dict[str, tuple]:
    """The jobs as Ray Train v2 runs (one driver process each, started at its arrival); each
    one's (started, ended)."""
    script = os.path.join(HERE, "_emulated_ray_train.py")
    storage = os.path.join(tmp, "ray-train")
    env = {**os.environ, "PYTHONPATH": SRC, "RAY_ADDRESS": cluster.address,
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    procs: dict[str, tuple[subprocess.Popen, float]] = {}
    ended: dict[str, tuple] = {}
    try:
        start = time.time()
        pending = list(jobs)
        while pending or len(ended) < len(jobs):
            while pending and time.time() >= start + pending[0][1]:
                name, _, app, requested = pending.pop(0)
                most = args.max_workers
                if args.ray_train_max == "requested":  # the job's own size in the workload
                    most = max(1, min(requested, args.max_workers))
                command = [sys.executable, script, app, "--scale", str(scales[app]),
                           "--max-workers", str(most), "--storage", storage,
                           "--name", name, "--monitor", str(args.interval)]  # fmt: skip
                if app in fixed:
                    command += ["--batch-size", str(fixed[app])]
                log = open(os.path.join(tmp, f"{name}.log"), "w")  # noqa: SIM115
                procs[name] = (
                    subprocess.Popen(
                        command,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=env,
                        start_new_session=True,
                    ),
                    time.time(),
                )
                log.close()
                print(f"  [ray-train] t={time.time() - start:6.1f} s started {name}", flush=True)
            for name, (proc, t) in procs.items():
                if name not in ended and proc.poll() is not None:
                    if proc.returncode != 0:
                        raise RuntimeError(f"{name} exited {proc.returncode}: see {tmp}/{name}.log")
                    with open(os.path.join(storage, f"{name}.starts")) as f:
                        starts = [json.loads(line)["placement"] for line in f]
                    restarts = len(starts) - 1
                    if args.verbose:
                        print(f"    {name}: worker groups {starts}", flush=True)
                    ended[name] = (t, time.time(), restarts)
                    print(f"  [ray-train] t={time.time() - start:6.1f} s {name} done", flush=True)
            time.sleep(0.5)
        return ended
    finally:
        for proc, _ in procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)


def vs_train(args: argparse.Namespace) -> None:
    sys.path.insert(0, HERE)
    from bench_service import DEFAULT_WORKLOAD, EMULATED_NODES, FIXED_BATCH, emulated_workload

    args.workload = args.workload or DEFAULT_WORKLOAD
    jobs, apps, scales, squeeze = emulated_workload(args)
    print(f"emulated compute: sleep. {len(jobs)} jobs of {os.path.basename(args.workload)}, "
          f"arrivals x{squeeze:.3f} (over {args.span:g} s), a Ray cluster of {EMULATED_NODES} "
          f"nodes x 2 CPUs, rounds / resize checks every {args.interval:g} s")  # fmt: skip
    for name, at, app, requested in jobs:
        print(f"  {name:<16} at {at:6.1f} s  ({app}, work / {scales[app]:.2f}, requests "
              f"{requested})")  # fmt: skip
    print(f"  the service's jobs: --max-replicas {args.max_workers}; Ray Train's: num_workers="
          f"(1, {'their request' if args.ray_train_max == 'requested' else args.max_workers})"
          f", global batch fixed (the trace's initial one), split over the workers")  # fmt: skip
    results = {}
    with tempfile.TemporaryDirectory() as tmp, ray_cluster(workers=EMULATED_NODES) as cluster:
        os.environ["RAY_ADDRESS"] = cluster.address  # Ray Train's helpers find this cluster
        runs = {"service": _service_run, "ray-train": _ray_train_run}
        for which in args.only or ("service", "ray-train"):
            results[which] = runs[which](args, cluster, jobs, scales, FIXED_BATCH, tmp)
    names = [j[0] for j in jobs]
    print(f"\n  {'job':<16}" + "".join(f"{w + ' JCT':>18}{'restarts':>10}" for w in results))
    for n in names:
        row = "".join(f"{r[n][1] - r[n][0]:18.1f}{r[n][2]:10d}" for r in results.values())
        print(f"  {n:<16}{row}")
    summary = {}
    for which, r in results.items():
        jct = statistics.mean(r[n][1] - r[n][0] for n in names)
        makespan = max(r[n][1] for n in names) - min(r[n][0] for n in names)
        summary[which] = (jct, makespan)
        print(f"  {which:<12} average JCT {jct:7.1f} s   makespan {makespan:7.1f} s")
    if len(summary) == 2:
        ratio = summary["service"][0] / summary["ray-train"][0]
        print(f"  service / Ray Train average JCT = {ratio:.3f}  (goal <= 0.8); makespan "
              f"{summary['service'][1] / summary['ray-train'][1]:.3f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("nodeloss", help="node lost -> training resumed on the remaining nodes")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--verbose", action="store_true", help="each loss's events")
    p = sub.add_parser("vs-train", help="the service on Ray against Ray Train v2 (elastic)")
    p.add_argument("--jobs", type=int, default=6)
    p.add_argument("--span", type=float, default=120.0)
    p.add_argument("--one-slot", type=float, default=90.0)
    p.add_argument("--interval", type=float, default=10.0)
    p.add_argument("--restart-delay", type=float, default=5.0)
    p.add_argument("--workload", default=None)
    p.add_argument("--max-workers", type=int, default=8, help="each job's most replicas")
    p.add_argument("--only", choices=("service", "ray-train"), action="append")
    p.add_argument("--verbose", action="store_true", help="each Ray Train run's worker groups")
    p.add_argument(
        "--ray-train-max",
        choices=("same", "requested"),
        default="same",
        help="Ray Train's max workers: --max-workers as the service's jobs, or each job's "
        "size in the workload (at most --max-workers)",
    )
    args = parser.parse_args()
    {"nodeloss": nodeloss, "vs-train": vs_train}[args.command](args)


if __name__ == "__main__":
    main()
