"""The stream runtime used directly (no scheduler): waits, events, lifetime, registry."""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
import weakref

import numpy as np
import pytest

from dask_gpustreams import KernelError, StreamsConfig, sim
from dask_gpustreams.backends import nvidia
from dask_gpustreams.backends.sim import SimBackend
from dask_gpustreams.runtime import (
    EventRegistry,
    StreamPool,
    StreamRuntime,
    TaskRecord,
    get_runtime,
)
from dask_gpustreams.runtime import lifetime as runtimes_module

N = 100
GATE_TIMEOUT = 5.0


def make_runtime(streams=2, policy="test-placement", **more):
    return get_runtime(StreamsConfig(backend="sim", streams=streams, policy=policy, **more))


def gated_fill(gate, value):
    def kernel(out):
        if not gate.wait(GATE_TIMEOUT):
            raise TimeoutError("gate never opened")
        out[...] = value

    return kernel


def produce(value, gate=None):
    """A task function: a new array filled with ``value`` (after ``gate``, if given)."""

    def task(inputs):
        out = sim.empty(N)
        if gate is None:
            sim.launch(lambda o: o.fill(value), out)
        else:
            sim.launch(gated_fill(gate, value), out)
        return out

    return task


def scale(key, factor, gate=None):
    """A task function: ``inputs[key] * factor`` in a new array (after ``gate``, if given)."""

    def kernel(out, x):
        if gate is not None and not gate.wait(GATE_TIMEOUT):
            raise TimeoutError("gate never opened")
        np.multiply(x, factor, out=out)

    def task(inputs):
        out = sim.empty(N)
        sim.launch(kernel, out, inputs[key])
        return out

    return task


@pytest.fixture
def waits(monkeypatch):
    """Records the (stream, event) of every device-side wait the runtime enqueues."""
    seen = []
    original = SimBackend.wait_event

    def spy(self, stream, event):
        seen.append((stream, event))
        original(self, stream, event)

    monkeypatch.setattr(SimBackend, "wait_event", spy)
    return seen


def test_get_runtime_is_one_per_config():
    a = make_runtime(streams=2, policy="round-robin")
    assert make_runtime(streams=2, policy="round-robin") is a
    b = make_runtime(streams=3, policy="round-robin")
    assert b is not a
    assert (a.pool.n_streams, b.pool.n_streams) == (2, 3)
    assert repr(a) == "<StreamRuntime backend=sim device=0 streams=2 policy='round-robin'>"


def test_streams_are_created_on_first_use(by_key):
    rt = make_runtime(streams=3)
    assert not rt.pool.started()
    assert rt.collect() == 0
    rt.run("a", produce(1.0), {}, EventRegistry())
    assert rt.pool.started()
    streams = [slot.stream for slot in rt.pool.slots]
    assert len(set(streams)) == 3
    assert all(isinstance(s, sim.Stream) for s in streams)
    assert sim.get_device().default_stream not in streams
    rt.pool.synchronize()


def test_consumer_waits_on_the_device_not_on_the_host(by_key, waits):
    by_key.update({"p": 0, "c": 1})
    rt = make_runtime()
    reg = EventRegistry()
    gate = threading.Event()
    x = rt.run("p", produce(7.0, gate), {}, reg)
    y = rt.run("c", scale("p", 2.0), {"p": x}, reg)  # returns although p is blocked
    assert not reg.get("c").event.done
    assert waits == [(rt.pool.slots[1].stream, reg.get("p").event)]
    gate.set()
    rt.synchronize(["c"], reg)
    np.testing.assert_array_equal(y._view, np.full(N, 14.0))
    assert rt.collect() == 0


def test_waits_only_for_the_latest_producer_on_another_stream(by_key, waits):
    by_key.update({"p1": 0, "p2": 0, "same": 0, "c1": 1, "c2": 1, "c3": 1})
    rt = make_runtime()
    reg = EventRegistry()
    gate = threading.Event()
    p1 = rt.run("p1", produce(1.0, gate), {}, reg)
    rt.run("same", scale("p1", 2.0), {"p1": p1}, reg)
    assert waits == []  # same stream: FIFO order suffices
    rt.run("c1", scale("p1", 3.0), {"p1": p1}, reg)
    assert len(waits) == 1
    rt.run("c2", scale("p1", 4.0), {"p1": p1}, reg)
    assert len(waits) == 1  # stream 1 already waits for p1
    p2 = rt.run("p2", produce(2.0), {}, reg)
    c3 = rt.run("c3", lambda inputs: inputs["p1"], {"p1": p1, "p2": p2}, reg)
    assert waits[1:] == [(rt.pool.slots[1].stream, reg.get("p2").event)]  # p2 covers p1
    assert reg.get("p2").seq > reg.get("p1").seq
    gate.set()
    rt.synchronize(["c3", "same", "c1", "c2"], reg)
    assert c3 is p1
    assert rt.collect() == 0


def test_completed_producers_need_no_host_sync(by_key):
    by_key.update({"p": 0, "c": 1})
    rt = make_runtime()
    reg = EventRegistry()
    x = rt.run("p", produce(5.0), {}, reg)
    rt.synchronize(["p"], reg)
    y = rt.run("c", scale("p", 2.0), {"p": x}, reg)
    rt.synchronize(["c"], reg)
    np.testing.assert_array_equal(y._view, np.full(N, 10.0))


def test_task_runs_with_its_stream_current_and_its_key(by_key):
    by_key.update({"k": 1})
    rt = make_runtime()
    seen = []

    def task(inputs):
        seen.append((sim.get_device().current_stream(), sim.get_device().current_key()))

    rt.run("k", task, {}, EventRegistry())
    assert seen == [(rt.pool.slots[1].stream, "k")]
    assert sim.get_device().current_stream() is sim.get_device().default_stream
    assert sim.get_device().current_key() is None


def produced_on_stream_0(by_key):
    """A runtime, its registry, ``p`` produced (and synced) on stream 0, a gate for ``c`` on 1."""
    by_key.update({"p": 0, "c": 1})
    rt = make_runtime()
    reg = EventRegistry()
    x = rt.run("p", produce(3.0), {}, reg)
    rt.synchronize(["p"], reg)
    return rt, reg, x, threading.Event()


def test_inputs_are_held_until_the_task_event_completes(by_key):
    rt, reg, x, gate = produced_on_stream_0(by_key)
    y = rt.run("c", scale("p", 2.0, gate), {"p": x}, reg)
    ref = weakref.ref(x)
    del x
    gc.collect()
    assert ref() is not None  # held by stream 1's in-flight work
    assert rt.collect() == 1
    gate.set()
    rt.synchronize(["c"], reg)
    assert rt.collect() == 0
    assert ref() is None
    np.testing.assert_array_equal(y._view, np.full(N, 6.0))


def test_inputs_are_held_when_the_task_raises_after_launching(by_key):
    rt, reg, x, gate = produced_on_stream_0(by_key)
    launch = scale("p", 2.0, gate)

    def task(inputs):
        launch(inputs)
        raise RuntimeError("host failure after a launch")

    with pytest.raises(RuntimeError, match="host failure after a launch"):
        rt.run("c", task, {"p": x}, reg)
    ref = weakref.ref(x)
    del x
    assert ref() is not None
    assert rt.collect() == 1
    # Registered, so that a drain of the registry waits for the kernels it launched.
    assert not reg.get("c").event.done
    gate.set()
    rt.drain(reg)
    assert reg.get("c").event.done
    rt.collect()
    assert ref() is None


def test_synchronize_waits_only_for_the_given_keys(by_key):
    by_key.update({"slow": 0, "fast": 1, "bad": 1})
    rt = make_runtime()
    reg = EventRegistry()
    gate = threading.Event()
    rt.run("slow", produce(1.0, gate), {}, reg)
    fast = rt.run("fast", produce(2.0), {}, reg)
    rt.synchronize(["fast", "unknown-key"], reg)
    np.testing.assert_array_equal(fast._view, np.full(N, 2.0))
    assert not reg.get("slow").event.done
    assert rt.collect() == 1

    def bad(inputs):
        sim.launch(lambda: [][1])

    rt.run("bad", bad, {}, reg)
    with pytest.raises(KernelError, match=r"^kernel launched by task 'bad' failed: IndexError"):
        rt.synchronize(["bad"], reg)
    gate.set()
    rt.synchronize(["slow"], reg)
    assert rt.collect() == 0


def test_timeline_records_tasks_with_device_times(by_key):
    by_key.update({"a": 0, "b": 1, "c": 0})
    rt = make_runtime(timeline=True)
    reg = EventRegistry()

    def sleepy(inputs):
        sim.launch(time.sleep, 0.03)

    for key in "abc":
        rt.run(key, sleepy, {}, reg)
    rt.pool.synchronize()
    records = list(rt.timeline)
    assert [(r.key, r.slot.index, r.seq) for r in records] == [
        ("a", 0, 1),
        ("b", 1, 1),
        ("c", 0, 2),
    ]
    for r in records:
        assert rt.backend.elapsed_ms(r.start, r.event) >= 30.0
    assert make_runtime(timeline=False).timeline is None


def test_pool_is_capped_at_the_hardware_queues(monkeypatch):
    monkeypatch.setattr(SimBackend, "hardware_queues", lambda self: 2)
    with pytest.warns(
        RuntimeWarning, match=r"gpustreams\.streams=4 exceeds the device's 2 hardware"
    ):
        rt = StreamRuntime(SimBackend(), StreamsConfig(backend="sim", streams=4, policy="auto"))
    assert rt.pool.n_streams == 2


def test_copy_streams_sharing_the_hardware_queues_are_logged_not_capped(monkeypatch, caplog):
    monkeypatch.setattr(SimBackend, "hardware_queues", lambda self: 8)
    config = StreamsConfig(backend="sim", streams=8, copy_streams=1)
    with caplog.at_level(logging.INFO, logger="dask_gpustreams"):
        rt = StreamRuntime(SimBackend(), config)
    assert rt.pool.n_streams == 8  # copy streams beyond the queues are not capped
    assert "8 compute and 2 copy streams share the device's 8 hardware queues" in caplog.text
    assert "CUDA_DEVICE_MAX_CONNECTIONS=10" in caplog.text


def test_runtime_asks_for_queues_before_cuda_starts(monkeypatch):
    events = []
    monkeypatch.setattr(runtimes_module, "reserve_hardware_queues", lambda n: events.append(n))
    real_resolve = runtimes_module.resolve_backend
    monkeypatch.setattr(
        runtimes_module, "resolve_backend", lambda name: events.append(name) or real_resolve(name)
    )
    get_runtime(StreamsConfig(backend="auto", streams=12, copy_streams=2))
    get_runtime(StreamsConfig(backend="sim", streams=12))
    assert events == [16, "auto", "sim"]  # 12 compute + 2 x 2 copy streams; none for sim


@pytest.mark.parametrize(
    "environ, started, n, expected",
    [
        ({}, False, 12, "12"),
        ({}, False, 40, "32"),  # CUDA's maximum
        ({}, False, 8, None),  # the default suffices
        ({}, True, 12, None),  # the driver has read it already
        ({}, None, 12, None),  # no NVIDIA driver
        ({"CUDA_DEVICE_MAX_CONNECTIONS": "4"}, False, 12, "4"),  # the user's value is kept
    ],
)
def test_reserve_hardware_queues(monkeypatch, environ, started, n, expected):
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(nvidia, "cuda_started", lambda: started)
    assert nvidia.reserve_hardware_queues(n) is (expected is not None and not environ)
    assert os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == expected


def test_registry():
    reg = EventRegistry()
    slot = StreamPool(SimBackend(), 1).slots[0]
    a, b = TaskRecord("a", slot, sim.Event(), 1), TaskRecord("b", slot, sim.Event(), 2)
    reg.add(a)
    reg.add(b)
    assert (len(reg), "a" in reg, reg.get("a"), reg.get("zz")) == (2, True, a, None)
    assert reg.records(["b", "zz", "a"]) == [b, a]
    assert reg.claim(a) is True
    assert reg.claim(a) is False
    reg.forget(["a", "zz"])
    assert (len(reg), "a" in reg) == (1, False)
    assert repr(b) == "<TaskRecord 'b' stream=0 seq=2>"


def test_discard_hands_the_record_back_for_its_caller_to_free():
    reg = EventRegistry()
    slot = StreamPool(SimBackend(), 1).slots[0]
    record = TaskRecord("a", slot, sim.Event(), 1)
    reg.add(record)
    assert (reg.discard("a"), reg.discard("a"), "a" in reg, len(reg)) == (record, None, False, 0)


def test_elapsed_time_needs_two_timing_events_as_on_cuda():
    """``cudaEventElapsedTime`` fails for an event created without timing (the backends'
    default): the sim's backend refuses it too, so a timing path that reads an untimed
    record fails on the sim, not first on a GPU."""
    backend = SimBackend()
    stream = backend.create_stream()
    timed, untimed = backend.create_event(timing=True), backend.create_event()
    later = backend.create_event(timing=True)
    for event in (timed, untimed, later):
        backend.record(event, stream)
    backend.synchronize_event(later)
    assert backend.elapsed_ms(timed, later) >= 0
    for start, end in ((untimed, later), (timed, untimed)):
        with pytest.raises(RuntimeError, match="created without timing"):
            backend.elapsed_ms(start, end)
    backend.destroy_stream(stream)


def test_pool_records_in_stream_order_and_skips_covered_waits():
    backend = SimBackend()
    pool = StreamPool(backend, 2)
    s0, s1 = pool.slots
    gate = threading.Event()
    with backend.use_stream(s0.stream):
        sim.launch(lambda: gate.wait(GATE_TIMEOUT))
    e1, e2 = backend.create_event(), backend.create_event()
    assert (pool.record(s0, e1, "first"), pool.record(s0, e2, "second")) == (1, 2)
    assert [refs for _, refs in s0.inflight] == ["first", "second"]
    pool.wait(s1, s0, e2, 2)
    pool.wait(s1, s0, e1, 1)  # covered by the wait for event 2
    assert s1.waited == {0: 2}
    assert pool.collect_all() == 2
    gate.set()
    pool.synchronize()
    assert (pool.collect(s0), len(s0.inflight)) == (0, 0)


def test_a_task_failing_before_its_event_leaves_no_pending_count(by_key, monkeypatch):
    rt = make_runtime(streams=2)
    by_key["t"] = 1
    monkeypatch.setattr(SimBackend, "create_event", lambda self, timing=False: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        rt.run("t", lambda inputs: None, {}, EventRegistry())
    assert [slot.pending for slot in rt.pool.slots] == [0, 0]


def test_host_far_ahead_of_a_stream_waits_for_its_oldest_task(by_key):
    """Back-pressure bounds the inputs held per stream; results stay exact."""
    rt = make_runtime(streams=1)
    rt.pool.max_inflight = 4
    gate = threading.Event()
    registry = EventRegistry()
    values = {}

    def add_one(key):
        def kernel(out, x):
            np.add(x, 1.0, out=out)

        def task(inputs):
            out = sim.empty(N)
            sim.launch(kernel, out, inputs[key])
            return out

        return task

    def chain():
        values["x0"] = rt.run("x0", produce(0.0, gate), {}, registry)
        for i in range(1, 10):
            prev = f"x{i - 1}"
            values[f"x{i}"] = rt.run(f"x{i}", add_one(prev), {prev: values[prev]}, registry)

    host = threading.Thread(target=chain)
    host.start()
    host.join(timeout=0.3)
    assert host.is_alive()  # blocked behind the gated first kernel
    assert len(rt.pool.slots[0].inflight) <= 4
    gate.set()
    host.join(GATE_TIMEOUT)
    rt.synchronize(["x9"], registry)
    np.testing.assert_array_equal(values["x9"]._view, np.full(N, 9.0))
