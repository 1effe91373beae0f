"""``to_device`` / ``to_host``: asynchronous pinned-staged copies for ``map_blocks``/``delayed``.

Inside a task run by the stream runtime, the copy runs on the device's copy
streams and the task's stream waits for it on the device. Elsewhere it uses
the runtime of this thread's device with the current stream. With the plugin
enabled, graphs that call ``cupy.asarray`` / ``cupy.asnumpy`` (or
``sim.asarray`` / ``sim.asnumpy``) as task functions are rewritten to these.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dask_gpustreams.runtime import get_runtime
from dask_gpustreams.runtime.context import active_task


def _runtime_task() -> tuple[Any, Any, list | None]:
    runtime, stream, holds = active_task()
    if runtime is None:
        runtime = get_runtime()
        stream = runtime.backend.current_stream()
    return runtime, stream, holds


def to_device(x: Any, dtype: Any = None) -> Any:
    """``x`` on the device; device arrays of the right dtype are returned unchanged."""
    runtime, stream, holds = _runtime_task()
    backend = runtime.backend
    if backend.is_device_array(x):
        if dtype is None or np.dtype(dtype) == x.dtype:
            return x
        with backend.use_stream(stream):
            return backend.upload_functions[0](x, dtype)
    host = np.asarray(x, dtype=dtype)
    return runtime.transfers.to_device(host, stream, holds)


def to_host(x: Any) -> np.ndarray:
    """``x`` as a complete NumPy array; host arrays are returned unchanged."""
    runtime, stream, _ = _runtime_task()
    if not runtime.backend.is_device_array(x):
        return np.asarray(x)
    return runtime.transfers.to_host(x, stream)
