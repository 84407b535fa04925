"""One simulated training job, replayed from its application's traces.

An adaptive job learns its goodput model online as AdaptDL's jobs do: each newly met
(nodes, replicas, local batch) configuration joins its profile, to which ``fit_perf_params`` is
refitted, and its batch size is re-optimised with ``GoodputFunction.optimize``. The fit, the
batch size a model picks and a model's speedup table are pure functions of their inputs, so
they are held in :class:`GoodputMemos` shared by every job of a simulation (and, by default,
by all simulations of the process): jobs of one model often share a profile, hence a model.
The memos save time and change no result.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from adaptrain.core.goodput import GoodputFunction, fit_perf_params
from adaptrain.sched.memo import Memo
from adaptrain.sched.speedup import LinearSpeedup, SpeedupFunction

from .traces import Application

__all__ = ["GoodputMemos", "SimJob", "job_kind_for_policy"]


class GoodputMemos:
    """The memos of the simulated jobs' goodput models (pure functions of their keys).

    ``fits``: a profile (its sorted items) -> the fitted ``PerfParams``; ``batch_sizes``: (the
    model, its batch limits, nodes, replicas) -> the ``(atomic_bsz, accum_steps)`` it picks;
    ``speedups``: (the model, its limits, the table's size) -> its :class:`SpeedupFunction`,
    whose own table of best goodputs then fills once for every job of that model.
    """

    def __init__(
        self, fits: int = 200_000, batch_sizes: int = 200_000, speedups: int = 256
    ) -> None:
        self.fits = Memo(fits)
        self.batch_sizes = Memo(batch_sizes)
        self.speedups = Memo(speedups)  # each holds a (nodes x replicas) table, ~130 kB


#: The memos every simulation of this process shares unless given its own.
SHARED_MEMOS = GoodputMemos()


def job_kind_for_policy(policy_name: str) -> str:
    """Which workload columns a policy's jobs use: 'fixed' (replicas + batch size: Tiresias,
    FIFO), 'batch' (batch size only, Optimus) or 'adaptive' (neither: Pollux and ours)."""
    return {"tiresias": "fixed", "fifo": "fixed", "optimus": "batch"}.get(policy_name, "adaptive")


class SimJob:
    """One training job replayed from its application's traces."""

    def __init__(
        self,
        name: str,
        app: Application,
        submission_time: float,
        *,
        target_num_replicas: int | None = None,
        target_batch_size: int | None = None,
        adaptive: bool = False,
        restart_delay: float = 30.0,
        max_nodes: int = 64,
        max_replicas: int = 256,
        memos: GoodputMemos | None = None,
    ) -> None:
        self.memos = SHARED_MEMOS if memos is None else memos
        self.name = name
        self.app = app
        self.submission_time = submission_time
        self.target_num_replicas = target_num_replicas
        self.target_batch_size = target_batch_size
        self.adaptive = adaptive  # learns a goodput model (needed by goodput-based policies)
        self.restart_delay = restart_delay
        # size of the speedup memo table: at least the cluster (``speedup_fn`` is never asked
        # about more nodes or replicas than the cluster has)
        self.max_nodes = max_nodes
        self.max_replicas = max_replicas
        self.completion_time: float | None = None
        self.current_time = 0.0
        self.rescale_time = 0.0
        self.placement: tuple[int, ...] = ()
        self.atomic_bsz = 0
        self.accum_steps = 0
        self.profile: dict[tuple[int, int, int], tuple[float, float]] = {}
        self.perf_params = None
        self.grad_params: tuple[float, float] | None = None
        self.progress = 0.0
        self.epoch = 0
        self.attained_service = 0.0
        self.num_restarts: int | None = None

    def state_dict(self) -> dict[str, Any]:
        """Everything that decides how the job steps on: its attributes, its application by
        name (the memos are not part of its state)."""
        state = {k: v for k, v in self.__dict__.items() if k not in ("app", "memos")}
        state["profile"] = dict(self.profile)
        state["app"] = self.app.name
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take the state of :meth:`state_dict`; its application must be this job's."""
        if state["app"] != self.app.name:
            raise ValueError(
                f"state of a job of application {state['app']!r} given to job {self.name!r} of "
                f"{self.app.name!r}"
            )
        for key, value in state.items():
            if key != "app":
                setattr(self, key, value)
        self.profile = dict(state["profile"])

    # ---- goodput model ----------------------------------------------------------------------
    @property
    def max_profiled_replicas(self) -> int:
        return max((k[1] for k in self.profile), default=0)

    def goodput_fn(self) -> GoodputFunction:
        return GoodputFunction(self.perf_params, self.grad_params, self.app.init_batch_size)

    def _model_key(self) -> tuple:
        """What the goodput model's answers depend on: its parameters and the batch limits."""
        app = self.app
        return (
            tuple(self.perf_params),
            tuple(self.grad_params),
            app.init_batch_size,
            app.max_batch_size,
            app.min_local_bsz,
            app.max_local_bsz,
        )

    def speedup_fn(self):
        """Speedup over one GPU from the learned goodput model (``r`` before any profile)."""
        if self.perf_params is None:
            return LinearSpeedup()
        key = (self._model_key(), self.max_nodes, self.max_replicas)
        app = self.app
        return self.memos.speedups.get_or_compute(
            key,
            lambda: SpeedupFunction(
                self.goodput_fn(),
                max_batch_size=app.max_batch_size,
                atomic_bsz_range=(app.min_local_bsz, app.max_local_bsz),
                accumulation=True,
                max_nodes=self.max_nodes,
                max_replicas=self.max_replicas,
            ),
        )

    def update_local_bsz(self, placement: Sequence[int]) -> None:
        app = self.app
        placement = tuple(p for p in placement if p)
        num_nodes, num_replicas = len(placement), sum(placement)
        batch_size = self.target_batch_size
        if batch_size is None and self.perf_params is None:
            batch_size = max(app.init_batch_size, app.min_local_bsz * num_replicas)
        if batch_size is None:
            key = (self._model_key(), num_nodes, num_replicas)
            self.atomic_bsz, self.accum_steps = self.memos.batch_sizes.get_or_compute(
                key, lambda: self._best_batch(num_nodes, num_replicas)
            )
        else:
            local_bsz = math.ceil(batch_size / num_replicas - 1e-8)
            self.accum_steps = math.ceil(local_bsz / app.max_local_bsz - 1e-8) - 1
            if num_replicas == 1 and batch_size > app.init_batch_size:
                self.accum_steps = max(1, self.accum_steps)
            self.atomic_bsz = math.ceil(local_bsz / (self.accum_steps + 1) - 1e-8)
        count = num_replicas * (self.accum_steps + 1)
        self.atomic_bsz = min(self.atomic_bsz, int(app.max_batch_size / count))

    def _best_batch(self, num_nodes: int, num_replicas: int) -> tuple[int, int]:
        """``(atomic_bsz, accum_steps)`` of the best goodput on that many nodes and replicas."""
        app = self.app
        _, atomic, accum = self.goodput_fn().optimize(
            num_nodes,
            num_replicas,
            max_batch_size=app.max_batch_size,
            atomic_bsz_range=(app.min_local_bsz, app.max_local_bsz),
            accumulation=True,
            round_past_max=True,  # the artifact's (AdaptDL's) rule, for fidelity
        )
        return int(atomic), int(accum)

    def update_params(self, num_nodes, num_replicas, local_bsz, step_time, sync_time, sqr, var):
        self.grad_params = (sqr, var)
        if not self.adaptive or (num_nodes, num_replicas, local_bsz) in self.profile:
            return
        self.profile[num_nodes, num_replicas, local_bsz] = (step_time, sync_time)
        # The fit is a pure function of the profile; jobs of one model often share profiles.
        # Observations go in sorted order, so that the fit (its floating-point sums) does not
        # depend on the order a job met its configurations, nor on which job filled the cache.
        items = tuple(sorted(self.profile.items()))
        self.perf_params = self.memos.fits.get_or_compute(items, lambda: _fit(items))

    # ---- dynamics ---------------------------------------------------------------------------
    def step(self, seconds: float, interference: float = 0.0) -> None:
        """Advance ``seconds`` of wall time on the current placement.

        The time to an epoch boundary is rounded to whole seconds (as in the artifact) only when
        ``seconds``, the job's clock and its restart delay are all whole; it is exact otherwise.
        """
        whole = (
            float(seconds).is_integer()
            and float(self.current_time).is_integer()
            and float(self.restart_delay).is_integer()
        )
        if not self.placement:
            self.current_time += seconds
            return
        replicas_total = sum(self.placement)
        delay = min(self.rescale_time, seconds)
        self.current_time += delay
        self.attained_service += delay * replicas_total
        self.rescale_time -= delay
        seconds -= delay
        app = self.app
        while seconds > 0 and self.completion_time is None:
            placement = tuple(p for p in self.placement if p)
            num_nodes, num_replicas = len(placement), sum(placement)
            batch_size = num_replicas * self.atomic_bsz * (self.accum_steps + 1)
            scale = batch_size / app.init_batch_size
            step_time, sync_time = app.get_throughput(placement, self.atomic_bsz)
            accum_time = step_time - sync_time
            sqr, var = app.get_grad_stats(batch_size, self.epoch)
            gain = (var + sqr) / (var / scale + sqr)
            self.update_params(
                num_nodes, num_replicas, self.atomic_bsz, step_time, sync_time, sqr, var
            )
            total_time = step_time + accum_time * self.accum_steps
            goodput = gain / total_time * (1.0 - interference)
            next_progress = app.get_progress(self.epoch + 1)
            if self.progress + goodput * seconds < next_progress:
                self.progress += goodput * seconds
                self.current_time += seconds
                self.attained_service += seconds * replicas_total
                seconds = 0
            else:
                self.epoch += 1
                delta = float((next_progress - self.progress) / goodput)
                if whole:  # the artifact's rounding; then delta <= seconds already
                    delta = round(delta)
                delta = min(delta, seconds)
                if self.epoch > app.get_completion_epoch(batch_size):
                    self.completion_time = self.current_time + delta
                self.progress = next_progress
                self.current_time += delta
                self.attained_service += delta * replicas_total
                seconds -= delta
            self.update_local_bsz(self.placement)
        self.current_time += seconds

    def reallocate(self, placement: Sequence[int]) -> None:
        if placement:
            self.placement = tuple(placement)
            self.update_local_bsz(self.placement)
            self.rescale_time = self.restart_delay
            self.num_restarts = 0 if self.num_restarts is None else self.num_restarts + 1
        else:
            self.placement = ()
            self.atomic_bsz = 0

    def remaining_work(self, speedup: SpeedupFunction | None = None) -> float | None:
        """Estimated seconds left on one GPU: remaining statistical progress (known from the
        remaining epochs) over the goodput the job's own model (or ``speedup``'s) predicts on
        one GPU."""
        if self.perf_params is None:
            return None
        left = self.app.get_progress(self.app.max_epochs) - self.progress
        fn = self.speedup_fn() if speedup is None else speedup
        rate = fn.base_goodput / self.app.init_batch_size
        return max(left, 0.0) / rate if rate > 0 else None

    def remaining_steps(self) -> float:
        """Steps left at the fixed batch size (Optimus's estimate)."""
        app, bsz = self.app, self.target_batch_size
        done = app.get_completion_epoch(bsz)
        if done <= self.epoch:
            return 1.0
        return app.get_iteration(bsz, done) - app.get_iteration(bsz, self.epoch)

    def step_time_fn(self, gpus_per_node: int = 4) -> Callable[[int], float]:
        """Seconds per step at the fixed batch size on ``r`` replicas packed onto nodes of
        ``gpus_per_node`` GPUs (Optimus's model)."""
        app, bsz = self.app, self.target_batch_size
        if gpus_per_node < 1:
            raise ValueError(f"gpus_per_node={gpus_per_node} must be >= 1")

        def fn(r: int) -> float:
            placement: tuple[int, ...] = ()
            while sum(placement) < r:
                placement = (*placement, min(r - sum(placement), gpus_per_node))
            local = math.ceil(bsz / r - 1e-8)
            accum = math.ceil(local / app.max_local_bsz - 1e-8) - 1
            if r == 1:
                accum = max(1, accum)
            atomic = math.ceil(local / (accum + 1) - 1e-8)
            atomic = min(atomic, int(app.max_batch_size / (r * (accum + 1))))
            step, sync = app.get_throughput(placement, atomic)
            return step + (step - sync) * accum

        return fn


def _fit(items: tuple) -> Any:
    """The goodput model's ``PerfParams`` fitted to a profile's sorted items."""
    keys = [k for k, _ in items]
    step = np.array([v[0] for _, v in items])
    sync = np.array([v[1] for _, v in items])
    return fit_perf_params(
        np.array([k[0] for k in keys]),
        np.array([k[1] for k in keys]),
        np.array([k[2] for k in keys]),
        step - sync,
        step,
    )
