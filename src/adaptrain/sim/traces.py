"""Measured per-model profiles of the Pollux artifact, and workload files.

An :class:`Application` holds one model's traces (the layout of the OSDI'21 Pollux artifact,
``simulator/traces/<model>/``):

- ``placements.csv``: ``placement`` (replicas per node as digits, e.g. ``22`` = 2 nodes x 2
  GPUs), ``local_bsz``, ``step_time``, ``sync_time`` measured on real placements;
- ``scalability.csv``: ``num_nodes``, ``num_replicas``, ``local_bsz``, ``step_time``,
  ``sync_time`` for larger spreads;
- ``validation-<bsz>.csv``: per epoch ``progress``, ``iteration``, ``metric``, ``grad_sqr``,
  ``grad_var`` when training at initial batch size ``<bsz>``.

Semantics follow the artifact's simulator (Qiao et al., "Pollux: Co-adaptive Cluster Scheduling
for Goodput-Optimized Deep Learning", OSDI'21): a step time for a placement seen in
``placements.csv`` is linearly interpolated over ``local_bsz``; any other placement is linearly
interpolated over (num_nodes, num_replicas, local_bsz) among the per-configuration means of
``placements.csv`` together with ``scalability.csv``. Gradient statistics, iteration counts and
metrics at a batch size between two validated ones are interpolated linearly between them; the
progress at the end of an epoch is the smallest across batch sizes.
"""

from __future__ import annotations

import collections
import csv
import glob
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

logger = logging.getLogger(__name__)

__all__ = [
    "APPLICATION_DEFAULTS",
    "PACKAGED_TRACES",
    "Application",
    "WorkloadJob",
    "default_traces_dir",
    "load_applications",
    "load_workload",
]

# Epochs per model and overrides used by the artifact (simulator/applications.py).
APPLICATION_DEFAULTS: dict[str, dict[str, int]] = {
    "bert": {"max_epochs": 2},
    "cifar10": {"max_epochs": 100},
    "ncf": {"max_epochs": 10},
    "imagenet": {"max_epochs": 90},
    "deepspeech2": {"max_epochs": 80},
    "yolov3": {"max_epochs": 50, "max_local_bsz": 8},
}


def _read_csv(path: str) -> dict[str, np.ndarray]:
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        header = next(reader)
        rows = [row for row in reader if row]
    cols = list(zip(*rows)) if rows else [() for _ in header]
    out = {}
    for name, col in zip(header, cols):
        out[name] = np.array([float(x) for x in col], dtype=np.float64)
    return out


class Application:
    """One model's measured throughput and statistical-efficiency profile."""

    def __init__(
        self,
        trace_dir: str,
        *,
        init_batch_size: int | None = None,
        max_batch_size: int | None = None,
        min_local_bsz: int | None = None,
        max_local_bsz: int | None = None,
        max_epochs: int | None = None,
    ) -> None:
        if not os.path.isdir(trace_dir):
            raise ValueError(f"trace directory {trace_dir!r} does not exist")
        self.name = os.path.basename(os.path.normpath(trace_dir))
        validation = {}
        for path in glob.glob(os.path.join(trace_dir, "validation-*.csv")):
            bsz = int(os.path.basename(path)[len("validation-") : -len(".csv")])
            validation[bsz] = _read_csv(path)
        if not validation:
            raise ValueError(f"no validation-<bsz>.csv files in {trace_dir!r}")
        self.validation = dict(sorted(validation.items()))
        self._vbsz = np.array(list(self.validation), dtype=np.float64)
        pl = _read_csv(os.path.join(trace_dir, "placements.csv"))
        self._pl_id = pl["placement"].astype(np.int64)
        self._pl_bsz = pl["local_bsz"]
        self._pl_step = pl["step_time"]
        self._pl_sync = pl["sync_time"]
        # a placement id's digits are its replicas per node ("22": 2 nodes x 2 GPUs); it is
        # looked up by that tuple, never by a number built from a placement's counts, which
        # would make 11 replicas on one node read as "11" (2 nodes x 1 GPU)
        keys = [tuple(int(c) for c in str(p)) for p in self._pl_id]
        rows: dict[tuple[int, ...], list[int]] = {}
        for i, key in enumerate(keys):
            rows.setdefault(key, []).append(i)
        self._pl_rows = {k: np.array(v, dtype=np.int64) for k, v in rows.items()}
        self._pl_nodes = np.array([len(k) for k in keys])
        self._pl_reps = np.array([sum(k) for k in keys])
        self._pl_max_per_node = max((max(k) for k in keys), default=0)
        self._scal = _read_csv(os.path.join(trace_dir, "scalability.csv"))
        self.init_batch_size = int(init_batch_size or min(self.validation))
        self.max_batch_size = int(max_batch_size or max(self.validation))
        self.min_local_bsz = int(min_local_bsz or self._pl_bsz.min())
        self.max_local_bsz = int(max_local_bsz or self._pl_bsz.max())
        if self.max_batch_size < self.min_local_bsz:
            raise ValueError(f"{self.name}: max_batch_size < min_local_bsz")
        # Per-epoch arrays stacked over validated batch sizes: (num_bsz, num_epochs).
        n = min(len(v["progress"]) for v in self.validation.values())
        if max_epochs is not None and not 1 <= max_epochs <= n:
            raise ValueError(
                f"{self.name}: max_epochs={max_epochs} must lie in [1, {n}]: the validation "
                f"files in {trace_dir!r} hold {n} epochs (pass max_epochs <= {n}, or None for all)"
            )
        self.max_epochs = int(n if max_epochs is None else max_epochs)
        stack = {
            k: np.stack([v[k][:n] for v in self.validation.values()])
            for k in ("progress", "iteration", "metric", "grad_sqr", "grad_var")
        }
        self._stack = stack
        # progress at the end of epoch e (e >= 1) is the min over batch sizes of progress[e - 1].
        self._epoch_progress = np.concatenate([[0.0], stack["progress"].min(axis=0)])
        self._tp_cache: dict[tuple[tuple[int, ...], float], tuple[float, float]] = {}
        self._nd_interp = None

    # ---- statistical efficiency -------------------------------------------------------------
    def _bracket(self, batch_size: float) -> tuple[int, int, float]:
        """Indices of the validated batch sizes around ``batch_size`` and the weight of upper."""
        vb = self._vbsz
        if not vb[0] - 1e-9 <= batch_size <= vb[-1] + 1e-9:
            raise ValueError(
                f"{self.name}: batch size {batch_size} outside validated range [{vb[0]}, {vb[-1]}]"
            )
        hi = int(np.searchsorted(vb, batch_size, side="left"))
        hi = min(hi, len(vb) - 1)
        if vb[hi] == batch_size or hi == 0:
            return hi, hi, 0.0
        lo = hi - 1
        return lo, hi, float((batch_size - vb[lo]) / (vb[hi] - vb[lo]))

    def _interp(self, key: str, batch_size: float, epoch: int) -> float:
        lo, hi, w = self._bracket(batch_size)
        col = self._stack[key][:, epoch]
        if lo == hi:
            return float(col[lo])
        return float(w * col[hi] + (1.0 - w) * col[lo])

    def get_grad_stats(self, batch_size: float, epoch: int) -> tuple[float, float]:
        """(grad_sqr, grad_var) during ``epoch`` when training at ``batch_size``."""
        return self._interp("grad_sqr", batch_size, epoch), self._interp(
            "grad_var", batch_size, epoch
        )

    def get_iteration(self, batch_size: float, epoch: int) -> float:
        """Iterations done after completing ``epoch`` at ``batch_size``."""
        return self._interp("iteration", batch_size, epoch)

    def get_progress(self, epoch: int) -> float:
        """Statistical progress (in initial-batch-size examples) at the end of ``epoch``."""
        return float(self._epoch_progress[epoch])

    def get_completion_epoch(self, batch_size: float) -> int:
        """Index of the last epoch to run (no target metric: all ``max_epochs`` epochs)."""
        return self.max_epochs - 1

    # ---- throughput -------------------------------------------------------------------------
    def get_throughput(self, placement: Sequence[int], local_bsz: float) -> tuple[float, float]:
        """(step_time, sync_time) in seconds of one step on ``placement`` at ``local_bsz``."""
        placement = tuple(int(p) for p in placement if p)
        if not placement:
            raise ValueError("empty placement")
        key = (placement, float(local_bsz))
        hit = self._tp_cache.get(key)
        if hit is not None:
            return hit
        rot = min(placement[i:] + placement[:i] for i in range(len(placement)))
        mask = self._pl_rows.get(rot)
        if mask is not None:
            bsz = self._pl_bsz[mask]
            order = np.argsort(bsz, kind="stable")
            bsz = bsz[order]
            if not bsz[0] - 1e-9 <= local_bsz <= bsz[-1] + 1e-9:
                raise ValueError(
                    f"{self.name}: local_bsz {local_bsz} outside profiled range for {rot}"
                )
            step = float(np.interp(local_bsz, bsz, self._pl_step[mask][order]))
            sync = float(np.interp(local_bsz, bsz, self._pl_sync[mask][order]))
        else:
            interp = self._get_nd_interp()
            nodes = min(len(placement), 16)
            step, sync = (float(x) for x in interp([nodes, sum(placement), local_bsz])[0])
        if not (math.isfinite(step) and math.isfinite(sync)):
            raise ValueError(
                f"{self.name}: no throughput for placement {placement} at local_bsz {local_bsz}"
            )
        self._tp_cache[key] = (step, sync)
        return step, sync

    def _get_nd_interp(self):
        if self._nd_interp is None:
            from scipy.interpolate import LinearNDInterpolator

            groups: dict[tuple[float, float, float], list[tuple[float, float]]] = {}
            for n, r, b, s, y in zip(
                self._pl_nodes, self._pl_reps, self._pl_bsz, self._pl_step, self._pl_sync
            ):
                groups.setdefault((float(n), float(r), float(b)), []).append((s, y))
            pts = sorted(groups)
            xs = [list(p) for p in pts]
            ys = [list(np.mean(groups[p], axis=0)) for p in pts]
            sc = self._scal
            for i in range(len(sc["num_nodes"])):
                xs.append([sc["num_nodes"][i], sc["num_replicas"][i], sc["local_bsz"][i]])
                ys.append([sc["step_time"][i], sc["sync_time"][i]])
            self._nd_interp = LinearNDInterpolator(np.array(xs), np.array(ys))
        return self._nd_interp

    @property
    def max_gpus_per_node(self) -> int:
        """The most replicas on one node in ``placements.csv``: no throughput is known for a
        node holding more (``scalability.csv`` spreads its replicas over many nodes)."""
        return int(self._pl_max_per_node)

    @property
    def max_measured_replicas(self) -> int:
        """The largest replica count in ``placements.csv`` and ``scalability.csv``: no
        throughput is known beyond it (interpolation needs measurements on both sides)."""
        reps = self._pl_reps.tolist() + self._scal["num_replicas"].tolist()
        return int(max(reps))

    def measurements(self) -> dict[str, np.ndarray]:
        """Every throughput measurement of ``placements.csv`` and ``scalability.csv`` as arrays
        ``num_nodes``, ``num_replicas``, ``local_bsz``, ``step_time``, ``sync_time`` (copies)."""
        sc = self._scal
        return {
            "num_nodes": np.concatenate([self._pl_nodes, sc["num_nodes"]]).astype(np.int64),
            "num_replicas": np.concatenate([self._pl_reps, sc["num_replicas"]]).astype(np.int64),
            "local_bsz": np.concatenate([self._pl_bsz, sc["local_bsz"]]),
            "step_time": np.concatenate([self._pl_step, sc["step_time"]]),
            "sync_time": np.concatenate([self._pl_sync, sc["sync_time"]]),
        }

    def __repr__(self) -> str:
        return f"Application({self.name!r}, bsz {self.init_batch_size}..{self.max_batch_size})"


def load_applications(
    traces_dir: str, names: Sequence[str] | None = None
) -> dict[str, Application]:
    """Load every model folder of ``traces_dir`` (or only ``names``) with the artifact defaults."""
    if not os.path.isdir(traces_dir):
        raise ValueError(f"traces directory {traces_dir!r} does not exist; pass --traces DIR")
    if names is None:
        names = sorted(
            d
            for d in os.listdir(traces_dir)
            if os.path.isfile(os.path.join(traces_dir, d, "placements.csv"))
        )
    apps = {}
    for name in names:
        apps[name] = Application(
            os.path.join(traces_dir, name), **APPLICATION_DEFAULTS.get(name, {})
        )
    return apps


@dataclass(frozen=True)
class WorkloadJob:
    """One row of a workload file: submission time (s), model, and tuned replicas/batch size."""

    name: str
    time: float
    application: str
    num_replicas: int
    batch_size: int


def load_workload(path: str) -> list[WorkloadJob]:
    """Read ``workload-N.csv`` (columns name,time,application,num_replicas,batch_size).

    Every row is checked: it has one field per column, ``time`` is a finite number of seconds
    >= 0 (the job's submission time), ``num_replicas`` and ``batch_size`` are integers; a
    ``ValueError`` names the file, the row and the problem otherwise.
    """
    if not os.path.isfile(path):
        raise ValueError(f"workload file {path!r} does not exist")
    need = ("name", "time", "application", "num_replicas", "batch_size")
    jobs = []
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            return []
        missing = [c for c in need if c not in header]
        if missing:
            raise ValueError(f"workload {path!r} lacks columns {sorted(missing)}")
        num = 0
        for row in reader:
            if not row:
                continue
            num += 1
            where = f"workload {path!r}, row {num} (line {reader.line_num})"
            if len(row) != len(header):
                raise ValueError(
                    f"{where} has {len(row)} fields, expected {len(header)} "
                    f"({','.join(header)}): fix or remove the row"
                )
            r = dict(zip(header, row))
            jobs.append(
                WorkloadJob(
                    r["name"],
                    _submission_time(r["time"], where),
                    r["application"],
                    _integer(r["num_replicas"], "num_replicas", where),
                    _integer(r["batch_size"], "batch_size", where),
                )
            )
    counts = collections.Counter(j.name for j in jobs)
    dups = sorted(name for name, count in counts.items() if count > 1)
    if dups:
        raise ValueError(
            f"workload {path!r} has duplicate job names {dups}; every job needs its own name "
            "(the simulator keys jobs by name)"
        )
    return jobs


def _submission_time(text: str, where: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(
            f"{where}: time {text!r} is not a number (the submission time in seconds)"
        ) from None
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(
            f"{where}: time={text.strip()} must be a finite number of seconds >= 0 (the job's "
            "submission time from the start of the trace)"
        )
    return value


def _integer(text: str, column: str, where: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{where}: {column} {text!r} is not an integer") from None


#: The artifact's per-model traces shipped with the package (``data/traces/NOTICE`` gives their
#: source and licence).
PACKAGED_TRACES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "traces")


def default_traces_dir() -> str | None:
    """The Pollux artifact's per-model traces installed with the package (bert, cifar10,
    deepspeech2, imagenet, ncf, yolov3: :data:`PACKAGED_TRACES`), or None if that folder is
    missing (an install that left out the package data)."""
    if os.path.isfile(os.path.join(PACKAGED_TRACES, "bert", "placements.csv")):
        return PACKAGED_TRACES
    return None
