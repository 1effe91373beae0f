"""The small protocol every stream backend implements.

A backend is one device's streams, events and arrays. Names follow CuPy's
(``record``, ``wait_event``, ``synchronize``, ``done``) so the CuPy backend is
a thin pass-through. Everything here is safe to call from any thread.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Hashable, Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol


class AllocationMeter:
    """What a launcher's allocator and the launcher tell each other.

    :attr:`largest`: the largest device allocation made through the allocator since
    the launcher last set it to 0 (after each task). :attr:`stream` and :attr:`event`:
    the pool stream of the task being launched and the event the launcher records on it
    after the task (None between tasks); the task's blocks on that stream that are not
    small come from the :class:`SharedArena`.
    """

    __slots__ = ("largest", "stream", "event")

    def __init__(self) -> None:
        self.largest = 0
        self.stream: Any = None
        self.event: Any = None


class SharedArena:
    """One arena of the device's memory pool for the large blocks of every pool stream's
    tasks, and which task held each of its ranges last.

    The pool keeps an arena per stream and reuses a freed block only on its own
    stream, in stream order; a block freed on one stream is never reused by
    another, so each stream caches its own set of a graph's temporaries. Here the
    blocks of every stream come from the arena of one :attr:`stream` that runs
    no work, and :meth:`claim` orders a reuse across streams as the per-stream
    arenas order it on one: a range handed to a task on one stream, that a task
    on another stream held last, makes the new task's stream wait (on the device)
    for the old task's event, unless it has completed. That event follows all of
    the old task's work on its stream, and the launcher frees a task's inputs only
    once their consumers' events have completed, so every use of the range comes
    before its reuse. Thread-safe.
    """

    def __init__(self, backend: Backend, create_stream: Callable[[], Any]) -> None:
        self._backend = backend
        self._create_stream = create_stream
        self._lock = threading.Lock()
        self._stream: Any = None
        # The ranges claimed, as sorted starts and start -> (end, stream, event): each
        # range's last holder; ranges never overlap (a claim trims those it covers).
        self._starts: list[int] = []
        self._ranges: dict[int, tuple[int, Any, Any]] = {}

    @property
    def stream(self) -> Any:
        """The stream current while the shared blocks are allocated (made at first use)."""
        if self._stream is None:
            with self._lock:
                if self._stream is None:
                    self._stream = self._create_stream()
        return self._stream

    @property
    def existing_stream(self) -> Any:
        """:attr:`stream` if made, else None."""
        return self._stream

    def claim(self, start: int, size: int, meter: AllocationMeter) -> None:
        """The task being launched with ``meter`` got ``[start, start + size)``: make its
        stream wait for the event of each other stream's task that held a part of it
        last, unless that event has completed.

        A task still being launched (by another thread: the distributed worker's
        threads share a runtime) has not recorded its event yet: a wait for it would
        be none, so its stream records a new event for this wait. An event given back
        to the launcher's pool may be recorded again for a later task before it is
        waited on here; it is handed out again only once complete, so that wait orders
        the reuse after a later task as well: a needless dependency, never a missing one.
        """
        end = start + size
        stream = meter.stream
        backend = self._backend
        done, wait = backend.done, backend.wait_event
        with self._lock:
            starts, ranges = self._starts, self._ranges
            first = bisect.bisect_right(starts, start) - 1
            if first < 0 or ranges[starts[first]][0] <= start:
                first += 1  # the range before ends before ``start``
            last = first
            before: list[tuple[int, tuple]] = []
            after: list[tuple[int, tuple]] = []
            waited = None
            while last < len(starts) and starts[last] < end:
                old_start = starts[last]
                old = old_end, old_stream, old_event, old_meter = ranges.pop(old_start)
                last += 1
                launching = old_meter.event is old_event
                if not launching and done(old_event):
                    continue  # its task has completed: nothing to order, nor to remember
                if old_stream is not stream and old_event is not waited:
                    waited = old_event
                    if launching:
                        event = backend.create_event()
                        backend.record(event, old_stream)
                        wait(stream, event)
                    else:
                        wait(stream, old_event)
                # Its parts outside the claim still follow that task's work.
                if old_start < start:
                    before.append((old_start, (start, *old[1:])))
                if old_end > end:
                    after.append((end, old))
            claimed = [*before, (start, (end, stream, meter.event, meter)), *after]
            starts[first:last] = [s for s, _ in claimed]
            ranges.update(claimed)


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


class Backend(Protocol):
    """Streams, events and device arrays of one device."""

    name: str
    device_id: int
    #: Whether the device is AMD's, run through HIP (ROCm); False for CUDA and the sim.
    is_hip: bool
    #: Functions that copy host data to this device / device data to the host, which
    #: integrations may replace by the runtime's staged copies (``cupy.asarray``, ...).
    #: The first upload function also converts device arrays between dtypes.
    upload_functions: tuple
    download_functions: tuple
    #: What an allocation raises when the device is full, after the allocator has
    #: released what it caches (the stream launcher then waits for its work and retries).
    out_of_memory_errors: tuple[type[BaseException], ...]

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
        shared_arena: bool,
    ) -> AbstractContextManager[AllocationMeter | None]:
        """This thread's allocator while the stream launcher runs; yields its meter.

        Allocations under ``small_blocks`` bytes made while one of ``streams`` (the
        pool's) is current come from an arena of that stream's apart, reused on that
        stream only, as the pool's own arenas are: a small result is then never
        carved out of a large cached block, which the pool cannot free while the
        small part lives (each stream holding one would pin a whole block). The
        meter records the largest of the other allocations (for ``large_tasks``);
        those a task makes on its stream (:attr:`AllocationMeter.stream`, set by the
        launcher) come from the backend's :class:`SharedArena`, one for every stream,
        so that a graph's temporaries are cached once, not once per stream. Only
        while the allocator is the default pool's and one of the three is on
        (``shared_arena``: the shared arena); otherwise (RMM, ``cudaMallocAsync``;
        all off) nothing changes and the meter
        is None.
        """

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
