"""The adaptive Tune trial scheduler on a real multi-node Ray cluster: trials of real adaptrain
training are resized by the policy from their goodput, through Tune's pause and restore."""

from __future__ import annotations

import contextlib
import os
import time

import psutil
import pytest
from _ray_cluster import local_ray_cluster  # first: it sets what Ray reads at import
from _tune_trials import digits_trial
from ray import tune

pytestmark = [pytest.mark.slow]

#: an upper bound: the search ends once a resized trial has reported twice at its new size
MAX_EPOCHS = 100
HERE = os.path.dirname(os.path.abspath(__file__))


class _Watch(tune.Callback, tune.Stopper):
    """Every result Tune processed, as it processed it (a trial's ``result.json`` may miss the
    result it was paused at: Ray's logger copies the file back from storage at the restart);
    the search stops once some trial has reported ``after`` results on a new replica count."""

    def __init__(self, after: int = 2) -> None:
        self.seen: dict[str, list[dict]] = {}
        self.after = after

    def on_trial_result(self, iteration, trials, trial, result, **info) -> None:
        self.seen.setdefault(trial.trial_id, []).append(dict(result))

    def __call__(self, trial_id: str, result: dict) -> bool:
        return False

    def stop_all(self) -> bool:
        return any(
            sum(r["num_replicas"] != 1 for r in results) >= self.after
            for results in self.seen.values()
        )


def _replica_processes(since: float) -> list[psutil.Process]:
    """The trial replica processes started since ``since`` (Unix time) still alive."""
    found = []
    for proc in psutil.process_iter(["cmdline", "create_time"]):
        cmd = " ".join(proc.info["cmdline"] or ())
        if "adaptrain.ray._tune_replica" in cmd and proc.info["create_time"] >= since - 1:
            found.append(proc)
    return found


@pytest.mark.timeout(300)
def test_trials_are_resized_by_their_goodput(tmp_path, monkeypatch):
    from adaptrain.ray.tune import AdaptDLScheduler, AdaptDLTrainableCreator

    # the cluster's workers (and the replicas) import the trial function from its module
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [HERE, os.getenv("PYTHONPATH")])))
    scheduler = AdaptDLScheduler(interval=5.0, restart_delay=5.0)
    watch = _Watch()
    since = time.time()
    try:
        with local_ray_cluster([{"num_cpus": 2}, {"num_cpus": 2}]):
            tuner = tune.Tuner(
                AdaptDLTrainableCreator(digits_trial, num_workers=1, hints_interval=1.0),
                param_space={
                    "lr": tune.grid_search([0.05, 0.1]),
                    "epochs": MAX_EPOCHS,
                    "repeat": 8,
                },
                tune_config=tune.TuneConfig(
                    scheduler=scheduler, metric="mean_accuracy", mode="max"
                ),
                run_config=tune.RunConfig(
                    storage_path=str(tmp_path),
                    name="adaptive",
                    verbose=0,
                    callbacks=[watch],
                    stop=watch,
                ),
            )
            started = time.monotonic()
            results = tuner.fit()
            wall = time.monotonic() - started
    finally:
        # a replica ends with its host: SIGTERM at once, SIGKILL 10 s later
        deadline = time.monotonic() + 20
        while (leftover := _replica_processes(since)) and time.monotonic() < deadline:
            time.sleep(0.5)
        for proc in leftover:  # never leak one into the next test
            with contextlib.suppress(psutil.Error):
                proc.kill()
    errors = [r.error for r in results if r.error]
    assert not errors, errors
    assert not leftover, f"replica processes outlived the cluster: {leftover}"
    histories = watch.seen
    assert len(histories) == 2, list(histories)
    # every epoch of every trial reached Tune exactly once, pauses and restarts included
    for trial_id, history in histories.items():
        epochs = [r["epoch"] for r in history]
        assert epochs == list(range(len(epochs))), (trial_id, epochs)
    # the policy resized a trial, knowing its goodput model from the hints rank 0 posted
    assert scheduler.resizes, "no trial was resized"
    assert all(r.measured for r in scheduler.resizes), scheduler.resizes
    # a resize really changed the number of training processes, as the replicas see it
    sizes = {
        (trial_id, r["num_replicas"], r["world_size"], r["processes"])
        for trial_id, history in histories.items()
        for r in history
    }
    assert all(n == w == p for _, n, w, p in sizes), sizes
    resized = {t for t, n, _, _ in sizes if n != 1}
    assert resized, sizes
    restarted = {t for t, h in histories.items() if max(r["num_restarts"] for r in h) >= 1}
    assert resized <= restarted
    best = results.get_best_result()
    assert best.metrics["mean_accuracy"] > 0.8, best.metrics
    print(f"adaptive Tune: {len(histories)} trials in {wall:.0f} s; {scheduler.resizes}")
