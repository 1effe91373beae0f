"""Completion events: work in flight behind them, and events reused across graphs."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from dask_gpustreams.backends.base import Backend


class InflightQueue(deque):
    """``(event, payload)`` pairs in the order their events were recorded on one stream.

    Events of one stream complete in that order, so the completed ones are
    always at the front. Not locked: its owner serializes the calls that pop or
    drop with those that append (:meth:`drop_done` reads pairs, then drops
    them). A queue of several streams' events (the pinned pool's) may use
    :meth:`pop_done` only.
    """

    __slots__ = ()

    def pop_done(self, done: Callable[[Any], bool]) -> list[Any]:
        """Pop the pairs whose event is ``done``, front first; return their payloads."""
        payloads = []
        while self and done(self[0][0]):
            payloads.append(self.popleft()[1])
        return payloads

    def drop_done(self, done: Callable[[Any], bool]) -> None:
        """Drop the pairs whose event is ``done``, in one stream's queue.

        Events of one stream complete in order, so the done ones are a prefix,
        found by bisection: all of them after one query when the last one is (after
        a graph's final sync, the common case), else in about log2(len) queries,
        not one per pair. An event reused from :class:`EventPool` is re-recorded
        only once its earlier recording has completed, so a done answer still
        means that every pair before it is done.
        """
        if not self:
            return
        if done(self[-1][0]):
            self.clear()
            return
        lo, hi = 0, len(self) - 1  # pairs before lo are done; those from hi on are not
        while lo < hi:
            mid = (lo + hi) // 2
            if done(self[mid][0]):
                lo = mid + 1
            else:
                hi = mid
        for _ in range(lo):
            self.popleft()


class EventPool:
    """Timing-free events of one backend, handed out again once complete and unreferenced.

    Callers give events back with :meth:`release` only when nothing else will
    wait on or query them (their task records are gone). An event is handed
    out again only once it has completed, so re-recording it can never move a
    wait that is still to be enqueued: those released as done (the caller saw
    their streams drain) without asking the device, the others once a query says
    so. At most :attr:`capacity` are kept.
    """

    capacity = 8192

    def __init__(self, backend: Backend):
        self._backend = backend
        self._free: deque[Any] = deque()  # in the order recorded: the oldest is asked first
        self._done: deque[Any] = deque()  # known done: handed out with no query
        self._lock = threading.Lock()

    def acquire(self) -> Any:
        """A completed released event, or a new one.

        One known done, with no query (an event query is the launcher's
        dearest device call per task: 0.3-3 us on a busy H200); else the
        oldest released, if a query says it is done.
        """
        known = self._done
        if known:
            try:
                return known.pop()
            except IndexError:  # another thread took the last one
                pass
        free = self._free
        if free:
            with self._lock:
                if free and self._backend.done(free[0]):
                    return free.popleft()
        return self._backend.create_event()

    def release(self, events: Iterable[Any], done: bool = False) -> None:
        """Give back ``events`` (about in the order they were recorded) for reuse.

        ``done``: every one of them is known to have completed (the streams they
        were recorded on have drained since), so none needs a query.
        """
        kept = self._done if done else self._free
        with self._lock:
            kept.extend(events)
            while len(self._done) + len(self._free) > self.capacity:
                (self._free or self._done).popleft()

    def clear(self) -> None:
        """Drop every released event."""
        with self._lock:
            self._free.clear()
            self._done.clear()

    def __len__(self) -> int:
        return len(self._free) + len(self._done)
