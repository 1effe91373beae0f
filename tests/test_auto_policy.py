"""The ``auto`` policy while the host runs far ahead of the device (the benchmark's regime).

Streams are held by a gate, so nothing completes while a whole graph is
assigned, as when kernels are long: every choice must then come from what
is queued, not from what has finished.
"""

from __future__ import annotations

import threading

import pytest

from dask_gpustreams import StreamsConfig, sim
from dask_gpustreams.runtime import EventRegistry, get_runtime

#: Seconds a test waits for a thread that should be done at once (generous: a loaded CI).
TIMEOUT = 10.0


@pytest.fixture
def blocked():
    """``run(key, producers, gate=None)``: a task through the runtime on 4 sim streams.

    The task reads its producers' keys (records in the graph's registry), and its
    kernel waits for ``gate`` (default: one gate opened when the test ends), so by
    default nothing completes while the graph is assigned. Returns its record.
    """
    runtime = get_runtime(StreamsConfig(backend="sim", streams=4, policy="auto"))
    held = threading.Event()
    registry = EventRegistry()

    def run(key, producers=(), gate=None):
        inputs = {r.key: None for r in producers}
        runtime.run(key, lambda inputs: sim.launch((gate or held).wait, 10), inputs, registry)
        return registry.get(key)

    yield run
    held.set()
    runtime.drain(registry)


def streams(records):
    return sorted(r.slot.index for r in records)


def test_chains_stay_on_their_streams(blocked):
    heads = [blocked(("c", i, 0)) for i in range(4)]
    assert streams(heads) == [0, 1, 2, 3]
    last = heads
    for d in range(1, 5):
        last = [blocked(("c", i, d), [last[i]]) for i in range(4)]
        assert [r.slot for r in last] == [h.slot for h in heads]


def test_fanouts_spread_behind_each_join(blocked):
    join = blocked("root")
    for d in range(3):
        branches = [blocked(("b", d, i), [join]) for i in range(4)]
        assert streams(branches) == [0, 1, 2, 3]  # no branch queued behind a sibling
        assert branches[0].slot is join.slot  # the first one needs no event
        join = blocked(("join", d), branches)


def test_layers_spread_when_every_stream_is_busy(blocked):
    # chainlink: (i, d) reads (i, d-1) and (i+1, d-1); all of layer d-1 is still queued.
    layer = [blocked(("l", i, 0)) for i in range(4)]
    for d in range(1, 5):
        layer = [blocked(("l", i, d), [layer[i], layer[(i + 1) % 4]]) for i in range(4)]
        assert streams(layer) == [0, 1, 2, 3]


def test_a_branch_avoids_a_stream_freed_early_and_taken_by_a_sibling(blocked):
    # One branch of a fan-out ends early; its stream takes the next fan-out's first
    # branch. The other branches must go to streams whose work the join waits for
    # anyway, not queue behind that sibling (equal queue lengths, unequal waits).
    done = threading.Event()
    done.set()
    root = blocked("root", gate=done)
    early = threading.Event()
    branches = [blocked(("b", i), [root], gate=early if i == 1 else None) for i in range(4)]
    assert streams(branches) == [0, 1, 2, 3]
    join = blocked("join", branches)
    early.set()
    branches[1].event.synchronize()
    after = [blocked(("c", i), [join]) for i in range(4)]
    assert streams(after) == [0, 1, 2, 3]


def test_levels_stay_with_their_tasks_when_a_stream_records_out_of_order():
    """Two threads on one stream: the task assigned second records its event first.

    Each record must carry its own task's level (the first task, on an idle
    stream, ends at level 1; the second, queued behind it, at 2), not the one
    planned for the event number it happened to get.
    """
    runtime = get_runtime(StreamsConfig(backend="sim", streams=1, policy="auto"))
    registry = EventRegistry()
    inside, recorded = threading.Event(), threading.Event()

    def first(inputs):
        inside.set()  # assigned, its event not recorded until the second's is
        recorded.wait(TIMEOUT)

    host = threading.Thread(target=runtime.run, args=("first", first, {}, registry))
    host.start()
    assert inside.wait(TIMEOUT)
    runtime.run("second", lambda inputs: None, {}, registry)
    recorded.set()
    host.join(TIMEOUT)
    assert not host.is_alive()
    runtime.drain(registry)
    one, two = registry.get("first"), registry.get("second")
    assert (one.seq, two.seq) == (2, 1)  # recorded in the other order
    assert (one.level, two.level) == (1, 2)
    # A consumer of the second task is ready after it: one level later.
    runtime.run("after", lambda inputs: None, {"second": None}, registry)
    assert registry.get("after").level == 3


def test_streams_that_drained_take_new_work_instead_of_a_busy_one(blocked):
    # Stream 0 holds one long task at level 1; streams 1-3 ran chains to level 5 and are
    # idle. By levels alone stream 0 ends first; new roots must see the drained streams
    # (asked one per selection, so within 4 selections) and leave stream 0 alone.
    chains = threading.Event()  # held while the chains are assigned: they spread
    long = blocked("long")
    last = [blocked(("c", i, 0), gate=chains) for i in range(3)]
    for d in range(1, 5):
        last = [blocked(("c", i, d), [last[i]], gate=chains) for i in range(3)]
    assert long.slot.index == 0 and streams(last) == [1, 2, 3]
    chains.set()
    for record in last:
        record.event.synchronize()
    roots = [blocked(("r", i)) for i in range(4)]
    behind_long = [r.key for r in roots if r.slot is long.slot]
    assert len(behind_long) <= 1, streams(roots)


def test_work_stays_on_one_stream_while_the_device_keeps_up(blocked):
    # Each task completes before the next is chosen (a host-bound graph): roots and chains
    # stay on the first stream, as on one, instead of spreading over idle streams (each
    # spread costs event waits, a memory arena and cuFFT plans of its own).
    done = threading.Event()
    done.set()
    placed = []
    for i in range(8):
        record = blocked(("root", i), gate=done)
        record.event.synchronize()
        link = blocked(("link", i), [record], gate=done)
        link.event.synchronize()
        placed += [record.slot.index, link.slot.index]
    assert placed == [0] * 16
