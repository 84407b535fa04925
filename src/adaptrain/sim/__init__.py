"""The trace-driven cluster simulator: workloads replayed under a scheduling policy.

It replays the Pollux OSDI'21 artifact's workloads with the per-model traces that ship with the
package (:func:`default_traces_dir`), under any policy of :mod:`adaptrain.sched`.
"""

from .job import GoodputMemos, SimJob
from .simulator import SimResult, SimulationStalled, Simulator
from .traces import Application, WorkloadJob, default_traces_dir, load_applications, load_workload

__all__ = [
    "Application",
    "GoodputMemos",
    "SimJob",
    "SimResult",
    "SimulationStalled",
    "Simulator",
    "WorkloadJob",
    "default_traces_dir",
    "load_applications",
    "load_workload",
]
