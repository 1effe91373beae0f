"""What the NVIDIA driver says before CuPy starts CUDA: hardware queues and the host's GPUs.

Read through ``ctypes`` from ``libcuda`` and ``libnvidia-ml``, without
importing CuPy and without initializing CUDA, so that
``CUDA_DEVICE_MAX_CONNECTIONS`` can still be set: the driver reads it once,
in ``cuInit``. Where the libraries are missing (no NVIDIA driver, ROCm),
every answer is "unknown".
"""

from __future__ import annotations

import ctypes
import os

#: CUDA's default and maximum of ``CUDA_DEVICE_MAX_CONNECTIONS``.
CUDA_DEFAULT_CONNECTIONS = 8
CUDA_MAX_CONNECTIONS = 32
_CONNECTIONS = "CUDA_DEVICE_MAX_CONNECTIONS"
_CUDA_ERROR_NOT_INITIALIZED = 3


def _library(name: str) -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


def cuda_started() -> bool | None:
    """Whether this process has initialized the CUDA driver (``cuInit``); None if unknown.

    Before ``cuInit``, driver calls other than ``cuInit`` and ``cuDriverGetVersion``
    fail with ``CUDA_ERROR_NOT_INITIALIZED``; ``cuDeviceGetCount`` is asked, which
    starts nothing.
    """
    driver = _library("libcuda.so.1")
    try:
        status = driver.cuDeviceGetCount(ctypes.byref(ctypes.c_int()))
    except AttributeError:  # no library, or not the driver's
        return None
    return status != _CUDA_ERROR_NOT_INITIALIZED


def reserve_hardware_queues(n: int) -> bool:
    """Set ``CUDA_DEVICE_MAX_CONNECTIONS`` to ``n`` (at most 32) while the driver will read it.

    Only where the variable is unset (a user's value is kept) and CUDA has
    not started in this process. Returns whether it was set.
    """
    if n <= CUDA_DEFAULT_CONNECTIONS or _CONNECTIONS in os.environ or cuda_started() is not False:
        return False
    os.environ[_CONNECTIONS] = str(min(n, CUDA_MAX_CONNECTIONS))
    return True


def cuda_connections() -> int:
    """The hardware queues CUDA gives each device: ``CUDA_DEVICE_MAX_CONNECTIONS`` or 8."""
    return int(os.environ.get(_CONNECTIONS, CUDA_DEFAULT_CONNECTIONS))


def host_gpu_count() -> int | None:
    """NVIDIA GPUs on this host, whatever ``CUDA_VISIBLE_DEVICES`` shows (NVML); None if unknown.

    A GPU split into MIG instances counts once.
    """
    nvml = _library("libnvidia-ml.so.1")
    try:
        if nvml.nvmlInit_v2() != 0:
            return None
    except AttributeError:  # no library, or not NVML
        return None
    try:
        count = ctypes.c_uint()
        return count.value if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) == 0 else None
    finally:
        nvml.nvmlShutdown()
