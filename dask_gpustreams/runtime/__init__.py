"""The scheduler-independent stream runtime: pools, event registry, lifetime, copies, policies."""

from dask_gpustreams.runtime.lifetime import Runtimes
from dask_gpustreams.runtime.pool import StreamPool, StreamSlot
from dask_gpustreams.runtime.registry import EventRegistry, TaskRecord
from dask_gpustreams.runtime.runtime import (
    StreamRuntime,
    acquire_runtime,
    get_runtime,
    live_runtimes,
    runtimes,
)

__all__ = [
    "EventRegistry",
    "Runtimes",
    "StreamPool",
    "StreamRuntime",
    "StreamSlot",
    "TaskRecord",
    "acquire_runtime",
    "get_runtime",
    "live_runtimes",
    "runtimes",
]
