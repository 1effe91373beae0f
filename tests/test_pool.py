"""The stream pool under concurrent use: back-pressure, in-flight queues and locks."""

from __future__ import annotations

from dask_gpustreams import sim
from dask_gpustreams.runtime.events import InflightQueue


def test_inflight_queue_pops_done_pairs_from_the_front_only():
    events = [sim.Event() for _ in range(4)]
    queue = InflightQueue((e, i) for i, e in enumerate(events))
    finished = {events[0], events[1], events[3]}  # events[3] is behind one not done
    assert queue.pop_done(finished.__contains__) == [0, 1]
    assert [payload for _, payload in queue] == [2, 3]
    assert queue.pop_done(finished.__contains__) == []
