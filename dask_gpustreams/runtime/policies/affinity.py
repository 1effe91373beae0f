"""Policies that follow the data: affinity and its load-aware variant, auto."""

from __future__ import annotations

from dask_gpustreams.runtime.policies.base import (
    StreamPolicy,
    TaskInfo,
    least_loaded,
    register_policy,
)
from dask_gpustreams.runtime.pool import StreamPool, StreamSlot


def _claim_producer_stream(task: TaskInfo) -> StreamSlot | None:
    """The stream of the first producer this task is the first consumer of, if any."""
    for record in task.producers:
        if task.registry.claim(record):
            return record.slot
    return None


@register_policy
class Affinity(StreamPolicy):
    """A producer's first consumer stays on the producer's stream; others spread.

    A chain thus runs on one stream with no event wait at all. Tasks that are
    no first consumer go to the least-loaded stream.
    """

    name = "affinity"

    def select(self, task: TaskInfo, pool: StreamPool) -> StreamSlot:
        slot = _claim_producer_stream(task)
        return slot if slot is not None else least_loaded(pool, pool.slots)


@register_policy
class Auto(StreamPolicy):
    """Affinity while it keeps streams balanced, least-loaded otherwise (the default).

    Staying on the producer's stream saves an event wait and keeps chains
    together (linear DAGs); it is refused when that stream already holds more
    queued work than the least-loaded one by ``slack`` tasks, which is what
    spreads fan-outs and tangled layers (diamond, tangled).
    """

    name = "auto"
    slack = 1

    def select(self, task: TaskInfo, pool: StreamPool) -> StreamSlot:
        spread = least_loaded(pool, pool.slots)
        slot = _claim_producer_stream(task)
        if slot is None or slot is spread:
            return spread
        if pool.collect(slot) <= pool.collect(spread) + self.slack:
            return slot
        return spread
