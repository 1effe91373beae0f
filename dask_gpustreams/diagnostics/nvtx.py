"""NVTX ranges for Nsight Systems: one per task, named by its key (``gpustreams.nvtx``).

With ``gpustreams.nvtx`` on, a runtime's backend pushes a range around each
task's launch: ``fn(inputs)`` with the task's stream current, on the thread
that enqueues it (a worker thread, a dask pool thread or the launcher's). The
range is named by the task's key, colored by its key prefix, in the
``dask_gpustreams`` domain, with the stream as its category (``stream 3``), so
``nsys profile`` shows which stream each launch went to and projects the range
onto the kernels it enqueued. Uses the ``nvtx`` package
(``pip install 'dask-gpustreams[nvtx]'``), else CuPy's ``cupy.cuda.nvtx``
(the stream then in the range's name).

Off (the default), nothing here is imported and no task pays anything: the
backend's own ``use_stream`` is called as before.

>>> dask.config.set({"gpustreams.enabled": True, "gpustreams.nvtx": True})  # doctest: +SKIP
>>> # nsys profile -t cuda,nvtx python script.py
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Callable, Hashable, Iterator
from typing import Any

from dask.utils import key_split

#: The NVTX domain of the ranges.
DOMAIN = "dask_gpustreams"
#: Range colors (ARGB), one per key prefix.
PALETTE = (0xFF1F77B4, 0xFFFF7F0E, 0xFF2CA02C, 0xFFD62728, 0xFF9467BD, 0xFF8C564B, 0xFFE377C2)


def range_functions() -> tuple[Callable[[str, int, str], None], Callable[[], None]]:
    """``push(message, color, category)`` and ``pop()`` of the NVTX library found.

    Raises ``ModuleNotFoundError`` when neither ``nvtx`` nor CuPy is installed.
    """
    try:
        import nvtx
    except ImportError:
        nvtx = None
    if nvtx is not None:
        domain = nvtx.get_domain(DOMAIN)
        attributes = domain.get_event_attributes

        def push(message: str, color: int, category: str) -> None:
            domain.push_range(attributes(message=message, color=color, category=category))

        return push, domain.pop_range
    try:
        from cupy.cuda import nvtx as cupy_nvtx
    except ImportError:
        raise ModuleNotFoundError(
            "gpustreams.nvtx=True needs the nvtx package or CuPy; install it with "
            "pip install 'dask-gpustreams[nvtx]', or set gpustreams.nvtx to False"
        ) from None

    def push_cupy(message: str, color: int, category: str) -> None:
        # RangePushC takes an ARGB color; RangePush only an index into CuPy's palette
        # (CuPy 14's cupy_backends.cuda.libs.nvtx: a keyword argb_color raises TypeError).
        cupy_nvtx.RangePushC(f"{message} [{category}]", color)

    return push_cupy, cupy_nvtx.RangePop


def annotate(backend: Any, pool: Any) -> None:
    """Make ``backend.use_stream(stream, key)`` push a range named by ``key``.

    ``pool`` (the runtime's :class:`~dask_gpustreams.runtime.StreamPool`) names
    the streams. Calls without a key (copies, allocations) get no range. The
    backend instance is the runtime's own; its class is left alone.
    """
    push, pop = range_functions()
    use_stream = backend.use_stream
    names: dict[int, str] = {}
    colors: dict[str, int] = {}

    def category(stream: Any) -> str:
        name = names.get(id(stream))
        if name is None:
            names.update((id(stream), f"stream {index}") for index, stream in pool.streams())
            name = names.get(id(stream), "other stream")
        return name

    def color(key: Hashable) -> int:
        prefix = key_split(key)
        value = colors.get(prefix)
        if value is None:
            value = colors[prefix] = PALETTE[zlib.crc32(prefix.encode()) % len(PALETTE)]
        return value

    @contextlib.contextmanager
    def annotated(stream: Any, key: Hashable = None) -> Iterator[None]:
        if key is None:
            with use_stream(stream):
                yield
            return
        push(str(key), color(key), category(stream))
        try:
            with use_stream(stream, key):
                yield
        finally:
            pop()

    backend.use_stream = annotated
