"""Stream backends: ``cupy`` (CUDA/ROCm through CuPy) and ``sim`` (the simulated device)."""

from __future__ import annotations

import logging

from dask_gpustreams.backends.base import Backend
from dask_gpustreams.backends.nvidia import host_gpu_count, reserve_hardware_queues

logger = logging.getLogger("dask_gpustreams")


def gpu_visible() -> tuple[bool, str]:
    """Whether CuPy imports and sees at least one device, with the reason if not."""
    try:
        import cupy
    except ImportError as e:
        return False, f"CuPy is not installed ({e})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # CUDARuntimeError when no driver/device is present
        return False, f"CuPy sees no device ({e})"
    return (count > 0, f"{count} device(s) visible")


def resolve_backend(name: str) -> str:
    """``cupy`` or ``sim`` for the configured ``name``; raise if ``cupy`` cannot run here."""
    if name == "auto":
        ok, reason = gpu_visible()
        if ok:
            return "cupy"
        logger.info(
            "gpustreams: %s; using the simulated stream device (gpustreams.backend='sim')",
            reason,
        )
        return "sim"
    if name == "cupy":
        ok, reason = gpu_visible()
        if not ok:
            raise ValueError(
                f"gpustreams.backend='cupy' cannot start: {reason}; "
                "allowed values are auto | cupy | sim (use 'sim' or 'auto' without a GPU)"
            )
    return name


def current_device(resolved: str) -> int:
    """The calling thread's current device id for backend ``resolved``."""
    if resolved == "cupy":
        import cupy

        return cupy.cuda.Device().id
    return 0


def host_device_count(resolved: str) -> int:
    """Devices on this host for backend ``resolved``, visible to this process or not.

    NVML's count for CUDA (one dask-cuda worker per GPU each sees them all,
    one process per GPU under ``CUDA_VISIBLE_DEVICES`` sees one); the
    visible devices where NVML cannot tell (ROCm); 1 for the simulated device.
    """
    if resolved == "cupy":
        import cupy

        return host_gpu_count() or cupy.cuda.runtime.getDeviceCount()
    return 1


def create_backend(resolved: str) -> Backend:
    """A backend instance for ``resolved`` (``cupy`` or ``sim``) on the current device."""
    if resolved == "cupy":
        from dask_gpustreams.backends.cupy import CupyBackend

        return CupyBackend()
    from dask_gpustreams.backends.sim import SimBackend

    return SimBackend()


__all__ = [
    "Backend",
    "create_backend",
    "current_device",
    "gpu_visible",
    "host_device_count",
    "reserve_hardware_queues",
    "resolve_backend",
]
