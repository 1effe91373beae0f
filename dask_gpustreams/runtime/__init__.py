"""The scheduler-independent stream runtime: pools, event registry, lifetime, copies, policies."""

from dask_gpustreams.runtime.pool import StreamPool, StreamSlot
from dask_gpustreams.runtime.registry import EventRegistry, TaskRecord
from dask_gpustreams.runtime.runtime import StreamRuntime, get_runtime

__all__ = [
    "EventRegistry",
    "StreamPool",
    "StreamRuntime",
    "StreamSlot",
    "TaskRecord",
    "get_runtime",
]
