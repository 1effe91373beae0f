"""Stream-assignment policies, selected by name through ``gpustreams.policy``.

A new policy subclasses :class:`StreamPolicy` and is decorated with
:func:`register_policy`; the runtime needs no change.
"""

from dask_gpustreams.runtime.policies.affinity import Affinity, Auto
from dask_gpustreams.runtime.policies.base import (
    StreamPolicy,
    TaskInfo,
    make_policy,
    policy_names,
    register_policy,
)
from dask_gpustreams.runtime.policies.critical_path import CriticalPath, critical_keys
from dask_gpustreams.runtime.policies.simple import LeastLoaded, RoundRobin

__all__ = [
    "Affinity",
    "Auto",
    "CriticalPath",
    "LeastLoaded",
    "RoundRobin",
    "StreamPolicy",
    "critical_keys",
    "TaskInfo",
    "make_policy",
    "policy_names",
    "register_policy",
]
