"""The scheduler-independent stream runtime: pools, event registry, lifetime, copies, policies."""

from dask_gpustreams.runtime.lifetime import Runtimes
from dask_gpustreams.runtime.pool import StreamPool, StreamSlot, StreamStats
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
    "StreamStats",
    "TaskRecord",
    "acquire_runtime",
    "get_runtime",
    "live_runtimes",
    "runtimes",
]
