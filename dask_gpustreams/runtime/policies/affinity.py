"""Policies that follow the data: affinity, and auto (stay at the tail of a producer's stream)."""

from __future__ import annotations

from dask_gpustreams.runtime.policies.base import (
    StreamPolicy,
    TaskInfo,
    least_loaded,
    register_policy,
)
from dask_gpustreams.runtime.pool import PoolView, StreamSlot


@register_policy
class Affinity(StreamPolicy):
    """A producer's first consumer stays on the producer's stream; others spread.

    A chain thus runs on one stream with no event wait at all. Tasks that are
    no first consumer go to the least-loaded stream.
    """

    name = "affinity"

    def select(self, task: TaskInfo, pool: PoolView) -> StreamSlot:
        for record in task.producers:
            if task.registry.claim(record):  # its first consumer: stay on its stream
                return record.slot
        return least_loaded(pool, pool.slots)


@register_policy
class Auto(StreamPolicy):
    """The stream on which the task can start first, counting in tasks (the default).

    Each task gets a level: one more than the latest of its inputs' levels and
    of the level its stream reaches before it, so a level estimates when a task
    ends in task durations, as a list scheduler would. A task follows a
    producer that is the last work of its stream (no event wait, nothing
    waited for in vain); otherwise it goes to a stream that is idle or whose
    queued work ends by the level of its inputs, preferring a producer's
    stream, else to the stream whose work ends first. So a chain stays on its
    stream (linear), and the branches of a fan-out and the nodes of a layer
    spread over streams whose work ends with their inputs' (diamond,
    chainlink, tangled) instead of queueing behind a sibling, even while the
    host runs far ahead of the device.

    It reads levels and asks the device little, one event query per ask:

    - whether the first :attr:`queries` streams it would pass over by level
      are idle (a producer's first, then the pool's in order), so that while
      the device keeps up with the host the work stays on few streams, as on
      one (fewer event waits, memory arenas and cuFFT plans);
    - whether one more stream, taken in turn, is idle; its level then drops
      to 0, so a stream that drained is seen within ``n_streams`` selections
      of tasks that do not follow a producer (one that does asks nothing).

    Streams with work of unknown level (recorded by other means) count their
    unfinished tasks instead.

    A large task (:attr:`TaskInfo.large`) goes to one of the first
    :attr:`large_streams` streams: its kernels fill the device on their own, so
    more streams would only run more of them at once in the memory they hold, and
    keep that many more free blocks cached (CuPy's pool keeps an arena per stream).

    A task's level goes with its record (:attr:`TaskRecord.level`, through
    :meth:`EventRegistry.plan`), so it stays the task's whatever order the
    events of one stream are recorded in. Called under the pool's assign lock
    (:attr:`StreamPool.assign_lock`); reads the pool through :class:`PoolView`.
    """

    name = "auto"
    #: Streams passed over by level that a selection asks whether they are idle.
    queries = 2
    #: The streams large tasks run on: one launching while the other runs.
    large_streams = 2

    def __init__(self) -> None:
        self._tail: dict[int, int] = {}  # stream -> level of its last assigned task
        self._probe = 0  # the stream asked next whether it is idle
        self._large_probe = 0  # the same, among the streams of large tasks

    def select(self, task: TaskInfo, pool: PoolView) -> StreamSlot:
        every = slots = pool.slots
        if task.large:
            slots = every[: self.large_streams]
        n = len(slots)
        tail = self._tail
        ready = 0  # the level at which the last input is ready
        mine: list[StreamSlot] = []  # the producers' streams, tried first
        tail_of: StreamSlot | None = None  # a producer's stream that ends with it
        for record in task.producers:
            producer = record.slot
            index = producer.index
            if index >= len(every) or every[index] is not producer:
                continue  # recorded by another pool
            if record.level > ready:
                ready = record.level
            if index >= n:
                continue  # not one of a large task's streams
            if producer not in mine:
                mine.append(producer)
            if tail_of is None and pool.is_tail(producer, record.seq):
                tail_of = producer
        if tail_of is not None:  # a chain goes on: no stream need be asked
            return self._assign(task, tail_of, ready)
        if task.large:
            probe = self._large_probe % n
            self._large_probe = probe + 1
        else:
            probe = self._probe % n
            self._probe = probe + 1
        if tail.get(probe, 0) and pool.is_idle(slots[probe]):
            tail[probe] = 0  # drained: any task can start on it at once
        best, best_start = slots[0], -1
        queries = self.queries
        for slot in (*mine, *(s for s in slots if s not in mine)) if mine else slots:
            start = tail.get(slot.index)
            if start is None:  # work of unknown level: count it
                start = ready + pool.load(slot)
            elif start > ready and queries:
                queries -= 1
                if pool.is_idle(slot):
                    start = ready
            if start <= ready:
                return self._assign(task, slot, ready)
            if best_start < 0 or start < best_start:
                best, best_start = slot, start
        return self._assign(task, best, best_start)

    def _assign(self, task: TaskInfo, slot: StreamSlot, start: int) -> StreamSlot:
        """Note the level ``task`` ends at on ``slot``: the stream's tail, and its record's."""
        self._tail[slot.index] = level = start + 1
        task.registry.plan(task.key, level)
        return slot
