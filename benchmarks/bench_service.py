"""The scheduler service's control plane at scale: many jobs, many slots, one server.

    python benchmarks/bench_service.py control [--jobs 1000] [--nodes 16] [--slots-per-node 4]
                                               [--rounds 5] [--ls 200]

starts a real ``adaptrain server`` (its default waterfill policy, emulated nodes), submits
``--jobs`` jobs over HTTP (each a ``sleep``, so that only the control plane is measured),
waits for ``--rounds`` policy rounds with every job known, and reports the policy round's time
(median and largest, from ``/metrics``) and the latency of ``GET /jobs`` (what ``adaptrain ls
--json`` reads), median and p99 over ``--ls`` calls; goals: a round <= 1 s, ls p99 <= 50 ms.
Everything it started is stopped at the end.
"""

from __future__ import annotations

import argparse
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


def control(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        state = os.path.join(tmp, "state")
        proc, url = start_server(
            state,
            ["--nodes", str(args.nodes), "--slots-per-node", str(args.slots_per_node),
             "--interval", str(args.interval), "--grace", "5"],
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
            latencies.sort()
            p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
            slots = args.nodes * args.slots_per_node
            print(f"{args.jobs} jobs on {slots} slots ({args.nodes} emulated nodes), waterfill")
            print(
                f"submit: {submit_s:.1f} s for {args.jobs} jobs ({1e3 * submit_s / args.jobs:.1f} ms each)"
            )
            print(
                f"policy round: median {statistics.median(rounds):.3f} s, max {max(rounds):.3f} s "
                f"over {len(rounds)} rounds (goal <= 1 s)"
            )
            print(
                f"GET /jobs ({args.jobs} rows): median {1e3 * statistics.median(latencies):.1f} ms, "
                f"p99 {1e3 * p99:.1f} ms over {len(latencies)} calls (goal p99 <= 50 ms)"
            )
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


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
    args = parser.parse_args()
    if args.what == "control":
        control(args)


if __name__ == "__main__":
    main()
