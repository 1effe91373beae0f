"""Completion events of task keys: where each key's result was produced and when it is ready."""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterable, Iterator
from typing import Any

from dask_gpustreams.runtime.pool import StreamSlot


class TaskRecord:
    """The stream a task ran on and the event recorded after its work."""

    __slots__ = ("key", "slot", "event", "seq", "start", "claimed", "level")

    def __init__(self, key: Hashable, slot: StreamSlot, event: Any, seq: int, start: Any = None):
        self.key = key
        self.slot = slot
        self.event = event
        self.seq = seq
        self.start = start  # a timing event recorded before the task's work, if timeline is on
        self.claimed = False  # set by the first consumer that takes this stream (affinity)
        self.level = 0  # when the task ends, in task durations, as its policy planned (auto)

    @property
    def timed(self) -> bool:
        """Whether the task has timing events (the timeline was on when it ran)."""
        return self.start is not None

    @property
    def stream_index(self) -> int:
        """The index, in its runtime's pool, of the stream the task ran on."""
        return self.slot.index

    def __repr__(self) -> str:
        return f"<TaskRecord {self.key!r} stream={self.slot.index} seq={self.seq}>"


class EventRegistry:
    """One :class:`TaskRecord` per key of a graph run (local) or of a worker (distributed).

    Entries go when their keys are forgotten, so a long-running process holds
    no growing state.
    """

    def __init__(self) -> None:
        self._records: dict[Hashable, TaskRecord] = {}
        self._planned: dict[Hashable, int] = {}  # levels of keys assigned, not yet added
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[Hashable]:
        return iter(list(self._records))

    def __contains__(self, key: Hashable) -> bool:
        return key in self._records

    def get(self, key: Hashable) -> TaskRecord | None:
        return self._records.get(key)

    def add(self, record: TaskRecord) -> None:
        """Register ``record``; it takes the level planned for its key, if any (:meth:`plan`)."""
        level = self._planned.pop(record.key, None)
        if level is not None:
            record.level = level
        self._records[record.key] = record

    def plan(self, key: Hashable, level: int) -> None:
        """Note the ``level`` of ``key``'s task, chosen when it is assigned, for its record.

        The record gets it when it is added, so the level stays with its task
        whatever order the tasks of one stream record their events in.
        """
        self._planned[key] = level

    def claim(self, record: TaskRecord) -> bool:
        """True for the first caller only: that consumer may reuse the producer's stream."""
        with self._lock:
            if record.claimed:
                return False
            record.claimed = True
            return True

    def forget(self, keys: Iterable[Hashable]) -> None:
        """Drop the entries of ``keys`` (missing keys are ignored)."""
        pop = self._records.pop
        unplan = self._planned.pop
        for key in keys:
            pop(key, None)
            unplan(key, None)

    def discard(self, key: Hashable) -> TaskRecord | None:
        """Drop the entry of ``key``; return its record (None if it had none).

        Freeing a record frees its event, a driver call on a GPU: a caller on a
        thread that must not wait for it (a worker's event loop) keeps it to free
        elsewhere.
        """
        self._planned.pop(key, None)
        return self._records.pop(key, None)

    def clear(self) -> None:
        """Drop every entry."""
        self._records.clear()
        self._planned.clear()

    def records(self, keys: Iterable[Hashable]) -> list[TaskRecord]:
        """The records of those ``keys`` that have one."""
        get = self._records.get
        return [r for k in keys if (r := get(k)) is not None]
