"""Streams and events of the simulated device.

Each stream is a FIFO of operations run in order by its own thread. The thread
starts with the stream's first work and ends after :attr:`Stream.idle_timeout`
seconds without any (the next work starts it again), and once the stream is
garbage or closed and its work is done: an idle stream holds no thread, as a
CUDA stream holds none. Launching only enqueues. An event is a marker in a
stream: recording enqueues a marker, waiting enqueues a wait for the marker as
recorded at that moment. A launched function that raises puts its stream in
error: later launches on that stream are skipped (as after a sticky CUDA error)
and every marker it reaches carries the error, which waits pass on to other
streams. The first host sync that sees the error raises it and clears it from
every stream it reached; once reported, it is neither raised nor passed on
again, but for the event of work it skipped: that carries a copy of it, not yet
reported, so that what waits for unwritten output fails (:meth:`Stream.record`).

``Device.kernel_delay`` makes every kernel (and host-to-device copy) sleep a
random time before it runs, to vary the interleaving of streams in tests. A
device starts with the delay of the environment variable
``GPUSTREAMS_SIM_KERNEL_DELAY`` (``LOW,HIGH`` in seconds, e.g. ``0,0.002``), read
when the device is made, as CUDA reads its variables when it starts: worker
processes inherit it, where a delay set in one process would not reach them.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import os
import queue
import random
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from dask_gpustreams.errors import KernelError

_stream_ids = itertools.count()


class _Marker:
    """One recording of an event: completes when its stream reaches it."""

    __slots__ = ("device", "done", "error", "time")

    def __init__(self, device: Device) -> None:
        self.device = device
        self.done = threading.Event()
        self.error: KernelError | None = None
        self.time = 0.0


class _Server:
    """A stream's queue and the thread serving it, which starts with work and ends when idle.

    It refers to no stream (work queued holds its stream), so a stream can be
    garbage while its thread runs. ``serving`` is true from a thread's start
    until it ends for idleness, and is only changed under ``lock``.
    """

    __slots__ = ("lock", "name", "queue", "serving", "thread")

    def __init__(self, name: str) -> None:
        self.name = name
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        # Reentrant: a garbage collection in the idle check may finalize a stream.
        self.lock = threading.RLock()
        self.serving = False
        self.thread: threading.Thread | None = None  # the latest one

    def start(self) -> None:
        """Start a thread unless one serves (called after a put that found none)."""
        with self.lock:
            if not self.serving:
                self.serving = True
                self.thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
                self.thread.start()

    def _serve(self) -> None:
        """Run the queued operations in order; end on None, or after ``Stream.idle_timeout`` idle.

        Between operations it holds no reference to the stream, as CUDA lets a
        stream be destroyed with work pending: that work still runs, then the
        thread ends.
        """
        work = self.queue
        while True:
            try:
                item = work.get(timeout=Stream.idle_timeout)
            except queue.Empty:
                with self.lock:
                    # Not serving first: a put from now on starts a thread (after this lock).
                    self.serving = False
                    if work.empty():
                        return
                    self.serving = True  # a put came meanwhile: serve it
                continue
            if item is None:
                return
            stream, op = item
            op(stream)
            del item, stream, op


class Stream:
    """A FIFO of work executed in order by one thread; see :func:`Device.create_stream`."""

    #: Seconds without work after which a stream's thread ends (the next work starts one).
    idle_timeout = 0.5

    def __init__(self, device: Device, priority: int = 0, *, _token: object = None):
        if _token is not _factory_token:
            raise TypeError(
                "Stream objects cannot be instantiated directly: use Device.create_stream"
            )
        self.device = device
        self.priority = priority
        self.id = next(_stream_ids)
        self._error: KernelError | None = None
        # Per launching thread, the error that skipped one of its kernels since its last
        # record on this stream (read and written on the stream's thread only): see record.
        self._skipped: weakref.WeakKeyDictionary[threading.Thread, KernelError] = (
            weakref.WeakKeyDictionary()
        )
        self._server = _Server(f"sim-stream-{self.id}")
        self._closed = False
        # Work queued holds the stream; once none is and the stream is garbage (or closed),
        # the thread ends.
        self._end = weakref.finalize(self, _stream_ended, self._server.queue, device, self.id)
        self._end.atexit = False  # atexit code may sync

    def __repr__(self) -> str:
        return f"<sim.Stream {self.id} priority={self.priority}>"

    def enqueue(self, op: Callable[[Stream], None]) -> None:
        """Append ``op`` to the stream; it runs after everything enqueued before it."""
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")
        server = self._server
        server.queue.put((self, op))
        if not server.serving:
            server.start()

    @property
    def thread(self) -> threading.Thread | None:
        """The thread serving the stream now, or the last one; None before any work."""
        return self._server.thread

    @property
    def busy(self) -> bool:
        """Whether a thread serves the stream (work may be pending); False: none is queued."""
        return self._server.serving

    def close(self, timeout: float | None = None) -> None:
        """End the stream now, as if it were garbage (``cudaStreamDestroy``); idempotent.

        The work already enqueued still runs, then the thread ends; this waits
        for that, up to ``timeout`` seconds (not when called on the stream's
        own thread). Later work on the stream raises ``RuntimeError``.
        """
        self._closed = True
        self._end()  # once: later calls do nothing
        thread = self._server.thread
        if thread is not None and threading.current_thread() is not thread:
            thread.join(timeout)

    def launch(
        self, fn: Callable, args: tuple, kwargs: dict, key: Any, runs_on_error: bool = False
    ) -> None:
        """Enqueue a kernel: ``fn(*args, **kwargs)`` run on the stream's thread.

        It first sleeps for a delay drawn now from :attr:`Device.kernel_delay`. It is
        skipped on a stream in error unless ``runs_on_error`` (host-to-device copies: a
        copy skipped there, then synced after another thread reported the failure, would
        raise nothing and leave its array poisoned, unpickled or deserialized data among
        them).
        """
        delay = self.device._draw_delay()
        launcher = threading.current_thread()

        def kernel(stream: Stream) -> None:
            if stream._error is not None and not runs_on_error:
                stream._skipped[launcher] = stream._error
                return
            if delay:
                time.sleep(delay)
            try:
                fn(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 - any kernel failure is reported later
                if stream._error is None:
                    stream._error = KernelError(key, f"{type(e).__name__}: {e}")

        self.enqueue(kernel)

    def record(self, event: Event | None = None) -> Event:
        """Record ``event`` (a new one if None) at the current end of the stream.

        It carries the stream's error, or, where a kernel this thread launched on the
        stream since its last record here was skipped, an unreported copy of the error
        that skipped it: the kernel's output was never written, so the event's sync must
        raise, and a stream that waits for the event must fail what it runs after, even
        where another thread's sync reported (and cleared) that failure meanwhile (a
        task's kernels and its event come from one thread). Reporting the copy reports
        the error too. Other threads' work is not held back by it.
        """
        event = event if event is not None else Event()
        marker = _Marker(self.device)
        event._marker = marker
        recorder = threading.current_thread()

        def complete(stream: Stream) -> None:
            error = stream._error
            if stream._skipped:
                skipped = stream._skipped.pop(recorder, None)
                if skipped is not None:
                    error = stream.device._copy(skipped)
            marker.error = error
            marker.time = time.perf_counter()
            marker.done.set()

        self.enqueue(complete)
        return event

    def wait_event(self, event: Event) -> None:
        """Later work on this stream waits for ``event`` as recorded now; the host does not."""
        marker = event._marker
        if marker is None or (marker.done.is_set() and marker.error is None):
            return

        def wait(stream: Stream) -> None:
            marker.done.wait()
            error = marker.error
            device = self.device
            if error is not None and stream._error is None and not device._reported(error):
                stream._error = error
                # A report between the check and the set found this stream clean and left
                # it in error for good (it marks the error reported, then looks at streams).
                if device._reported(error):
                    stream._error = None

        self.enqueue(wait)

    def synchronize(self) -> None:
        """Block until all enqueued work is done; raise (and clear) the stream's error.

        The error is the one the sync's own marker saw, not the stream's error
        read afterwards: work enqueued after the sync may fail meanwhile, and
        clearing its error here would hide it from that work's events.
        """
        self.record().synchronize()

    def __enter__(self) -> Stream:
        self.device._push(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self.device._pop()


class Event:
    """A point in a stream that the host or other streams can wait for.

    ``timing`` (on by default, as for CuPy's events): whether device times may be
    measured between it and another timing event; CUDA refuses an event created
    without (``cudaEventDisableTiming``): see ``SimBackend.elapsed_ms``.
    """

    __slots__ = ("_marker", "timing")

    def __init__(self, timing: bool = True) -> None:
        self._marker: _Marker | None = None
        self.timing = timing

    @property
    def done(self) -> bool:
        """True once the recorded point is reached (or if never recorded)."""
        marker = self._marker
        return marker is None or marker.done.is_set()

    def wait(self) -> KernelError | None:
        """Block until the recorded point is reached; return the error of failed work before it.

        Unlike :meth:`synchronize`, this neither raises nor reports the error:
        it returns it on every call, reported or not (None if the work succeeded).
        """
        marker = self._marker
        if marker is None:
            return None
        done = marker.done
        if not done.is_set():  # a set threading.Event's wait() still takes its lock
            done.wait()
        return marker.error

    def synchronize(self) -> None:
        """Block until the recorded point is reached; raise the error of failed work before it."""
        marker = self._marker
        if marker is None:
            return
        marker.done.wait()
        error = marker.error
        device = marker.device
        # _consume is False if another sync reported it meanwhile: one of them raises.
        if error is not None and not device._reported(error) and device._consume(error):
            raise error

    @property
    def time(self) -> float:
        """Host clock (``time.perf_counter``) at which the marker was reached."""
        marker = self._marker
        if marker is None or not marker.done.is_set():
            raise RuntimeError("event has not completed")
        return marker.time


_factory_token = object()


#: The environment variable of a new device's :attr:`Device.kernel_delay`.
KERNEL_DELAY_VARIABLE = "GPUSTREAMS_SIM_KERNEL_DELAY"


def _stream_ended(work: queue.SimpleQueue, device: Device, stream_id: int) -> None:
    """A stream is garbage: its thread ends after the work queued; tell the device's listener.

    Without a thread (idle), the None stays queued with the garbage queue.
    """
    work.put(None)
    if device._on_stream_end is not None:
        device._on_stream_end(stream_id)


def _clear_error(error: KernelError, stream: Stream) -> None:
    if stream._error is error:
        stream._error = None


class Device:
    """The simulated device: a default stream and the streams created on it.

    ``on_stream_end(stream_id)`` is called, from any thread and without
    locks that it may take, when a stream of this device is garbage (its
    memory pool drops that stream's free list).
    """

    def __init__(
        self, device_id: int = 0, on_stream_end: Callable[[int], None] | None = None
    ) -> None:
        self.id = device_id
        self._local = threading.local()
        self._streams: weakref.WeakSet[Stream] = weakref.WeakSet()
        self._reported_errors: weakref.WeakSet[KernelError] = weakref.WeakSet()
        #: The copy of an error in an event of skipped work -> that error (see Stream.record).
        self._origins: weakref.WeakKeyDictionary[KernelError, KernelError] = (
            weakref.WeakKeyDictionary()
        )
        # Reentrant: a garbage collection while a report enqueues its clears may run code
        # that syncs.
        self._report_lock = threading.RLock()
        self._reports = 0
        self._kernel_delay = (0.0, 0.0)
        delay = os.environ.get(KERNEL_DELAY_VARIABLE)
        if delay:
            try:
                self.kernel_delay = [float(v) for v in delay.split(",")]
            except ValueError:  # not two numbers, or not 0 <= low <= high < inf
                raise ValueError(
                    f"{KERNEL_DELAY_VARIABLE}={delay!r} is invalid: allowed values are "
                    "LOW,HIGH in seconds with 0 <= LOW <= HIGH < inf, such as '0,0.002'"
                ) from None
        self._random = random.Random()
        self._on_stream_end = on_stream_end
        self._default_stream: Stream | None = None
        self._default_lock = threading.Lock()

    @property
    def default_stream(self) -> Stream:
        """The stream of work launched with no stream current (its thread starts at first use)."""
        stream = self._default_stream
        if stream is None:
            with self._default_lock:
                if self._default_stream is None:
                    self._default_stream = self.create_stream()
                stream = self._default_stream
        return stream

    @property
    def kernel_delay(self) -> tuple[float, float]:
        """``(low, high)``: each kernel sleeps uniformly that many seconds before it runs.

        Drawn per launch, on the launching thread; ``(0, 0)`` (the default)
        adds no sleep. Slow, randomly timed kernels make ordering and lifetime
        bugs show as wrong values in tests.
        """
        return self._kernel_delay

    @kernel_delay.setter
    def kernel_delay(self, value: tuple[float, float]) -> None:
        try:
            low, high = (float(v) for v in value)
        except (TypeError, ValueError):  # not two numbers: 0.002, None, ('a', 'b')
            low = high = math.nan
        # Finite: time.sleep(inf) raises in the stream's thread, which ends, and every sync hangs.
        if not (0 <= low <= high and math.isfinite(high)):
            raise ValueError(
                f"kernel_delay must satisfy 0 <= low <= high < inf, got {value!r}: "
                "give (low, high) in seconds, such as (0, 0.002)"
            )
        self._kernel_delay = (low, high)

    def _draw_delay(self) -> float:
        low, high = self._kernel_delay
        return self._random.uniform(low, high) if high else 0.0

    def create_stream(self, priority: int = 0) -> Stream:
        """A new stream (its thread starts with its work); ``priority`` is kept for diagnostics."""
        stream = Stream(self, priority, _token=_factory_token)
        self._streams.add(stream)
        return stream

    def _copy(self, error: KernelError) -> KernelError:
        """An unreported copy of ``error`` (same key and cause), for the event of work it
        skipped; reporting the copy reports ``error`` too."""
        copy = KernelError(error.key, error.cause)
        self._origins[copy] = error
        return copy

    def _consume(self, error: KernelError) -> bool:
        """Clear ``error`` (and the error it copies, if so) from every stream it reached,
        once a host sync reports it.

        A reported error is not passed on again: waits still queued on events
        recorded before the report do not put another stream in error, and
        those events' syncs do not raise it a second time. Returns False if it
        was reported already (two syncs at once: only one of them raises it).
        """
        with self._report_lock:
            if error in self._reported_errors:
                return False
            chain = [error]  # the error, and the errors it copies not reported yet
            while (origin := self._origins.get(chain[-1])) is not None:
                if origin in self._reported_errors:
                    break
                chain.append(origin)
            self._reported_errors.update(chain)  # before the streams are read: see wait_event
            # Counted with the clears enqueued, under the lock that reported_failures takes:
            # work launched after a read of the count runs after the clears it counts.
            self._reports += 1
            for stream in list(self._streams):
                failed = stream._error
                if failed is not None and any(failed is e for e in chain) and not stream._closed:
                    # In stream order: work enqueued before the report still sees the error.
                    # A stream closed meanwhile runs nothing new; the others still get theirs.
                    with contextlib.suppress(RuntimeError):
                        stream.enqueue(functools.partial(_clear_error, failed))
        return True

    @property
    def reported_failures(self) -> int:
        """How many failures host syncs have reported so far.

        A report counts and enqueues its clears at once (under one lock), before
        the streams it reached run again. So work that a compute launched after
        its first read ran on output a skipped or failed kernel never wrote only
        if a report cleared that failure after the read, and the count moved: a
        compute that finds it unchanged at its end may trust its results' events.
        """
        with self._report_lock:
            return self._reports

    def _reported(self, error: KernelError) -> bool:
        return error in self._reported_errors

    def _stack(self) -> list[Stream]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def _push(self, stream: Stream) -> None:
        self._stack().append(stream)

    def _pop(self) -> None:
        self._stack().pop()

    def current_stream(self) -> Stream:
        """The stream current in this thread, or the default stream."""
        stack = self._stack()
        return stack[-1] if stack else self.default_stream

    @contextmanager
    def task(self, key: Any) -> Iterator[None]:
        """Label launches made in this thread with ``key`` (for :class:`KernelError`)."""
        previous = getattr(self._local, "key", None)
        self._local.key = key
        try:
            yield
        finally:
            self._local.key = previous

    def current_key(self) -> Any:
        return getattr(self._local, "key", None)

    def synchronize(self) -> None:
        """Block until the default stream is idle (other streams do not sync with it)."""
        self.default_stream.synchronize()
