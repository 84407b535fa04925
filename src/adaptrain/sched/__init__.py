"""The scheduling policies and their types: pure functions of the jobs' reported state.

No I/O, no processes, no torch: the simulator (:mod:`adaptrain.sim`) and a service call the
same policies, building what they see with :func:`job_info`.
"""

from .config import Arrivals, ClusterSpec, Exploration, Growth, Objective, Search, Sharing
from .fifo import FifoPolicy
from .jobs import JobReport, job_info
from .memo import Memo, memoized
from .optimus import OptimusPolicy
from .policy_base import (
    Allocation,
    JobInfo,
    NodeInfo,
    NodeKey,
    Policy,
    check_allocations,
    replica_bound,
)
from .pollux import PolluxPolicy
from .speedup import (
    ExploringSpeedup,
    LinearSpeedup,
    PowerSpeedup,
    RampSpeedup,
    SpeedupFunction,
)
from .tiresias import TiresiasPolicy
from .waterfill import WaterfillPolicy

__all__ = [
    "Allocation",
    "Arrivals",
    "ClusterSpec",
    "Exploration",
    "Growth",
    "Objective",
    "Search",
    "Sharing",
    "ExploringSpeedup",
    "FifoPolicy",
    "JobInfo",
    "JobReport",
    "Memo",
    "LinearSpeedup",
    "NodeInfo",
    "NodeKey",
    "OptimusPolicy",
    "Policy",
    "PolluxPolicy",
    "PowerSpeedup",
    "RampSpeedup",
    "SpeedupFunction",
    "TiresiasPolicy",
    "WaterfillPolicy",
    "check_allocations",
    "job_info",
    "memoized",
    "replica_bound",
]
