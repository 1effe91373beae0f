"""Policies that need nothing but the pool: round-robin and least-loaded."""

from __future__ import annotations

import itertools

from dask_gpustreams.runtime.policies.base import (
    StreamPolicy,
    TaskInfo,
    least_loaded,
    register_policy,
)
from dask_gpustreams.runtime.pool import PoolView, StreamSlot


@register_policy
class RoundRobin(StreamPolicy):
    """Each task on the next stream, in turn."""

    name = "round-robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def select(self, task: TaskInfo, pool: PoolView) -> StreamSlot:
        slots = pool.slots
        return slots[next(self._counter) % len(slots)]


@register_policy
class LeastLoaded(StreamPolicy):
    """The stream with the fewest tasks whose completion events have not fired."""

    name = "least-loaded"

    def select(self, task: TaskInfo, pool: PoolView) -> StreamSlot:
        return least_loaded(pool, pool.slots)
