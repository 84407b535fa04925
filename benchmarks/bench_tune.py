"""Ray Tune: the adaptive trial scheduler against Tune's FIFO scheduler with fixed resources.

Both arms run ``examples/ray_tune_hyperopt.py`` (the digits ConvNet, HyperOpt over learning
rate and momentum) on the same trials: HyperOpt's seed is fixed and the searches are shorter
than its random start-up phase (20 trials), so both arms draw the same configurations (checked).
Each run is a fresh process with a fresh multi-node Ray cluster on this machine (a head without
CPUs and ``--nodes`` worker nodes of ``--cpus-per-node`` CPUs, one replica slot per CPU):

- ``fifo``: Tune's ``FIFOScheduler``, every trial on ``--replicas`` replicas for its whole life;
- ``adaptive``: ``AdaptDLScheduler``, trials start on ``--replicas`` replicas and the policy
  re-decides every trial's replica count from the goodput the trials report, every
  ``--interval`` seconds.

The figure is the time Tune takes to finish all the trials (``Tuner.fit``, the cluster's start
excluded), with the best trial's accuracy; ``--reps`` repetitions, the two arms in alternating
order, and the ratio adaptive / fifo of each repetition.

    python benchmarks/bench_tune.py [--reps 2] [--num-samples 3] [--epochs 300]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(os.path.dirname(HERE), "examples", "ray_tune_hyperopt.py")
RESULTS = os.path.join(HERE, "results", "tune.md")


def run_arm(arm: str, args: argparse.Namespace) -> dict:
    """One search in a fresh process and cluster; the example's summary."""
    with tempfile.TemporaryDirectory(prefix="bench-tune-") as tmp:
        out = os.path.join(tmp, "summary.json")
        command = [
            sys.executable,
            EXAMPLE,
            "--scheduler",
            arm,
            "--num-samples",
            str(args.num_samples),
            "--epochs",
            str(args.epochs),
            "--replicas",
            str(args.replicas),
            "--seed",
            str(args.seed),
            "--interval",
            str(args.interval),
            "--restart-delay",
            str(args.restart_delay),
            "--nodes",
            str(args.nodes),
            "--cpus-per-node",
            str(args.cpus_per_node),
            "--json",
            out,
        ]
        started = time.monotonic()
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
        elapsed = time.monotonic() - started
        if done.returncode != 0 or not os.path.exists(out):
            sys.stderr.write(done.stdout[-5000:] + done.stderr[-5000:])
            raise RuntimeError(f"{arm} run failed with exit code {done.returncode}")
        with open(out) as f:
            summary = json.load(f)
    summary["process_s"] = elapsed
    return summary


def _configs(summary: dict) -> list[tuple]:
    return sorted(
        (round(t["config"]["lr"], 9), round(t["config"]["momentum"], 9)) for t in summary["trials"]
    )


def _load() -> str:
    try:
        return " / ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "?"


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=HERE,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--num-samples", type=int, default=3)
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--interval", type=float, default=10.0)
    p.add_argument("--restart-delay", type=float, default=15.0)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--cpus-per-node", type=int, default=1)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    p.add_argument("--out", default=RESULTS)
    args = p.parse_args()

    rows: list[tuple[int, str, dict, str]] = []
    for rep in range(args.reps):
        order = ("adaptive", "fifo") if rep % 2 == 0 else ("fifo", "adaptive")
        for arm in order:
            load = _load()
            summary = run_arm(arm, args)
            rows.append((rep, arm, summary, load))
            print(
                f"rep {rep} {arm}: {summary['wall_s']:.1f} s, best accuracy "
                f"{summary['best_accuracy']:.4f}, {len(summary['resizes'])} resizes "
                f"(load {load})",
                flush=True,
            )
    configs = {_configs(s) == _configs(rows[0][2]) for _, _, s, _ in rows}
    if configs != {True}:
        raise RuntimeError("the arms did not run the same trials; see the summaries")

    by_arm: dict[str, list[dict]] = {"adaptive": [], "fifo": []}
    for _, arm, summary, _ in rows:
        by_arm[arm].append(summary)
    ratios = [
        next(s for r, a, s, _ in rows if r == rep and a == "adaptive")["wall_s"]
        / next(s for r, a, s, _ in rows if r == rep and a == "fifo")["wall_s"]
        for rep in range(args.reps)
    ]
    command = (
        f"python benchmarks/bench_tune.py --reps {args.reps} --num-samples {args.num_samples} "
        f"--epochs {args.epochs} --nodes {args.nodes} --cpus-per-node {args.cpus_per_node}"
    )
    lines = [
        "# Ray Tune: adaptive trial scheduler vs FIFO with fixed resources",
        "",
        f"    {command}",
        "",
        f"**Method.** `examples/ray_tune_hyperopt.py` (the digits ConvNet, HyperOpt over learning "
        f"rate and momentum, seed {args.seed}): {args.num_samples} trials of {args.epochs} "
        f"epochs, the same configurations in both arms, on a fresh Ray cluster per run (a head "
        f"without CPUs and {args.nodes} worker nodes of {args.cpus_per_node} CPU(s) on this "
        f"machine, one replica slot per CPU). `fifo`: Tune's FIFOScheduler, {args.replicas} "
        f"replica(s) per trial throughout. `adaptive`: `AdaptDLScheduler(interval="
        f"{args.interval:g}, restart_delay={args.restart_delay:g})`, trials start on "
        f"{args.replicas} replica(s) and are resized by the policy. Time: `Tuner.fit` until every "
        f"trial finished (the cluster's start excluded). {args.reps} repetitions, the arms in "
        "alternating order.",
        "",
        f"**Machine.** {os.cpu_count()} CPUs ({platform.machine()}), Python "
        f"{platform.python_version()}, code {_commit()}; load average before each run below "
        "(1/5/15 min).",
        "",
        "| rep | arm | time (s) | best accuracy | resizes (replicas) | trials' own time (s) | load |",
        "|---:|---|---:|---:|---|---|---|",
    ]
    for rep, arm, s, load in rows:
        resizes = ", ".join(f"{r['before']}→{r['after']}" for r in s["resizes"]) or "none"
        own = ", ".join(f"{t['time_total_s']:.0f}" for t in s["trials"])
        lines.append(
            f"| {rep} | {arm} | {s['wall_s']:.1f} | {s['best_accuracy']:.4f} | {resizes} | "
            f"{own} | {load} |"
        )
    med = {arm: statistics.median(s["wall_s"] for s in runs) for arm, runs in by_arm.items()}
    best = {
        arm: statistics.median(s["best_accuracy"] for s in runs) for arm, runs in by_arm.items()
    }
    lines += [
        "",
        "| arm | median time (s) | median best accuracy | time / fifo (median of reps) |",
        "|---|---:|---:|---:|",
        f"| fifo | {med['fifo']:.1f} | {best['fifo']:.4f} | 1.00 |",
        f"| adaptive | {med['adaptive']:.1f} | {best['adaptive']:.4f} | "
        f"**{statistics.median(ratios):.2f}** |",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
