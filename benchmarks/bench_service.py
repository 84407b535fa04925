"""The scheduler service's control plane at scale: many jobs, many slots, one server.

    python benchmarks/bench_service.py control [--jobs 1000] [--nodes 16] [--slots-per-node 4]
                                               [--rounds 5] [--ls 200] [--repeat 2]

starts a real ``adaptrain server`` (its default waterfill policy, emulated nodes), submits
``--jobs`` jobs over HTTP (each a ``sleep``, so that only the control plane is measured),
waits for ``--rounds`` policy rounds with every job known, and reports the policy round's time
(median and largest, from ``/metrics``) and the latency of ``GET /jobs`` (what ``adaptrain ls
--json`` reads), median and p99 over ``--ls`` calls; goals: a round <= 1 s, ls p99 <= 50 ms.
Each of ``--repeat`` repetitions runs two servers one after the other: the policy's rounds in
their worker process (the default) and, as the reference, in the server's process
(``--policy-in-process``), where they hold the interpreter lock the API needs.

    python benchmarks/bench_service.py startup [--repeat 5]

submit -> first training step of a digits job (AdaptDL's digits tutorial: the CNN, Adadelta,
autoscale_batch_size; one replica, ``--max-replicas 1``) on a real server with free slots: from
the ``POST /jobs`` call to the end of the job's first optimizer step, which the job stamps in
its share folder with the times of its own start-up phases. Median over ``--repeat`` jobs run
one after the other, and where the time goes: the server's handling up to the launch (the
``Started`` event), the launcher's and the job's interpreter starts (the job's process creation
time, then its first line), ``import torch`` and ``adaptrain.torch``, the process group, and
the first step (data set, model, the step). Goal <= 3 s on CPU.

    python benchmarks/bench_service.py rescale [--repeat 3]

SIGTERM -> first step on the new replica count, for a 10M-parameter MLP (random data from a
fixed seed, SGD, autoscale_batch_size) under the service. Method: a server of 2 slots, policy
rounds every 2 s; the MLP job (``--max-replicas 2``) starts on both slots; once it has trained
and posted hints, a second job (a ``sleep``, never run so the policy values it first) is
submitted and the next round shrinks the MLP to 1 replica to admit it (2 -> 1); once that
restart has stepped, the second job is deleted and a later round grows the MLP back onto the
free slot (1 -> 2; ``--restart-delay 1`` so that the growth pays within the payback the policy
asks). Each rescale is timed from its ``Stopping`` event (the controller sends SIGTERM to the
replicas just before it records it) to the end of the first optimizer step of the new restart
group, which the job stamps; with the split: the old replicas' checkpoint and exit (their
status files' times), the relaunch (the ``Started`` event), the interpreter and imports, the
process group, and the restore + first step. Median over every rescale of ``--repeat`` rounds
of this, and per direction. Goal <= 5 s.

    python benchmarks/bench_service.py emulated [--jobs 8] [--span 600] [--one-slot 120]
                                                [--workload WORKLOAD.csv] [--interval 10]

real processes, emulated compute: the first ``--jobs`` jobs of a Pollux workload (default the
artifact's ``workloads/workload-6.csv``), their arrivals compressed into ``--span`` seconds, on
``adaptrain server --nodes 4 --slots-per-node 2``. Each job is ``benchmarks/_emulated_job.py``:
a real adaptrain.torch training loop with real checkpoint-restart whose steps sleep to its
trace's step time ("emulated compute: sleep") and whose work is the trace's statistical progress
divided by the job's scale, chosen so that the job takes ``--one-slot`` seconds on one slot at
its initial batch size (never scaled up: a job shorter than that keeps its trace's work). The
jobs run once under the default policy (waterfill, ``--max-replicas 8``) and once under
``--policy fifo`` (``--max-replicas`` = the workload's ``num_replicas``, at most 8), one run after
the other; each job's JCT is its ``finished - submitted`` from ``GET /jobs`` (what ``adaptrain ls
--json`` reads). The simulator (:class:`adaptrain.sim.Simulator`, the waterfill policy, 4 nodes
x 2 GPUs, the same round length and restart delay) replays the same compressed arrivals with
the same scaled work. Goals: average JCT waterfill / FIFO <= 0.7; waterfill measured /
simulated within 10%.

Everything it started is stopped at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(HERE, "..", "src")


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(m.group(1)) if m else float("nan")


def start_server(state: str, args: list[str]) -> tuple[subprocess.Popen, str]:
    log = open(state + ".log", "w")  # noqa: SIM115 - the child writes it
    env = {**os.environ, "PYTHONPATH": SRC}
    proc = subprocess.Popen(
        [sys.executable, "-m", "adaptrain", "server", "--port", "0", "--state-dir", state, *args],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
    )  # fmt: skip
    for _ in range(300):
        with open(state + ".log") as f:
            found = re.findall(r"listening on (http://\S+)", f.read())
        if found:
            return proc, found[-1]
        if proc.poll() is not None:
            raise RuntimeError(open(state + ".log").read())
        time.sleep(0.1)
    raise RuntimeError("the server did not start")


#: The startup benchmark's job: the digits tutorial, timing its phases (``--steps`` steps).
STARTUP_JOB = r"""
import time
T0 = time.time()
import json, os, sys
with open("/proc/self/stat") as f:  # when this process started (clock ticks since boot)
    ticks = float(f.read().rsplit(")", 1)[1].split()[19])
CREATED = T0 - (time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"))
import torch
T_TORCH = time.time()
import torch.nn.functional as F
from torch.optim.lr_scheduler import StepLR
import adaptrain.torch as adl
T_LIB = time.time()
from adaptrain.workloads import DigitsNet, digits_datasets

torch.set_num_threads(1)
torch.manual_seed(1)
adl.init_process_group("gloo")
T_PG = time.time()
train_set, _ = digits_datasets()
T_DATA = time.time()
loader = adl.AdaptiveDataLoader(train_set, batch_size=64, shuffle=True)
loader.autoscale_batch_size(512, local_bsz_bounds=(32, 128))
model = DigitsNet()
optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
T_OPT = time.time()
model = adl.AdaptiveDataParallel(model, optimizer, StepLR(optimizer, step_size=1, gamma=0.7))
T_MODEL = time.time()
steps = int(sys.argv[1])
for epoch in adl.remaining_epochs_until(1):
    for i, (x, y) in enumerate(loader):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        if i == 0:
            with open(os.path.join(os.environ["ADAPTRAIN_SHARE_PATH"], "first-step.json"), "w") as f:
                json.dump({"created": CREATED, "start": T0, "torch": T_TORCH, "lib": T_LIB, "pg": T_PG,
                           "data": T_DATA, "opt": T_OPT, "model": T_MODEL, "step": time.time()}, f)
        if i + 1 >= steps:
            break
"""

#: The rescale benchmark's job: a 10M-parameter MLP on random data, stamping the first step of
#: every restart group (``first-step-gG.json``) until it is deleted.
RESCALE_JOB = r"""
import time
T0 = time.time()
import json, os
with open("/proc/self/stat") as f:  # when this process started (clock ticks since boot)
    ticks = float(f.read().rsplit(")", 1)[1].split()[19])
CREATED = T0 - (time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"))
import torch
T_TORCH = time.time()
import torch.nn.functional as F
import adaptrain.torch as adl
T_LIB = time.time()

torch.set_num_threads(1)
adl.init_process_group("gloo")
T_PG = time.time()
group = os.environ["ADAPTRAIN_NUM_RESTARTS"]
rank = torch.distributed.get_rank()
g = torch.Generator().manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(8192, 1024, generator=g),
                                      torch.randint(0, 10, (8192,), generator=g))
torch.manual_seed(0)
T_DATA = time.time()
net = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.ReLU(),
                          torch.nn.Linear(2048, 2048), torch.nn.ReLU(),
                          torch.nn.Linear(2048, 2048), torch.nn.ReLU(),
                          torch.nn.Linear(2048, 10))
params = sum(p.numel() for p in net.parameters())
optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
T_OPT = time.time()
model = adl.AdaptiveDataParallel(net, optimizer)
loader = adl.AdaptiveDataLoader(data, batch_size=64, shuffle=True)
loader.autoscale_batch_size(512, local_bsz_bounds=(32, 256))
T_MODEL = time.time()
first = True
for epoch in adl.remaining_epochs_until(10_000):
    for x, y in loader:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        if first and rank == 0:
            first = False
            path = os.path.join(os.environ["ADAPTRAIN_SHARE_PATH"], f"first-step-g{group}.json")
            with open(path + ".tmp", "w") as f:
                json.dump({"created": CREATED, "start": T0, "torch": T_TORCH, "lib": T_LIB, "pg": T_PG,
                           "data": T_DATA, "opt": T_OPT, "model": T_MODEL, "step": time.time(),
                           "params": params,
                           "replicas": torch.distributed.get_world_size()}, f)
            os.replace(path + ".tmp", path)
"""


def _wait(predicate, timeout: float, what: str, step: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step)
    raise RuntimeError(f"timed out after {timeout:g} s waiting for {what}")


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _event(detail: dict, kind: str, after: float = 0.0, contains: str = "") -> float | None:
    for e in detail["events"]:
        if e["kind"] == kind and e["time"] >= after and contains in e["message"]:
            return e["time"]
    return None


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def _median_row(label: str, values: list[float]) -> str:
    return f"  {label:<52} {statistics.median(values):6.2f} s   ({', '.join(f'{v:.2f}' for v in values)})"


def startup(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "digits_job.py")
        with open(script, "w") as f:
            f.write(STARTUP_JOB)
        state = os.path.join(tmp, "state")
        proc, url = start_server(state, ["--slots", "2", "--interval", "5", "--grace", "10"])
        rows: dict[str, list[float]] = {}
        try:
            with httpx.Client(base_url=url, timeout=60) as http:
                for i in range(args.repeat):
                    name = f"digits-{i}"
                    spec = {"name": name, "command": [sys.executable, script, str(args.steps)],
                            "max_replicas": 1}  # fmt: skip
                    t_submit = time.time()
                    http.post("/jobs", json=spec).raise_for_status()
                    share = os.path.join(state, "jobs", name, "share")
                    path = os.path.join(share, "first-step.json")
                    stamp = _wait(lambda p=path: _read_json(p), 120, f"{name}'s first step", 0.01)
                    detail = _wait(lambda n=name: _ended(http, n), 120, f"{name}'s end")
                    if detail["status"] != "Succeeded":
                        raise RuntimeError(f"{name} failed: {detail}")
                    started = _event(detail, "Started")
                    phases = {
                        "submit -> first step (total)": stamp["step"] - t_submit,
                        "  submit -> launched (Started event)": started - t_submit,
                        "  launcher start (-> job process created)": stamp["created"] - started,
                        "  job interpreter start": stamp["start"] - stamp["created"],
                        "  import torch": stamp["torch"] - stamp["start"],
                        "  import adaptrain.torch": stamp["lib"] - stamp["torch"],
                        "  init_process_group": stamp["pg"] - stamp["lib"],
                        "  digits data set": stamp["data"] - stamp["pg"],
                        "  model + optimizer (torch imports torch._dynamo)": stamp["opt"]
                        - stamp["data"],
                        "  AdaptiveDataParallel": stamp["model"] - stamp["opt"],
                        "  first step": stamp["step"] - stamp["model"],
                    }
                    for k, v in phases.items():
                        rows.setdefault(k, []).append(v)
        finally:
            _stop(proc)
    print(f"startup: submit -> first step of the digits job, {args.repeat} jobs, 1 replica each, "
          f"{os.cpu_count()} CPU cores (goal <= 3 s)")  # fmt: skip
    for k, v in rows.items():
        print(_median_row(k, v))


def _ended(http: httpx.Client, name: str) -> dict | None:
    detail = http.get(f"/jobs/{name}").json()
    return detail if detail["status"] in ("Succeeded", "Failed", "Cancelled") else None


def _hint(detail: dict, key: str):
    return (detail.get("hints") or {}).get(key)


def _profiled(detail: dict, replicas: int) -> bool:
    """Whether the job's hints hold a step time measured on ``replicas`` replicas."""
    return any(p["numReplicas"] == replicas for p in _hint(detail, "profile") or ())


def _status_time(state: str, name: str, group: int, rank: int) -> float:
    stamp = _read_json(os.path.join(state, "runs", name, f"g{group}-r{rank}.status"))
    return float("nan") if stamp is None else float(stamp["time"])


def rescale(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "mlp_job.py")
        with open(script, "w") as f:
            f.write(RESCALE_JOB)
        state = os.path.join(tmp, "state")
        proc, url = start_server(
            state,
            ["--slots", "2", "--interval", "2", "--restart-delay", "1", "--hints-interval", "1",
             "--rescale-rounds", "1", "--checkpoint-interval", "0", "--grace", "60"],
        )  # fmt: skip
        rows: dict[str, dict[str, list[float]]] = {}
        params = 0
        try:
            with httpx.Client(base_url=url, timeout=60) as http:

                def detail(name: str) -> dict:
                    return http.get(f"/jobs/{name}").json()

                def measure(name: str, group: int, after: float) -> None:
                    """The rescale that started restart group ``group``: wait for its first
                    step, then split SIGTERM -> first step."""
                    share = os.path.join(state, "jobs", name, "share")
                    stamp = _wait(
                        lambda: _read_json(os.path.join(share, f"first-step-g{group}.json")),
                        180,
                        f"{name}'s first step in group {group}",
                    )
                    d = detail(name)
                    stopping = _event(d, "Stopping", after, "rescale")
                    started = _event(d, "Started", after, f"group {group}:")
                    old = [e for e in d["events"] if e["kind"] == "Started"][group - 1]
                    old_n = int(re.search(r": (\d+) on", old["message"]).group(1))
                    exited = max(_status_time(state, name, group - 1, r) for r in range(old_n))
                    key = f"{old_n} -> {stamp['replicas']}"
                    phases = {
                        "SIGTERM -> first step on the new count (total)": stamp["step"] - stopping,
                        "  checkpoint + exit of the old replicas": exited - stopping,
                        "  -> relaunch (Started event)": started - exited,
                        "  launcher start (-> job process created)": stamp["created"] - started,
                        "  job interpreter start": stamp["start"] - stamp["created"],
                        "  import torch + adaptrain.torch": stamp["lib"] - stamp["start"],
                        "  init_process_group": stamp["pg"] - stamp["lib"],
                        "  data + model + optimizer (torch._dynamo import)": stamp["opt"]
                        - stamp["pg"],
                        "  AdaptiveDataParallel (checkpoint restore)": stamp["model"]
                        - stamp["opt"],
                        "  first step": stamp["step"] - stamp["model"],
                    }
                    for k, v in phases.items():
                        rows.setdefault(key, {}).setdefault(k, []).append(v)
                        rows.setdefault("all", {}).setdefault(k, []).append(v)
                    print(f"  {name} {key}: {phases[next(iter(phases))]:.2f} s", flush=True)

                for i in range(args.repeat):
                    name, other = f"mlp-{i}", f"other-{i}"
                    spec = {"name": name, "command": [sys.executable, script], "max_replicas": 2}
                    http.post("/jobs", json=spec).raise_for_status()
                    share = os.path.join(state, "jobs", name, "share")
                    path = os.path.join(share, "first-step-g0.json")
                    stamp = _wait(lambda p=path: _read_json(p), 180, f"{name}'s first step")
                    params = stamp["params"]
                    if stamp["replicas"] != 2:
                        raise RuntimeError(f"{name} started on {stamp['replicas']} replicas, not 2")
                    _wait(lambda n=name: _hint(detail(n), "perfParams"), 120, f"{name}'s hints")
                    t = time.time()
                    spec = {"name": other, "command": ["sleep", "3600"], "max_replicas": 1}
                    http.post("/jobs", json=spec).raise_for_status()
                    measure(name, 1, t)  # 2 -> 1 to admit the other job
                    _wait(lambda n=name: _profiled(detail(n), 1), 60, f"{name}'s hints on 1", 0.2)
                    t = time.time()
                    http.delete(f"/jobs/{other}").raise_for_status()
                    try:
                        measure(name, 2, t)  # 1 -> 2 on the freed slot
                    except RuntimeError as exc:
                        print(f"  {name}: no growth back to 2 ({exc})", flush=True)
                    http.delete(f"/jobs/{name}").raise_for_status()
                    _wait(lambda n=name: _ended(http, n), 120, f"{name}'s end")
        finally:
            _stop(proc)
    print(f"rescale: {params / 1e6:.1f}M-parameter MLP under the service, 2 slots, "
          f"{os.cpu_count()} CPU cores (goal <= 5 s); median (each value)")  # fmt: skip
    for key, phases in rows.items():
        n = len(next(iter(phases.values())))
        print(f"{key if key != 'all' else 'every rescale'} ({n}):")
        for k, v in phases.items():
            print(_median_row(k, v))


#: the control benchmark's two ways to run the policy: its own process (the default) and the
#: server's (the reference)
CONTROL_MODES = {"worker process": [], "in the server's process": ["--policy-in-process"]}


def _control_once(args: argparse.Namespace, extra: list[str]) -> tuple[float, list, list]:
    """One server: the submit time, the rounds' seconds and the ``GET /jobs`` latencies."""
    with tempfile.TemporaryDirectory() as tmp:
        state = os.path.join(tmp, "state")
        proc, url = start_server(
            state,
            ["--nodes", str(args.nodes), "--slots-per-node", str(args.slots_per_node),
             "--interval", str(args.interval), "--grace", "5", *extra],
        )  # fmt: skip
        try:
            with httpx.Client(base_url=url, timeout=60) as http:
                t0 = time.perf_counter()
                for i in range(args.jobs):
                    spec = {"name": f"job-{i}", "command": ["sleep", "3600"], "max_replicas": 4}
                    http.post("/jobs", json=spec).raise_for_status()
                submit_s = time.perf_counter() - t0
                start_round = _metric(http.get("/metrics").text, "adaptrain_rounds")
                rounds = []
                while len(rounds) < args.rounds:
                    time.sleep(args.interval / 4)
                    text = http.get("/metrics").text
                    done = _metric(text, "adaptrain_rounds") - start_round
                    if done >= 1 and done > len(rounds):
                        rounds.append(_metric(text, "adaptrain_round_seconds"))
                latencies = []
                for _ in range(args.ls):
                    t = time.perf_counter()
                    http.get("/jobs").raise_for_status()
                    latencies.append(time.perf_counter() - t)
            return submit_s, rounds, latencies
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def _p99(values: list[float]) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(0.99 * len(values)))]


def control(args: argparse.Namespace) -> None:
    slots = args.nodes * args.slots_per_node
    print(f"{args.jobs} jobs on {slots} slots ({args.nodes} emulated nodes), waterfill, rounds "
          f"every {args.interval:g} s; {args.repeat} server(s) per mode, alternating")  # fmt: skip
    runs: dict[str, list[tuple[float, list, list]]] = {mode: [] for mode in CONTROL_MODES}
    for rep in range(args.repeat):
        for mode, extra in CONTROL_MODES.items():
            submit_s, rounds, latencies = _control_once(args, extra)
            runs[mode].append((submit_s, rounds, latencies))
            print(
                f"  [{rep + 1}] policy in {mode:<24} submit {1e3 * submit_s / args.jobs:4.1f} ms/job"
                f"  round median {statistics.median(rounds):.3f} s"
                f"  GET /jobs median {1e3 * statistics.median(latencies):5.1f} ms"
                f"  p99 {1e3 * _p99(latencies):6.1f} ms"
            )
    p99s = {}
    for mode, got in runs.items():
        rounds = [r for _, rs, _ in got for r in rs]
        latencies = [x for _, _, ls in got for x in ls]
        p99s[mode] = _p99(latencies)
        print(
            f"policy in {mode}: round median {statistics.median(rounds):.3f} s, max "
            f"{max(rounds):.3f} s over {len(rounds)} rounds (goal <= 1 s); GET /jobs "
            f"({args.jobs} rows) median {1e3 * statistics.median(latencies):.1f} ms, p99 "
            f"{1e3 * p99s[mode]:.1f} ms over {len(latencies)} calls (goal p99 <= 50 ms)"
        )
    worker, local = p99s.values()
    print(f"GET /jobs p99, worker process / in the server's process: {worker / local:.2f}x")


DEFAULT_WORKLOAD = os.path.join(
    HERE, "..", "..", "shared", "data", "pollux", "workloads", "workload-6.csv"
)
if not os.path.exists(DEFAULT_WORKLOAD):
    DEFAULT_WORKLOAD = "/work/shared/data/pollux/workloads/workload-6.csv"
#: the simulator's (the artifact's) fixed batch size of ncf under adaptive policies
FIXED_BATCH = {"ncf": 32768}
EMULATED_NODES, EMULATED_SLOTS = 4, 2


def one_slot_seconds(app, batch_size: int | None = None) -> float:
    """Seconds ``app``'s whole trace takes on one GPU at ``batch_size`` (default: its initial
    batch size), by the simulator's progress rule."""
    bsz = batch_size or app.init_batch_size
    local = min(max(bsz, app.min_local_bsz), app.max_local_bsz)
    step, _ = app.get_throughput((1,), local)
    total = 0.0
    for epoch in range(app.max_epochs):
        sqr, var = app.get_grad_stats(bsz, epoch)
        scale = bsz / app.init_batch_size
        gain = (var + sqr) / (var / scale + sqr)
        total += (app.get_progress(epoch + 1) - app.get_progress(epoch)) / gain * step
    return total


def emulated_workload(args: argparse.Namespace):
    """The first ``--jobs`` jobs, arrivals compressed into ``--span`` s, and each application's
    scale (its trace's work over that scale takes ``--one-slot`` s on one slot)."""
    from adaptrain.sim.traces import default_traces_dir, load_applications, load_workload

    rows = load_workload(args.workload)[: args.jobs]
    t0, t1 = rows[0].time, rows[-1].time
    squeeze = args.span / (t1 - t0) if t1 > t0 else 1.0
    apps = load_applications(default_traces_dir(), sorted({w.application for w in rows}))
    scales = {
        name: max(1.0, one_slot_seconds(app, FIXED_BATCH.get(name)) / args.one_slot)
        for name, app in apps.items()
    }
    jobs = [(w.name, (w.time - t0) * squeeze, w.application, w.num_replicas) for w in rows]
    return jobs, apps, scales, squeeze


def simulate_emulated(args: argparse.Namespace, jobs, apps, scales) -> dict[str, float]:
    """The simulator's JCT per job for the same compressed, scaled workload under waterfill."""
    import copy

    from adaptrain.sched import ClusterSpec, WaterfillPolicy
    from adaptrain.sim import Simulator
    from adaptrain.sim.traces import WorkloadJob

    scaled = {}
    for name, app in apps.items():
        s = copy.copy(app)
        s._epoch_progress = app._epoch_progress / scales[name]  # the trace's work / scale
        scaled[name] = s
    # 1e-6 s more restart delay keeps the simulator's epoch crossings exact: with whole round
    # and restart times it rounds them to whole seconds (the artifact's rule), which the scaled
    # epochs (a fraction of a second each) would turn into no time at all
    cluster = ClusterSpec(
        gpus_per_node=EMULATED_SLOTS,
        round_seconds=args.interval,
        restart_delay=args.restart_delay + 1e-6,
    )
    workload = [WorkloadJob(n, t, a, r, apps[a].init_batch_size) for n, t, a, r in jobs]
    sim = Simulator(
        workload, scaled, WaterfillPolicy(cluster=cluster), num_nodes=EMULATED_NODES,
        cluster=cluster,
    )  # fmt: skip
    result = sim.run()
    return dict(result.jcts)


def run_emulated(args: argparse.Namespace, jobs, scales, policy: str) -> dict[str, float]:
    """Run the jobs under a real server with ``policy``; each job's JCT (s)."""
    script = os.path.join(HERE, "_emulated_job.py")
    with tempfile.TemporaryDirectory() as tmp:
        state = os.path.join(tmp, "state")
        proc, url = start_server(
            state,
            ["--nodes", str(EMULATED_NODES), "--slots-per-node", str(EMULATED_SLOTS),
             "--policy", policy, "--interval", str(args.interval),
             "--restart-delay", str(args.restart_delay), "--hints-interval", "2",
             "--checkpoint-interval", "0", "--grace", "60"],
        )  # fmt: skip
        try:
            with httpx.Client(base_url=url, timeout=60) as http:
                start = time.time()
                for name, at, app, replicas in jobs:
                    time.sleep(max(0.0, start + at - time.time()))
                    command = [sys.executable, script, app, "--scale", str(scales[app])]
                    if app in FIXED_BATCH:
                        command += ["--batch-size", str(FIXED_BATCH[app])]
                    size = min(replicas, EMULATED_NODES * EMULATED_SLOTS)
                    spec = {"name": name, "command": command,
                            "max_replicas": size if policy == "fifo" else 8,
                            "env": {"OMP_NUM_THREADS": "1"}}  # fmt: skip
                    http.post("/jobs", json=spec).raise_for_status()
                    print(f"  [{policy}] t={time.time() - start:6.1f} s submitted {name}",
                          flush=True)  # fmt: skip
                names = [j[0] for j in jobs]
                details = {
                    n: _wait(lambda n=n: _ended(http, n), 3600, f"{n}'s end", 1.0) for n in names
                }
                bad = {n: d["status"] for n, d in details.items() if d["status"] != "Succeeded"}
                if bad:
                    raise RuntimeError(f"jobs did not succeed: {bad} (log: {state}.log)")
                listing = {j["name"]: j for j in http.get("/jobs").json()}
                return {n: listing[n]["finished"] - listing[n]["submitted"] for n in names}
        finally:
            _stop(proc)


def emulated(args: argparse.Namespace) -> None:
    jobs, apps, scales, squeeze = emulated_workload(args)
    only = set(args.only or ("waterfill", "fifo", "sim"))
    print(f"emulated compute: sleep. {len(jobs)} jobs of {os.path.basename(args.workload)}, "
          f"arrivals x{squeeze:.3f} (over {args.span:g} s), {EMULATED_NODES} nodes x "
          f"{EMULATED_SLOTS} slots, rounds {args.interval:g} s, restart delay "
          f"{args.restart_delay:g} s")  # fmt: skip
    for name, app in apps.items():
        seconds = one_slot_seconds(app, FIXED_BATCH.get(name)) / scales[name]
        print(f"  {name:<12} work / {scales[name]:7.2f} -> {seconds:6.1f} s on one slot")
    for n, t, _app, r in jobs:
        print(f"  {n:<16} at {t:6.1f} s  requests {r}")
    jct: dict[str, dict[str, float]] = {}
    if "sim" in only:
        jct["simulated (waterfill)"] = simulate_emulated(args, jobs, apps, scales)
    for policy in ("waterfill", "fifo"):
        if policy in only:
            jct[f"measured {policy}"] = run_emulated(args, jobs, scales, policy)
    avg = {k: statistics.mean(v.values()) for k, v in jct.items()}
    print(f"\n  {'job':<16}" + "".join(f"{k:>24}" for k in jct))
    for n, *_ in jobs:
        print(f"  {n:<16}" + "".join(f"{v[n]:24.1f}" for v in jct.values()))
    print(f"  {'average JCT':<16}" + "".join(f"{avg[k]:24.1f}" for k in jct))
    wf, ff, sm = (avg.get(k) for k in ("measured waterfill", "measured fifo",
                                        "simulated (waterfill)"))  # fmt: skip
    if wf and ff:
        print(f"  waterfill / fifo = {wf / ff:.3f}  (goal <= 0.7)")
    if wf and sm:
        print(f"  waterfill measured / simulated = {wf / sm:.3f}  (goal within 10%: 0.9-1.1)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    c = sub.add_parser("control", help="round time and ls latency with many jobs")
    c.add_argument("--jobs", type=int, default=1000)
    c.add_argument("--nodes", type=int, default=16)
    c.add_argument("--slots-per-node", type=int, default=4)
    c.add_argument("--interval", type=float, default=5.0)
    c.add_argument("--rounds", type=int, default=5)
    c.add_argument("--ls", type=int, default=200)
    c.add_argument("--repeat", type=int, default=2, help="servers per mode")
    s = sub.add_parser("startup", help="submit -> first step of the digits job")
    s.add_argument("--repeat", type=int, default=5)
    s.add_argument("--steps", type=int, default=3, help="steps each job trains")
    r = sub.add_parser("rescale", help="SIGTERM -> first step on the new count, 10M MLP")
    r.add_argument("--repeat", type=int, default=3)
    e = sub.add_parser("emulated", help="JCT of trace-emulated jobs: waterfill vs FIFO vs sim")
    e.add_argument("--workload", default=DEFAULT_WORKLOAD)
    e.add_argument("--jobs", type=int, default=8)
    e.add_argument("--span", type=float, default=600.0, help="seconds the arrivals spread over")
    e.add_argument("--one-slot", type=float, default=120.0, help="a job's seconds on one slot")
    e.add_argument("--interval", type=float, default=10.0)
    e.add_argument("--restart-delay", type=float, default=5.0)
    e.add_argument("--only", choices=("waterfill", "fifo", "sim"), action="append")
    args = parser.parse_args()
    {"control": control, "startup": startup, "rescale": rescale, "emulated": emulated}[args.what](
        args
    )


if __name__ == "__main__":
    main()
