"""Diagnostics of stream runtimes: the per-task timeline and what is derived from it."""

from dask_gpustreams.diagnostics.timeline import (
    clear_timeline,
    plot_gantt,
    saturation,
    timeline,
    to_chrome_trace,
    to_rectangles,
)

__all__ = [
    "clear_timeline",
    "plot_gantt",
    "saturation",
    "timeline",
    "to_chrome_trace",
    "to_rectangles",
]
