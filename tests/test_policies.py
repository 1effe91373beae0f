"""Stream-assignment policies: their choices, the critical path, and adding a policy by name."""

from __future__ import annotations

import threading

import dask
import dask.threaded
import pytest
from dask import delayed
from dask.callbacks import Callback

from dask_gpustreams import StreamsConfig, sim
from dask_gpustreams.backends.sim import SimBackend
from dask_gpustreams.runtime import EventRegistry, StreamPool, TaskRecord, get_runtime
from dask_gpustreams.runtime.policies import (
    Affinity,
    Auto,
    CriticalPath,
    LeastLoaded,
    RoundRobin,
    StreamPolicy,
    TaskInfo,
    critical_keys,
    make_policy,
    policy_names,
    register_policy,
)

BUILTIN = {"auto", "round-robin", "least-loaded", "affinity", "critical-path"}


@pytest.fixture
def pool():
    """Three sim streams, and ``busy(slot, n)`` putting n incomplete events on a slot."""
    backend = SimBackend()
    pool = StreamPool(backend, 3)
    gate = threading.Event()

    def busy(index, n=1):
        slot = pool.slots[index]
        with backend.use_stream(slot.stream):
            sim.launch(lambda: gate.wait(5))
        for _ in range(n):
            pool.record(slot, backend.create_event(), None)

    pool.busy = busy
    yield pool
    gate.set()
    pool.synchronize()


def info(key="t", producers=(), registry=None, critical=None):
    return TaskInfo(key, tuple(producers), registry or EventRegistry(), critical)


def record_on(pool, index, key="producer"):
    return TaskRecord(key, pool.slots[index], sim.Event(), 1)


def test_builtin_policies_are_registered():
    assert set(policy_names()) >= BUILTIN
    for name, cls in [
        ("auto", Auto),
        ("round-robin", RoundRobin),
        ("least-loaded", LeastLoaded),
        ("affinity", Affinity),
        ("critical-path", CriticalPath),
    ]:
        assert type(make_policy(name)) is cls
    assert make_policy("round-robin") is not make_policy("round-robin")


def test_unknown_policy_names_the_allowed_ones():
    with pytest.raises(
        ValueError, match=r"^gpustreams\.policy='fastest' is invalid: allowed values are "
    ) as e:
        make_policy("fastest")
    assert str(e.value).endswith(" | ".join(policy_names()))
    assert all(name in str(e.value) for name in BUILTIN)


def test_a_policy_needs_a_name():
    class Nameless(StreamPolicy):
        def select(self, task, pool):
            return pool.slots[0]

    with pytest.raises(ValueError, match="Nameless needs a non-empty 'name' to be registered"):
        register_policy(Nameless)


def test_round_robin_cycles(pool):
    policy = RoundRobin()
    assert [policy.select(info(), pool).index for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_least_loaded_counts_incomplete_events(pool):
    policy = LeastLoaded()
    assert policy.select(info(), pool).index == 0  # all idle: the first
    pool.busy(0, 2)
    pool.busy(1, 1)
    assert policy.select(info(), pool).index == 2
    pool.busy(2, 1)
    assert policy.select(info(), pool).index == 1  # loads 2, 1, 1: the first of the least
    pool.busy(1, 1)
    assert policy.select(info(), pool).index == 2  # loads 2, 2, 1


def test_least_loaded_sees_completed_events(pool):
    backend = pool.backend
    for slot in pool.slots:
        with backend.use_stream(slot.stream):
            sim.launch(lambda: None)
        pool.record(slot, backend.create_event(), None)
    pool.synchronize()
    pool.busy(0, 1)
    assert LeastLoaded().select(info(), pool).index == 1


def test_affinity_only_the_first_consumer_takes_the_producer_stream(pool):
    policy = Affinity()
    registry = EventRegistry()
    producer = record_on(pool, 1)
    pool.busy(1, 1)  # the producer's stream is not the least loaded
    assert policy.select(info("c1", [producer], registry), pool).index == 1
    assert producer.claimed
    assert policy.select(info("c2", [producer], registry), pool).index == 0
    assert policy.select(info("c3", [producer], registry), pool).index == 0
    # no producer: least loaded
    assert policy.select(info("root", [], registry), pool).index == 0


def test_affinity_takes_the_first_unclaimed_producer(pool):
    registry = EventRegistry()
    first, second = record_on(pool, 1, "a"), record_on(pool, 2, "b")
    registry.claim(first)
    assert Affinity().select(info("c", [first, second], registry), pool).index == 2


def test_auto_follows_a_producer_only_at_the_tail_of_its_stream(pool):
    registry = EventRegistry()
    pool.busy(1, 2)
    producer = TaskRecord("p", pool.slots[1], sim.Event(), pool.slots[1].seq)
    # Nothing queued after the producer: stay, however loaded the stream is.
    assert Auto().select(info("c1", [producer], registry), pool).index == 1
    pool.busy(1, 1)  # unrelated work now follows the producer
    assert Auto().select(info("c2", [producer], registry), pool).index == 0
    # A task assigned to a stream but not yet recorded also follows its producer.
    other = TaskRecord("q", pool.slots[2], sim.Event(), pool.slots[2].seq)
    pool.assign(pool.slots[2])
    assert Auto().select(info("c3", [other], registry), pool).index == 0


def large(key, producers, registry):
    return TaskInfo(key, tuple(producers), registry, None, True)


def test_auto_runs_large_tasks_on_two_streams_after_inputs_anywhere(pool):
    """A large task goes to one of the first 2 streams, and its level counts an input on a
    stream it may not use: its consumers then wait for what it waits for."""
    registry = EventRegistry()
    auto = Auto()
    pool.busy(2, 3)
    producer = TaskRecord("far", pool.slots[2], sim.Event(), pool.slots[2].seq)
    producer.level = 10
    slot = auto.select(large("big", [producer], registry), pool)
    assert slot.index in (0, 1)
    record = TaskRecord("big", slot, sim.Event(), 1)
    registry.add(record)
    assert record.level == 11


def test_auto_asks_each_of_a_large_tasks_two_streams_in_turn(pool, monkeypatch):
    """Large and other tasks alternating: each kind asks its own streams whether they are
    idle, in turn, so every stream is asked (one shared turn skipped streams 3 and up)."""
    asked: list[int] = []
    monkeypatch.setattr(Auto, "queries", 0)  # only the turn's question
    real_is_idle = type(pool).is_idle

    def is_idle(self, slot):
        asked.append(slot.index)
        return real_is_idle(self, slot)

    monkeypatch.setattr(type(pool), "is_idle", is_idle)
    auto, registry = Auto(), EventRegistry()
    for i in range(3):
        pool.busy(i, 1)
    auto._tail.update({0: 5, 1: 5, 2: 5})  # every stream has work planned
    for n in range(6):
        auto.select(large(("big", n), [], registry), pool)
        auto.select(info(("small", n), [], registry), pool)
    assert {0, 1, 2} <= set(asked), asked


def test_affinity_keeps_a_chain_on_one_stream(gpustreams):
    def step(x):
        out = sim.empty(4)
        sim.launch(lambda o, i: o.__setitem__(..., i + 1), out, x)
        return out

    def start():
        return sim.asarray([0.0] * 4)

    with gpustreams(streams=4, policy="affinity", timeline=True):
        node = delayed(start)(dask_key_name="chain-0")
        for i in range(1, 8):
            node = delayed(step)(node, dask_key_name=f"chain-{i}")
        result = node.compute()
        rt = get_runtime()
    assert result._view.tolist() == [7.0] * 4
    slots = {r.key: r.slot.index for r in rt.timeline}
    assert set(slots) == {f"chain-{i}" for i in range(8)}
    assert len(set(slots.values())) == 1


def test_affinity_spreads_a_fan_out(gpustreams):
    gate = threading.Event()

    def root():
        out = sim.empty(4)
        sim.launch(lambda o: (gate.wait(5), o.fill(1.0)), out)
        return out

    def leaf(x):
        out = sim.empty(4)
        sim.launch(lambda o, i: o.__setitem__(..., i), out, x)
        return out

    class OpenAfterLeaves(Callback):
        # The root's kernel stays blocked until every leaf has been placed.
        def _posttask(self, key, result, dsk, state, worker_id):
            if all(f"leaf-{i}" in state["finished"] for i in range(3)):
                gate.set()

    with gpustreams(streams=4, policy="affinity", timeline=True), OpenAfterLeaves():
        r = delayed(root)(dask_key_name="root")
        leaves = [delayed(leaf)(r, dask_key_name=f"leaf-{i}") for i in range(3)]
        results = dask.compute(*leaves)
        rt = get_runtime()
    assert [x._view.tolist() for x in results] == [[1.0] * 4] * 3
    slots = {r.key: r.slot.index for r in rt.timeline}
    on_root_stream = [k for k in slots if k != "root" and slots[k] == slots["root"]]
    assert len(on_root_stream) == 1  # the first consumer only; the root's stream is busy


def test_critical_keys_of_a_hand_graph():
    #   a -> b -> c -> e      (longest: 4 nodes)
    #   a -> d ------> e
    #   f -> g                (a separate short chain)
    deps = {"a": [], "b": ["a"], "c": ["b"], "d": ["a"], "e": ["c", "d"], "f": [], "g": ["f"]}
    assert critical_keys(deps) == {"a", "b", "c", "e"}


def test_critical_keys_keeps_every_longest_path_and_ignores_outside_keys():
    deps = {"x": ["outside"], "y1": ["x"], "y2": ["x"], "z": ["y1", "y2"], "w": []}
    assert critical_keys(deps) == {"x", "y1", "y2", "z"}
    assert critical_keys({}) == set()
    assert critical_keys({"solo": []}) == {"solo"}


@pytest.mark.parametrize("streams, high", [(1, 0), (2, 1), (4, 1), (8, 2), (9, 2)])
def test_critical_path_creates_high_priority_streams(streams, high):
    rt = get_runtime(StreamsConfig(backend="sim", streams=streams, policy="critical-path"))
    assert rt.pool.n_high_priority == high
    priorities = [slot.priority for slot in rt.pool.slots]
    assert priorities == [-1] * high + [0] * (streams - high)
    assert [slot.stream.priority for slot in rt.pool.slots] == priorities


@pytest.mark.parametrize("scheduler", ["gpustreams", pytest.param(dask.threaded.get, id="threads")])
def test_critical_path_places_critical_tasks_on_high_priority_streams(gpustreams, scheduler):
    """On the launcher and on the threaded route. (The launcher once told the policy no
    task's place on the critical path, and side tasks took the high-priority streams.)"""

    def make(*_):
        out = sim.empty(2)
        sim.launch(lambda o: o.fill(1.0), out)
        return out

    with gpustreams(streams=4, policy="critical-path", timeline=True):
        a = delayed(make)(dask_key_name="a")
        b = delayed(make)(a, dask_key_name="b")
        c = delayed(make)(b, dask_key_name="c")
        side = [delayed(make)(a, dask_key_name=f"side-{i}") for i in range(3)]
        dask.compute(delayed(make)(c, *side, dask_key_name="end"), scheduler=scheduler)
        rt = get_runtime()
    slots = {r.key: r.slot.index for r in rt.timeline}
    high = {k for k, i in slots.items() if i < rt.pool.n_high_priority}
    # Only critical tasks run on high-priority streams, and they win ties for them.
    assert high <= {"a", "b", "c", "end"}
    assert "a" in high


def test_critical_path_on_one_stream_uses_it(pool):
    one = StreamPool(SimBackend(), 1)
    assert CriticalPath().select(info(critical=True), one) is one.slots[0]
    assert CriticalPath().select(info(critical=False), one) is one.slots[0]


def test_a_registered_policy_is_usable_by_name(gpustreams):
    @register_policy
    class LastStream(StreamPolicy):
        name = "test-last-stream"

        def select(self, task, pool):
            return pool.slots[-1]

    assert "test-last-stream" in policy_names()
    assert StreamsConfig(policy="test-last-stream").policy == "test-last-stream"

    def where(_=None):
        return sim.get_device().current_stream()

    with gpustreams(streams=3, policy="test-last-stream", timeline=True):
        first = delayed(where)(dask_key_name="one")
        streams = dask.compute(first, delayed(where)(first, dask_key_name="two"))
        rt = get_runtime()
    assert type(rt.policy) is LastStream
    assert streams == (rt.pool.slots[2].stream,) * 2
    assert [(r.key, r.slot.index) for r in rt.timeline] == [("one", 2), ("two", 2)]
