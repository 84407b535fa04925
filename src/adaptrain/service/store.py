"""The service's state in SQLite: jobs, their replicas, their events and the policy's state.

One database file under the state directory, in WAL mode (readers never wait for the writer),
one transaction per state change, so a ``kill -9`` at any moment leaves the last committed
state. The schema carries a version; :data:`MIGRATIONS` brings an older file up to date.
"""

from __future__ import annotations

import json
import pickle
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "MIGRATIONS",
    "ROUNDS_KEPT",
    "SAMPLES_PER_JOB",
    "SCHEMA_VERSION",
    "JobRecord",
    "ReplicaRecord",
    "RoundRecord",
    "SampleRecord",
    "Store",
]

MIGRATIONS: list[str] = [
    # version 1
    """
    CREATE TABLE jobs (
        name TEXT PRIMARY KEY,
        spec TEXT NOT NULL,
        token TEXT NOT NULL,
        phase TEXT NOT NULL,
        reason TEXT,
        submitted REAL NOT NULL,
        started REAL,
        finished REAL,
        grp INTEGER NOT NULL DEFAULT -1,
        failures INTEGER NOT NULL DEFAULT 0,
        allocation TEXT NOT NULL DEFAULT '[]',
        target TEXT,
        hints TEXT,
        hints_time REAL,
        attained REAL NOT NULL DEFAULT 0,
        rescaled_round INTEGER,
        cancel INTEGER NOT NULL DEFAULT 0
    );
    CREATE INDEX jobs_phase ON jobs (phase);
    CREATE TABLE replicas (
        job TEXT NOT NULL,
        grp INTEGER NOT NULL,
        rank INTEGER NOT NULL,
        node TEXT NOT NULL,
        slot INTEGER NOT NULL,
        pid INTEGER,
        create_time REAL,
        exit_code INTEGER,
        PRIMARY KEY (job, grp, rank)
    );
    CREATE TABLE events (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        job TEXT NOT NULL,
        time REAL NOT NULL,
        kind TEXT NOT NULL,
        message TEXT NOT NULL
    );
    CREATE INDEX events_job ON events (job, id);
    CREATE TABLE policy (id INTEGER PRIMARY KEY CHECK (id = 1), state BLOB NOT NULL);
    """,
    # version 2: the dashboard's history, a job's hints over time and the cluster's rounds
    """
    CREATE TABLE samples (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        job TEXT NOT NULL,
        time REAL NOT NULL,
        replicas INTEGER NOT NULL,
        batch_size INTEGER,
        gain REAL,
        goodput REAL,
        throughput REAL
    );
    CREATE INDEX samples_job ON samples (job, id);
    CREATE TABLE rounds (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        time REAL NOT NULL,
        round INTEGER NOT NULL,
        used INTEGER NOT NULL,
        total INTEGER NOT NULL,
        held TEXT NOT NULL
    );
    """,
]
SCHEMA_VERSION = len(MIGRATIONS)
#: samples kept per job (the oldest go first): 16 hours of hints posted every 30 s
SAMPLES_PER_JOB = 2000
#: policy rounds kept (the oldest go first): a week of rounds a minute apart
ROUNDS_KEPT = 10_000
#: prune the history once every that many rows written (a row id multiple of it)
_PRUNE_EVERY = 64


@dataclass
class JobRecord:
    """A job as stored (``spec`` without its working copy)."""

    name: str
    spec: dict[str, Any]
    token: str
    phase: str
    submitted: float
    reason: str | None = None
    started: float | None = None
    finished: float | None = None
    group: int = -1
    failures: int = 0
    allocation: list[str] = field(default_factory=list)
    target: list[str] | None = None
    hints: dict[str, Any] | None = None
    hints_time: float | None = None
    attained: float = 0.0
    rescaled_round: int | None = None
    cancel: bool = False


@dataclass
class ReplicaRecord:
    job: str
    group: int
    rank: int
    node: str
    slot: int
    pid: int | None = None
    create_time: float | None = None
    exit_code: int | None = None


@dataclass
class SampleRecord:
    """What a job reported at ``time`` (its hints), with the replicas it held then; or, the
    rest ``None``, its replica count as its replicas started or all ended (0)."""

    time: float
    replicas: int
    batch_size: int | None = None
    gain: float | None = None
    goodput: float | None = None
    throughput: float | None = None


@dataclass
class RoundRecord:
    """The cluster at the start of policy round ``round``: ``used`` of ``total`` slots held by
    live replicas, ``held`` per job."""

    time: float
    round: int
    used: int
    total: int
    held: dict[str, int] = field(default_factory=dict)


_JOB_COLUMNS = (
    "name, spec, token, phase, reason, submitted, started, finished, grp, failures, allocation, "
    "target, hints, hints_time, attained, rescaled_round, cancel"
)


def _job(row: tuple) -> JobRecord:
    return JobRecord(
        name=row[0],
        spec=json.loads(row[1]),
        token=row[2],
        phase=row[3],
        reason=row[4],
        submitted=row[5],
        started=row[6],
        finished=row[7],
        group=row[8],
        failures=row[9],
        allocation=json.loads(row[10]),
        target=None if row[11] is None else json.loads(row[11]),
        hints=None if row[12] is None else json.loads(row[12]),
        hints_time=row[13],
        attained=row[14],
        rescaled_round=row[15],
        cancel=bool(row[16]),
    )


class Store:
    """The state database at ``path`` (created and migrated on open)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.RLock()
        self._sample_count: dict[str, int] = {}
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA foreign_keys=ON")
        self._migrate()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """One atomic state change (nested calls join the outer one)."""
        with self._lock:
            if self._db.in_transaction:
                yield self._db
                return
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _migrate(self) -> None:
        with self.transaction() as db:
            db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT)")
            row = db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
            version = int(row[0]) if row else 0
            if version > SCHEMA_VERSION:
                raise RuntimeError(
                    f"state database {self.path} has schema version {version}, newer than this "
                    f"adaptrain's {SCHEMA_VERSION}: upgrade adaptrain or use another --state-dir"
                )
            for script in MIGRATIONS[version:]:
                for statement in script.split(";"):
                    if statement.strip():
                        db.execute(statement)
            db.execute(
                "INSERT OR REPLACE INTO meta (key, value) VALUES ('schema_version', ?)",
                (str(SCHEMA_VERSION),),
            )

    # ---- jobs ---------------------------------------------------------------------------
    def add_job(self, job: JobRecord) -> None:
        with self.transaction() as db:
            db.execute(
                f"INSERT INTO jobs ({_JOB_COLUMNS}) VALUES ({', '.join('?' * 17)})",
                (
                    job.name,
                    json.dumps(job.spec),
                    job.token,
                    job.phase,
                    job.reason,
                    job.submitted,
                    job.started,
                    job.finished,
                    job.group,
                    job.failures,
                    json.dumps(job.allocation),
                    None if job.target is None else json.dumps(job.target),
                    None if job.hints is None else json.dumps(job.hints),
                    job.hints_time,
                    job.attained,
                    job.rescaled_round,
                    int(job.cancel),
                ),
            )

    def has_job(self, name: str) -> bool:
        with self._lock:
            return (
                self._db.execute("SELECT 1 FROM jobs WHERE name = ?", (name,)).fetchone()
                is not None
            )

    def job(self, name: str) -> JobRecord | None:
        with self._lock:
            row = self._db.execute(
                f"SELECT {_JOB_COLUMNS} FROM jobs WHERE name = ?", (name,)
            ).fetchone()
        return None if row is None else _job(row)

    def jobs(
        self, phases: tuple[str, ...] | None = None, *, targeted: bool = False
    ) -> list[JobRecord]:
        """The jobs in ``phases`` (all when None), oldest first; ``targeted``: only those
        given a target allocation."""
        where, args = [], list(phases or ())
        if phases is not None:
            where.append(f"phase IN ({', '.join('?' * len(phases))})")
        if targeted:
            where.append("target IS NOT NULL AND target != '[]'")
        sql = f"SELECT {_JOB_COLUMNS} FROM jobs"
        if where:
            sql += " WHERE " + " AND ".join(where)
        with self._lock:
            rows = self._db.execute(sql + " ORDER BY submitted, name", args).fetchall()
        return [_job(r) for r in rows]

    def update_job(self, name: str, **fields: Any) -> None:
        """Set ``fields`` of job ``name`` (JSON columns given as Python values)."""
        if not fields:
            return
        columns = {"group": "grp"}
        sets, values = [], []
        for key, value in fields.items():
            if key in ("allocation", "hints", "target", "spec") and value is not None:
                value = json.dumps(value)
            if key == "cancel":
                value = int(value)
            sets.append(f"{columns.get(key, key)} = ?")
            values.append(value)
        with self.transaction() as db:
            db.execute(f"UPDATE jobs SET {', '.join(sets)} WHERE name = ?", (*values, name))

    def live_replicas(self) -> dict[str, int]:
        """Per job, its replicas of the current group not known to have exited."""
        with self._lock:
            rows = self._db.execute(
                "SELECT r.job, COUNT(*) FROM replicas r JOIN jobs j ON j.name = r.job "
                "AND j.grp = r.grp WHERE r.exit_code IS NULL GROUP BY r.job"
            ).fetchall()
        return dict(rows)

    def token_of(self, name: str) -> str | None:
        with self._lock:
            row = self._db.execute("SELECT token FROM jobs WHERE name = ?", (name,)).fetchone()
        return None if row is None else row[0]

    # ---- replicas -------------------------------------------------------------------------
    def set_replicas(self, job: str, group: int, replicas: list[ReplicaRecord]) -> None:
        with self.transaction() as db:
            db.execute("DELETE FROM replicas WHERE job = ? AND grp = ?", (job, group))
            db.executemany(
                "INSERT INTO replicas (job, grp, rank, node, slot, pid, create_time, exit_code) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                [
                    (r.job, r.group, r.rank, r.node, r.slot, r.pid, r.create_time, r.exit_code)
                    for r in replicas
                ],
            )

    def replicas(self, job: str, group: int) -> list[ReplicaRecord]:
        with self._lock:
            rows = self._db.execute(
                "SELECT job, grp, rank, node, slot, pid, create_time, exit_code FROM replicas "
                "WHERE job = ? AND grp = ? ORDER BY rank",
                (job, group),
            ).fetchall()
        return [ReplicaRecord(*r) for r in rows]

    def set_exit_code(self, job: str, group: int, rank: int, code: int) -> None:
        with self.transaction() as db:
            db.execute(
                "UPDATE replicas SET exit_code = ? WHERE job = ? AND grp = ? AND rank = ?",
                (code, job, group, rank),
            )

    # ---- events ---------------------------------------------------------------------------
    def add_event(self, job: str, kind: str, message: str, when: float | None = None) -> None:
        with self.transaction() as db:
            db.execute(
                "INSERT INTO events (job, time, kind, message) VALUES (?, ?, ?, ?)",
                (job, time.time() if when is None else when, kind, message),
            )

    def events(self, job: str, limit: int = 1000) -> list[tuple[float, str, str]]:
        with self._lock:
            rows = self._db.execute(
                "SELECT time, kind, message FROM (SELECT id, time, kind, message FROM events "
                "WHERE job = ? ORDER BY id DESC LIMIT ?) ORDER BY id",
                (job, limit),
            ).fetchall()
        return [tuple(r) for r in rows]

    # ---- the policy's state ---------------------------------------------------------------
    def save_policy_state(self, state: dict[str, Any]) -> None:
        """The policy's ``state_dict`` (numpy arrays and generator states: pickled; the file is
        the server's own, under its state directory)."""
        blob = pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)
        with self.transaction() as db:
            db.execute("INSERT OR REPLACE INTO policy (id, state) VALUES (1, ?)", (blob,))

    def policy_state(self) -> dict[str, Any] | None:
        with self._lock:
            row = self._db.execute("SELECT state FROM policy WHERE id = 1").fetchone()
        return None if row is None else pickle.loads(row[0])

    # ---- the dashboard's history ------------------------------------------------------------
    def add_sample(self, job: str, sample: SampleRecord, keep: int = SAMPLES_PER_JOB) -> None:
        """Append a sample of job ``job``; beyond ``keep`` samples the oldest go."""
        with self.transaction() as db:
            db.execute(
                "INSERT INTO samples (job, time, replicas, batch_size, gain, goodput, throughput)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    job,
                    sample.time,
                    sample.replicas,
                    sample.batch_size,
                    sample.gain,
                    sample.goodput,
                    sample.throughput,
                ),
            )
            # pruned once every _PRUNE_EVERY of the job's own samples (ids are shared by all
            # jobs: a rule on them could skip one job for ever)
            count = self._sample_count.get(job, 0) + 1
            self._sample_count[job] = count
            if count % _PRUNE_EVERY == 0 or keep < _PRUNE_EVERY:
                db.execute(
                    "DELETE FROM samples WHERE job = ? AND id <= (SELECT id FROM samples "
                    "WHERE job = ? ORDER BY id DESC LIMIT 1 OFFSET ?)",
                    (job, job, keep),
                )

    def samples(
        self, job: str, since: float | None = None, limit: int = SAMPLES_PER_JOB
    ) -> list[SampleRecord]:
        """Job ``job``'s last ``limit`` samples (after time ``since``), oldest first."""
        with self._lock:
            rows = self._db.execute(
                "SELECT time, replicas, batch_size, gain, goodput, throughput FROM (SELECT * "
                "FROM samples WHERE job = ? AND time > ? ORDER BY id DESC LIMIT ?) ORDER BY id",
                (job, -1.0 if since is None else since, limit),
            ).fetchall()
        return [SampleRecord(*r) for r in rows]

    def add_round(
        self, when: float, round_: int, total: int, held: dict[str, int], keep: int = ROUNDS_KEPT
    ) -> None:
        """Append the cluster's use at a policy round; beyond ``keep`` rounds the oldest go."""
        held = {k: int(v) for k, v in held.items() if v > 0}
        with self.transaction() as db:
            cur = db.execute(
                "INSERT INTO rounds (time, round, used, total, held) VALUES (?, ?, ?, ?, ?)",
                (when, round_, sum(held.values()), total, json.dumps(held, sort_keys=True)),
            )
            if cur.lastrowid % _PRUNE_EVERY == 0 or keep < _PRUNE_EVERY:
                db.execute("DELETE FROM rounds WHERE id <= ?", (cur.lastrowid - keep,))

    def rounds(self, since: float | None = None, limit: int = ROUNDS_KEPT) -> list[RoundRecord]:
        """The last ``limit`` rounds recorded (after time ``since``), oldest first."""
        with self._lock:
            rows = self._db.execute(
                "SELECT time, round, used, total, held FROM (SELECT * FROM rounds WHERE time > ? "
                "ORDER BY id DESC LIMIT ?) ORDER BY id",
                (-1.0 if since is None else since, limit),
            ).fetchall()
        return [RoundRecord(t, r, u, n, json.loads(h)) for t, r, u, n, h in rows]
