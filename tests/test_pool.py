"""The stream pool under concurrent use: back-pressure, in-flight queues and locks."""

from __future__ import annotations

import threading

from dask_gpustreams import sim
from dask_gpustreams.backends.sim import SimBackend
from dask_gpustreams.runtime import StreamPool
from dask_gpustreams.runtime.events import EventPool, InflightQueue

#: Seconds a test waits for a thread that should be done at once (generous: a loaded CI).
TIMEOUT = 10.0


class SignallingBackend(SimBackend):
    """The sim backend, setting ``waiting`` when a host thread starts to wait for an event."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = threading.Event()

    def event_error(self, event: sim.Event) -> BaseException | None:
        self.waiting.set()
        return super().event_error(event)


class HeldBackend(SimBackend):
    """The sim backend whose events complete only once in ``finished``; counts queries.

    Nothing is recorded on the device, so the test alone says what is done.
    """

    def __init__(self) -> None:
        super().__init__()
        self.finished: set = set()
        self.queries = 0

    def record(self, event: sim.Event, stream: sim.Stream) -> None:
        pass

    def done(self, event: sim.Event) -> bool:
        self.queries += 1
        return event in self.finished


def test_inflight_queue_pops_done_pairs_from_the_front_only():
    events = [sim.Event() for _ in range(4)]
    queue = InflightQueue((e, i) for i, e in enumerate(events))
    finished = {events[0], events[1], events[3]}  # events[3] is behind one not done
    assert queue.pop_done(finished.__contains__) == [0, 1]
    assert [payload for _, payload in queue] == [2, 3]
    assert queue.pop_done(finished.__contains__) == []


def test_collect_after_the_last_event_completed_drops_all_with_one_query():
    """After a graph's final sync a stream's whole queue is done: its last event says so,
    and the earlier ones (done before it, in stream order) need no query each."""
    events = [sim.Event() for _ in range(4)]
    queries = []

    def done(event):
        queries.append(event)
        return event is not events[2]

    queue = InflightQueue((e, i) for i, e in enumerate(events))
    queue.drop_done(done)
    assert (len(queue), queries) == (0, [events[3]])
    queue = InflightQueue((e, i) for i, e in enumerate(events[:3]))
    queries.clear()
    queue.drop_done(done)  # the last one is not done: the done prefix by bisection
    assert [payload for _, payload in queue] == [2]
    assert queries == [events[2], events[1]]


def test_collect_finds_the_done_prefix_of_a_long_queue_in_log_queries():
    """Events of one stream complete in order: the 40 done of 64 go after 7 queries, not
    41 (a query costs 0.3-3 us on a busy H200), and none of the other 24 goes."""
    events = [sim.Event() for _ in range(64)]
    finished = set(events[:40])
    queries = []

    def done(event):
        queries.append(event)
        return event in finished

    queue = InflightQueue((e, i) for i, e in enumerate(events))
    queue.drop_done(done)
    assert [payload for _, payload in queue] == list(range(40, 64))
    assert len(queries) <= 7


def test_back_pressure_waits_for_the_device_without_the_slot_lock():
    """A record blocked behind the oldest task leaves the slot's queries free.

    ``load`` runs under the pool's assign lock, so a query waiting for a
    back-pressured record would stall every stream's assignment.
    """
    backend = SignallingBackend()
    pool = StreamPool(backend, 1)
    pool.max_inflight = 1
    (slot,) = pool.slots
    gate = threading.Event()
    try:
        with backend.use_stream(slot.stream):
            sim.launch(gate.wait, TIMEOUT)
        first, second = backend.create_event(), backend.create_event()
        assert pool.record(slot, first, "first") == 1
        seqs = []
        host = threading.Thread(target=lambda: seqs.append(pool.record(slot, second, "second")))
        host.start()
        assert backend.waiting.wait(TIMEOUT)  # the second record waits for the first task
        loads = []
        query = threading.Thread(target=lambda: loads.append(pool.load(slot)))
        query.start()
        query.join(TIMEOUT)
        assert loads == [1]  # answered while the record still waits
        assert host.is_alive() and [refs for _, refs in slot.inflight] == ["first"]
    finally:
        gate.set()
    host.join(TIMEOUT)
    assert seqs == [2]
    assert [refs for _, refs in slot.inflight] == ["second"]  # "first" went once done
    pool.synchronize()


def test_event_pool_hands_out_events_known_done_without_a_query():
    backend = HeldBackend()
    events = EventPool(backend)
    unknown, known = sim.Event(), sim.Event()
    events.release([unknown])
    assert events.acquire() is not unknown  # asked, and not done: a new event instead
    assert backend.queries == 1
    events.release([known], done=True)
    assert events.acquire() is known
    assert backend.queries == 1
    backend.finished.add(unknown)
    assert events.acquire() is unknown
