"""benchmarks/bench_sched.py: the median over seeds, the target summary, and a run end to end
(several loads, seeds and processes) on tiny hand-made traces."""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import subprocess
import sys

import numpy as np
import pytest

from adaptrain.sched import Search

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "bench_sched.py")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_sched", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _row(seed, avg, pollux=1000.0, spr=0.1, wall=10.0):
    return {
        "workload": "workload-3",
        "load": "0.5",
        "policy": "waterfill",
        "seed": seed,
        "avg_jct": avg,
        "stored_same_policy": None,
        "stored_pollux": pollux,
        "ratio_to_stored_same_policy": None,
        "ratio_to_stored_pollux": avg / pollux if pollux else None,
        "p99_jct": 2 * avg,
        "policy_s_per_round": spr,
        "wall_s": wall,
    }


def _artifact_data(tmp_path, tiny_app_writer, rows, summary, loads=("1.0",)):
    """A tiny data folder laid out as the artifact's (``traces/``, ``workloads*/workload-9.csv``
    with ``rows``, ``results-jobload/pollux-<load>/summary.json`` holding ``summary``): the
    ``traces`` path, as the benchmarks take it."""
    data = tmp_path / "pollux"
    traces = data / "traces"
    traces.mkdir(parents=True)
    tiny_app_writer(traces)
    for load in loads:
        wdir = data / ("workloads" if load == "1.0" else f"workloads-{load}")
        wdir.mkdir()
        with open(wdir / "workload-9.csv", "w") as f:
            f.write("name,time,application,num_replicas,batch_size\n")
            f.writelines(",".join(map(str, r)) + "\n" for r in rows)
        res = data / "results-jobload" / f"pollux-{load}"
        res.mkdir(parents=True)
        (res / "summary.json").write_text(json.dumps(summary))
    return traces


def test_median_row_takes_the_middle_seed(bench):
    rows = [_row(0, 912.0, spr=0.07), _row(1, 896.0, spr=0.09), _row(2, 900.0, spr=0.08)]
    med = bench.median_row(rows)
    assert med["seed"] == "median" and med["seeds"] == [0, 1, 2]
    assert med["avg_jct"] == 900.0
    assert med["ratio_to_stored_pollux"] == pytest.approx(0.900)
    assert med["ratios_to_stored_pollux"] == pytest.approx([0.912, 0.896, 0.900])
    assert med["p99_jct"] == 1800.0
    assert med["policy_s_per_round"] == 0.09  # the slowest seed
    assert med["wall_s"] == 30.0
    assert med["stored_same_policy"] is None and med["ratio_to_stored_same_policy"] is None
    assert med["ratio_mean"] == pytest.approx((0.912 + 0.896 + 0.900) / 3)
    assert med["ratio_sd"] == pytest.approx(0.008327, abs=1e-6)  # sample sd of the three
    one = bench.median_row([_row(0, 912.0)])
    assert one["ratio_mean"] == pytest.approx(0.912) and one["ratio_sd"] is None
    unknown = bench.median_row([_row(0, 912.0, pollux=None), _row(1, 900.0, pollux=None)])
    assert unknown["ratio_mean"] is None and unknown["ratio_sd"] is None
    with pytest.raises(ValueError, match="at least one row"):
        bench.median_row([])


def test_target_summary_separates_median_and_every_seed(bench):
    under_by_median = bench.median_row([_row(0, 912.0), _row(1, 896.0), _row(2, 900.0)])
    under_always = bench.median_row([_row(0, 880.0), _row(1, 890.0), _row(2, 870.0)])
    under_always["workload"] = "workload-1"
    over = bench.median_row([_row(0, 923.0), _row(1, 917.0), _row(2, 917.0)])
    over["load"] = "1.0"
    single = _row(0, 850.0)
    single["workload"] = "workload-5"
    out = bench.target_summary([under_by_median, under_always, over, single])["waterfill"]
    assert out["median"] == ["workload-3@0.5", "workload-1@0.5", "workload-5@0.5"]
    assert out["every_seed"] == ["workload-1@0.5", "workload-5@0.5"]
    # 0.912 / 0.896 / 0.900: under by the median, over by the mean (0.9027)
    assert out["mean"] == ["workload-1@0.5", "workload-5@0.5"]
    assert out["over"] == ["workload-3@1.0"]


def test_host_probe_times_the_additions(bench):
    """The probe's median grows with the work: 10 additions take less than 300 000."""
    small, large = bench.host_probe(10, reps=3), bench.host_probe(300_000, reps=3)
    assert 0.0 < small < large


def test_simd_label_names_found_and_missing_extensions(bench):
    """The header's SIMD line lists what numpy's build config found on this host and what not,
    so readings from hosts with and without AVX-512 can be told apart."""
    simd = np.show_config(mode="dicts")["SIMD Extensions"]
    label = bench.simd_label()
    assert label.startswith("SIMD found: ")
    for ext in simd.get("found", []):
        assert ext in label.split(";")[0]
    for ext in simd.get("not found", []):
        assert ext in label.split("not found:")[1]


def test_blas_label_names_the_kernels_and_follows_openblas_coretype(bench):
    """The header's BLAS line names each library's kernels; ``OPENBLAS_CORETYPE`` (read when
    OpenBLAS loads, hence a fresh interpreter) changes them, and the line shows it."""
    threadpoolctl = pytest.importorskip("threadpoolctl")
    label = bench.blas_label()  # imports scipy.optimize, which loads scipy's BLAS
    blas = [i for i in threadpoolctl.threadpool_info() if i.get("user_api") == "blas"]
    assert label.startswith("BLAS: ") and blas
    for info in blas:
        version, kernels = info.get("version") or "?", info.get("architecture") or "?"
        assert f"{info['internal_api']} {version} {kernels}" in label
    if not all(i["internal_api"] == "openblas" for i in blas):
        pytest.skip("OPENBLAS_CORETYPE applies to OpenBLAS only")
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("an x86 OpenBLAS kernel name")
    code = (
        f"import sys; sys.path.insert(0, {os.path.dirname(BENCH)!r}); "
        "import bench_sched; print(bench_sched.blas_label())"
    )
    env = dict(os.environ, OPENBLAS_CORETYPE="Prescott")  # SSE3 kernels: any x86-64 runs them
    other = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert other.returncode == 0, other.stderr[-2000:]
    assert other.stdout.startswith("BLAS: ") and other.stdout.strip() != label


def test_bench_end_to_end_seeds_loads_and_processes(tmp_path, tiny_app_writer):
    """Two loads, two seeds of our policy, Tiresias once, on two processes: per-seed rows in
    task order, a median row per (file, stochastic policy), the summary, and the JSON."""
    rows = [("a", 0, "toy", 1, 8), ("b", 53, "toy", 4, 16), ("c", 130, "toy", 2, 8)]
    summary = {"avgs": {"workload-9": 400.0}}
    traces = _artifact_data(tmp_path, tiny_app_writer, rows, summary, loads=("0.5", "1.0"))
    out_json = tmp_path / "rows.json"
    cmd = [
        sys.executable,
        BENCH,
        "--traces",
        str(traces),
        "--load",
        "0.5",
        "1.0",
        "--workloads",
        "9",
        "--policies",
        "waterfill",
        "tiresias",
        "--seed",
        "0",
        "1",
        "--processes",
        "2",
        "--json",
        str(out_json),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(out_json.read_text())
    keys = [(r["load"], r["policy"], r["seed"]) for r in got]
    assert keys == [
        ("0.5", "waterfill", 0),
        ("0.5", "waterfill", 1),
        ("0.5", "waterfill", "median"),
        ("0.5", "tiresias", 0),
        ("1.0", "waterfill", 0),
        ("1.0", "waterfill", 1),
        ("1.0", "waterfill", "median"),
        ("1.0", "tiresias", 0),
    ]
    for load in ("0.5", "1.0"):
        seeds = [r for r in got if r["load"] == load and r["policy"] == "waterfill"]
        s0, s1, med = seeds
        assert med["avg_jct"] == pytest.approx((s0["avg_jct"] + s1["avg_jct"]) / 2)
        assert med["ratio_to_stored_pollux"] == pytest.approx(med["avg_jct"] / 400.0)
        assert med["ratios_to_stored_pollux"] == pytest.approx(
            [s0["avg_jct"] / 400.0, s1["avg_jct"] / 400.0]
        )
    text = proc.stdout
    assert "2 simulation(s) at a time" in text
    versions = [line for line in text.splitlines() if line.startswith("numpy ")]
    assert len(versions) == 1 and f"numpy {np.__version__}, scipy " in versions[0]
    assert "SIMD" in versions[0]
    probes = [line for line in text.splitlines() if line.startswith("host probe:")]
    assert len(probes) == 2 and "before the runs" in probes[1] and "after" in probes[1]
    lines = text.splitlines()
    assert sum(" waterfill median " in line for line in lines) == 2
    means = [line for line in lines if " mean over 2 seeds: " in line]
    assert len(means) == 2  # one per median row, none for Tiresias' single run
    for load, line in zip(("0.5", "1.0"), means, strict=True):
        med = next(r for r in got if r["load"] == load and r["seed"] == "median")
        assert f"{med['ratio_mean']:.4f} x stored Pollux (sd {med['ratio_sd']:.4f}" in line
    assert "waterfill: <= 0.90 x stored Pollux on" in text and "of 2 file(s)" in text
    summary = text.split("waterfill:")[1].splitlines()[0]
    assert "under every seed" in summary and " by the mean, " in summary
    tiresias = text.split("tiresias:")[1].splitlines()[0]
    assert "under every seed" not in tiresias and "one run (deterministic)" in tiresias


_INTERRUPTING_DRIVER = """
import signal, sys
sys.path.insert(0, {bench_dir!r})
import bench_sched

print_row = bench_sched._print_row

def print_then_interrupt(row):  # a Ctrl-C once the first row is out
    print_row(row)
    signal.raise_signal(signal.SIGINT)

bench_sched._print_row = print_then_interrupt
if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with it ignored
    sys.argv = ["bench_sched.py", *sys.argv[1:]]
    sys.exit(bench_sched.main())
"""


@pytest.mark.parametrize("processes", ["1", "2"])
def test_bench_interrupted_keeps_the_finished_rows(tmp_path, tiny_app_writer, processes):
    """A Ctrl-C: status 130, one line on stderr, the finished rows in --json (nothing
    finished is lost), and, with a process pool, no wait for the simulations under way."""
    rows = [("a", 0, "toy", 1, 8), ("b", 53, "toy", 4, 16)]
    traces = _artifact_data(tmp_path, tiny_app_writer, rows, {"avgs": {"workload-9": 400.0}})
    driver = tmp_path / "driver.py"
    driver.write_text(_INTERRUPTING_DRIVER.format(bench_dir=os.path.dirname(BENCH)))
    out_json = tmp_path / "rows.json"
    cmd = [sys.executable, str(driver), "--traces", str(traces), "--workloads", "9"]
    cmd += ["--policies", "tiresias", "waterfill", "--processes", processes]
    cmd += ["--json", str(out_json)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        f"bench_sched: interrupted after 1 of 2 simulations; their rows are above and in {out_json}"
    ]
    got = json.loads(out_json.read_text())
    assert [(r["policy"], r["seed"]) for r in got] == [("tiresias", 0)]
    assert sum(" tiresias " in line for line in proc.stdout.splitlines()) == 1
    assert " waterfill " not in proc.stdout


DIAG = os.path.join(os.path.dirname(BENCH), "diag_sched_models.py")


def _run_diag(tmp_path, tiny_app_writer, *args: str) -> list[str]:
    """benchmarks/diag_sched_models.py on a tiny trace whose jobs arrive between rounds:
    its result lines."""
    rows = [("toy-0", 0, "toy", 1, 8), ("toy-1", 53, "toy", 4, 16), ("toy-2", 130, "toy", 2, 8)]
    stored = {"jcts": {"workload-9": {"toy-0": 400.0, "toy-1": 400.0, "toy-2": 400.0}}}
    traces = _artifact_data(tmp_path, tiny_app_writer, rows, stored)
    cmd = [sys.executable, DIAG, "--traces", str(traces), "--workloads", "9", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    return [line for line in proc.stdout.splitlines() if "workload-9" in line]


def test_diag_models_runs_every_mode_with_arrivals(tmp_path, tiny_app_writer):
    """benchmarks/diag_sched_models.py end to end on a tiny trace whose jobs arrive between
    rounds (the simulator then asks for a job's view at the arrival time): one line per mode,
    with the ratio to the stored per-job JCTs."""
    lines = _run_diag(tmp_path, tiny_app_writer)
    assert [line.split()[3] for line in lines] == ["learned", "full", "full-nocap"]
    assert all("/ stored Pollux" in line and "(toy " in line for line in lines)


def test_diag_models_restart_free_modes(tmp_path, tiny_app_writer, tiny_traces):
    """The restart modes of benchmarks/diag_sched_models.py: a job's first placement waits
    the restart delay, a restart then waits nothing (a start-up under way goes on); both modes
    run end to end, with a seed."""
    spec = importlib.util.spec_from_file_location("diag_sched_models", DIAG)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    from adaptrain.sim.traces import load_applications

    app = load_applications(tiny_traces)["toy"]
    job = mod.SimJob("toy-0", app, 0.0, adaptive=True, restart_delay=30.0)
    job.__class__ = mod._FreeRestartJob
    job.reallocate([1])  # the first placement: the start-up
    assert job.rescale_time == 30.0 and job.num_restarts == 0
    job.step(10.0)
    job.reallocate([2])  # resized during its start-up: the 20 s left go on, nothing added
    assert job.rescale_time == pytest.approx(20.0) and job.num_restarts == 1
    job.step(60.0)
    job.reallocate([1])  # a restart: free
    assert job.rescale_time == 0.0 and job.num_restarts == 2
    plain = mod.SimJob("toy-1", app, 0.0, adaptive=True, restart_delay=30.0)
    plain.reallocate([1])
    plain.step(60.0)
    plain.reallocate([2])
    assert plain.rescale_time == 30.0  # the simulator's own rule, for contrast

    lines = _run_diag(
        tmp_path, tiny_app_writer, "--seed", "1", "--modes", "learned", "restart-free", "no-delay"
    )
    assert [line.split()[3] for line in lines] == ["learned", "restart-free", "no-delay"]
    jct = [float(line.split("avg JCT")[1].split()[0]) for line in lines]
    assert jct[2] < jct[0]  # with nothing to wait, the average JCT falls on this trace


def test_diag_models_free_restart_kinds(tmp_path, tiny_app_writer, tiny_traces):
    """The ``free-*`` modes of benchmarks/diag_sched_models.py: each makes one kind of restart
    free (shrinks; growths; growths past the largest size run, the exploration steps; growths
    within it), the others wait the restart delay; a move at the same size waits unless all
    are free. End to end, ``free-grow`` and ``free-explore`` run on the tiny trace."""
    spec = importlib.util.spec_from_file_location("diag_sched_models", DIAG)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    from adaptrain.sim.traces import load_applications

    assert [mod.restart_kind(4, n, 4) for n in (2, 0, 4, 8)] == [
        "shrink", "shrink", "move", "explore"
    ]  # fmt: skip
    assert mod.restart_kind(2, 4, 8) == "regrow"
    app = load_applications(tiny_traces)["toy"]

    def delays(mode: str) -> list[float]:
        """The restart delay after each change of one job: 1 -> 2 (explore) -> 1 (shrink)
        -> 2 (regrow) -> 2 on other nodes (move) -> 0 (preempted) -> 2 (re-placed: regrow)."""
        job = mod.SimJob("toy-0", app, 0.0, adaptive=True, restart_delay=30.0)
        job.__class__ = mod._FreeRestartJob
        job.free_kinds = mod.FREE_KINDS[mode]
        job.reallocate([1])
        job.step(60.0)
        out = []
        for placement in ((2,), (1,), (2,), (1, 1), (), (2,)):  # replicas per node
            job.reallocate(placement)
            out.append(job.rescale_time if placement else None)
            job.step(60.0)
        assert job.max_profiled_replicas == 2
        return out

    d = 30.0
    assert delays("restart-free") == [0.0, 0.0, 0.0, 0.0, None, 0.0]
    assert delays("free-shrink") == [d, 0.0, d, d, None, d]
    assert delays("free-grow") == [0.0, d, 0.0, d, None, 0.0]
    assert delays("free-explore") == [0.0, d, d, d, None, d]
    assert delays("free-regrow") == [d, d, 0.0, d, None, 0.0]

    lines = _run_diag(tmp_path, tiny_app_writer, "--modes", "learned", "free-grow", "free-explore")
    assert [line.split()[3] for line in lines] == ["learned", "free-grow", "free-explore"]
    jct = [float(line.split("avg JCT")[1].split()[0]) for line in lines]
    assert all(0 < j < float("inf") for j in jct)


def test_parse_settings_reads_literals_and_names_errors(bench):
    got = bench.parse_settings(
        ["exploration.ramp_credit=2", "objective.future_gamma=0.7", "exploration.beta=None",
         "search.method=local", "growth.payback_remaining=False"]
    )  # fmt: skip
    assert got == {
        "exploration.ramp_credit": 2,
        "objective.future_gamma": 0.7,
        "exploration.beta": None,
        "search.method": "local",
        "growth.payback_remaining": False,
    }
    assert bench.parse_settings([]) == {}
    for items, match in [
        (["exploration.ramp_credit"], "expected GROUP.FIELD=VALUE"),
        (["=2"], "expected GROUP.FIELD=VALUE"),
        (["foo=1"], "no setting 'foo'"),
        (["seed=3"], "seed comes from --seed"),
        (["exploration.ramp_credit=1", "exploration.ramp_credit=2"], "set twice"),
        (["exploration.ramp_credit=-1"], "ramp_credit=-1 must be >= 0"),
        (["search.method=nope"], "must be 'genetic' or 'local'"),
    ]:
        with pytest.raises(ValueError, match=match):
            bench.parse_settings(items)


def test_set_builds_the_screened_policy_and_labels_its_rows(bench, tmp_path, tiny_app_writer):
    """A screen's settings reach ``WaterfillPolicy``; its rows (and their median) are labelled
    ``waterfill*`` and carry the settings; without settings the CLI's policy is built."""
    pol = bench._policy("waterfill", 4, {"exploration.ramp_credit": None, "search.generations": 7})
    assert pol.ramp_credit is None and pol._genetic.generations == 7
    seeded = bench.WaterfillPolicy(seed=4)._genetic.rng.bit_generator.state
    assert pol._genetic.rng.bit_generator.state == seeded  # the seed from --seed
    default = bench._policy("waterfill", 4)
    assert default.ramp_credit == 1.0 and default._genetic.generations == 50
    rows = [("a", 0, "toy", 1, 8), ("b", 53, "toy", 4, 16)]
    traces = _artifact_data(tmp_path, tiny_app_writer, rows, {"avgs": {"workload-9": 400.0}})
    settings = {"search.method": "local"}
    rows = [bench._run((str(traces), "1.0", "9", "waterfill", s, settings)) for s in (0, 1)]
    for row in rows:
        assert row["policy"] == "waterfill*" and row["waterfill_kwargs"] == settings
        assert row["ratio_to_stored_pollux"] == pytest.approx(row["avg_jct"] / 400.0)
    assert bench.median_row(rows)["waterfill_kwargs"] == settings
    plain = bench._run((str(traces), "1.0", "9", "waterfill", 0, {}))
    assert plain["policy"] == "waterfill" and "waterfill_kwargs" not in plain
    # a screen at the default values is the plain policy: the same simulation, to the bit
    same = bench._run((str(traces), "1.0", "9", "waterfill", 0, {"exploration.ramp_credit": 1.0}))
    assert same["policy"] == "waterfill*" and same["avg_jct"] == plain["avg_jct"]
    with pytest.raises(ValueError, match="not 'pollux'"):
        bench._policy("pollux", 0, {"exploration.ramp_credit": 2})


def test_set_needs_the_waterfill_policy():
    proc = subprocess.run(
        [sys.executable, BENCH, "--policies", "pollux", "--set", "exploration.ramp_credit=2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "add waterfill to --policies" in proc.stderr


def test_diag_sched_arrivals_replays_the_policy_estimate(tmp_path):
    """benchmarks/diag_sched_arrivals.py's replay on a hand-made file: 5 jobs an hour apart on
    the 64 GPUs read 4 / 4 h / 64 = 1/64 per GPU-hour once an hour of arrivals is seen, below
    ``sparse_rate``, so the gate is open in every round from the second job on."""
    path = os.path.join(os.path.dirname(BENCH), "diag_sched_arrivals.py")
    spec = importlib.util.spec_from_file_location("diag_sched_arrivals", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    from adaptrain.sched import WaterfillPolicy

    csv = tmp_path / "workload-9.csv"
    rows = [f"j{i},{3600 * i},cifar10,1,128" for i in range(5)]
    csv.write_text("name,time,application,num_replicas,batch_size\n" + "\n".join(rows) + "\n")
    r = mod.replay(str(csv), WaterfillPolicy(search=Search(method="local")))
    # rounds at 0, 60, ... up to 4 h + 2 h; the rate is defined from 1 h on (the second job)
    assert r["rounds"] == 6 * 60 + 1
    assert len(r["rates"]) == r["opened"] == 5 * 60 + 1
    assert min(r["rates"]) == pytest.approx(1 / 64) and max(r["rates"]) == pytest.approx(1 / 64)
    dense = tmp_path / "workload-8.csv"
    rows = [f"j{i},{180 * i},cifar10,1,128" for i in range(30)]  # 20 per hour
    dense.write_text("name,time,application,num_replicas,batch_size\n" + "\n".join(rows) + "\n")
    r = mod.replay(str(dense), WaterfillPolicy(search=Search(method="local")))
    assert r["opened"] == 0 and min(r["rates"]) == pytest.approx(20 / 64)


def test_search_label_names_numbas_kernels(bench):
    """The header's ``genetic searches:`` line names the compiled kernels and numba's version."""
    import numba

    assert bench.search_label() == f"compiled kernels (numba {numba.__version__})"
