"""Stream backends: ``cupy`` (CUDA/ROCm through CuPy) and ``sim`` (the simulated device).

Each is an entry of the registry (:mod:`.registry`); the functions here find
backends through it, by name, and import a backend's module only when it is used.
"""

from __future__ import annotations

import logging

from dask_gpustreams.backends.base import Backend
from dask_gpustreams.backends.nvidia import host_gpu_count, reserve_hardware_queues
from dask_gpustreams.backends.registry import (
    BACKENDS,
    BackendEntry,
    backend_entries,
    backend_entry,
    backend_names,
    register_backend,
)

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
    """The registered backend that ``name`` stands for; raise if it cannot run here.

    ``auto``: the first registered backend that can run (the GPU through CuPy,
    else the simulated device, which logs why).
    """
    if name == "auto":
        reasons = []
        for entry in backend_entries():
            ok, reason = entry.available()
            if ok:
                if reasons:
                    logger.info(
                        "gpustreams: %s; using %s (gpustreams.backend=%r)",
                        "; ".join(reasons),
                        entry.description,
                        entry.name,
                    )
                return entry.name
            reasons.append(reason)
        raise ValueError(f"gpustreams.backend='auto': no backend can run here ({reasons})")
    entry = backend_entry(name)
    ok, reason = entry.available()
    if not ok:
        remedy = f" ({entry.remedy})" if entry.remedy else ""
        raise ValueError(
            f"gpustreams.backend={name!r} cannot start: {reason}; "
            f"allowed values are {BACKENDS.allowed()}{remedy}"
        )
    return name


def reserves_queues(name: str) -> bool:
    """Whether ``name`` (or a backend ``auto`` may pick) needs its hardware queues reserved.

    Then :func:`reserve_hardware_queues` must run before anything starts the device.
    """
    entries = backend_entries() if name == "auto" else (backend_entry(name),)
    return any(entry.reserves_queues for entry in entries)


def backend_class(resolved: str) -> type[Backend]:
    """The class of the backend registered as ``resolved`` (imports its module)."""
    return backend_entry(resolved).load()


def current_device(resolved: str) -> int:
    """The calling thread's current device id for backend ``resolved``."""
    return backend_entry(resolved).current_device()


def host_device_count(resolved: str) -> int:
    """Devices on this host for backend ``resolved``, visible to this process or not.

    NVML's count for CUDA (one dask-cuda worker per GPU each sees them all,
    one process per GPU under ``CUDA_VISIBLE_DEVICES`` sees one); the
    visible devices where NVML cannot tell (ROCm); 1 for the simulated device.
    """
    return backend_entry(resolved).host_device_count()


def create_backend(resolved: str) -> Backend:
    """A backend instance for ``resolved`` (a registered name) on the current device."""
    return backend_class(resolved)()


# --- the registered backends, in the order ``auto`` tries them --------------------------------


def _cupy_class() -> type[Backend]:
    from dask_gpustreams.backends.cupy import CupyBackend

    return CupyBackend


def _cupy_device() -> int:
    import cupy

    return cupy.cuda.Device().id


def _cupy_host_devices() -> int:
    import cupy

    return host_gpu_count() or cupy.cuda.runtime.getDeviceCount()


def _sim_class() -> type[Backend]:
    from dask_gpustreams.backends.sim import SimBackend

    return SimBackend


def _sim_available() -> tuple[bool, str]:
    return True, "the simulated device is always available"


def _device_zero() -> int:
    return 0


def _one_device() -> int:
    return 1


register_backend(
    BackendEntry(
        "cupy",
        _cupy_class,
        gpu_visible,
        _cupy_device,
        _cupy_host_devices,
        description="the GPU through CuPy",
        remedy="use 'sim' or 'auto' without a GPU",
        reserves_queues=True,
    )
)
register_backend(
    BackendEntry(
        "sim",
        _sim_class,
        _sim_available,
        _device_zero,
        _one_device,
        description="the simulated stream device",
    )
)


__all__ = [
    "Backend",
    "BackendEntry",
    "backend_class",
    "backend_entry",
    "backend_names",
    "create_backend",
    "current_device",
    "gpu_visible",
    "host_device_count",
    "register_backend",
    "reserve_hardware_queues",
    "reserves_queues",
    "resolve_backend",
]
