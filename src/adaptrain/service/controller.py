"""The service's brain: jobs' phases, the allocator's rounds and the replicas' lives.

Phases follow AdaptDL's controller: ``Pending`` -> ``Starting`` (an allocation given, replicas
launched, the restart group + 1) -> ``Running`` (all replicas up) -> ``Stopping`` (allocation
changed or emptied: SIGTERM, the library's checkpoint, exit 143) -> ``Pending`` (or straight
back to ``Starting`` on the new allocation); ``Succeeded`` when every replica exits 0;
``Failed`` once a job that keeps crashing has used its restart budget; ``Cancelled`` by
``adaptrain delete``. Unlike AdaptDL's, a replica that exits non-zero (not 143 after a stop)
restarts the job from its last checkpoint, up to ``max_restarts`` times; a replica lost with
its node (the backend drops the node from :attr:`Backend.nodes`) restarts it at once on the
remaining nodes, which does not count against that budget.

Every :attr:`ServerConfig.interval` seconds a round builds each job's
:class:`~adaptrain.sched.JobInfo` from its hints (:func:`adaptrain.sched.job_info`) and asks
the policy for the cluster's allocation; a job that arrives between rounds is placed at once
(the policy's ``allocate_job``). A job moved in a round keeps its allocation for
``rescale_rounds`` rounds (it is passed as non-preemptible, which pins it). Each state change
is one transaction of the :class:`~adaptrain.service.store.Store`.
"""

from __future__ import annotations

import base64
import io
import logging
import os
import secrets
import shutil
import signal
import tarfile
import threading
import time
from collections import Counter, defaultdict
from typing import Any

from adaptrain.sched import ClusterSpec, NodeInfo, job_info

from .backend import LOST, Backend
from .config import ServerConfig
from .models import JobSpec
from .policy_process import PolicyProcess
from .reports import job_report, speedup_from_hints
from .store import JobRecord, SampleRecord, Store

logger = logging.getLogger(__name__)

__all__ = ["ACTIVE", "TERMINAL", "Controller", "JobError"]

ACTIVE = ("Pending", "Starting", "Running", "Stopping")
TERMINAL = ("Succeeded", "Failed", "Cancelled")
#: exit status of a replica stopped by SIGTERM after checkpointing (128 + 15)
STOPPED = 143
#: seconds (at most ``grace``) the other replicas of a job that lost one with its node get to
#: exit before SIGKILL: a checkpoint needs every replica, and they may hang in a collective
#: with the one gone
NODE_LOSS_GRACE = 5.0


class JobError(Exception):
    """A request the service refuses: ``status`` is the HTTP status, the message the reason."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Controller:
    """Owns the store, the backend and the policy; thread-safe (one lock)."""

    def __init__(self, config: ServerConfig, backend: Backend, url: str) -> None:
        self.config = config
        self.backend = backend
        self.url = url
        os.makedirs(config.state_dir, exist_ok=True)
        self.store = Store(os.path.join(config.state_dir, "state.db"))
        gpn = max(len(n.slots) for n in backend.nodes.values())
        self.cluster = ClusterSpec(
            gpus_per_node=gpn, round_seconds=config.interval, restart_delay=config.restart_delay
        )
        # the rounds in a worker process, off the API's interpreter lock (FIFO is too cheap)
        self.policy = PolicyProcess(
            config.policy,
            self.cluster,
            self.store.policy_state(),
            in_process=config.policy_in_process or config.policy == "fifo",
        )
        self.lock = threading.RLock()
        self.round = 0
        self.round_seconds: list[float] = []
        self.pending_reason: dict[str, str] = {}
        self._stop_deadline: dict[str, float] = {}
        #: stopping jobs whose deadline a lost node cut short (see NODE_LOSS_GRACE)
        self._cut_short: set[str] = set()
        self._failure: dict[str, str] = {}
        #: set by :meth:`shutdown`: no job starts any more
        self.closing = False
        self._last_tick = time.time()
        self.counters: Counter = Counter()
        #: job -> ((hints time, allocation), its speedup there): see :meth:`speedup`
        self._speedups: dict[str, tuple[tuple, float | None]] = {}

    # ---- paths ------------------------------------------------------------------------------
    def job_dir(self, name: str, *parts: str) -> str:
        return os.path.join(self.config.state_dir, "jobs", name, *parts)

    @property
    def capacity(self) -> dict[str, int]:
        return {name: len(node.slots) for name, node in self.backend.nodes.items()}

    # ---- requests ---------------------------------------------------------------------------
    def submit(self, spec: JobSpec) -> JobRecord:
        total = sum(self.capacity.values())
        if spec.min_replicas > total:
            raise JobError(
                422,
                f"min_replicas={spec.min_replicas} exceeds the cluster's {total} slots: the job "
                "could never start; lower --min-replicas",
            )
        with self.lock:
            if self.closing:
                raise JobError(503, "the server is stopping; submit again once it has restarted")
            name = spec.name or self._generate_name(spec.command)
            if self.store.has_job(name):
                raise JobError(409, f"a job named {name!r} exists; choose another --name")
            workdir = self.job_dir(name, "workdir")
            os.makedirs(workdir, exist_ok=True)
            for sub in ("checkpoint", "share", "tensorboard", "logs"):
                os.makedirs(self.job_dir(name, sub), exist_ok=True)
            if spec.workdir:
                try:
                    _extract(spec.workdir, workdir)
                except (ValueError, tarfile.TarError, OSError) as exc:
                    shutil.rmtree(self.job_dir(name), ignore_errors=True)
                    raise JobError(422, f"workdir: not a usable gzip'd tar ({exc})") from None
            data = spec.model_dump(exclude={"workdir"})
            data["name"] = name
            job = JobRecord(
                name=name,
                spec=data,
                token=secrets.token_urlsafe(24),
                phase="Pending",
                submitted=time.time(),
            )
            self.store.add_job(job)
            self.store.add_event(name, "Submitted", " ".join(spec.command)[:500])
            self._place_arrival(job)
            return self.store.job(name)

    def _generate_name(self, command: list[str]) -> str:
        base = os.path.basename(command[-1] if command[0].startswith("python") else command[0])
        base = "".join(c if c.isalnum() else "-" for c in base.lower().rsplit(".", 1)[0])
        base = base.strip("-")[:40] or "job"
        return f"{base}-{secrets.token_hex(3)}"

    def cancel(self, name: str) -> JobRecord:
        with self.lock:
            job = self._get(name)
            if job.phase in TERMINAL:
                return job
            self.store.update_job(name, cancel=True)
            self.store.add_event(name, "Cancelling", "adaptrain delete: checkpoint and stop")
            if job.phase in ("Starting", "Running"):
                self._stop(job, target=None, why="cancelled")
            elif job.phase == "Pending":
                self._finish(job, "Cancelled", "cancelled before it ran")
            return self.store.job(name)

    def put_hints(self, name: str, hints: dict[str, Any]) -> None:
        with self.lock:
            job = self._get(name)
            if job.phase in TERMINAL:
                return
            now = time.time()
            self.store.update_job(name, hints=hints, hints_time=now)
            self.store.add_sample(
                name,
                SampleRecord(
                    now,
                    len(job.allocation),
                    hints.get("batchSize"),
                    hints.get("gain"),
                    hints.get("goodput"),
                    hints.get("throughput"),
                ),
            )

    def speedup(self, job: JobRecord) -> float | None:
        """The job's speedup at its current allocation, from the goodput model it posted (None
        without a model or an allocation). Cached per job and recomputed only when its hints
        or its allocation change: a listing of a thousand jobs must not refit a thousand
        models."""
        if not job.hints or not job.allocation:
            return None
        key = (job.hints_time, tuple(sorted(job.allocation)))
        cached = self._speedups.get(job.name)
        if cached is not None and cached[0] == key:
            return cached[1]
        value = None
        capacity = self.capacity
        fn = speedup_from_hints(job.hints, len(capacity), sum(capacity.values()))
        if fn is not None:
            try:
                value = float(fn(len(set(job.allocation)), len(job.allocation)))
            except (ValueError, RuntimeError, ZeroDivisionError):  # e.g. beyond a shrunk cluster
                value = None
        self._speedups[job.name] = (key, value)
        return value

    def _get(self, name: str) -> JobRecord:
        job = self.store.job(name)
        if job is None:
            raise JobError(404, f"no job named {name!r} (adaptrain ls lists them)")
        return job

    # ---- the loop -----------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        """Tick (replicas' exits, deadlines) every ``tick`` seconds and run a policy round
        every ``interval`` seconds, until ``stop`` is set."""
        next_round = time.monotonic()
        self.policy.start()
        while not stop.is_set():
            try:
                with self.lock:
                    self.tick()
                    if time.monotonic() >= next_round:
                        next_round = time.monotonic() + self.config.interval
                        self.policy_round()
            except Exception:  # noqa: BLE001 - the loop must outlive one bad round
                logger.exception("scheduling loop error (the loop goes on)")
            stop.wait(self.config.tick)

    def tick(self) -> None:
        now = time.time()
        dt, self._last_tick = now - self._last_tick, now
        for job in self.store.jobs(("Starting", "Running", "Stopping")):
            records = self.store.replicas(job.name, job.group)
            codes = []
            for rec in records:
                code = rec.exit_code
                if code is None:
                    code = self.backend.exit_code(rec)
                    if code is not None:
                        self.store.set_exit_code(job.name, job.group, rec.rank, code)
                codes.append(code)
            running = sum(c is None for c in codes)
            if running and dt > 0:
                self.store.update_job(job.name, attained=job.attained + dt * running)
            self._advance(job, records, codes, now)
        for job in self.store.jobs(("Pending",), targeted=True):
            self._start_if_free(job)

    def _advance(self, job: JobRecord, records, codes: list[int | None], now: float) -> None:
        failed = [(r.rank, c) for r, c in zip(records, codes) if c not in (None, 0, STOPPED)]
        stopped = [r.rank for r, c in zip(records, codes) if c == STOPPED]
        if job.phase in ("Starting", "Running"):
            lost = self._lost_nodes(records, codes)
            if lost:  # not the job's fault: no failure recorded
                self._stop(job, target=None, why=f"node(s) {', '.join(lost)} left the cluster")
                return
            if failed:
                rank, code = failed[0]
                why = "vanished (its launcher was killed)" if code == LOST else f"exited {code}"
                failure = f"replica {rank} {why}"
                # kept in the database too: a server killed now still counts it on restart
                self.store.update_job(job.name, reason=failure)
                self._failure[job.name] = failure
                self.store.add_event(job.name, "ReplicaFailed", failure)
                self._stop(job, target=None, why=failure)
                return
            if stopped:  # checkpointed on a SIGTERM nobody here sent (e.g. its orphan timeout)
                self._stop(
                    job, target=None, why=f"replica {stopped[0]} stopped with a checkpoint (143)"
                )
                return
            if codes and all(c == 0 for c in codes):
                self._finish(job, "Succeeded", None)
                return
            if job.phase == "Starting" and all(c is None for c in codes):
                self.store.update_job(job.name, phase="Running")
            return
        # Stopping
        if any(c is None for c in codes):
            if job.name not in self._cut_short and self._lost_nodes(records, codes):
                self._cut_short.add(job.name)
                soon = now + min(self.config.grace, NODE_LOSS_GRACE)
                self._stop_deadline[job.name] = min(self._stop_deadline.get(job.name, soon), soon)
            if now >= self._stop_deadline.get(job.name, now + 1):
                for rec, code in zip(records, codes):
                    if code is None:
                        self.backend.signal(rec, signal.SIGKILL)
                self.store.add_event(
                    job.name, "Killed", f"no checkpoint within {self.config.grace:g} s: SIGKILL"
                )
                self._stop_deadline[job.name] = now + 3600.0
            return
        self._stop_deadline.pop(job.name, None)
        self.store.add_sample(job.name, SampleRecord(now, 0))  # its allocation's end, charted
        self._cut_short.discard(job.name)
        failure = self._failure.pop(job.name, None) or job.reason
        lost = self._lost_nodes(records, codes)
        if lost and not job.cancel and not (codes and all(c == 0 for c in codes)):
            # its node left (a failure or a drain): a replica that crashed as its peers
            # vanished is no fault of the job's either; on what remains, at once
            self.store.update_job(
                job.name, phase="Pending", allocation=[], target=None, reason=None
            )
            self.store.add_event(
                job.name,
                "NodeLost",
                f"node(s) {', '.join(lost)} left: restarting from its last checkpoint on the "
                "remaining nodes (not counted against its restart budget)",
            )
            self._place_repaired(self.store.job(job.name), records)
            return
        if job.cancel:
            self._finish(job, "Cancelled", "adaptrain delete")
        elif failure is not None:
            failures = job.failures + 1
            limit = int(job.spec.get("max_restarts", self.config.max_restarts))
            if failures > limit:
                self._finish(job, "Failed", f"{failure}; restart budget {limit} used")
                self.store.update_job(job.name, failures=failures)
            else:
                self.store.update_job(
                    job.name,
                    phase="Pending",
                    failures=failures,
                    allocation=[],
                    target=None,
                    reason=None,
                )
                self.store.add_event(
                    job.name,
                    "Restarting",
                    f"from its last checkpoint ({failures} of {limit} restarts)",
                )
                self._place_arrival(self.store.job(job.name))
        elif codes and all(c == 0 for c in codes):
            self._finish(job, "Succeeded", None)
        else:
            self.store.update_job(job.name, phase="Pending", allocation=[])
            if job.target:
                self._start_if_free(self.store.job(job.name))

    def _place_repaired(self, job: JobRecord, records) -> None:
        """A job that lost a node, at once: its replicas on the nodes that remain where they
        were, the lost ones on free slots (its own nodes first, then those with the most free),
        as many as fit if at least ``min_replicas`` do; else as an arrival (the policy's
        ``allocate_job``), or at the next round. Pinned for ``rescale_rounds`` rounds."""
        free = self._free()
        alloc = []
        for rec in records:
            if free.get(rec.node, 0) > 0:
                free[rec.node] -= 1
                alloc.append(rec.node)
        for _ in range(len(records) - len(alloc)):
            spare = [n for n, k in free.items() if k > 0]
            if not spare:
                break
            node = min(spare, key=lambda n: (n not in alloc, -free[n], n))
            free[node] -= 1
            alloc.append(node)
        if alloc and len(alloc) >= int(job.spec.get("min_replicas", 1)):
            self.store.update_job(job.name, target=alloc, rescaled_round=self.round)
            self._start_if_free(self.store.job(job.name))
        else:
            self._place_arrival(job)

    def _lost_nodes(self, records, codes: list[int | None]) -> list[str]:
        """The nodes that left the cluster (gone from the backend's nodes) with a replica of
        these records that ended :data:`LOST`."""
        nodes = self.backend.nodes
        return sorted({r.node for r, c in zip(records, codes) if c == LOST and r.node not in nodes})

    def _finish(self, job: JobRecord, phase: str, reason: str | None) -> None:
        self.store.update_job(
            job.name, phase=phase, reason=reason, finished=time.time(), allocation=[], target=None
        )
        self.store.add_event(job.name, phase, reason or "every replica exited 0")
        self.pending_reason.pop(job.name, None)

    # ---- starting and stopping ------------------------------------------------------------------
    def _used(self, exclude: str | None = None) -> dict[str, Counter]:
        """Slots held per node: by live replicas, and reserved by pending jobs' targets."""
        # (a node may have left while replicas or targets still name it)
        used: dict[str, Counter] = defaultdict(Counter, {n: Counter() for n in self.backend.nodes})
        for job in self.store.jobs(ACTIVE):
            if job.name == exclude:
                continue
            if job.phase == "Pending":
                for node in job.target or ():
                    used[node]["reserved"] += 1
                continue
            for rec in self.store.replicas(job.name, job.group):
                if rec.exit_code is None:
                    used[rec.node][rec.slot] += 1
        return used

    def _free(self, exclude: str | None = None) -> dict[str, int]:
        used = self._used(exclude)
        return {n: cap - sum(used[n].values()) for n, cap in self.capacity.items()}

    def _busy_slots(self, exclude: str) -> dict[str, set[int]]:
        used = self._used(exclude)
        return {n: {s for s in c if s != "reserved"} for n, c in used.items()}

    def _start_if_free(self, job: JobRecord) -> None:
        """Launch a pending job on its target once every slot of it is free (jobs that shrink
        or move release theirs as they exit)."""
        if any(n not in self.backend.nodes for n in job.target or ()):  # a node left
            self.store.update_job(job.name, target=None)
            self._place_arrival(self.store.job(job.name))
            return
        free = self._free(exclude=job.name)
        need = Counter(job.target or [])
        if need and all(free.get(n, 0) >= k for n, k in need.items()):
            self._start(job, list(job.target))

    def _start(self, job: JobRecord, allocation: list[str]) -> None:
        if self.closing:
            return
        group = job.group + 1
        spec = job.spec
        env = {
            **spec.get("env", {}),
            "ADAPTRAIN_JOB_ID": job.name,
            "ADAPTRAIN_CHECKPOINT_PATH": os.path.abspath(self.job_dir(job.name, "checkpoint")),
            "ADAPTRAIN_SHARE_PATH": os.path.abspath(self.job_dir(job.name, "share")),
            "ADAPTRAIN_TENSORBOARD_LOGDIR": os.path.abspath(self.job_dir(job.name, "tensorboard")),
            "ADAPTRAIN_SUPERVISOR_URL": self.url,
            # a restarted server writes its new URL there (see Server.serve)
            "ADAPTRAIN_SUPERVISOR_FILE": os.path.abspath(
                os.path.join(self.config.state_dir, "server.json")
            ),
            "ADAPTRAIN_JOB_TOKEN": job.token,
            "ADAPTRAIN_SCHED_VERSION": _version(),
            "ADAPTRAIN_CHECKPOINT_INTERVAL": repr(self.config.checkpoint_interval),
            "ADAPTRAIN_HINTS_INTERVAL": repr(self.config.hints_interval),
        }
        records = self.backend.launch(
            job.name,
            group,
            allocation,
            spec["command"],
            env,
            cwd=self.job_dir(job.name, "workdir"),
            busy=self._busy_slots(job.name),
        )
        self.store.set_replicas(job.name, group, records)
        self.store.update_job(
            job.name,
            phase="Starting",
            group=group,
            allocation=list(allocation),
            target=None,
            started=job.started or time.time(),
        )
        self.counters["restarts" if group > 0 else "starts"] += 1
        self.store.add_sample(job.name, SampleRecord(time.time(), len(allocation)))
        nodes = ", ".join(f"{n}x{k}" for n, k in Counter(allocation).items())
        self.store.add_event(job.name, "Started", f"group {group}: {len(allocation)} on {nodes}")
        self.pending_reason.pop(job.name, None)

    def _stop(self, job: JobRecord, target: list[str] | None, why: str) -> None:
        for rec in self.store.replicas(job.name, job.group):
            if rec.exit_code is None:
                self.backend.signal(rec, signal.SIGTERM)
        self._stop_deadline[job.name] = time.time() + self.config.grace
        self.store.update_job(job.name, phase="Stopping", target=target)
        self.store.add_event(job.name, "Stopping", why)

    # ---- the policy ---------------------------------------------------------------------------
    def _info(self, job: JobRecord, now: float, capacity: dict[str, int] | None = None):
        capacity = self.capacity if capacity is None else capacity
        total = sum(capacity.values())
        cooldown = (
            job.rescaled_round is not None
            and self.round - job.rescaled_round < self.config.rescale_rounds
        )
        report = job_report(
            submitted=job.submitted,
            attained_service=job.attained,
            spec=job.spec,
            group=job.group,
            hints=job.hints,
            running=job.phase in ("Starting", "Running") or bool(job.target),
            cooldown=cooldown,
            max_nodes=len(capacity),
            max_replicas=total,
        )
        return job_info(report, cluster_replicas=total, now=now)

    def _place_arrival(self, job: JobRecord) -> None:
        """A job that arrives between rounds: the policy's ``allocate_job`` on free slots."""
        free = {n: NodeInfo(k) for n, k in self._free().items() if k > 0}
        if not free:
            self.pending_reason[job.name] = "every slot is taken: waiting for the next round"
            return
        alloc = self.policy.allocate_job(self._info(job, time.time()), free)
        if alloc:
            self.store.update_job(job.name, target=alloc)
            self._start_if_free(self.store.job(job.name))
        else:
            self.pending_reason[job.name] = "no place on the free slots: waiting for the round"

    def policy_round(self) -> None:
        t0 = time.perf_counter()
        now = time.time()
        self.round += 1
        self.store.add_round(
            now, self.round, sum(self.capacity.values()), self.store.live_replicas()
        )
        capacity = dict(self.capacity)
        cluster = dict(capacity)  # (what _info reads: the nodes, before the busy slots go)
        active = self.store.jobs(ACTIVE)
        # running on a node that left: the tick restarts it on what remains (not this round)
        stranded = {
            j.name
            for j in active
            if j.phase in ("Starting", "Running") and any(n not in capacity for n in j.allocation)
        }
        jobs = {
            j.name: j
            for j in active
            if not j.cancel
            and not (j.phase == "Stopping" and not j.target)
            and j.name not in stranded
        }
        stopping_idle = [
            j for j in active if (j.phase == "Stopping" and not j.target) or j.name in stranded
        ]
        for j in stopping_idle:  # failing, cancelled or stranded: slots busy until they exit
            for node in j.allocation:
                if node in capacity:  # (a node that left frees nothing)
                    capacity[node] -= 1
        if not jobs:
            self.round_seconds.append(time.perf_counter() - t0)
            return
        infos, base = {}, {}
        for name, job in jobs.items():
            held = job.target if job.phase in ("Stopping", "Pending") else job.allocation
            held = [n for n in held or () if n in capacity]  # not on nodes that left
            if held:
                base[name] = list(held)
            infos[name] = self._info(job, now, cluster)
        nodes = {n: NodeInfo(max(0, k)) for n, k in capacity.items()}
        alloc = self.policy.optimize(infos, nodes, base, now)
        for name, job in jobs.items():
            new = sorted(alloc.get(name) or [])
            old = sorted(base.get(name, []))
            if new == old:
                if not new:
                    self.pending_reason[name] = self._why_pending(infos[name], cluster)
                continue
            self.counters["rescales"] += 1 if old and new else 0
            self.store.update_job(name, rescaled_round=self.round)
            if job.phase in ("Starting", "Running"):
                what = f"{len(old)} -> {len(new)} replicas" if new else "preempted"
                self._stop(job, target=new or None, why=f"rescale: {what}")
            else:
                self.store.update_job(name, target=new or None)
                if new:
                    self._start_if_free(self.store.job(name))
                else:
                    self.pending_reason[name] = self._why_pending(infos[name], cluster)
        try:
            self.store.save_policy_state(self.policy.state_dict())
        except Exception as exc:  # noqa: BLE001 - the state only warm-starts the next run
            logger.warning("could not save the policy's state: %s", exc)
        self.round_seconds.append(time.perf_counter() - t0)

    def _why_pending(self, info, capacity: dict[str, int]) -> str:
        total = sum(capacity.values())
        if info.min_replicas > total:
            return f"min_replicas={info.min_replicas} exceeds the cluster's {total} slots"
        return (
            f"the policy gave all {total} slots to other jobs this round (min_replicas="
            f"{info.min_replicas}); it waits for slots to free up"
        )

    # ---- start and end of the server -------------------------------------------------------------
    def recover(self) -> None:
        """After a restart: re-adopt the replicas that outlived the old server; the others'
        ends are read from their status files at the next tick."""
        with self.lock:
            for job in self.store.jobs(("Starting", "Running", "Stopping")):
                records = self.store.replicas(job.name, job.group)
                alive = self.backend.adopt([r for r in records if r.exit_code is None])
                self.store.add_event(
                    job.name,
                    "Recovered",
                    f"server restarted: {len(alive)} of {len(records)} replicas re-adopted",
                )
                if job.phase == "Stopping":
                    self._stop_deadline[job.name] = time.time() + self.config.grace

    def shutdown(self, timeout: float | None = None) -> None:
        """SIGTERM/SIGINT of the server: every running job checkpoints and stops, and waits
        as ``Pending`` for the next server on this state directory."""
        timeout = self.config.grace if timeout is None else timeout
        with self.lock:
            self.closing = True
            running = self.store.jobs(("Starting", "Running", "Stopping"))
            for job in running:
                for rec in self.store.replicas(job.name, job.group):
                    if rec.exit_code is None:
                        self.backend.signal(rec, signal.SIGTERM)
        deadline = time.time() + timeout
        while time.time() < deadline:
            with self.lock:
                left = [
                    rec
                    for job in running
                    for rec in self.store.replicas(job.name, job.group)
                    if rec.exit_code is None and self.backend.exit_code(rec) is None
                ]
            if not left:
                break
            time.sleep(0.2)
        with self.lock:
            for job in running:
                for rec in self.store.replicas(job.name, job.group):
                    code = self.backend.exit_code(rec)
                    if code is None:
                        self.backend.signal(rec, signal.SIGKILL)
                        code = -9
                    self.store.set_exit_code(job.name, job.group, rec.rank, code)
                job = self.store.job(job.name)
                if job.phase in TERMINAL:
                    continue
                codes = [r.exit_code for r in self.store.replicas(job.name, job.group)]
                if codes and all(c == 0 for c in codes):
                    self._finish(job, "Succeeded", None)
                elif job.cancel:
                    self._finish(job, "Cancelled", "adaptrain delete")
                else:
                    self.store.update_job(job.name, phase="Pending", allocation=[], target=None)
                    self.store.add_event(
                        job.name, "Suspended", "server stopped: resumes on restart"
                    )
            self.store.save_policy_state(self.policy.state_dict())
        self.policy.close()


def _extract(data_b64: str, dest: str) -> None:
    raw = base64.b64decode(data_b64, validate=True)
    with tarfile.open(fileobj=io.BytesIO(raw), mode="r:gz") as tar:
        tar.extractall(dest, filter="data")


def _version() -> str:
    from adaptrain import __version__

    return __version__
