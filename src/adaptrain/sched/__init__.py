"""Cluster scheduling: Pollux policy, Tiresias/Optimus baselines, our policy, and a simulator."""

from .optimus import OptimusPolicy
from .policy_base import (
    Allocation,
    JobInfo,
    NodeInfo,
    Policy,
    check_allocations,
    replica_bound,
)
from .pollux import PolluxPolicy
from .simulator import SimJob, SimResult, SimulationStalled, Simulator
from .speedup import (
    ExploringSpeedup,
    LinearSpeedup,
    PowerSpeedup,
    RampSpeedup,
    SpeedupFunction,
)
from .tiresias import TiresiasPolicy
from .traces import Application, WorkloadJob, load_applications, load_workload
from .waterfill import WaterfillPolicy

__all__ = [
    "Allocation",
    "Application",
    "ExploringSpeedup",
    "JobInfo",
    "LinearSpeedup",
    "NodeInfo",
    "OptimusPolicy",
    "Policy",
    "PolluxPolicy",
    "PowerSpeedup",
    "RampSpeedup",
    "SimJob",
    "SimResult",
    "SimulationStalled",
    "Simulator",
    "SpeedupFunction",
    "TiresiasPolicy",
    "WaterfillPolicy",
    "WorkloadJob",
    "check_allocations",
    "load_applications",
    "load_workload",
    "replica_bound",
]
