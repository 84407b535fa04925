"""``adaptrain ray submit``: one elastic adaptrain job on a Ray cluster, any cloud or none.

AdaptDL's ``adaptdl_on_ray_aws``, without the AWS tie. The launcher is the Ray driver: it runs
where you type the command (``-u ray://HEAD:10001`` connects through Ray Client; without
``-u``, Ray's usual address resolution applies) and drives the job until it ends:

1. **Size.** It picks the replica count from the job's goodput model (rank 0's hints) with
   the speedup per replica rule and its margin (:mod:`._launch_policy`), asks Ray's autoscaler
   for that many replica-sized bundles (``ray.autoscaler.sdk.request_resources``) and uses
   what has arrived when they are all there or ``cluster_rescale_timeout`` has passed, the job
   training meanwhile on what it has.
2. **Run.** One :class:`~adaptrain.ray._launch_host.ReplicaHost` actor per node (keyed by Ray
   node ID, pinned there, holding the node's share of CPUs and GPUs) starts that node's
   replicas as ordinary processes with the ``ADAPTRAIN_*`` environment. The working directory
   and the checkpoint to restore travel through Ray's object store: no shared filesystem.
3. **Rescale.** SIGTERM to every replica, adaptrain's checkpoint (rank 0 writes it), exit 143;
   rank 0's host sends the newest checkpoint back to the launcher, which relaunches with the
   new count from it. If it has not arrived within ``checkpoint_timeout`` seconds, the
   replicas are killed and the job restarts from the checkpoint the launcher already holds
   (never from nothing when one exists).
4. **Notices.** A node that will go away (a Ray drain request, ``ray drain-node
   --deadline-remaining-seconds``, as the autoscaler issues for preemptions; or a cloud spot
   notice: AWS IMDSv2 ``spot/instance-action``, GCP ``instance/preempted``, watched on each
   node by its host) makes the job checkpoint before the deadline and continue on the
   remaining nodes; the node is not used again. The autoscaler's request stays, so a
   replacement node, once it joins, is grown onto as in 1.
5. **Failures.** A replica that fails (or is stopped by someone else), or a node lost without
   notice, restarts the job from the newest checkpoint that arrived; after ``max_failures``
   failures in a row with no new checkpoint in between, the launcher gives up with the
   replica's exit status.

Drain requests are read from the GCS with ``ray._private.state.state.get_draining_nodes()``
(what Ray Train's own preemption watcher uses; Ray 2.x has no public API for a node's drain
state), through a zero-CPU task under Ray Client.
"""

from __future__ import annotations

import logging
import math
import os
import re
import secrets
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from adaptrain.ray._launch_host import ReplicaHost
from adaptrain.ray._launch_policy import ScalingRule, plan_placement, replica_capacity

__all__ = ["RayLauncher"]

logger = logging.getLogger(__name__)

_TAR_RE = re.compile(r"^checkpoint-(\d+)\.tar$")


class _StopRequested(Exception):
    """:meth:`RayLauncher.stop` was called."""


class _LaunchFailed(Exception):
    """The hosts started but could not set up or start the replicas."""


@dataclass
class _Host:
    handle: Any
    node_id: str
    ranks: list[int]
    dead: bool = False


@dataclass
class _Group:
    """One launch: the replicas started together, until they stop."""

    index: int
    hosts: list[_Host]
    started: float  # time.monotonic()
    hints_seen: int = 0
    unresponsive: dict[str, int] = field(default_factory=dict)

    @property
    def count(self) -> int:
        return sum(len(h.ranks) for h in self.hosts)

    @property
    def rank0(self) -> _Host:
        return self.hosts[0]

    @property
    def nodes(self) -> dict[str, int]:
        return {h.node_id: len(h.ranks) for h in self.hosts}


@dataclass
class _Outcome:
    kind: str  # done, rescale, notice, lost, failed, stopped
    why: str
    count: int | None = None  # rescale: the new count
    deadline: float | None = None  # notice: time.time() by which the nodes go
    code: int = 0


class RayLauncher:
    """Run ``script`` (with ``args``) as one elastic job on a Ray cluster (see the module doc).

    Args:
        script: the training script, relative to ``working_dir`` (or a path, whose folder is
            the working directory when ``working_dir`` is None).
        args: its command-line arguments.
        max_workers: the most replicas (``-m``).
        address: the Ray cluster (``ray://HOST:PORT`` or a GCS address); None: Ray's default.
        cpus: CPUs per replica.
        gpus: GPUs per replica.
        working_dir: the folder shipped to every node (its ``.gitignore`` honoured, 64 MiB at
            most, packed when the launcher is made); replicas run in a copy of it.
        checkpoint_timeout: seconds from SIGTERM for rank 0's checkpoint to arrive.
        cluster_rescale_timeout: seconds to wait for requested nodes before using what came.
        name: the job's name (``ADAPTRAIN_JOB_ID``); default from the script's.
        env: environment variables for the replicas.
        checkpoint_dir: a local folder where each checkpoint that arrives is kept as
            ``checkpoint-<seq>.tar`` (and the newest restored from at start), or None.
        spot: cloud notices to watch on each node: ``"auto"``, ``"aws"``, ``"gcp"``, ``"off"``.
        aws_metadata_url: AWS metadata base URL (default: each node's
            ``ADAPTRAIN_AWS_METADATA_URL``, else ``http://169.254.169.254``).
        gcp_metadata_url: the same for GCP (``ADAPTRAIN_GCP_METADATA_URL``).
        rule: the replica-count rule (default ``ScalingRule(max_workers)``).
        rescale_interval: seconds a launch runs before the rule may rescale it (notices and
            failures act at once).
        poll_interval: seconds between two looks at the replicas, hints and nodes.
        spot_interval: seconds between two metadata polls on each node.
        max_failures: failures in a row, with no new checkpoint, before giving up.
        start_timeout: seconds for the hosts to start on their nodes (default: at least 30,
            at least ``cluster_rescale_timeout``).
    """

    def __init__(
        self,
        script: str,
        args: Sequence[str] = (),
        *,
        max_workers: int,
        address: str | None = None,
        cpus: float = 1.0,
        gpus: float = 0.0,
        working_dir: str | None = None,
        checkpoint_timeout: float = 120.0,
        cluster_rescale_timeout: float = 60.0,
        name: str | None = None,
        env: Mapping[str, str] | None = None,
        checkpoint_dir: str | None = None,
        spot: str = "auto",
        aws_metadata_url: str | None = None,
        gcp_metadata_url: str | None = None,
        rule: ScalingRule | None = None,
        rescale_interval: float = 60.0,
        poll_interval: float = 1.0,
        spot_interval: float = 5.0,
        max_failures: int = 3,
        start_timeout: float | None = None,
    ) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers={max_workers} must be at least 1")
        if cpus < 0 or gpus < 0 or not (cpus > 0 or gpus > 0):
            raise ValueError(f"cpus={cpus}, gpus={gpus}: a replica needs some CPUs or GPUs")
        if spot not in ("auto", "aws", "gcp", "off"):
            raise ValueError(f"spot={spot!r}: one of auto, aws, gcp, off")
        for what, value in (
            ("checkpoint_timeout", checkpoint_timeout),
            ("cluster_rescale_timeout", cluster_rescale_timeout),
            ("poll_interval", poll_interval),
        ):
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{what}={value} must be a non-negative number of seconds")
        if working_dir is None:
            working_dir = os.path.dirname(os.path.abspath(script))
            script = os.path.basename(script)
        working_dir = os.path.abspath(working_dir)
        if os.path.isabs(script):
            script = os.path.relpath(script, working_dir)
        if script.startswith("..") or not os.path.isfile(os.path.join(working_dir, script)):
            raise ValueError(
                f"{script!r} is not a file inside the working directory {working_dir}: give the "
                "script's path relative to --working-dir"
            )
        self.script = script
        self.args = [str(a) for a in args]
        self.max_workers = int(max_workers)
        self.address = address
        self.cpus = float(cpus)
        self.gpus = float(gpus)
        self.working_dir = working_dir
        self.checkpoint_timeout = float(checkpoint_timeout)
        self.cluster_rescale_timeout = float(cluster_rescale_timeout)
        stem = re.sub(r"[^a-z0-9-]+", "-", os.path.splitext(os.path.basename(script))[0].lower())
        self.name = name or f"{stem.strip('-') or 'job'}-{secrets.token_hex(3)}"
        self.env = dict(env or {})
        self.checkpoint_dir = checkpoint_dir
        self.spot = spot
        self.aws_metadata_url = aws_metadata_url
        self.gcp_metadata_url = gcp_metadata_url
        self.rule = rule or ScalingRule(self.max_workers)
        self.rescale_interval = float(rescale_interval)
        self.poll_interval = float(poll_interval)
        self.spot_interval = float(spot_interval)
        self.max_failures = int(max_failures)
        self.start_timeout = (
            float(start_timeout)
            if start_timeout is not None
            else max(30.0, self.cluster_rescale_timeout)
        )
        from adaptrain.service.snapshot import pack

        #: the working directory as shipped to the nodes (a gzip'd tar)
        self.code = pack(working_dir)
        self._token = secrets.token_urlsafe(24)
        #: ``(time.time(), kind, message)`` of what happened, oldest first.
        self.events: list[tuple[float, str, str]] = []
        #: ``{node_id: replicas}`` of each launch, in order.
        self.launches: list[dict[str, int]] = []
        #: rank 0's newest hints.
        self.hints: dict | None = None
        self.group: _Group | None = None
        self._groups = 0
        self._ckpt: tuple[int, bytes] | None = None
        self._ckpt_ref: Any = None
        self._code_ref: Any = None
        self._excluded: dict[str, str] = {}  # node ID -> why it is not used again
        self._requested: int | None = None
        self._request_time = 0.0
        self._failures = 0
        self._connected_here = False
        self._tasks: dict[Any, Any] = {}  # cluster-side helpers under Ray Client
        self._stop_requested = threading.Event()

    # ----- public ------------------------------------------------------------------------------
    @property
    def checkpoint_seq(self) -> int | None:
        """The number of the newest checkpoint the launcher holds, or None."""
        return None if self._ckpt is None else self._ckpt[0]

    @property
    def checkpoint(self) -> bytes | None:
        """The newest checkpoint the launcher holds, as a tar of its ``checkpoint-<seq>``."""
        return None if self._ckpt is None else self._ckpt[1]

    def stop(self) -> None:
        """Make :meth:`run` (in another thread) stop the job as an interrupt does."""
        self._stop_requested.set()

    def run(self) -> int:
        """Run the job to its end: 0 when rank 0 finished, the failing replica's status after
        ``max_failures``, 130 when interrupted (Ctrl-C, SIGTERM turned into KeyboardInterrupt
        by the caller, or :meth:`stop`: the replicas checkpoint first)."""
        import ray

        self._load_checkpoint_dir()
        if not ray.is_initialized():
            ray.init(address=self.address)
            self._connected_here = True
        try:
            self._code_ref = ray.put(self.code)
            return self._run()
        except (KeyboardInterrupt, _StopRequested):
            self._event("interrupted", "interrupted: stopping the replicas (checkpoint first)")
            if self.group is not None:
                self._stop(self.group, self.checkpoint_timeout, "interrupted")
            return 130
        finally:
            self._teardown()

    # ----- the loop ----------------------------------------------------------------------------
    def _run(self) -> int:
        want = self.rule.target(self.hints, 0, 1)
        self._request(want)
        patient = True  # the first launch waits for the nodes asked for (up to the timeout)
        while True:
            capacity = self._wait_capacity(want, patient)
            size = min(want, sum(capacity.values()), self.max_workers)
            try:
                group = self._launch(size, capacity)
            except _LaunchFailed:
                self._failures += 1
                if self._failures > self.max_failures:
                    self._event("gave-up", f"{self._failures} failed launches: giving up")
                    return 1
                group = None
            if group is None:
                self._sleep(self.poll_interval)
                continue
            outcome = self._watch(group)
            if outcome.kind == "done":
                self._stop(group, self.checkpoint_timeout, outcome.why, final=True)
                self._event("done", f"job finished: {outcome.why}")
                return 0
            budget = self.checkpoint_timeout
            if outcome.deadline is not None:  # leave a second for the transfer's end
                budget = max(0.0, min(budget, outcome.deadline - time.time() - 1.0))
            arrived = self._stop(group, budget, outcome.why)
            if outcome.kind in ("failed", "lost", "stopped"):
                self._failures = 0 if arrived else self._failures + 1
                if self._failures > self.max_failures:
                    self._event(
                        "gave-up",
                        f"{self._failures} failures in a row with no new checkpoint: giving up",
                    )
                    return outcome.code or 1
            if outcome.kind == "rescale" and outcome.count is not None:
                want = outcome.count
            else:  # on what is left, at once; growth comes back through _decide
                want = self.rule.target(self.hints, group.count, self._per_node(capacity))
                self._request(want)
            patient = False

    def _wait_capacity(self, want: int, patient: bool) -> dict[str, int]:
        """The usable nodes: once ``want`` replicas fit or, if not ``patient``, one does; a
        patient wait takes what is there after ``cluster_rescale_timeout``. Waits as long as
        no node fits a replica."""
        start = time.monotonic()
        warned = start
        while True:
            capacity = self._capacity()
            total = min(sum(capacity.values()), self.max_workers)
            waited = time.monotonic() - start
            if total >= want or (
                total > 0 and (not patient or waited >= self.cluster_rescale_timeout)
            ):
                return capacity
            if total == 0 and time.monotonic() - warned >= max(self.cluster_rescale_timeout, 5):
                warned = time.monotonic()
                self._event(
                    "waiting",
                    f"no node fits a replica ({self._bundle()}) after {waited:.0f} s: waiting "
                    "for the autoscaler",
                )
            self._sleep(self.poll_interval)

    def _launch(self, count: int, capacity: dict[str, int]) -> _Group | None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        prefer = self.launches[-1] if self.launches else None
        plan = plan_placement(capacity, count, prefer)
        host_cls = ray.remote(ReplicaHost)
        hosts: list[_Host] = []
        for node_id, k in plan.items():
            handle = host_cls.options(
                num_cpus=self.cpus * k,
                num_gpus=self.gpus * k,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
                max_concurrency=8,
                max_restarts=0,
            ).remote(
                self.name,
                self._token,
                self.spot,
                self.aws_metadata_url,
                self.gcp_metadata_url,
                self.spot_interval,
            )
            hosts.append(_Host(handle, node_id, [0] * k))
        index = self._groups
        group = _Group(index, hosts, time.monotonic())
        self.group = group
        # the hosts that start in time carry the launch; the others are given up
        refs = [h.handle.node.remote() for h in hosts]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.start_timeout)
        ready_set = set(ready)
        up = []
        for h, ref in zip(hosts, refs):
            ok = ref in ready_set
            if ok:
                try:
                    ok = ray.get(ref)["node_id"] == h.node_id
                except ray.exceptions.RayError:
                    ok = False
            if ok:
                up.append(h)
            else:
                h.dead = True
                ray.kill(h.handle)
        if len(up) < len(hosts):
            missing = sorted(h.node_id[:12] for h in hosts if h.dead)
            self._event("partial", f"hosts on nodes {missing} did not start in time: left out")
        if not up:
            self.group = None
            return None
        group.hosts = up
        if self._ckpt is not None and self._ckpt_ref is None:
            self._ckpt_ref = ray.put(self._ckpt[1])
        try:
            infos = ray.get(
                [
                    h.handle.setup.remote(self._code_ref, self._ckpt_ref, i == 0)
                    for i, h in enumerate(up)
                ],
                timeout=self.start_timeout,
            )
            rank = 0
            for h in up:
                h.ranks = list(range(rank, rank + len(h.ranks)))
                rank += len(h.ranks)
            common = {
                **self.env,
                "ADAPTRAIN_JOB_ID": self.name,
                "ADAPTRAIN_JOB_TOKEN": self._token,
                "ADAPTRAIN_MASTER_ADDR": infos[0]["ip"],
                "ADAPTRAIN_MASTER_PORT": str(infos[0]["port"]),
                "ADAPTRAIN_NUM_REPLICAS": str(rank),
                "ADAPTRAIN_NUM_NODES": str(len(up)),
                "ADAPTRAIN_NUM_RESTARTS": str(index),
                "ADAPTRAIN_RAY": "1",
            }
            if self.cpus >= 1:
                common.setdefault("OMP_NUM_THREADS", str(int(self.cpus)))
            ray.get(
                [
                    h.handle.start.remote(
                        self.script,
                        self.args,
                        [
                            {
                                **common,
                                "ADAPTRAIN_REPLICA_RANK": str(r),
                                "ADAPTRAIN_LOCAL_RANK": str(i),
                            }
                            for i, r in enumerate(h.ranks)
                        ],
                    )
                    for h in up
                ],
                timeout=self.start_timeout,
            )
        except ray.exceptions.RayError as exc:
            self._event("launch-failed", f"launch {index} failed: {exc}")
            self._close(group)
            self.group = None
            raise _LaunchFailed from exc
        self._groups += 1
        self.launches.append(group.nodes)
        nodes = ", ".join(f"{n[:12]}x{k}" for n, k in group.nodes.items())
        where = "from the start" if self._ckpt is None else f"from checkpoint {self._ckpt[0]}"
        self._event("launched", f"launch {index}: {group.count} replica(s) on {nodes}, {where}")
        return group

    def _watch(self, group: _Group) -> _Outcome:
        """Poll until the launch must end; what ended it."""
        import ray

        rank0_done_at: float | None = None
        while True:
            self._sleep(self.poll_interval)
            exits: dict[int, int | None] = {}
            notices: dict[str, dict] = {}
            lost: list[str] = []
            refs = [
                h.handle.poll.remote(group.hints_seen if h is group.rank0 else 0)
                for h in group.hosts
            ]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=10.0)
            ready_set = set(ready)
            for h, ref in zip(group.hosts, refs):
                if ref not in ready_set:
                    misses = group.unresponsive.get(h.node_id, 0) + 1
                    group.unresponsive[h.node_id] = misses
                    if misses >= 3:
                        lost.append(h.node_id)
                    continue
                group.unresponsive.pop(h.node_id, None)
                try:
                    state = ray.get(ref)
                except ray.exceptions.RayActorError:
                    h.dead = True
                    lost.append(h.node_id)
                    continue
                exits.update(state["exits"])
                if state.get("notice"):
                    notices[h.node_id] = state["notice"]
                if "hints" in state:
                    group.hints_seen, self.hints = state["hints"]
            draining = self._draining()
            if lost:
                alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
                for n in lost:  # a dead node is not used again; a live one's host just failed
                    if n not in alive:
                        self._excluded[n] = "lost"
                self._event("lost", f"lost the host(s) on node(s) {[n[:12] for n in lost]}")
                return _Outcome("lost", f"lost node(s) {[n[:12] for n in lost]}", code=1)
            for h in group.hosts:
                if h.node_id in draining and h.node_id not in notices:
                    deadline = draining[h.node_id]
                    notices[h.node_id] = {
                        "source": "drain",
                        "deadline": deadline,
                        "detail": "Ray drain request"
                        + ("" if deadline is None else f" ({deadline - time.time():.0f} s left)"),
                    }
            if notices:
                for n, notice in notices.items():
                    self._excluded[n] = notice["detail"]
                deadlines = [x["deadline"] for x in notices.values() if x["deadline"] is not None]
                why = "; ".join(f"{n[:12]}: {x['detail']}" for n, x in notices.items())
                self._event("notice", f"node(s) going away: {why}")
                return _Outcome("notice", why, deadline=min(deadlines) if deadlines else None)
            codes = [exits.get(r) for r in range(group.count)]
            failed = {r: c for r, c in enumerate(codes) if c not in (None, 0, 143)}
            if failed:
                r, c = next(iter(failed.items()))
                self._event("failed", f"rank {r} exited with status {c}")
                return _Outcome("failed", f"rank {r} exited with status {c}", code=c)
            if codes and codes[0] == 0:
                if all(c is not None for c in codes):
                    return _Outcome("done", "every replica exited 0")
                rank0_done_at = rank0_done_at or time.monotonic()
                if time.monotonic() - rank0_done_at > self.checkpoint_timeout:
                    return _Outcome("done", "rank 0 exited 0 (the other replicas stopped)")
                continue
            if any(c == 143 for c in codes):
                return _Outcome("stopped", "replicas were stopped from outside (status 143)")
            if any(c == 0 for c in codes):
                continue  # a replica finished before rank 0: wait for rank 0
            count = self._decide(group, draining)
            if count is not None:
                return _Outcome("rescale", f"rescale {group.count} -> {count}", count=count)

    def _decide(self, group: _Group, draining: Mapping[str, Any]) -> int | None:
        """The rule's new replica count for a running launch, or None to keep it."""
        now = time.monotonic()
        capacity = self._capacity(draining)
        per_node = self._per_node(capacity)
        target = self.rule.target(self.hints, group.count, per_node)
        if target != self._requested:
            self._request(target)
        if now - group.started < self.rescale_interval:
            return None
        total = min(sum(capacity.values()), self.max_workers)
        desired = min(target, total)
        if desired == group.count:
            return None
        if (
            desired > group.count
            and total < target
            and now - self._request_time < self.cluster_rescale_timeout
        ):
            return None  # more nodes are on their way: rescale once, when they are here
        if not self.rule.worth(self.hints, group.count, desired, per_node):
            return None
        s = self.rule.speedup(self.hints, per_node)
        why = (
            "no goodput model yet: exploring"
            if s is None
            else f"speedup {s(group.count):.2f} -> {s(desired):.2f}"
        )
        self._event("rescale", f"rescaling {group.count} -> {desired} replicas ({why})")
        return desired

    def _stop(self, group: _Group, budget: float, why: str, final: bool = False) -> bool:
        """SIGTERM the launch's replicas, wait up to ``budget`` seconds for them and for rank
        0's checkpoint, then kill what is left; whether a new checkpoint arrived. ``final``:
        the job ended (the replicas are gone; only the last checkpoint is fetched)."""
        import ray

        start = time.monotonic()
        end = start + max(0.0, budget)
        live = [h for h in group.hosts if not h.dead]
        for h in live:
            h.handle.terminate.remote()
        rank0_code = None
        while live:
            refs = [h.handle.poll.remote(0) for h in live]
            ready, _ = ray.wait(
                refs, num_returns=len(refs), timeout=max(0.1, end - time.monotonic())
            )
            running = False
            for h, ref in zip(live, refs):
                if ref not in ready:
                    running = True
                    continue
                try:
                    exits = ray.get(ref)["exits"]
                except ray.exceptions.RayActorError:
                    h.dead = True
                    continue
                running = running or any(c is None for c in exits.values())
                if h is group.rank0:
                    rank0_code = exits.get(0)
            if not running or time.monotonic() >= end:
                break
            time.sleep(0.2)
        arrived = False
        after = -1 if self._ckpt is None else self._ckpt[0]
        if not group.rank0.dead:
            try:
                got = ray.get(
                    group.rank0.handle.checkpoint.remote(after),
                    timeout=max(1.0, end - time.monotonic()),
                )
            except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError):
                got = None
            if got is not None:
                self._store_checkpoint(*got)
                arrived = True
        took = time.monotonic() - start
        if arrived:
            when = "at the end" if final else f"{took:.1f} s after SIGTERM"
            self._event("checkpoint", f"checkpoint {self._ckpt[0]} arrived {when}")
        elif not final:
            previous = (
                "from the start (no checkpoint yet)"
                if self._ckpt is None
                else f"from checkpoint {self._ckpt[0]}"
            )
            if rank0_code is None:
                cause = f"rank 0's checkpoint did not arrive within {budget:g} s"
            else:
                cause = f"rank 0 exited ({rank0_code}) with no new checkpoint"
            self._event("no-checkpoint", f"{cause}: restarting {previous}")
        self._close(group)
        self.group = None
        return arrived

    def _close(self, group: _Group) -> None:
        """Kill the launch's replicas, delete its hosts' files, end its actors."""
        import ray

        live = [h for h in group.hosts if not h.dead]
        if live:
            ray.wait([h.handle.close.remote() for h in live], num_returns=len(live), timeout=15)
        for h in group.hosts:
            try:
                ray.kill(h.handle)
            except ray.exceptions.RayError:
                pass

    def _teardown(self) -> None:
        import ray

        try:
            if self.group is not None:
                self._close(self.group)
                self.group = None
            if self._requested:
                self._requested = None
                try:  # withdraw the ask, so that the autoscaler may scale down
                    self._on_cluster(_request_resources, [])
                except Exception as exc:  # noqa: BLE001 - the cluster may be gone
                    logger.warning("could not withdraw the autoscaler request: %s", exc)
        finally:
            if self._connected_here:
                ray.shutdown()
                self._connected_here = False

    # ----- the cluster -------------------------------------------------------------------------
    def _bundle(self) -> dict[str, float]:
        bundle = {}
        if self.cpus > 0:
            bundle["CPU"] = self.cpus
        if self.gpus > 0:
            bundle["GPU"] = self.gpus
        return bundle

    def _on_cluster(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` here, or under Ray Client (whose driver has no GCS connection) in a
        zero-CPU task on the cluster."""
        import ray

        if not ray.util.client.ray.is_connected():
            return fn(*args)
        if fn not in self._tasks:
            self._tasks[fn] = ray.remote(num_cpus=0)(fn)
        return ray.get(self._tasks[fn].remote(*args), timeout=30)

    def _request(self, count: int) -> None:
        """Ask the autoscaler for ``count`` replica-sized bundles (replacing the last ask)."""
        count = max(1, min(int(count), self.max_workers))
        if count == self._requested:
            return
        self._on_cluster(_request_resources, [self._bundle()] * count)
        self._requested = count
        self._request_time = time.monotonic()
        self._event("request", f"asked the autoscaler for {count} x {self._bundle()}")

    def _draining(self) -> dict[str, float | None]:
        """``{node_id: deadline (time.time()) or None}`` of the nodes being drained."""
        try:
            raw = self._on_cluster(_draining_nodes)
        except Exception as exc:  # noqa: BLE001 - a missed poll is retried at the next one
            logger.debug("cannot read the draining nodes: %s", exc)
            return {}
        return {n: (ms / 1000.0 if ms else None) for n, ms in raw.items()}

    def _capacity(self, draining: Mapping[str, Any] | None = None) -> dict[str, int]:
        """``{node_id: replicas that fit}`` over the alive nodes not draining or noticed."""
        import ray

        if draining is None:
            draining = self._draining()
        out = {}
        for node in ray.nodes():
            nid = node["NodeID"]
            if not node.get("Alive") or nid in self._excluded or nid in draining:
                continue
            k = replica_capacity(node.get("Resources", {}), self.cpus, self.gpus)
            if k > 0:
                out[nid] = k
        return out

    @staticmethod
    def _per_node(capacity: Mapping[str, int]) -> int:
        return max(capacity.values(), default=1) or 1

    # ----- checkpoints -------------------------------------------------------------------------
    def _store_checkpoint(self, seq: int, data: bytes) -> None:
        self._ckpt = (int(seq), data)
        self._ckpt_ref = None
        if not self.checkpoint_dir:
            return
        os.makedirs(self.checkpoint_dir, exist_ok=True)
        path = os.path.join(self.checkpoint_dir, f"checkpoint-{seq:06d}.tar")
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        for name in os.listdir(self.checkpoint_dir):
            m = _TAR_RE.match(name)
            if m and int(m.group(1)) < seq:
                os.remove(os.path.join(self.checkpoint_dir, name))

    def _load_checkpoint_dir(self) -> None:
        if not self.checkpoint_dir or not os.path.isdir(self.checkpoint_dir):
            return
        found = [
            (int(m.group(1)), name)
            for name in os.listdir(self.checkpoint_dir)
            if (m := _TAR_RE.match(name))
        ]
        if found:
            seq, name = max(found)
            with open(os.path.join(self.checkpoint_dir, name), "rb") as f:
                self._ckpt = (seq, f.read())
            self._event("restore", f"restoring from {name} in {self.checkpoint_dir}")

    def _sleep(self, seconds: float) -> None:
        if self._stop_requested.wait(seconds):
            raise _StopRequested

    def _event(self, kind: str, message: str) -> None:
        self.events.append((time.time(), kind, message))
        logger.info("%s: %s", self.name, message)


def _request_resources(bundles: list[dict[str, float]]) -> None:
    from ray.autoscaler.sdk import request_resources

    request_resources(bundles=bundles)


def _draining_nodes() -> dict[str, int]:
    """The GCS's draining nodes, ``{node_id_hex: deadline_ms}`` (0: no deadline)."""
    import ray._private.state

    return ray._private.state.state.get_draining_nodes()
