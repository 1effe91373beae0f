"""A device's pool of compute streams and the work still in flight on each."""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from dask_gpustreams.backends.base import Backend
from dask_gpustreams.runtime.events import InflightQueue

#: Default of :attr:`StreamPool.max_inflight`: bounds the inputs held per stream.
MAX_INFLIGHT = 256
#: Seconds :meth:`StreamPool.close` waits for each stream's end after its work is done.
STREAM_END_TIMEOUT = 10.0


class StreamSlot:
    """One stream of a pool, with the tasks recorded on it that are not known to be done.

    ``inflight`` holds ``(event, refs)`` pairs in stream order: ``refs`` are the
    task's inputs, kept alive until its event completes, so no input block goes
    back to a memory pool while a kernel on this stream may still read it.
    """

    __slots__ = (
        "index",
        "stream",
        "priority",
        "inflight",
        "_assigned",
        "lock",
        "seq",
        "waited",
        "waits",
    )

    def __init__(self, index: int, stream: Any, priority: int):
        self.index = index
        self.stream = stream
        self.priority = priority
        self.inflight = InflightQueue()
        # One token per task assigned to this stream whose event is not recorded yet
        # (deque appends and pops are atomic, so counting takes no lock).
        self._assigned: deque[None] = deque()
        self.lock = threading.Lock()
        # Number of events recorded on this stream, and for each other slot the
        # highest such number this stream already waits for.
        self.seq = 0
        self.waited: dict[int, int] = {}
        #: Event waits enqueued on this stream for other streams' work (a plain counter:
        #: concurrent tasks on one stream may rarely lose an increment).
        self.waits = 0

    @property
    def pending(self) -> int:
        """Tasks assigned to this stream whose event is not recorded yet."""
        return len(self._assigned)

    def __repr__(self) -> str:
        return f"<StreamSlot {self.index} priority={self.priority} inflight={len(self.inflight)}>"


@dataclass(frozen=True)
class StreamStats:
    """What one stream of a pool is doing, read at once (:meth:`StreamPool.stats`).

    Counters are read as they are, without the slot's lock: a snapshot that
    concurrent tasks may leave behind by a few.
    """

    #: ``"compute"``, ``"h2d"`` or ``"d2h"``: the pool the stream belongs to.
    kind: str
    #: The stream's index in its pool.
    index: int
    #: Events recorded on the stream: tasks run (compute) or copies (h2d, d2h).
    recorded: int
    #: Event waits enqueued on the stream for other streams' work.
    waits: int
    #: Tasks assigned to the stream whose event is not recorded yet.
    launching: int
    #: Recorded events not complete, asked of the device now; None where not asked.
    in_flight: int | None
    #: What the events not yet seen complete hold (each task's inputs and holds, in
    #: stream order): released once the events are seen complete.
    held: tuple


class PoolView(Protocol):
    """What a stream policy reads of a pool; it assigns and records nothing.

    None of these waits for the device: a pool's locks are never held across
    a device wait, so a policy may call them under :attr:`StreamPool.assign_lock`.
    """

    n_high_priority: int

    @property
    def slots(self) -> Sequence[StreamSlot]:
        """The streams, created on first use."""

    def load(self, slot: StreamSlot) -> int:
        """Tasks assigned to ``slot`` whose completion event has not been seen to fire."""

    def is_tail(self, slot: StreamSlot, seq: int) -> bool:
        """Whether event number ``seq`` ends ``slot``'s work: none recorded or assigned since."""

    def is_idle(self, slot: StreamSlot) -> bool:
        """Whether ``slot`` has no work left: nothing assigned, its last event complete.

        One event query at most, and nothing released (cheaper than :meth:`load`).
        """


class StreamPool:
    """``n_streams`` streams of one backend, created on first use.

    Streams are created lazily, in the thread that first runs a task, so a
    pool built before dask-cuda or RMM set up the CUDA context still works.
    The first ``n_high_priority`` streams get the device's most urgent priority.
    """

    def __init__(self, backend: Backend, n_streams: int, n_high_priority: int = 0):
        self.backend = backend
        self.n_streams = n_streams
        self.n_high_priority = min(n_high_priority, n_streams)
        self._slots: list[StreamSlot] | None = None
        self._lock = threading.Lock()
        self._closed = False
        #: Tasks queued on one stream before recording another waits for the oldest.
        self.max_inflight = MAX_INFLIGHT
        #: Held while a task's stream is chosen, so concurrent choices see each other.
        self.assign_lock = threading.Lock()

    #: The streams, created on first read (:meth:`__getattr__`); later reads are plain
    #: attribute reads. Read once per task (by every policy), so it costs no call.
    slots: Sequence[StreamSlot]

    def __getattr__(self, name: str) -> Any:
        """Create :attr:`slots` at its first read (only then is it missing)."""
        if name != "slots":
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        with self._lock:
            if self._slots is None:
                if self._closed:
                    raise RuntimeError("this stream pool is closed (its runtime was closed)")
                high = self.backend.high_priority() if self.n_high_priority else 0
                self._slots = [
                    StreamSlot(
                        i,
                        self.backend.create_stream(high if i < self.n_high_priority else 0),
                        high if i < self.n_high_priority else 0,
                    )
                    for i in range(self.n_streams)
                ]
                self.slots = self._slots  # under the lock: a close() cannot come between
            return self._slots

    def started(self) -> bool:
        """Whether the streams exist yet."""
        return self._slots is not None

    def streams(self) -> list[tuple[int, Any]]:
        """``(index, stream)`` of each stream (created at the first call)."""
        return [(slot.index, slot.stream) for slot in self.slots]

    def stats(self, kind: str, query: bool = True) -> list[StreamStats]:
        """A :class:`StreamStats` of each stream, none before they exist; takes no lock.

        ``query``: ask the device which recorded events are complete (``in_flight``);
        else ``in_flight`` is None. Releases nothing and creates no stream.
        """
        slots = self._slots
        if slots is None:
            return []
        done = self.backend.done
        stats = []
        for slot in slots:
            entries = tuple(slot.inflight)  # a copy under the GIL: no lock
            in_flight = sum(1 for event, _ in entries if not done(event)) if query else None
            stats.append(
                StreamStats(
                    kind,
                    slot.index,
                    slot.seq,
                    slot.waits,
                    slot.pending,
                    in_flight,
                    tuple(refs for _, refs in entries),
                )
            )
        return stats

    def wait_event_all(self, event: Any) -> None:
        """Make every stream wait (on the device) for ``event`` (creating the streams)."""
        wait = self.backend.wait_event
        for slot in self.slots:
            wait(slot.stream, event)

    def wait_all(self) -> None:
        """Block until the work enqueued so far on every stream is done; none created.

        Errors stay with the events of the work that failed (a stream sync would
        report them here, and on the simulated device clear them).
        """
        backend = self.backend
        for slot in self._slots or ():
            with backend.on_device():
                event = backend.create_event()
            backend.record(event, slot.stream)
            backend.event_error(event)  # waits; the error is its task's event's to report

    def synchronize_quietly(self) -> None:
        """Block until every stream is idle, ignoring the errors of its work; none created.

        Releases nothing: what the events hold goes at the next collect.
        """
        for slot in self._slots or ():
            with contextlib.suppress(Exception):  # the error being cleared, or one an event has
                self.backend.synchronize_stream(slot.stream)

    def collect(self, slot: StreamSlot) -> int:
        """Drop completed work from ``slot``'s in-flight queue; return how much is left."""
        inflight = slot.inflight
        with slot.lock:
            inflight.drop_done(self.backend.done)
            return len(inflight)

    def assign(self, slot: StreamSlot) -> None:
        """Count a task as assigned to ``slot`` until :meth:`record` records its event."""
        slot._assigned.append(None)

    def unassign(self, slot: StreamSlot) -> None:
        """Undo :meth:`assign` for a task that failed before its event was recorded."""
        slot._assigned.pop()

    def load(self, slot: StreamSlot) -> int:
        """Tasks assigned to ``slot`` whose completion event has not been seen to fire.

        Releases what completed tasks held, as :meth:`collect` does.
        """
        inflight = slot.inflight
        if inflight:
            with slot.lock:
                inflight.pop_done(self.backend.done)
        return len(inflight) + len(slot._assigned)

    def is_tail(self, slot: StreamSlot, seq: int) -> bool:
        """Whether event number ``seq`` ends ``slot``'s work: none recorded or assigned since."""
        return seq == slot.seq and not slot._assigned

    def is_idle(self, slot: StreamSlot) -> bool:
        """Whether ``slot`` has no work left: nothing assigned, its last event complete.

        One event query at most, and nothing released (cheaper than :meth:`load`).
        """
        if slot._assigned:
            return False
        with slot.lock:  # a concurrent pop_done may empty the queue
            last = slot.inflight[-1][0] if slot.inflight else None
        return last is None or self.backend.done(last)

    def next_seq(self, slot: StreamSlot) -> int:
        """The number of the next event recorded on ``slot``; takes no lock (safe in a finalizer).

        :meth:`record` counts an event before it enqueues it, so the event numbered
        this, and every later one, is enqueued after anything enqueued on ``slot``
        before this call: once it completes, so has all that.
        """
        return slot.seq + 1

    def reached(self, slot: StreamSlot, seq: int, query: bool) -> bool:
        """Whether ``slot``'s work up to its event number ``seq`` is known complete.

        Known from the events already seen complete (no query); with ``query``, also
        when the stream is idle: nothing assigned and its last event complete (one
        query), whether or not event ``seq`` was recorded. Never blocks: False while
        another caller holds the slot's lock (a finalizer may run under it).
        """
        if not slot.lock.acquire(blocking=False):
            return False
        try:
            if slot.seq - len(slot.inflight) >= seq:  # the events popped, all complete
                return True
            if not query or slot._assigned:
                return False
            last = slot.inflight[-1][0] if slot.inflight else None
        finally:
            slot.lock.release()
        return last is None or self.backend.done(last)

    def collect_all(self) -> int:
        """:meth:`collect` every stream; return the work still in flight."""
        left = 0
        for slot in self._slots or ():  # a loop, not a generator: no call per stream
            left += self.collect(slot)
        return left

    def record(self, slot: StreamSlot, event: Any, refs: Any, assigned: bool = False) -> int:
        """Record ``event`` on ``slot``, holding ``refs`` until it completes; return its number.

        ``assigned``: the event ends a task counted by :meth:`assign`. With
        :attr:`max_inflight` tasks in flight on ``slot``, first waits for the
        oldest (back-pressure), without holding the slot's lock, so the
        queries of other threads (:meth:`load`, under the assign lock) never
        wait for the device.
        """
        inflight = slot.inflight
        while True:
            with slot.lock:
                inflight.pop_done(self.backend.done)
                if len(inflight) < self.max_inflight:
                    # Counted before it is enqueued (see next_seq), uncounted if it fails.
                    slot.seq += 1
                    try:
                        self.backend.record(event, slot.stream)
                    except BaseException:
                        slot.seq -= 1
                        raise
                    inflight.append((event, refs))
                    if assigned:
                        slot._assigned.pop()
                    return slot.seq
                oldest = inflight[0][0]
            # Back-pressure: the host is far ahead of this stream, and every task
            # queued holds its inputs; wait (never raise) for the oldest one.
            self.backend.event_error(oldest)

    def wait(self, slot: StreamSlot, producer: StreamSlot, event: Any, seq: int) -> None:
        """Make ``slot`` wait for ``producer``'s event number ``seq`` unless it already does.

        Takes no lock: a wait is noted only after it is enqueued, so a task that
        skips its own wait is launched behind it; racing notes at worst repeat a wait.
        """
        waited = slot.waited
        index = producer.index
        if waited.get(index, 0) >= seq:
            return
        self.backend.wait_event(slot.stream, event)
        slot.waits += 1
        if seq > waited.get(index, 0):
            waited[index] = seq

    def close(self) -> None:
        """Wait for the work enqueued on the streams, then drop them and all they held.

        Errors of that work are not raised. The streams are destroyed (a
        simulated stream's thread is joined, up to :data:`STREAM_END_TIMEOUT`
        seconds). Later uses of :attr:`slots` raise ``RuntimeError``, and so
        does, on the simulated device, work enqueued by a thread still holding a slot.
        """
        with self._lock:
            self._closed = True
            slots, self._slots = self._slots, None
            vars(self).pop("slots", None)  # later reads go to __getattr__, and raise
        for slot in slots or ():
            with contextlib.suppress(Exception):  # the work's errors belong to its events
                self.backend.synchronize_stream(slot.stream)
            slot.inflight.clear()
        for slot in slots or ():
            # Now, not when the last reference goes: records and tasks kept elsewhere (a
            # closed worker's task states) refer to the slots; a simulated stream's
            # thread has ended when this returns.
            self.backend.destroy_stream(slot.stream, STREAM_END_TIMEOUT)

    def synchronize(self) -> None:
        """Block until every stream of the pool is idle; release everything held."""
        if self._slots is None:
            return
        for slot in self._slots:
            self.backend.synchronize_stream(slot.stream)
        self.collect_all()
