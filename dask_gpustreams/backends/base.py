"""The small protocol every stream backend implements.

A backend is one device's streams, events and arrays. Names follow CuPy's
(``record``, ``wait_event``, ``synchronize``, ``done``) so the CuPy backend is
a thin pass-through. Everything here is safe to call from any thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol


class AllocationMeter:
    """The largest device allocation made through a launcher's allocator since
    :attr:`largest` was last set to 0 (by the launcher, after each task), and where
    the allocations since :attr:`made` was last cleared (by the launcher, before each
    task) were made: ``made[address] = stream key`` (a backend's own address and key)."""

    __slots__ = ("largest", "made")

    def __init__(self) -> None:
        self.largest = 0
        self.made: dict[Hashable, Hashable] = {}

    def made_on(self, value: Any, stream: Any) -> bool:
        """Whether ``value`` is a device array whose memory was allocated through the
        allocator since :attr:`made` was cleared, on pool stream ``stream``: from an
        arena that only allocations on ``stream`` take blocks from, so that once freed
        it is reused in ``stream``'s order (False where the backend cannot tell).

        By address: an array that another thread allocated meanwhile, at an address
        freed since the allocator noted it, is taken for the noted one. The launcher
        asks only of tasks that hold nothing else (no nested compute's results)."""
        return False


class StandingStreams:
    """For each pool stream (by a key: a handle or an id), the stream that stands for it
    while its small blocks are allocated (``Backend.launch_allocator``); thread-safe."""

    def __init__(self) -> None:
        self._streams: dict[Hashable, Any] = {}
        self._lock = threading.Lock()
        #: The standing stream of a key, or None (a dict lookup: the allocator's hot path).
        self.get = self._streams.get

    def ensure(self, keys: Iterable[Hashable], create: Callable[[], Any]) -> None:
        """Make a standing stream with ``create()`` for each key that has none; only one
        is ever made per key, however many threads enter at once."""
        with self._lock:
            for key in keys:
                if key not in self._streams:
                    self._streams[key] = create()

    def pop(self, key: Hashable) -> Any:
        """Forget ``key``'s standing stream (its pool stream is being destroyed); return it."""
        with self._lock:
            return self._streams.pop(key, None)


class BlockSource(Protocol):
    """Blocks of a backend's default pool, allocated while a stream of their own, which
    never runs work, is current (``Backend.shared_block_source``)."""

    def stream_key(self, stream: Any) -> Hashable:
        """The key the launch allocator passes for ``stream`` (a handle or an id)."""

    def take(self, nbytes: int, allocate: Callable) -> tuple[Any, bool]:
        """A block of ``nbytes`` from that stream's arena through ``allocate`` (the default
        pool's allocator, or one that wraps it), and whether it was used before."""

    def lend(self, base: Any, nbytes: int, owner: Any, reused: bool) -> Any:
        """What the allocator returns for ``base``: memory that keeps ``owner`` alive."""

    def give_back(self, base: Any) -> None:
        """Return ``base`` to the arena (no work may still use it)."""

    def close(self) -> None:
        """Free the arena's cached blocks (none is in use any more)."""


class SharedAllocator(Protocol):
    """Large allocations of the launcher shared by the pool's streams
    (:class:`~dask_gpustreams.runtime.sharedblocks.SharedBlocks`)."""

    #: The smallest allocation it takes.
    size: int

    def malloc(self, nbytes: int, stream_key: Hashable, allocate: Callable) -> Any | None:
        """The allocator's return for ``nbytes`` on that stream, new blocks taken through
        ``allocate`` (:meth:`BlockSource.take`); None: not a pool stream."""


class Backend(Protocol):
    """Streams, events and device arrays of one device."""

    name: str
    device_id: int
    #: Whether the device is AMD's, run through HIP (ROCm); False for CUDA and the sim.
    is_hip: bool
    #: Whether a kernel failure is sticky for the whole context (CUDA's, HIP's): every later
    #: call fails, and a sync that reports it clears nothing. False for the simulated
    #: device, where a failure stays with the streams it reached only until a host sync
    #: reports it (the worker plugin then reports the failures that nothing reads).
    sticky_errors: bool
    #: Functions that copy host data to this device / device data to the host, which
    #: integrations may replace by the runtime's staged copies (``cupy.asarray``, ...).
    #: The first upload function also converts device arrays between dtypes.
    upload_functions: tuple
    download_functions: tuple
    #: What an allocation raises when the device is full, after the allocator has
    #: released what it caches (the stream launcher then waits for its work and retries).
    out_of_memory_errors: tuple[type[BaseException], ...]

    def reported_failures(self) -> int:
        """How many kernel failures host syncs have reported (and so cleared) so far.

        A backend whose failures are sticky (``sticky_errors``) need not define it:
        the runtime never asks. Where they are not, a compute that sees it move while
        it runs checks every event of its work, not only its results'.
        """

    def create_stream(self, priority: int = 0) -> Any:
        """A new stream; lower ``priority`` values are scheduled first, as in CUDA."""

    def high_priority(self) -> int:
        """The most urgent priority value this device accepts."""

    def create_event(self, timing: bool = False) -> Any:
        """A new event; ``timing=True`` lets :meth:`elapsed_ms` read it."""

    def record(self, event: Any, stream: Any) -> None:
        """Enqueue ``event`` on ``stream``; it completes once earlier work on ``stream`` has."""

    def wait_event(self, stream: Any, event: Any) -> None:
        """Make later work on ``stream`` wait for ``event`` as recorded now; no host wait."""

    def done(self, event: Any) -> bool:
        """Whether ``event`` has completed (a query, never blocks)."""

    def synchronize_event(self, event: Any) -> None:
        """Block the host until ``event`` completes; raise if the work before it failed."""

    def event_error(self, event: Any) -> BaseException | None:
        """Block the host until ``event`` completes; return the error of failed work before it.

        Returns the error on every call, whether a sync has reported it already
        or not, and never raises it; None if the work succeeded.
        """

    def event_state(self, event: Any) -> tuple[bool, BaseException | None]:
        """``(completed, error of failed work before it)`` of ``event``; never blocks.

        The error is as :meth:`event_error` gives it, and None while not completed.
        """

    def synchronize_stream(self, stream: Any) -> None:
        """Block the host until all work enqueued on ``stream`` completes."""

    def destroy_stream(self, stream: Any, timeout: float | None = None) -> None:
        """Release ``stream`` now, once the work enqueued on it is done; it is not used again.

        Whatever the stream holds of the host (the simulated device's thread)
        is gone when this returns, or after ``timeout`` seconds of its work.
        """

    def elapsed_ms(self, start: Any, end: Any) -> float:
        """Device time between two completed timing events, in milliseconds."""

    def isolate_thread(self) -> Callable[[], None]:
        """Make library state that this thread shares across streams safe to use on several.

        Called once per thread (and device) before the thread's first task. Returns
        the function that puts the state back, for a thread that is the user's.
        """

    def use_stream(self, stream: Any, key: Any = None) -> AbstractContextManager:
        """Make ``stream`` current in this thread; ``key`` labels what is launched."""

    def current_stream(self) -> Any:
        """The stream current in this thread."""

    def orders_before_pool(self, stream: Any) -> bool:
        """Whether work on ``stream`` comes before later work on the pool's streams anyway."""

    def unpooled_stream(self) -> Any:
        """A stream where an event recorded now completes after the work that any thread
        launched so far with no stream current (on a default stream): the worker plugin's
        wait for results made while it was not set up (CUDA's legacy default stream, which
        waits for every blocking stream, each thread's per-thread default stream included;
        the sim's default stream)."""

    def stream_idle(self, stream: Any) -> bool:
        """Whether the work enqueued on ``stream`` so far has completed (one query)."""

    def is_device_array(self, obj: Any) -> bool:
        """Whether ``obj`` is this backend's device memory."""

    def free_cached_memory(self) -> None:
        """Hand the free blocks the device allocator caches, every stream's, back to the device.

        Called once the work that may still use them is done (it may wait for the device).
        """

    def launch_allocator(
        self,
        streams: Sequence[Any],
        small_blocks: int,
        large_tasks: int,
        shared: SharedAllocator | None = None,
    ) -> AbstractContextManager[AllocationMeter | None]:
        """This thread's allocator while the stream launcher runs; yields its meter.

        Allocations under ``small_blocks`` bytes made while one of ``streams`` (the
        pool's) is current come from an arena of that stream's apart, reused on that
        stream only, as the pool's own arenas are: a small result is then never
        carved out of a large cached block, which the pool cannot free while the
        small part lives (each stream holding one would pin a whole block). Those
        of at least ``shared.size`` bytes go to ``shared.malloc`` (with the current
        stream's :meth:`BlockSource.stream_key` and the allocator), unless it
        returns None. The meter records the largest of the others but small ones
        (for ``large_tasks``). Only while the
        allocator is the default pool's and a size is set; otherwise (RMM,
        ``cudaMallocAsync``; all 0) nothing changes and the meter is None.
        """

    def shared_block_source(self) -> BlockSource:
        """Blocks of the default pool's arena of a new stream that never runs work, for
        :class:`~dask_gpustreams.runtime.sharedblocks.SharedBlocks`."""

    def hardware_queues(self) -> int | None:
        """How many streams the device runs without false serialization, if bounded."""

    def hardware_queues_variable(self) -> str:
        """The environment variable that sets :meth:`hardware_queues` before the device starts."""

    def on_device(self) -> AbstractContextManager:
        """Make this backend's device the current one in this thread, inside.

        For objects whose device is the current one when they are made
        (CuPy's events); streams and arrays of this backend need none.
        """

    def alloc_pinned(self, nbytes: int) -> Any:
        """``nbytes`` of page-locked host memory as a NumPy ``uint8`` array."""

    def empty(self, shape: tuple[int, ...], dtype: Any) -> Any:
        """An uninitialized device array, allocated on the current stream."""

    def copy_to_device(self, dst: Any, src: Any, stream: Any) -> None:
        """Enqueue a copy of host array ``src`` (pinned) into device array ``dst`` on ``stream``."""

    def copy_to_host(self, dst: Any, src: Any, stream: Any) -> None:
        """Enqueue a copy of device array ``src`` into host array ``dst`` (pinned) on ``stream``."""
