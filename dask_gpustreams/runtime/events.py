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
    drop with those that append (:meth:`drop_done` reads the last pair, then
    clears). A queue of several streams' events (the pinned pool's) may use
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
        """Drop the pairs whose event is ``done``: all of them after one query when the
        last one is (after a graph's final sync, the common case), else front first."""
        if self and done(self[-1][0]):
            self.clear()
        else:
            self.pop_done(done)


class EventPool:
    """Timing-free events of one backend, handed out again once complete and unreferenced.

    Callers give events back with :meth:`release` only when nothing else will
    wait on or query them (their task records are gone). An event is handed
    out again only once it has completed, so re-recording it can never move a
    wait that is still to be enqueued. At most :attr:`capacity` are kept.
    """

    capacity = 8192

    def __init__(self, backend: Backend):
        self._backend = backend
        self._free: deque[Any] = deque()
        self._lock = threading.Lock()

    def acquire(self) -> Any:
        """A completed released event, or a new one (the oldest released is tried only)."""
        free = self._free
        if free:
            with self._lock:
                if free and self._backend.done(free[0]):
                    return free.popleft()
        return self._backend.create_event()

    def release(self, events: Iterable[Any]) -> None:
        """Give back ``events`` (in the order they were recorded) for reuse."""
        free = self._free
        with self._lock:
            free.extend(events)
            while len(free) > self.capacity:
                free.popleft()

    def clear(self) -> None:
        """Drop every released event."""
        with self._lock:
            self._free.clear()

    def __len__(self) -> int:
        return len(self._free)
