"""cuFFT plan caches per thread and stream, for threads that launch onto several streams.

CuPy caches cuFFT plans per thread and device, keyed without the stream, and each
plan owns one work area (cupy#8079): two same-shape FFTs that one thread launches
onto two streams share it while both run. Nor may two host threads execute one
plan at once ("cuFFT APIs are thread safe as long as different host threads
execute FFTs using different plans", cuFFT docs; on the H200 at 14b8bc9, caches
per stream shared by 8 threads gave a wrong tile). Turning the cache off makes
every call plan anew (5x slower on the H200 for 1024² tiles). Instead, a thread
after :func:`use` gets plan caches of its own, one per (device, stream)
(:class:`StreamPlans`): a plan, and its work area, then only ever runs from that
thread on the stream that made it, in that stream's order, and is reused by its
later FFTs there.

They are not CuPy ``PlanCache`` objects: the end of one of those runs a full
``gc.collect()`` (``cupy.fft._cache._clear_LinkedList``), so every thread that ended,
and every cache dropped, paid one per stream it had used. At the exit of the GPU test
process on the H200 (69ddf50), 167 of them took 248 s in all, 0.2-6.4 s each, across
the dying threads. A thread still makes its own CuPy cache, to read its limits, and
pays for that one, as any thread that runs a CuPy FFT does.

CuPy's FFT functions find their cache through the module global ``get_plan_cache``
of ``cupy.fft._fft`` and ``cupyx.scipy.fftpack._fft``. :func:`use` replaces those
names once (per process) with a function that returns the calling thread's cache
for its current device and stream when the thread uses them, and CuPy's own cache
otherwise, so other threads and the public ``cupy.fft.config.get_plan_cache()``
are unchanged.

A new cache takes the size and memory limit of the thread's own CuPy cache on that
device at the time (``cupy.fft.config.get_plan_cache().set_size(0)`` before a
compute turns new ones off). A thread keeps the caches of at most
:data:`MAX_CACHES` streams, dropping the least recently used; they end with the
thread. Multi-GPU plans (``cupy.fft.config.set_cufft_gpus``) are not cached: they
are made anew on each call.
"""

from __future__ import annotations

import importlib
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import cupy
from cupy.fft import _cache

#: The modules whose global ``get_plan_cache`` CuPy's FFTs call.
PLAN_CACHE_USERS = ("cupy.fft._fft", "cupyx.scipy.fftpack._fft")
#: The (device, stream) caches a thread keeps at most (a pool's streams, with room).
MAX_CACHES = 64

#: .on: whether this thread's FFTs use its own caches; .caches: (device, stream handle)
#: -> StreamPlans, least recently used first.
_thread = threading.local()
_install_lock = threading.Lock()
_installed = False


class StreamPlans:
    """The cuFFT plans of one thread on one (device, stream), least recently used first.

    What CuPy's FFT functions ask of a ``PlanCache`` (``get``, and item assignment
    for a new plan), within its limits: at most ``size`` plans (-1: any number) whose
    work areas hold at most ``memsize`` bytes (-1: any); either at 0 caches nothing.
    A plan larger than ``memsize`` is used once, not kept (``PlanCache`` raises
    ``RuntimeError``, failing the FFT). Dropping a plan destroys it; its work area goes
    back to the pool in its stream's order.
    """

    __slots__ = ("_plans", "_size", "_memsize", "_bytes")

    def __init__(self, size: int, memsize: int):
        self._plans: OrderedDict[tuple, tuple[Any, int]] = OrderedDict()
        self._size = size
        self._memsize = memsize
        self._bytes = 0

    def get(self, key: tuple, default: Any = None) -> Any:
        """The plan made for ``key`` (now the most recently used), or ``default``."""
        entry = self._plans.get(key)
        if entry is None:
            return default
        self._plans.move_to_end(key)
        return entry[0]

    def __setitem__(self, key: tuple, plan: Any) -> None:
        size, memsize, plans = self._size, self._memsize, self._plans
        if size == 0 or memsize == 0 or plan.gpus is not None:
            return
        work_area = plan.work_area
        nbytes = 0 if work_area is None else work_area.mem.size
        if 0 < memsize < nbytes:
            return
        old = plans.pop(key, None)
        if old is not None:
            self._bytes -= old[1]
        while plans and (0 < size <= len(plans) or 0 < memsize < self._bytes + nbytes):
            self._bytes -= plans.popitem(last=False)[1][1]
        plans[key] = (plan, nbytes)
        self._bytes += nbytes

    def get_curr_size(self) -> int:
        """Plans cached now (as ``PlanCache.get_curr_size``)."""
        return len(self._plans)

    def get_curr_memsize(self) -> int:
        """Bytes of their work areas (as ``PlanCache.get_curr_memsize``)."""
        return self._bytes


def _plan_cache() -> Any:
    """``get_plan_cache`` for CuPy's FFTs: this thread's cache for its device and stream."""
    if not getattr(_thread, "on", False):
        return _cache.get_plan_cache()
    caches = _thread.caches
    key = (cupy.cuda.runtime.getDevice(), cupy.cuda.get_current_stream().ptr)
    cache = caches.get(key)
    if cache is not None:
        caches.move_to_end(key)
        return cache
    own = _cache.get_plan_cache()  # this thread's CuPy cache on this device: its limits
    cache = caches[key] = StreamPlans(own.get_size(), own.get_memsize())
    if len(caches) > MAX_CACHES:
        caches.popitem(last=False)  # its plans go; their work areas return in stream order
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


def use() -> Callable[[], None]:
    """Make this thread's FFTs use its own caches per stream; returns the function that stops it.

    Only where :func:`installable` says None.
    """
    _install()
    if getattr(_thread, "caches", None) is None:
        _thread.caches = OrderedDict()
    previous = getattr(_thread, "on", False)
    _thread.on = True

    def restore() -> None:
        _thread.on = previous

    return restore
