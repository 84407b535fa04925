"""The adaptive trial scheduler: a scheduling policy re-decides the trials' replica counts.

Every result of an adaptive trial carries its rank 0's latest scheduling hints (goodput model,
step-time profile, batch limits), its replica count and the Ray nodes of its replicas
(:data:`~adaptrain.ray._tune_trainable.RESULT_KEYS`). Every ``interval`` seconds (at a result, or
when Tune looks for a trial to run) the scheduler builds each trial's
:class:`~adaptrain.sched.JobInfo` from them exactly as the service does
(:func:`adaptrain.service.reports.job_report`, :func:`adaptrain.sched.job_info`), describes the
Ray cluster as nodes of replica slots (how many replica bundles each alive node holds), and asks
the policy (:class:`~adaptrain.sched.WaterfillPolicy` by default) for every trial's allocation.

A running trial whose replica count changes is paused at its next result (``PAUSE``: Tune has
the trainable checkpoint, which stops its replicas at a step boundary, then ends its actor); the
scheduler then gives the paused trial its new resources with ``Trial.update_resources`` and
hands it back to Tune (:meth:`choose_trial_to_run`), which restarts it from the checkpoint on
the new number of replicas once its placement group fits. A trial the policy gives no replica
stays paused until a later round gives it some. Trials that Tune has not started yet (PENDING)
start at their own size when slots free up (Tune starts them by itself); the policy leaves them
the free slots they need and counts them in once they report.

The policy places replicas on nodes; Ray places the bundles (``PACK``), so the node choice is
the policy's estimate and the replica count its decision. Trials of other trainables (whose
resources are not :func:`~adaptrain.ray._tune_trainable.replica_resources`) run as under FIFO:
they are neither resized nor counted.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import ray
from ray.tune.experiment import Trial
from ray.tune.schedulers import FIFOScheduler, TrialScheduler

from adaptrain.ray._tune_trainable import replica_bundle, replica_resources, replicas_of
from adaptrain.sched import ClusterSpec, JobInfo, NodeInfo, PolluxPolicy, WaterfillPolicy, job_info
from adaptrain.service.reports import job_report

if TYPE_CHECKING:  # pragma: no cover
    from ray.tune.execution.tune_controller import TuneController

logger = logging.getLogger(__name__)

__all__ = ["AdaptiveTrialScheduler", "Resize"]


class Resize(NamedTuple):
    """A resize the policy decided: when (Unix time), which trial, its replicas before and
    after, and whether the trial's goodput model (from its hints) informed the decision."""

    time: float
    trial_id: str
    before: int
    after: int
    measured: bool


@dataclass
class _TrialState:
    """What the scheduler knows of one trial."""

    added: float
    bundle: dict[str, float]
    replicas: int
    hints: dict[str, Any] | None = None
    nodes: list[str] = field(default_factory=list)
    attained: float = 0.0  # replica-seconds of training
    restarts: int = 0
    results: int = 0  # results since the trial last (re)started
    target: list[str] | None = None  # the policy's allocation, not applied yet
    resized_at: float | None = None
    named: str | None = None  # the name this scheduler gave the trial


class AdaptiveTrialScheduler(FIFOScheduler):
    """Resize adaptive trials (made by :func:`~adaptrain.ray.tune.AdaptDLTrainableCreator`) by
    a policy's decisions across their goodput. AdaptDL's name: ``AdaptDLScheduler``.

    Args:
        policy: the scheduling policy: an object with ``optimize(jobs, nodes, base, time)``
            (:class:`~adaptrain.sched.Policy`), or ``"waterfill"`` (default) / ``"pollux"``, made
            for the Ray cluster at the first round.
        interval: seconds between two policy rounds.
        restart_delay: seconds a resize costs a trial (checkpoint, new actors, restart); the
            policy weighs a resize against it.
        cooldown: seconds after a resize during which a trial keeps its size (default: two
            rounds), so a trial is not moved again before it has measured its new size.
        min_replicas: the fewest replicas the policy may give a trial that has reported (0: it
            may pause a trial for others, as AdaptDL's allocator could).
        max_replicas: the most replicas of one trial (default: the whole cluster).
        allocator_invoke_freq: AdaptDL's setting: a round every this many results instead of
            every ``interval`` seconds.
    """

    _supports_buffered_results = False  # a decision must follow the result it answers

    def __init__(
        self,
        policy: Any = "waterfill",
        *,
        interval: float = 30.0,
        restart_delay: float = 15.0,
        cooldown: float | None = None,
        min_replicas: int = 0,
        max_replicas: int | None = None,
        allocator_invoke_freq: int | None = None,
    ) -> None:
        super().__init__()
        if not interval > 0 or not math.isfinite(interval):
            raise ValueError(f"interval={interval} must be a positive number of seconds")
        if min_replicas < 0 or (max_replicas is not None and max_replicas < max(1, min_replicas)):
            raise ValueError(
                f"need 0 <= min_replicas={min_replicas} <= max_replicas={max_replicas}"
            )
        if allocator_invoke_freq is not None and allocator_invoke_freq < 1:
            raise ValueError(f"allocator_invoke_freq={allocator_invoke_freq} must be >= 1")
        if isinstance(policy, str) and policy not in ("waterfill", "pollux"):
            raise ValueError(f"policy={policy!r}: give 'waterfill', 'pollux' or a policy object")
        self._policy_spec = policy
        self.policy: Any = None if isinstance(policy, str) else policy
        self.interval = float(interval)
        self.restart_delay = float(restart_delay)
        self.cooldown = 2 * self.interval if cooldown is None else float(cooldown)
        self.min_replicas = int(min_replicas)
        self.max_replicas = max_replicas
        self.allocator_invoke_freq = allocator_invoke_freq
        self._trials: dict[str, _TrialState] = {}
        self._last_round = -math.inf
        self._results_since_round = 0
        self._slots: dict[str, int] = {}
        #: every resize the policy decided, in order
        self.resizes: list[Resize] = []
        self.rounds = 0

    # ---- Tune's calls --------------------------------------------------------------------------
    def on_trial_add(self, tune_controller: TuneController, trial: Trial) -> None:
        pgf = trial.placement_group_factory
        if not pgf.head_bundle_is_empty or replicas_of(pgf) < 1:
            return  # not an adaptive trial (replica_resources): it runs as under FIFO
        state = _TrialState(time.time(), replica_bundle(pgf), replicas_of(pgf))
        self._trials[trial.trial_id] = state
        if trial.custom_trial_name is None:
            self._name(trial, state)

    def on_trial_result(self, tune_controller: TuneController, trial: Trial, result: dict) -> str:
        state = self._trials.get(trial.trial_id)
        if state is None or "num_replicas" not in result:
            return TrialScheduler.CONTINUE  # not an adaptive trial
        self._update(trial, state, result)
        self._results_since_round += 1
        if self._round_due():
            self._round(tune_controller)
        if state.target is not None and len(state.target) != state.replicas:
            logger.info(
                "pausing %s to resize it from %d to %d replicas",
                trial,
                state.replicas,
                len(state.target),
            )
            return TrialScheduler.PAUSE
        state.target = None
        return TrialScheduler.CONTINUE

    def on_trial_error(self, tune_controller: TuneController, trial: Trial) -> None:
        state = self._trials.get(trial.trial_id)
        if state is not None:  # Tune may retry it from its checkpoint, at its size
            state.target, state.results = None, 0

    def on_trial_complete(
        self, tune_controller: TuneController, trial: Trial, result: dict
    ) -> None:
        self._trials.pop(trial.trial_id, None)

    def on_trial_remove(self, tune_controller: TuneController, trial: Trial) -> None:
        self._trials.pop(trial.trial_id, None)

    def choose_trial_to_run(self, tune_controller: TuneController) -> Trial | None:
        trials = tune_controller.get_trials()
        for trial in trials:
            if trial.status == Trial.PENDING:
                return trial
        for trial in trials:
            if trial.status == Trial.PAUSED and trial.trial_id not in self._trials:
                return trial  # not ours to resize
        paused = [t for t in trials if t.status == Trial.PAUSED and t.trial_id in self._trials]
        if not paused:
            return None
        busy = [t for t in trials if t.status in (Trial.RUNNING, Trial.PENDING)]
        if self.allocator_invoke_freq is None and self._round_due():
            self._round(tune_controller)
        elif not busy and all(self._wanted(t) == 0 for t in paused):
            self._round(tune_controller)  # nothing runs: a round must restart someone
        wanted = [(t, self._wanted(t)) for t in paused]
        ready = [(t, n) for t, n in wanted if n > 0]
        if not ready and not busy:  # the policy gave nobody a replica: restart the oldest
            ready = [(paused[0], 1)]
        if not ready:
            return None
        if not self._slots:
            self._slots = self._node_slots(self._trials[ready[0][0].trial_id].bundle)
        used = sum(replicas_of(t.placement_group_factory) for t in busy)
        free = sum(self._slots.values()) - used
        fits = [(t, n) for t, n in ready if n <= free]
        if not fits and free >= max(1, self.min_replicas):
            # Slots the policy counted on went to a trial Tune started meanwhile: restart on
            # those free now rather than idle; a later round grows the trial again.
            fits = [(ready[0][0], free)]
        if not fits:
            if busy:
                return None  # it waits for slots to free up
            fits = [min(ready, key=lambda tn: tn[1])]
        trial, n = fits[0]
        state = self._trials[trial.trial_id]
        if replicas_of(trial.placement_group_factory) != n:
            trial.update_resources(replica_resources(n, state.bundle))
        if state.replicas != n:
            state.replicas = n
        state.restarts += 1
        state.results = 0
        state.target = None
        self._name(trial, state)
        logger.info("restarting %s on %d replicas", trial, n)
        return trial

    def debug_string(self) -> str:
        return (
            f"Using the adaptive trial scheduler ({self._policy_name()} policy, a round every "
            f"{self.interval:g} s): {self.rounds} rounds, {len(self.resizes)} resizes."
        )

    # ---- what the trials report ----------------------------------------------------------------
    def _update(self, trial: Trial, state: _TrialState, result: dict) -> None:
        replicas = int(result.get("num_replicas") or state.replicas)
        state.attained += float(result.get("time_this_iter_s") or 0.0) * replicas
        state.replicas = replicas
        state.restarts = int(result.get("num_restarts") or 0)
        hints = result.get("adaptrain_hints")
        if hints:
            try:
                state.hints = json.loads(hints)
            except ValueError:
                logger.warning("%s: unreadable hints in its result; keeping the last ones", trial)
        nodes = result.get("adaptrain_nodes")
        if nodes:
            try:
                state.nodes = list(json.loads(nodes))
            except ValueError:
                pass
        state.results += 1
        self._name(trial, state)

    def _name(self, trial: Trial, state: _TrialState) -> None:
        """AdaptDL's trial names: ``<trainable>_<replicas>_<restarts>_<trial id>``, kept only
        while nobody else named the trial."""
        if trial.custom_trial_name not in (None, state.named):
            return
        name = f"{trial.trainable_name}_{state.replicas}_{state.restarts}_{trial.trial_id}"
        trial.custom_trial_name = state.named = name

    def _wanted(self, trial: Trial) -> int:
        """The replicas a paused trial should restart with (0: it stays paused)."""
        state = self._trials[trial.trial_id]
        return state.replicas if state.target is None else len(state.target)

    # ---- the policy ----------------------------------------------------------------------------
    def _round_due(self) -> bool:
        if self.allocator_invoke_freq is not None:
            return self._results_since_round >= self.allocator_invoke_freq
        return time.monotonic() - self._last_round >= self.interval

    def _policy_name(self) -> str:
        if self.policy is not None:
            return getattr(self.policy, "name", type(self.policy).__name__)
        return str(self._policy_spec)

    def _make_policy(self, slots: dict[str, int]) -> Any:
        cluster = ClusterSpec(
            gpus_per_node=max(1, max(slots.values(), default=1)),
            round_seconds=self.interval,
            restart_delay=self.restart_delay,
        )
        if self._policy_spec == "pollux":
            return PolluxPolicy(cluster=cluster)
        return WaterfillPolicy(cluster=cluster)

    @staticmethod
    def _node_slots(bundle: dict[str, float]) -> dict[str, int]:
        """Replica slots of every alive node: how many ``bundle``\\ s its resources hold."""
        slots: dict[str, int] = {}
        for node in ray.nodes():
            if not node.get("Alive"):
                continue
            have = node.get("Resources") or {}
            count = min((int(have.get(k, 0) // v) for k, v in bundle.items() if v > 0), default=0)
            if count > 0:
                slots[node["NodeID"]] = count
        return slots

    def _round(self, tune_controller: TuneController) -> None:
        """Ask the policy for every adaptive trial's allocation; record the changes."""
        now_wall, self._last_round = time.time(), time.monotonic()
        self._results_since_round = 0
        trials = [t for t in tune_controller.get_trials() if t.trial_id in self._trials]
        if not trials:
            return
        self._slots = self._node_slots(self._trials[trials[0].trial_id].bundle)
        total = sum(self._slots.values())
        if total < 1:
            return
        if self.policy is None:
            self.policy = self._make_policy(self._slots)
        jobs: dict[str, JobInfo] = {}
        base: dict[str, list[str]] = {}
        waiting = 0  # replicas of trials Tune is starting by itself
        for trial in trials:
            state = self._trials[trial.trial_id]
            running = trial.status == Trial.RUNNING
            if (running and state.results > 0) or trial.status == Trial.PAUSED:
                jobs[trial.trial_id] = self._info(state, running, now_wall, total)
                held = (
                    state.target if state.target is not None else (state.nodes if running else [])
                )
                if held:
                    base[trial.trial_id] = [n for n in held if n in self._slots]
            elif trial.status in (Trial.PENDING, Trial.RUNNING):
                waiting += state.replicas
        free = Counter(self._slots)
        for held in base.values():
            free.subtract(held)
        nodes = dict(self._slots)
        for _ in range(min(waiting, max(0, sum(free.values())))):  # leave them their slots
            node = max(free, key=lambda n: (free[n], n))
            free[node] -= 1
            nodes[node] -= 1
        if not jobs:
            return
        infos = {k: NodeInfo(max(0, v)) for k, v in nodes.items()}
        try:
            alloc = self.policy.optimize(jobs, infos, base, now_wall)
        except Exception:  # noqa: BLE001 - a failing round must not end the experiment
            logger.exception(
                "the %s policy failed this round; sizes unchanged", self._policy_name()
            )
            return
        self.rounds += 1
        logger.debug(
            "round %d: slots %s (%d kept for starting trials), held %s, allocation %s",
            self.rounds,
            nodes,
            waiting,
            {k: len(v) for k, v in base.items()},
            {k: len(v) for k, v in alloc.items()},
        )
        for trial in trials:
            if trial.trial_id not in jobs:
                continue
            state = self._trials[trial.trial_id]
            new = sorted(alloc.get(trial.trial_id) or [])
            current = (
                state.replicas
                if trial.status == Trial.RUNNING and state.target is None
                else len(state.target or [])
                if state.target is not None
                else 0
            )
            if len(new) == current:
                continue
            before = state.replicas if trial.status == Trial.RUNNING else current
            logger.info("round %d: %s %d -> %d replicas", self.rounds, trial, before, len(new))
            measured = jobs[trial.trial_id].speedup_fn is not None
            self.resizes.append(Resize(now_wall, trial.trial_id, before, len(new), measured))
            state.target = new
            state.resized_at = now_wall

    def _info(self, state: _TrialState, running: bool, now: float, total: int) -> JobInfo:
        """The trial as the policy sees it. A running trial whose hints hold no goodput model
        yet (its first steps) keeps its size: a resize costs a restart, and nothing but the
        policy's prior would decide it."""
        cooldown = state.resized_at is not None and now - state.resized_at < self.cooldown
        spec = {
            "min_replicas": self.min_replicas,
            "max_replicas": min(self.max_replicas or total, total),
            "preemptible": True,
        }
        args = {
            "submitted": state.added,
            "attained_service": state.attained,
            "group": state.restarts,
            "hints": state.hints,
            "running": running,
            "max_nodes": len(self._slots),
            "max_replicas": total,
        }
        report = job_report(spec=spec, cooldown=cooldown, **args)
        if running and report.speedup_fn is None:  # no goodput model: pinned where it is
            pinned = {"min_replicas": state.replicas, "max_replicas": state.replicas}
            report = job_report(spec=pinned, cooldown=True, **args)
        return job_info(report, cluster_replicas=total, now=now)
