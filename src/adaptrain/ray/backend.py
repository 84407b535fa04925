"""The service's Ray backend: ``adaptrain server --backend ray [--ray-address ADDRESS]``.

The same service, jobs, CLI and policy as the local backend; the cluster is a Ray cluster's
nodes, read from Ray and kept up to date as nodes join and leave:

- nodes are keyed by their Ray node ID, never by IP (several nodes may share one IP); a node's
  slots are its GPUs, or where it has none its CPUs (a node with neither is not offered);
- each allocation becomes a placement group, one bundle per node pinned to it by its
  ``ray.io/node-id`` label (``STRICT_SPREAD`` over several nodes, ``PACK`` on one), so that the
  slots the service uses are taken in Ray's accounting too; it is removed once every replica of
  the allocation has ended;
- a small agent actor per node (:class:`~adaptrain.ray._agent.Agent`, no CPUs of its own)
  starts each replica there as a real process under :mod:`adaptrain.service.launcher`, with the
  ``ADAPTRAIN_*`` environment: the user's code never runs inside a Ray task. The agent of rank
  0's node reports rank 0's address (its IP and a free port); SIGTERM on a rescale goes through
  the agent to the launcher and on to the command;
- checkpoints, share folders, logs and status files live under the server's state directory,
  which every node must see at the same path (a shared filesystem; on one machine, a local
  folder); every node runs the same Python environment, with adaptrain installed (the agents
  and the replicas' launchers import it);
- a node that leaves (Ray marks it dead: a failure, or a drain) is dropped from :attr:`nodes`
  and its running replicas read as :data:`~adaptrain.service.backend.LOST` (those that had
  finished, as finished); the controller then restarts the job from its last checkpoint on the
  remaining nodes at once, without counting it against the job's restart budget. The replicas
  of a node that leaves end: on a machine that failed with it, and on a drained node (or a
  node emulated on a shared machine) by their launchers, which pass SIGTERM on to them as soon
  as the node's agent is gone.
  A node that joins is offered once its agent has started: at the next round.

Replicas outlive a ``kill -9`` of the server as with the local backend: agents and placement
groups are detached, named after the state directory, and a server restarted on it finds them
and re-adopts the replicas that still run.
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import socket
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from adaptrain.service.backend import LOST, Node, replica_file
from adaptrain.service.config import is_loopback
from adaptrain.service.store import ReplicaRecord

from ._agent import Agent, Key

logger = logging.getLogger(__name__)

__all__ = ["INSTALL_HINT", "RayBackend", "import_ray"]

INSTALL_HINT = "the Ray backend needs Ray: pip install 'adaptrain[ray]'"

#: the label Ray gives every node: its node ID
NODE_ID_LABEL = "ray.io/node-id"


def import_ray():
    """The ``ray`` module, or an ImportError that says how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise ImportError(f"{INSTALL_HINT} ({exc})") from exc
    return ray


def _check_reachable(address: str | None, timeout: float = 5.0) -> None:
    """A ConnectionError at once if nothing listens at a ``HOST:PORT`` address (``ray.init``
    would retry for minutes); other forms (``auto``, ``ray://``, none) are left to Ray."""
    if not address or "://" in address or address in ("auto", "local") or ":" not in address:
        return
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            pass
    except ValueError:
        return
    except OSError as exc:
        raise ConnectionError(
            f"no Ray cluster answers at {address} ({exc}); start one with `ray start --head` "
            "or give its address (--ray-address HOST:PORT, the GCS port: 6379 by default)"
        ) from None


@dataclass
class _AgentHandle:
    node: str
    actor: Any
    info_ref: Any = None
    info: dict | None = None
    poll_ref: Any = None
    poll_sent: float = 0.0
    #: the last poll's answer and when that poll was sent
    view: dict[Key, int | None] | None = None
    view_time: float = 0.0
    forget: list[Key] = field(default_factory=list)


class RayBackend:
    """Starts, signals and watches replicas on a Ray cluster's nodes (see the module
    docstring). ``run_dir``: the state directory's ``runs`` folder (logs, exit statuses);
    ``address``: the cluster (``None``: ``RAY_ADDRESS`` or a running local cluster, as
    ``ray.init`` finds it; ignored when Ray is already initialised in this process);
    ``key``: what names this server's agents and placement groups (the state directory);
    ``poll_interval``: seconds between reads of the cluster and the agents; ``wait_nodes``:
    seconds to wait at start for a node with slots."""

    name = "ray"

    def __init__(
        self,
        run_dir: str,
        address: str | None = None,
        *,
        key: str | None = None,
        orphan_timeout: float = 600.0,
        poll_interval: float = 0.5,
        wait_nodes: float = 60.0,
        placement_timeout: float = 20.0,
    ) -> None:
        ray = import_ray()
        self._ray = ray
        self.run_dir = os.path.abspath(run_dir)
        os.makedirs(self.run_dir, exist_ok=True)
        digest = hashlib.sha1(os.path.abspath(key or run_dir).encode()).hexdigest()[:12]
        self.namespace = f"adaptrain-{digest}"
        self.orphan_timeout = orphan_timeout
        self.poll_interval = poll_interval
        self.placement_timeout = placement_timeout
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            _check_reachable(address)
            ray.init(
                address=address,
                namespace=self.namespace,
                log_to_driver=False,
                logging_level=logging.WARNING,
            )
        self.nodes: Mapping[str, Node] = {}
        self._slots: dict[str, tuple[int | None, ...]] = {}
        self._alive: set[str] = set()
        self._agents: dict[str, _AgentHandle] = {}
        self._final: dict[Key, int] = {}
        self._launched: dict[Key, float] = {}
        #: each allocation's placement group and the replicas of it not known to have ended
        self._groups: dict[tuple[str, int], tuple[Any, set[Key]]] = {}
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._my_ip = ray.util.get_node_ip_address()
        self._agent_cls = ray.remote(Agent)
        deadline = time.monotonic() + wait_nodes
        while True:
            self.refresh(wait=min(2.0, max(0.1, deadline - time.monotonic())))
            if self.nodes or time.monotonic() >= deadline:
                break
        if not self.nodes:
            self.close()
            raise RuntimeError(
                f"no node of the Ray cluster has GPUs or CPUs to offer (waited {wait_nodes:g} s)"
            )
        self._thread = threading.Thread(target=self._loop, daemon=True, name="ray-backend")
        self._thread.start()

    # ---- the cluster ------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.wait(self.poll_interval):
            try:
                self.refresh(wait=min(1.0, 2 * self.poll_interval))
            except Exception:  # noqa: BLE001 - the watch must outlive one bad read
                logger.exception("reading the Ray cluster failed (retrying)")

    def refresh(self, wait: float = 1.0) -> None:
        """Read the cluster's nodes, start agents on new ones, poll the agents (waiting up to
        ``wait`` seconds for their answers) and update :attr:`nodes`."""
        ray = self._ray
        alive: dict[str, tuple[int | None, ...]] = {}
        for n in ray.nodes():
            if not n.get("Alive"):
                continue
            res = n.get("Resources") or {}
            gpus, cpus = int(res.get("GPU", 0)), int(res.get("CPU", 0))
            slots: tuple[int | None, ...] = tuple(range(gpus)) if gpus else (None,) * cpus
            alive[n["NodeID"]] = slots
        with self._lock:
            left = [n for n in self._alive if n not in alive]
            self._alive = set(alive)
            self._slots.update(alive)
            for node in left:
                handle = self._agents.pop(node, None)
                if handle is not None:
                    logger.warning("Ray node %s left: its replicas are lost", node)
            for node, slots in alive.items():
                if slots and node not in self._agents:
                    self._agents[node] = self._start_agent(node)
            handles = list(self._agents.values())
        # answers from the agents (outside the lock: the controller's calls go on meanwhile)
        now = time.monotonic()
        refs = []
        for h in handles:
            if h.info is None and h.info_ref is None:  # its last answer failed: ask again
                h.info_ref = h.actor.info.remote()
            if h.info is None:
                refs.append(h.info_ref)
            elif h.info is not None and h.poll_ref is None:
                if h.forget:
                    h.actor.forget.remote(h.forget)
                    h.forget = []
                h.poll_ref, h.poll_sent = h.actor.poll.remote(), now
                refs.append(h.poll_ref)
            elif h.poll_ref is not None:
                refs.append(h.poll_ref)
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=wait)
        for h in handles:
            try:
                if h.info is None and h.info_ref is not None:
                    if ray.wait([h.info_ref], timeout=0)[0]:
                        h.info, h.info_ref = ray.get(h.info_ref), None
                        logger.info("Ray node %s (%s): agent ready", h.node, h.info.get("ip"))
                elif h.poll_ref is not None and ray.wait([h.poll_ref], timeout=0)[0]:
                    view = ray.get(h.poll_ref)
                    with self._lock:
                        h.view, h.view_time, h.poll_ref = view, h.poll_sent, None
            except ray.exceptions.RayActorError as exc:
                with self._lock:
                    if self._agents.get(h.node) is h:
                        del self._agents[h.node]
                        logger.warning("the agent of Ray node %s died (%s)", h.node, exc)
                    h.info = None
            except ray.exceptions.RayError as exc:
                logger.warning("Ray node %s: its agent did not answer (%s)", h.node, exc)
                h.poll_ref = h.info_ref = None
        with self._lock:
            nodes = {
                n: Node(n, self._slots[n])
                for n, h in sorted(self._agents.items())
                if h.info is not None and n in self._alive and self._slots.get(n)
            }
            joined = set(nodes) - set(self.nodes)
            for n in sorted(joined):
                logger.info("Ray node %s offers %d slots", n, len(nodes[n].slots))
            self.nodes = nodes

    def _start_agent(self, node: str) -> _AgentHandle:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        actor = self._agent_cls.options(
            name=f"agent-{node}",
            namespace=self.namespace,
            lifetime="detached",
            get_if_exists=True,
            num_cpus=0,
            max_concurrency=4,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
        ).remote(self.orphan_timeout)
        return _AgentHandle(node, actor, info_ref=actor.info.remote())

    # ---- launching --------------------------------------------------------------------------
    def log_path(self, job: str, group: int, rank: int) -> str:
        return replica_file(self.run_dir, job, group, rank, ".log")

    def status_path(self, job: str, group: int, rank: int) -> str:
        return replica_file(self.run_dir, job, group, rank, ".status")

    def _pg_name(self, job: str, group: int) -> str:
        return f"{self.namespace}:{job}:g{group}"

    def launch(
        self,
        job: str,
        group: int,
        allocation: Sequence[str],
        command: Sequence[str],
        env: Mapping[str, str],
        cwd: str,
        busy: Mapping[str, set[int]],
    ) -> list[ReplicaRecord]:
        """Reserve the allocation as a placement group and start one replica per entry of
        ``allocation`` (Ray node IDs, rank order) through the nodes' agents; their records."""
        ray = self._ray
        from ray.util.placement_group import placement_group, remove_placement_group

        nodes = list(dict.fromkeys(allocation))
        with self._lock:
            agents = {n: self._agents.get(n) for n in nodes}
            missing = [n for n, h in agents.items() if h is None or h.info is None]
            if missing:
                raise RuntimeError(f"Ray node(s) {', '.join(missing)} are not available")
            slots = {n: self._slots[n] for n in nodes}
        counts = Counter(allocation)
        gpus = {n: slots[n][0] is not None for n in nodes}
        bundles = [{"GPU" if gpus[n] else "CPU": float(counts[n])} for n in nodes]
        pg = placement_group(
            bundles,
            strategy="STRICT_SPREAD" if len(nodes) > 1 else "PACK",
            name=self._pg_name(job, group),
            lifetime="detached",
            bundle_label_selector=[{NODE_ID_LABEL: n} for n in nodes],
        )
        records: list[ReplicaRecord] = []
        try:
            t0 = time.monotonic()
            ready_ref, deadline = pg.ready(), t0 + self.placement_timeout
            while not ray.wait([ready_ref], timeout=0.25)[0]:
                with self._lock:
                    left = [n for n in nodes if n not in self._alive or n not in self._agents]
                if left:
                    raise RuntimeError(f"job {job}: Ray node(s) {', '.join(left)} left")
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"job {job}: Ray could not reserve {dict(counts)} within "
                        f"{self.placement_timeout:g} s (other Ray work holds those resources?)"
                    )
            t_placed = time.monotonic()
            master_ip, port = ray.get(agents[nodes[0]].actor.address.remote(), timeout=30)
            renv_base = dict(env)
            url = renv_base.get("ADAPTRAIN_SUPERVISOR_URL")
            used = {n: set(busy.get(n, ())) for n in nodes}
            local_rank: Counter = Counter()
            specs: dict[str, list[dict]] = {n: [] for n in nodes}
            for rank, node in enumerate(allocation):
                slot = next(i for i in range(len(slots[node])) if i not in used[node])
                used[node].add(slot)
                renv = dict(renv_base)
                renv.update(
                    {
                        "ADAPTRAIN_MASTER_ADDR": master_ip,
                        "ADAPTRAIN_MASTER_PORT": str(port),
                        "ADAPTRAIN_NUM_NODES": str(len(nodes)),
                        "ADAPTRAIN_NUM_REPLICAS": str(len(allocation)),
                        "ADAPTRAIN_REPLICA_RANK": str(rank),
                        "ADAPTRAIN_LOCAL_RANK": str(local_rank[node]),
                        "ADAPTRAIN_NUM_RESTARTS": str(group),
                        "ADAPTRAIN_RAY": "1",
                        "ADAPTRAIN_RAY_NODE_ID": node,
                        "PYTHONUNBUFFERED": "1",
                    }
                )
                if url:
                    renv["ADAPTRAIN_SUPERVISOR_URL"] = self._reachable(url, agents[node].info)
                local_rank[node] += 1
                gpu = slots[node][slot]
                if gpu is not None:
                    renv["CUDA_VISIBLE_DEVICES"] = str(gpu)
                specs[node].append(
                    {
                        "key": (job, group, rank),
                        "command": list(command),
                        "env": renv,
                        "cwd": cwd,
                        "log": self.log_path(job, group, rank),
                        "status": self.status_path(job, group, rank),
                        "slot": slot,
                    }
                )
            os.makedirs(os.path.join(self.run_dir, job), exist_ok=True)
            refs = {n: agents[n].actor.launch.remote(specs[n]) for n in nodes}
            started: dict[Key, tuple[int, float | None]] = {}
            error: Exception | None = None
            for n, ref in refs.items():
                try:
                    for spec, got in zip(specs[n], ray.get(ref, timeout=60)):
                        started[spec["key"]] = got
                except Exception as exc:  # noqa: BLE001 - the others are stopped below
                    error = error or exc
            now = time.monotonic()
            with self._lock:
                for n in nodes:
                    for spec in specs[n]:
                        key = spec["key"]
                        if key in started:
                            pid, created = started[key]
                            self._launched[key] = now
                            records.append(
                                ReplicaRecord(job, group, key[2], n, spec["slot"], pid, created)
                            )
                self._groups[job, group] = (pg, set(started))
            if error is not None:
                raise RuntimeError(f"job {job}: starting its replicas failed: {error}")
            logger.debug(
                "job %s group %d: %d replicas started in %.2f s (placement group %.2f s)",
                job, group, len(records), now - t0, t_placed - t0,
            )  # fmt: skip
            records.sort(key=lambda r: r.rank)
            return records
        except BaseException:
            for rec in records:
                self.signal(rec, signal.SIGKILL)
            with self._lock:
                self._groups.pop((job, group), None)
            remove_placement_group(pg)
            raise

    def _reachable(self, url: str, info: dict) -> str:
        """The supervisor's URL as a replica on the node of ``info`` reaches it: a loopback
        host is replaced by this server's node IP for a replica on another machine (the server
        must then listen there: ``--host 0.0.0.0`` with a token)."""
        parts = urlsplit(url)
        host = parts.hostname or ""
        if not is_loopback(host) or info.get("ip") in (self._my_ip, host):
            return url
        netloc = f"{self._my_ip}:{parts.port}" if parts.port else self._my_ip
        return urlunsplit(parts._replace(netloc=netloc))

    # ---- watching ---------------------------------------------------------------------------
    def _read_status(self, rec: ReplicaRecord) -> int:
        import json

        try:
            with open(self.status_path(rec.job, rec.group, rec.rank)) as f:
                return int(json.load(f)["exit_code"])
        except (OSError, ValueError, KeyError):
            return LOST

    def exit_code(self, rec: ReplicaRecord) -> int | None:
        """How the replica ended (its command's exit status; :data:`LOST` if its node left or
        it vanished without a status), ``None`` while it runs."""
        key = (rec.job, rec.group, rec.rank)
        with self._lock:
            if key in self._final:
                return self._final[key]
            handle = self._agents.get(rec.node)
            if rec.node in self._alive and handle is not None:
                if handle.info is None or handle.view is None:
                    return None  # its agent is starting, or has not answered yet
                if handle.view_time < self._launched.get(key, 0.0):
                    return None  # the last answer predates the launch
                if key in handle.view:
                    code = handle.view[key]
                    if code is None:
                        return None
                else:  # an agent that never knew it (it replaced one that died)
                    code = self._read_status(rec)
            elif rec.node in self._alive:
                return None  # its agent died: a new one starts at the next read
            else:  # the node left: lost, unless the replica had finished before
                code = 0 if self._read_status(rec) == 0 else LOST
            self._final[key] = code
            if handle is not None:
                handle.forget.append(key)
            self._ended(rec.job, rec.group)
            return code

    def _ended(self, job: str, group: int) -> None:
        """Remove a group's placement group once every replica of it has ended."""
        got = self._groups.get((job, group))
        if got is None:
            return
        pg, keys = got
        keys.difference_update(self._final)
        if not keys:
            del self._groups[job, group]
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(pg)
            except Exception as exc:  # noqa: BLE001 - already gone
                logger.debug("placement group of %s g%d: %s", job, group, exc)

    def signal(self, rec: ReplicaRecord, sig: int) -> None:
        """``sig`` to the replica through its node's agent (SIGTERM/SIGINT to the launcher,
        which passes it on; SIGKILL to the replica's whole session); nothing if the node left."""
        with self._lock:
            handle = self._agents.get(rec.node)
        if handle is None or handle.info is None:
            return
        try:
            handle.actor.signal.remote((rec.job, rec.group, rec.rank), int(sig))
        except Exception as exc:  # noqa: BLE001 - a dying agent: its replicas end with it
            logger.debug("signal to %s on %s: %s", rec.job, rec.node, exc)

    def adopt(self, records: Sequence[ReplicaRecord]) -> list[ReplicaRecord]:
        """The records of replicas still alive, by their agents' word (a restarted server
        takes them over); the placement groups of their allocations are found by name."""
        ray = self._ray
        records = list(records)
        with self._lock:
            handles = {r.node: self._agents.get(r.node) for r in records}
        views: dict[str, dict] = {}
        for node, h in handles.items():
            if h is None or h.info is None:
                continue
            try:
                views[node] = ray.get(h.actor.poll.remote(), timeout=30)
            except ray.exceptions.RayError as exc:
                logger.warning("Ray node %s: its agent did not answer (%s)", node, exc)
        alive = [
            r
            for r in records
            if (r.job, r.group, r.rank) in views.get(r.node, {})
            and views[r.node][(r.job, r.group, r.rank)] is None
        ]
        names = {self._pg_name(r.job, r.group): (r.job, r.group) for r in records}
        from ray.util.placement_group import PlacementGroup, remove_placement_group

        try:
            table = ray.util.placement_group_table()
        except Exception:  # noqa: BLE001 - only the reservations are at stake
            table = {}
        with self._lock:
            now = time.monotonic()
            for r in records:
                self._launched[r.job, r.group, r.rank] = now - 1.0
            for pg_id, entry in table.items():
                name = entry.get("name") or ""
                if not name.startswith(f"{self.namespace}:") or entry.get("state") == "REMOVED":
                    continue
                pg = PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id)))
                if name in names:
                    job, group = names[name]
                    keys = {
                        (r.job, r.group, r.rank)
                        for r in records
                        if (r.job, r.group) == (job, group)
                    }
                    self._groups[job, group] = (pg, keys)
                else:
                    remove_placement_group(pg)  # a stale reservation
        return alive

    # ---- the end ----------------------------------------------------------------------------
    def close(self) -> None:
        """Stop watching, remove this server's placement groups and agents (the server has
        stopped its replicas), and leave Ray if this backend joined it."""
        ray = self._ray
        self._stop.set()
        thread = getattr(self, "_thread", None)
        if thread is not None:
            thread.join(timeout=10)
        from ray.util.placement_group import remove_placement_group

        with self._lock:
            groups, self._groups = list(self._groups.values()), {}
            agents, self._agents = list(self._agents.values()), {}
        for pg, _ in groups:
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001
                pass
        for h in agents:
            try:
                ray.kill(h.actor, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
