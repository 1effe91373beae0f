"""The registry of stream backends, selected by name through ``gpustreams.backend``.

As for the stream policies (``runtime/policies/base.py``): a backend is
registered once, under its name, and found by name; nothing else tests
names. An entry imports nothing until it is used, so a backend whose
library is missing (CuPy) still registers, and says so when it is asked
whether it can run. ``auto`` picks the first registered backend that can.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from dask_gpustreams.backends.base import Backend
from dask_gpustreams.config import Registry


@dataclass(frozen=True)
class BackendEntry:
    """How to find, check and start one backend, without importing it.

    Every callable is called on the thread that needs its answer, and may
    import the backend's library.
    """

    #: Its value of ``gpustreams.backend``.
    name: str
    #: The backend class (imported when called).
    load: Callable[[], type[Backend]]
    #: ``(ok, reason)``: whether it can run in this process, and why not (or what it sees).
    available: Callable[[], tuple[bool, str]]
    #: The calling thread's current device id.
    current_device: Callable[[], int]
    #: Devices on this host, visible to this process or not.
    host_device_count: Callable[[], int]
    #: What it is, for the line that says ``auto`` chose it.
    description: str
    #: What to do when it cannot run, for the error that says so.
    remedy: str = ""
    #: Whether its driver reads the number of hardware queues once, when it starts
    #: (CUDA's ``CUDA_DEVICE_MAX_CONNECTIONS``): the runtime reserves them before.
    reserves_queues: bool = False


#: The values of ``gpustreams.backend``: ``auto`` and the registered backends, in the
#: order ``auto`` tries them.
BACKENDS: Registry[BackendEntry] = Registry("backend", extra=("auto",))


def register_backend(entry: BackendEntry) -> BackendEntry:
    """Make ``entry`` available as ``gpustreams.backend: <entry.name>``; returns it."""
    if not entry.name or entry.name == "auto":
        raise ValueError(f"a backend needs a name other than '' and 'auto'; got {entry.name!r}")
    return BACKENDS.register(entry.name, entry)


def backend_names() -> tuple[str, ...]:
    """The registered backend names, in the order ``auto`` tries them."""
    return BACKENDS.names()


def backend_entry(name: str) -> BackendEntry:
    """The entry registered as ``name``; ``ValueError`` naming the allowed values if none is."""
    return BACKENDS.get(name)


def backend_entries() -> tuple[BackendEntry, ...]:
    """Every registered entry, in the order ``auto`` tries them."""
    return BACKENDS.entries()
