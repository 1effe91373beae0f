"""cuFFT plan caches per thread and stream, for threads that launch onto several streams.

CuPy caches cuFFT plans per thread and device, keyed without the stream, and each
plan owns one work area (cupy#8079): two same-shape FFTs that one thread launches
onto two streams share it while both run. Nor may two host threads execute one
plan at once ("cuFFT APIs are thread safe as long as different host threads
execute FFTs using different plans", cuFFT docs; on the H200 at 14b8bc9, caches
per stream shared by 8 threads gave a wrong tile). Turning the cache off makes
every call plan anew (5x slower on the H200 for 1024² tiles). Instead, a thread
inside :meth:`StreamPlanCaches.use` gets one CuPy ``PlanCache`` of its own per
stream: a plan, and its work area, then only ever runs from that thread on the
stream that made it, in that stream's order, and is reused by its later FFTs there.

CuPy's FFT functions find their cache through the module global ``get_plan_cache``
of ``cupy.fft._fft`` and ``cupyx.scipy.fftpack._fft``. :func:`_install` replaces
those names once (per process) with a function that returns the per-stream cache
of the calling thread when it has one, and CuPy's own cache otherwise, so other
threads and the public ``cupy.fft.config.get_plan_cache()`` are unchanged.
"""

from __future__ import annotations

import importlib
import threading
import weakref
from collections.abc import Callable
from typing import Any

import cupy
from cupy.fft import _cache

#: The modules whose global ``get_plan_cache`` CuPy's FFTs call.
PLAN_CACHE_USERS = ("cupy.fft._fft", "cupyx.scipy.fftpack._fft")

#: .caches: (the StreamPlanCaches in use by this thread, its stream handle -> PlanCache),
#: while in use; .kept: StreamPlanCaches -> those caches of this thread, for the life of both.
_thread = threading.local()
_install_lock = threading.Lock()
_installed = False


def _plan_cache() -> Any:
    """``get_plan_cache`` for CuPy's FFTs: this thread's cache for its current stream."""
    caches = getattr(_thread, "caches", None)
    if caches is None:
        return _cache.get_plan_cache()
    owner, mine = caches
    stream = cupy.cuda.get_current_stream().ptr
    cache = mine.get(stream)
    if cache is None:
        cache = mine[stream] = owner.new_cache()
    return cache


def installable() -> str | None:
    """Why CuPy's FFTs cannot be pointed at per-stream caches here, or None."""
    for name in PLAN_CACHE_USERS:
        try:
            found = getattr(importlib.import_module(name), "get_plan_cache", None)
        except ImportError as e:
            return f"{name} does not import ({e})"
        if found is not _cache.get_plan_cache and found is not _plan_cache:
            return f"{name}.get_plan_cache is not cupy.fft._cache.get_plan_cache"
    return None


def _install() -> None:
    """Point CuPy's FFT modules at :func:`_plan_cache` (once per process)."""
    global _installed
    with _install_lock:
        if not _installed:
            for name in PLAN_CACHE_USERS:
                importlib.import_module(name).get_plan_cache = _plan_cache
            _installed = True


class StreamPlanCaches:
    """The cuFFT plan caches of one device, one ``PlanCache`` per (thread, stream).

    Each cache has the size and memory limit of the CuPy cache of the thread that
    first uses this object. A thread's caches live in that thread (a thread local),
    so plans are reused from one compute to the next and go with the thread (the
    launcher's host threads come and go) or with this object (the backend).
    """

    def __init__(self, device_id: int):
        self.device_id = device_id
        self._limits: tuple[int, int] | None = None

    def use(self) -> Callable[[], None]:
        """Make this thread's FFTs use its caches here; returns the function that stops it.

        Only where :func:`installable` says None.
        """
        _install()
        if self._limits is None:
            with cupy.cuda.Device(self.device_id):
                own = _cache.get_plan_cache()
                self._limits = (own.get_size(), own.get_memsize())
        kept = _thread.__dict__.get("kept")
        if kept is None:
            kept = _thread.kept = weakref.WeakKeyDictionary()
        mine = kept.get(self)
        if mine is None:
            mine = kept[self] = {}
        previous = getattr(_thread, "caches", None)
        _thread.caches = (self, mine)

        def restore() -> None:
            _thread.caches = previous

        return restore

    def new_cache(self) -> Any:
        """An empty ``PlanCache`` for this device, with the limits taken by :meth:`use`."""
        size, memsize = self._limits or (16, -1)
        return _cache.PlanCache(size=size, memsize=memsize, dev=self.device_id)
