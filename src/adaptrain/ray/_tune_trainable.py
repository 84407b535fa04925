"""The Tune trainable of an adaptive trial: one training process per replica, in the bundles
of the trial's placement group.

A trial's resources are a placement group of an empty head bundle (the trainable actor itself
needs nothing) and one bundle per replica (:func:`replica_resources`). In each replica bundle
the trainable starts a :class:`~adaptrain.ray._tune_host.ReplicaHost` actor, which runs the replica as a process of its
own (``python -m adaptrain.ray._tune_replica``) with the ``ADAPTRAIN_*`` variables of its rank:
the replicas meet in a gloo (or NCCL) process group at rank 0's host, post their hints and
results to the trial's :class:`~adaptrain.ray._tune_supervisor.TrialSupervisor`, and keep their
checkpoints in a folder of their host. Processes rather than threads of the actor: adaptrain's
preemption (a SIGTERM agreed on by every replica at a step boundary, a checkpoint, exit 143) and
its module state are per process, and a resize must really change the number of processes.

Tune's checkpoint of the trial (:meth:`AdaptiveTrainable.save_checkpoint`, called by Tune when
the scheduler pauses the trial) stops the replicas that way and stores rank 0's adaptrain
checkpoint in Tune's checkpoint folder; the restore (:meth:`~AdaptiveTrainable.load_checkpoint`,
on whatever number of replicas the trial then has) copies it into every new host's folder, so
no shared file system is needed.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import time
from collections.abc import Callable, Mapping
from typing import Any

import ray
from ray.tune import PlacementGroupFactory, Trainable
from ray.tune.result import RESULT_DUPLICATE
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from adaptrain.ray._tune_host import ReplicaHostActor, pack_newest_checkpoint, unpack_checkpoint
from adaptrain.ray._tune_supervisor import TrialSupervisor

try:  # the standalone package: a replica unpickles without importing Ray
    import cloudpickle
except ImportError:  # pragma: no cover - Ray's vendored copy
    from ray import cloudpickle

__all__ = [
    "AdaptDLTrainableCreator",
    "AdaptiveTrainable",
    "RESULT_KEYS",
    "replica_resources",
    "replicas_of",
    "replica_bundle",
]

logger = logging.getLogger(__name__)

#: What every result of an adaptive trial carries besides the function's metrics.
RESULT_KEYS = ("num_replicas", "num_nodes", "num_restarts", "adaptrain_hints", "adaptrain_nodes")
_STATE_DIR = "adaptrain"
_META = "adaptrain_trial.json"
#: Exit codes of a replica stopped by adaptrain's preemption (SIGTERM, SIGINT).
_STOPPED = (0, 143, 130)


def replica_resources(
    num_replicas: int, resources_per_replica: Mapping[str, float] | None = None
) -> PlacementGroupFactory:
    """An adaptive trial's resources: an empty head bundle (the trainable actor needs none)
    and ``num_replicas`` bundles of ``resources_per_replica`` (default one CPU), packed."""
    if num_replicas < 1:
        raise ValueError(f"num_replicas={num_replicas} must be at least 1")
    bundle = {k: float(v) for k, v in (resources_per_replica or {"CPU": 1}).items() if v}
    if not bundle:
        raise ValueError(f"resources_per_replica={resources_per_replica!r} asks for nothing")
    return PlacementGroupFactory([{}] + [dict(bundle) for _ in range(num_replicas)], "PACK")


def _replica_bundles(pgf: PlacementGroupFactory) -> list[dict[str, float]]:
    bundles = pgf.bundles
    return bundles if pgf.head_bundle_is_empty else bundles[1:]


def replicas_of(pgf: PlacementGroupFactory) -> int:
    """How many replicas a trial's resources hold (its bundles but the head)."""
    return len(_replica_bundles(pgf))


def replica_bundle(pgf: PlacementGroupFactory) -> dict[str, float]:
    """The resources of one replica of a trial's resources."""
    bundles = _replica_bundles(pgf)
    return dict(bundles[-1]) if bundles else {"CPU": 1.0}


class AdaptiveTrainable(Trainable):
    """A Tune trainable running ``_function(config)`` on one process per replica.

    Subclasses (made by :func:`AdaptDLTrainableCreator`) set ``_function``, ``_num_workers``
    (the replicas a new trial starts with), ``_resources_per_worker``, ``_backend``,
    ``_hints_interval`` and ``_first_group``. The replica count of a running trial is that of its
    resources (:func:`replicas_of` of ``trial_resources``), which the scheduler changes.
    """

    _function: Callable[[dict], Any] | None = None
    _num_workers: int = 1
    _resources_per_worker: dict[str, float] = {"CPU": 1.0}  # noqa: RUF012 - set per subclass
    _backend: str = "gloo"
    _hints_interval: float = 5.0
    _stop_timeout: float = 180.0
    _first_group: int = 0

    @classmethod
    def default_resource_request(cls, config: dict) -> PlacementGroupFactory:
        return replica_resources(cls._num_workers, cls._resources_per_worker)

    # ---- Tune's calls --------------------------------------------------------------------------
    def setup(self, config: dict) -> None:
        if self._function is None:
            raise TypeError("make the trainable with AdaptDLTrainableCreator(function, ...)")
        resources = self.trial_resources or self.default_resource_request(config)
        self._replicas = replicas_of(resources)
        self._restarts = self._first_group
        self._restore_blob: bytes | None = None
        self._pending: list[dict[str, Any]] = []  # results Tune has not seen (a stop's)
        self._reported = False
        self._running = False
        self._started = False  # replicas were started by this actor before
        self._finished = False
        self._config = dict(config)
        ip = ray.util.get_node_ip_address()
        self._supervisor = TrialSupervisor(self.trial_id or "trial", secrets.token_hex(16), ip)
        pg = ray.util.get_current_placement_group()
        offset = 0 if resources.head_bundle_is_empty else 1
        bundle = replica_bundle(resources)
        extra = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU", "memory")}
        self._hosts = [
            ReplicaHostActor.options(
                num_cpus=bundle.get("CPU", 0),
                num_gpus=bundle.get("GPU", 0),
                resources=extra or None,
                scheduling_strategy=(
                    PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=offset + i)
                    if pg is not None
                    else None
                ),
            ).remote(self.trial_id or "trial", i)
            for i in range(self._replicas)
        ]
        self._where = ray.get([h.where.remote() for h in self._hosts])

    def step(self) -> dict[str, Any]:
        if self._pending:  # results posted while the replicas stopped for a checkpoint
            return self._result(self._pending.pop(0))
        if self._finished:
            return self._done()
        if not self._running:
            self._start()
        self._supervisor.release()  # the replica that posted the last result goes on
        while True:
            metrics = self._supervisor.next_result(timeout=0.5)
            if metrics is not None:
                return self._result(metrics)
            codes = ray.get([h.poll.remote() for h in self._hosts])
            if any(c not in (None, 0) for c in codes):
                self._kill_replicas()
                raise RuntimeError(
                    f"trial {self.trial_id}: a replica failed (exit codes by rank: {codes}); "
                    "its output is in the Ray logs of the replica hosts"
                )
            if all(c == 0 for c in codes):
                metrics = self._supervisor.next_result(timeout=0.0)  # posted just before exit
                if metrics is not None:
                    return self._result(metrics)
                self._running, self._finished = False, True
                return self._done()

    def save_checkpoint(self, checkpoint_dir: str) -> None:
        """Stop the replicas at a step boundary (they checkpoint and exit) and keep rank 0's
        checkpoint in ``checkpoint_dir``; the next ``step`` (or a restore) restarts them."""
        if self._running:
            self._stop_replicas()
        blob = ray.get(self._hosts[0].checkpoint.remote()) or self._restore_blob
        if blob is not None:
            unpack_checkpoint(blob, os.path.join(checkpoint_dir, _STATE_DIR))
            self._restore_blob = blob
        meta = {
            "restarts": self._restarts,
            "replicas": self._replicas,
            "pending": self._pending,
            "reported": self._reported,
            "finished": self._finished,
            "hints": self._supervisor.hints,
        }
        with open(os.path.join(checkpoint_dir, _META), "w") as f:
            json.dump(meta, f)

    def load_checkpoint(self, checkpoint_dir: str) -> None:
        with open(os.path.join(checkpoint_dir, _META)) as f:
            meta = json.load(f)
        state = os.path.join(checkpoint_dir, _STATE_DIR)
        self._restore_blob = pack_newest_checkpoint(state)
        self._restarts = int(meta["restarts"]) + 1
        self._pending = list(meta.get("pending") or [])
        self._reported = bool(meta.get("reported"))
        self._finished = bool(meta.get("finished"))
        self._running = False
        if self._supervisor.hints is None:  # the goodput model it had, until rank 0 posts
            self._supervisor.hints = meta.get("hints")

    def cleanup(self) -> None:
        try:  # each host stops its replica and removes its folder
            ray.get([h.shutdown.remote() for h in self._hosts], timeout=30)
        except Exception as exc:  # noqa: BLE001 - a host already gone: its replica went with it
            logger.warning("trial %s: stopping the replica hosts: %s", self.trial_id, exc)
            for host in self._hosts:
                ray.kill(host)
        self._hosts = []  # the hosts' actors end with their last handle
        self._supervisor.close()

    def reset_config(self, new_config: dict) -> bool:
        return False  # a trial's replicas are its own: no actor reuse

    # ---- the replicas --------------------------------------------------------------------------
    def _start(self) -> None:
        if self._started:  # restarted in this actor, after a checkpoint Tune asked for
            self._restarts += 1
        self._started = True
        nodes = [node for node, _ in self._where]
        master = self._where[0][1]
        port = ray.get(self._hosts[0].free_port.remote())
        payload = cloudpickle.dumps((self._function, self._config, self._backend))
        blob = ray.put(self._restore_blob) if self._restore_blob is not None else None
        local: dict[str, int] = {}
        starts = []
        for rank, host in enumerate(self._hosts):
            node = nodes[rank]
            variables = {
                "ADAPTRAIN_MASTER_ADDR": master,
                "ADAPTRAIN_MASTER_PORT": str(port),
                "ADAPTRAIN_NUM_REPLICAS": str(self._replicas),
                "ADAPTRAIN_NUM_NODES": str(len(set(nodes))),
                "ADAPTRAIN_REPLICA_RANK": str(rank),
                "ADAPTRAIN_LOCAL_RANK": str(local.get(node, 0)),
                "ADAPTRAIN_NUM_RESTARTS": str(self._restarts),
                "ADAPTRAIN_JOB_ID": self._supervisor.job_id,
                "ADAPTRAIN_SUPERVISOR_URL": self._supervisor.url,
                "ADAPTRAIN_JOB_TOKEN": self._supervisor._token,
                "ADAPTRAIN_HINTS_INTERVAL": str(self._hints_interval),
                "OMP_NUM_THREADS": str(max(1, int(self._resources_per_worker.get("CPU", 1)))),
                "PYTHONUNBUFFERED": "1",
            }
            local[node] = local.get(node, 0) + 1
            starts.append(host.start.remote(variables, payload, blob))
        ray.get(starts)
        self._supervisor.reopen()
        self._running = True
        logger.info(
            "trial %s: %d replicas started on %d nodes (restart %d)",
            self.trial_id,
            self._replicas,
            len(set(nodes)),
            self._restarts,
        )

    def _stop_replicas(self) -> None:
        """SIGTERM every replica: they agree on a step, checkpoint, and exit 143 (0 if done)."""
        self._supervisor.stop()
        for host in self._hosts:
            host.signal.remote(signal.SIGTERM)
        deadline = time.monotonic() + self._stop_timeout
        codes: list[int | None] = [None] * len(self._hosts)
        while any(c is None for c in codes) and time.monotonic() < deadline:
            codes = ray.get([h.wait.remote(0.5) for h in self._hosts])
        self._running = False
        self._pending.extend(self._supervisor.late_results())
        if any(c is None for c in codes):
            self._kill_replicas()
            raise RuntimeError(
                f"trial {self.trial_id}: replicas did not stop within {self._stop_timeout:.0f} s "
                f"of SIGTERM (exit codes by rank: {codes})"
            )
        if any(c not in _STOPPED for c in codes):
            raise RuntimeError(f"trial {self.trial_id}: replicas failed while stopping: {codes}")
        # done with the last epoch: after the results it posted meanwhile (step() hands those
        # over first), the trial ends without restarting its replicas
        self._finished = all(c == 0 for c in codes)

    def _kill_replicas(self) -> None:
        self._running = False
        ray.get([h.signal.remote(signal.SIGKILL) for h in self._hosts])

    # ---- results -------------------------------------------------------------------------------
    def _extras(self) -> dict[str, Any]:
        hints = self._supervisor.hints
        return {
            "num_replicas": self._replicas,
            "num_nodes": len({node for node, _ in self._where}),
            "num_restarts": self._restarts,
            "adaptrain_hints": json.dumps(hints) if hints is not None else "",
            "adaptrain_nodes": json.dumps([node for node, _ in self._where]),
        }

    def _result(self, metrics: dict[str, Any]) -> dict[str, Any]:
        self._reported = True
        return {**metrics, **self._extras()}

    def _done(self) -> dict[str, Any]:
        if self._reported:  # Tune repeats the last result, marked done
            return {RESULT_DUPLICATE: True}
        return {"done": True, **self._extras()}


def AdaptDLTrainableCreator(  # noqa: N802 - AdaptDL's name
    func: Callable[..., Any],
    num_workers: int = 1,
    group: int = 0,
    num_cpus_per_worker: float = 1,
    backend: str | None = None,
    use_gpu: bool | None = None,
    *,
    resources_per_worker: Mapping[str, float] | None = None,
    hints_interval: float = 5.0,
    stop_timeout: float = 180.0,
) -> type[AdaptiveTrainable]:
    """A Tune trainable class running ``func(config)`` on ``num_workers`` replicas to start
    with (AdaptDL's ``adaptdl_ray.tune.AdaptDLTrainableCreator``).

    A trial's Tune checkpoints hold the adaptrain checkpoint its replicas took when they were
    last stopped (a pause): a trial that ends by finishing its epochs leaves no newer one. To
    keep the final model, save it in ``func`` (e.g. ``adaptrain.checkpoint.save_all_states()``
    after the epoch loop, or ``torch.save`` on rank 0).

    Args:
        func: the trial's function, written with :mod:`adaptrain.torch` and reporting with
            :func:`adaptrain.ray.tune.report`; it must pickle (cloudpickle).
        num_workers: replicas of a new trial; the scheduler changes them afterwards.
        group: the restart count a trial starts from (AdaptDL's name part).
        num_cpus_per_worker: CPUs of each replica (its bundle and ``OMP_NUM_THREADS``).
        backend: the torch.distributed backend; default ``"nccl"`` with GPUs, else ``"gloo"``.
        use_gpu: one GPU per replica; None (AdaptDL's rule): when the Ray cluster has GPUs.
        resources_per_worker: a replica's whole bundle, instead of ``num_cpus_per_worker``
            and ``use_gpu``.
        hints_interval: seconds between two posts of rank 0's scheduling hints.
        stop_timeout: seconds the replicas may take to checkpoint and exit at a pause.
    """
    if num_workers < 1:
        raise ValueError(f"num_workers={num_workers} must be at least 1")
    if resources_per_worker is None:
        if use_gpu is None:
            use_gpu = ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0
        resources_per_worker = {"CPU": float(num_cpus_per_worker)}
        if use_gpu:
            resources_per_worker["GPU"] = 1.0
    resources = {k: float(v) for k, v in resources_per_worker.items()}
    if backend is None:
        backend = "nccl" if resources.get("GPU", 0) > 0 else "gloo"

    class AdaptDLTrainable(AdaptiveTrainable):
        _function = staticmethod(func)
        _num_workers = int(num_workers)
        _resources_per_worker = resources
        _backend = backend
        _hints_interval = float(hints_interval)
        _stop_timeout = float(stop_timeout)
        _first_group = int(group)

    AdaptDLTrainable.__qualname__ = AdaptDLTrainable.__name__
    return AdaptDLTrainable
