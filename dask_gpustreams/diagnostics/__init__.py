"""Diagnostics of stream runtimes: status, the per-task timeline and what is derived from it.

Also, imported where used: :mod:`.prometheus` (workers' ``/metrics``),
:mod:`.fine_metrics` (distributed's fine performance metrics) and :mod:`.nvtx`.
"""

from dask_gpustreams.diagnostics.status import StreamsStatus, status
from dask_gpustreams.diagnostics.timeline import (
    clear_timeline,
    plot_gantt,
    saturation,
    timeline,
    to_chrome_trace,
    to_rectangles,
)

__all__ = [
    "StreamsStatus",
    "clear_timeline",
    "plot_gantt",
    "saturation",
    "status",
    "timeline",
    "to_chrome_trace",
    "to_rectangles",
]
