"""The simulated stream device: FIFO streams, events, poisoned memory, deferred kernel errors.

Blocking kernels wait on a ``threading.Event`` that the test sets, so every
ordering below is forced, not hoped for. A kernel's gate has a timeout only so
that a broken device fails the test instead of hanging it.
"""

from __future__ import annotations

import gc
import pickle
import re
import threading
import time

import numpy as np
import pytest

from dask_gpustreams import KernelError, sim
from dask_gpustreams.sim import POISON_BYTE

GATE_TIMEOUT = 5.0
N = 1000

device = sim.get_device()


def gated(gate: threading.Event, fn=None):
    """A kernel that blocks until ``gate`` is set, then runs ``fn(*views)``."""

    def kernel(*views):
        if not gate.wait(GATE_TIMEOUT):
            raise TimeoutError("gate never opened")
        if fn is not None:
            fn(*views)

    return kernel


def fill(value):
    def kernel(out):
        out[...] = value

    return kernel


def copy(out, src):
    np.copyto(out, src)


def boom(*_):
    raise ValueError("boom")


def zeros_then_gated_ones(stream, gate: threading.Event):
    """Zeros, synced on ``stream``, that ``stream`` overwrites with ones once ``gate`` opens."""
    x = sim.asarray(np.zeros(N))
    stream.synchronize()
    sim.launch(gated(gate, fill(1.0)), x)
    return x


@pytest.fixture
def streams():
    return device.create_stream(), device.create_stream()


# --- streams ---------------------------------------------------------------------------------


def test_factories_only():
    with pytest.raises(TypeError, match=r"^Stream objects cannot be instantiated directly"):
        sim.Stream(device)
    with pytest.raises(TypeError, match=r"^SimArray objects cannot be instantiated directly"):
        sim.SimArray()


def test_launch_only_enqueues(streams):
    a, _ = streams
    gate = threading.Event()
    ran = []
    with a:
        t0 = time.perf_counter()
        sim.launch(gated(gate, lambda: ran.append("kernel")))
        returned_after = time.perf_counter() - t0
    # The kernel cannot have run: it waits for a gate only this thread opens.
    assert ran == []
    assert returned_after < GATE_TIMEOUT / 2
    gate.set()
    a.synchronize()
    assert ran == ["kernel"]


def test_dropped_stream_runs_its_pending_work_then_its_thread_ends():
    stream = device.create_stream()
    gate = threading.Event()
    ran = []
    with stream:
        sim.launch(gated(gate, lambda: ran.append("kernel")))
    thread = stream.thread
    event = stream.record()
    del stream  # garbage at once: nothing else refers to it, queued work aside
    gate.set()
    event.synchronize()
    assert ran == ["kernel"]
    thread.join(GATE_TIMEOUT)
    assert not thread.is_alive()


def test_a_stream_whose_memory_was_reused_still_ends():
    # The pool's per-stream free lists are keyed by stream id: they do not keep it alive.
    pool = sim.get_default_memory_pool()
    stream = device.create_stream()
    with stream:
        x = sim.asarray(np.ones(1000))
        del x  # its block goes to the stream's free list
        y = sim.empty(1000)  # reused from it
        y.fill(1.0)
        total = pool.total_bytes()
        assert (y + 1).get().sum() == 2000
    thread = stream.thread
    del stream  # y and its free list refer to the stream's id only
    thread.join(GATE_TIMEOUT)
    assert not thread.is_alive()
    del y  # the stream has ended: its block and free list are dropped
    assert pool.total_bytes() <= total - 8192


AT_EXIT = """
import atexit

def late():  # runs after the weakref finalizers' exit hook (atexit is last in, first out)
    import numpy as np
    from dask_gpustreams import sim
    print(sim.asarray(np.ones(3)).get().sum())

atexit.register(late)
from dask_gpustreams import sim
sim.get_device()
"""


def test_streams_still_run_in_atexit_code(run_python):
    assert run_python(AT_EXIT, timeout=30).strip() == "3.0"


def test_stream_is_fifo(streams, rng):
    order = {0: [], 1: []}

    def step(stream_id, i, delay):
        time.sleep(delay)
        order[stream_id].append(i)

    for i, delays in enumerate(rng.uniform(0, 0.002, size=(40, 2))):
        for stream_id, stream in enumerate(streams):
            with stream:
                sim.launch(step, stream_id, i, float(delays[stream_id]))
    for stream in streams:
        stream.synchronize()
    assert order == {0: list(range(40)), 1: list(range(40))}


def test_current_stream_is_per_thread_and_nested(streams):
    a, b = streams
    assert device.current_stream() is device.default_stream
    seen_elsewhere = []
    with a:
        assert device.current_stream() is a
        with b:
            assert device.current_stream() is b
            worker = threading.Thread(target=lambda: seen_elsewhere.append(device.current_stream()))
            worker.start()
            worker.join()
        assert device.current_stream() is a
    assert device.current_stream() is device.default_stream
    assert seen_elsewhere == [device.default_stream]


def test_launch_without_current_stream_uses_default_stream():
    gate = threading.Event()
    sim.launch(gated(gate))
    marker = device.default_stream.record()
    assert not marker.done
    gate.set()
    device.synchronize()
    assert marker.done


# --- events ----------------------------------------------------------------------------------


def test_event_wait_orders_work_across_streams(streams):
    a, b = streams
    gate = threading.Event()
    with a:
        x = sim.empty(N)
        sim.launch(gated(gate, fill(7.0)), x)
        produced = a.record()
    with b:
        b.wait_event(produced)
        y = sim.empty(N)
        sim.launch(copy, y, x)
        consumed = b.record()
    # b is blocked on the device by a's gated kernel; the host is not.
    assert not produced.done
    assert not consumed.done
    gate.set()
    consumed.synchronize()
    assert produced.done
    assert consumed.time >= produced.time
    np.testing.assert_array_equal(y._view, np.full(N, 7.0))


def test_without_event_wait_consumer_reads_unwritten_memory(streams):
    a, b = streams
    gate = threading.Event()
    with a:
        x = sim.empty(N)
        sim.launch(gated(gate, fill(7.0)), x)
    with b:
        y = sim.empty(N)
        sim.launch(copy, y, x)
        unordered = y.get()
    gate.set()
    a.synchronize()
    assert np.isnan(unordered).all()


def test_wait_on_completed_or_unrecorded_event_is_free(streams):
    a, b = streams
    never_recorded = sim.Event()
    assert never_recorded.done
    never_recorded.synchronize()
    with a:
        x = sim.asarray(np.arange(4.0))
    finished = a.record()
    finished.synchronize()
    gate = threading.Event()
    with b:
        sim.launch(gated(gate))
        b.wait_event(finished)
        b.wait_event(never_recorded)
    gate.set()
    b.synchronize()
    np.testing.assert_array_equal(x._view, np.arange(4.0))


def test_event_time_requires_completion(streams):
    a, _ = streams
    gate = threading.Event()
    with a:
        sim.launch(gated(gate))
    event = a.record()
    with pytest.raises(RuntimeError, match="event has not completed"):
        event.time  # noqa: B018
    gate.set()
    event.synchronize()
    assert isinstance(event.time, float)


def test_get_waits_for_the_current_stream_only(streams):
    a, b = streams
    gate = threading.Event()
    with a:
        x = zeros_then_gated_ones(a, gate)
    with b:
        seen_from_b = x.get()  # returns while a is still blocked
    assert not a.record().done
    gate.set()
    with a:
        seen_from_a = x.get()
    np.testing.assert_array_equal(seen_from_b, np.zeros(N))
    np.testing.assert_array_equal(seen_from_a, np.ones(N))
    assert sim.asnumpy(x).tolist() == [1.0] * N
    assert sim.asnumpy([1, 2]).tolist() == [1, 2]


# --- arrays and memory -----------------------------------------------------------------------


def test_asarray_stages_host_data_and_has_array_attributes():
    host = np.arange(12, dtype="int32").reshape(3, 4)
    x = sim.asarray(host)
    host[:] = -1  # staged at call time: the device copy is unaffected
    assert (x.shape, x.dtype, x.nbytes, x.ndim, x.size) == ((3, 4), np.dtype("int32"), 48, 2, 12)
    np.testing.assert_array_equal(x.get(), np.arange(12, dtype="int32").reshape(3, 4))
    assert sim.asarray(x) is x
    converted = sim.asarray(x, dtype="float64")
    assert converted.dtype == np.dtype("float64")
    np.testing.assert_array_equal(converted.get(), np.arange(12.0).reshape(3, 4))
    assert repr(x) == "<sim.SimArray shape=(3, 4) dtype=int32>"


@pytest.mark.parametrize("dtype", ["float64", "float32", "complex128"])
def test_empty_float_memory_is_nan(dtype):
    x = sim.empty((5, 3), dtype)
    assert x.shape == (5, 3)
    assert np.isnan(x.get()).all()


@pytest.mark.parametrize("dtype", ["int64", "int32", "uint8", "bool"])
def test_empty_integer_memory_is_poison_bytes(dtype):
    x = sim.empty(7, dtype)
    assert x.get().view(np.uint8).tolist() == [POISON_BYTE] * (7 * np.dtype(dtype).itemsize)
    assert POISON_BYTE == 0xA5


def test_reused_block_is_poisoned_in_the_new_allocation_stream_order(streams):
    a, _ = streams
    pool = sim.get_default_memory_pool()
    with a:
        x = sim.asarray(np.ones(N))
        out = sim.empty(N)
        a.synchronize()
        gate = threading.Event()
        sim.launch(gated(gate, copy), out, x)  # reads x's block later, on a
        block = x._block
        del x
        z = sim.empty(N)  # the same block, poisoned after the queued read
    assert z._block is block
    np.testing.assert_array_equal(z._view, np.ones(N))  # poison not applied yet
    gate.set()
    with a:
        np.testing.assert_array_equal(out.get(), np.ones(N))
        assert np.isnan(z.get()).all()
    assert pool.used_bytes() >= 2 * N * 8


def test_reused_int_block_is_poisoned():
    x = sim.asarray(np.zeros(64, dtype="int16"))
    x.get()
    block = x._block
    del x
    y = sim.empty(64, "int16")
    assert y._block is block
    assert y.get().view(np.uint8).tolist() == [POISON_BYTE] * 128


def gated_reader_on_b(a, b):
    """``x`` allocated on ``a`` and copied into ``y`` on ``b`` by a kernel held at ``gate``."""
    with a:
        x = sim.asarray(np.full(N, 3.0))
    done = a.record()
    gate = threading.Event()
    with b:
        b.wait_event(done)
        y = sim.empty(N)
        sim.launch(gated(gate, copy), y, x)
        read = b.record()
    return x, y, gate, read


def test_freed_block_read_by_another_stream_shows_poison(streams):
    """The lifetime hazard, on the device alone: x lives on a, a slow reader on b, x is
    dropped on the host and a allocates the same size while b still has to read x."""
    a, b = streams
    x, y, gate, read = gated_reader_on_b(a, b)
    del x  # back to a's free list at once, on the host
    with a:
        z = sim.empty(N)
    a.synchronize()  # a has poisoned the block
    gate.set()
    read.synchronize()
    assert np.isnan(y._view).all()
    del z


def test_freed_block_kept_alive_until_reader_event_is_safe(streams):
    a, b = streams
    x, y, gate, read = gated_reader_on_b(a, b)
    held = [(read, x)]  # what the runtime does: the input lives until the reader's event
    del x
    with a:
        z = sim.empty(N)
    a.synchronize()
    assert z._block is not held[0][1]._block
    gate.set()
    read.synchronize()
    held.clear()
    np.testing.assert_array_equal(y._view, np.full(N, 3.0))


def test_pool_keeps_a_free_list_per_stream():
    pool = sim.MemoryPool()
    block, reused = pool.malloc(8000, "s1")
    assert (block.nbytes, reused, pool.used_bytes(), pool.total_bytes()) == (
        8192,
        False,
        8192,
        8192,
    )
    pool.free(block)
    assert (pool.used_bytes(), pool.total_bytes()) == (0, 8192)
    other, reused = pool.malloc(8000, "s2")  # another stream's list is empty
    assert other is not block and not reused
    again, reused = pool.malloc(8100, "s1")  # same rounded size, same stream
    assert again is block and reused
    assert (pool.used_bytes(), pool.total_bytes()) == (16384, 16384)
    pool.free(other)
    pool.free_all_blocks()
    assert (pool.used_bytes(), pool.total_bytes()) == (8192, 8192)


def test_a_small_allocation_splits_a_free_chunk_and_keeps_its_allocation():
    """As CuPy's pool: the smallest free chunk large enough is split; while the small part
    lives its allocation cannot be freed; freed, the parts merge into one chunk again."""
    pool = sim.MemoryPool()
    big, _ = pool.malloc(1 << 20, "s1")
    pool.free(big)
    small, reused = pool.malloc(1000, "s1")
    assert reused and small.nbytes == 1024 and np.shares_memory(small.buffer, big.segment)
    assert (pool.used_bytes(), pool.total_bytes()) == (1024, 1 << 20)
    pool.free_all_blocks()
    assert pool.total_bytes() == 1 << 20  # kept whole for 1 KiB in use
    other, reused = pool.malloc(1 << 20, "s1")  # what is left is too small
    assert not reused and pool.total_bytes() == 2 << 20
    pool.free(small)
    whole, reused = pool.malloc(1 << 20, "s1")  # the parts merged back
    assert reused and whole.segment is big.segment and whole.nbytes == 1 << 20
    pool.free(whole)
    pool.free(other)
    pool.free_all_blocks()
    assert (pool.used_bytes(), pool.total_bytes()) == (0, 0)


def test_a_split_chunk_of_an_ended_stream_goes_with_its_last_part():
    pool = sim.MemoryPool()
    big, _ = pool.malloc(1 << 20, "s1")
    pool.free(big)
    small, _ = pool.malloc(1000, "s1")
    pool.stream_ended("s1")
    assert pool.total_bytes() == 1 << 20  # the free rest stays: its allocation is in use
    again, reused = pool.malloc(4096, "s1")  # the same id again: a new, empty arena
    assert not reused and pool.total_bytes() == (1 << 20) + 4096
    pool.free(small)
    assert (pool.used_bytes(), pool.total_bytes()) == (4096, 4096)


def test_pool_beyond_its_capacity_drops_free_blocks_then_raises():
    """As CuPy's pool when ``cudaMalloc`` fails: every stream's free blocks go first."""
    pool = sim.MemoryPool()
    pool.set_capacity(16384)
    assert pool.get_capacity() == 16384
    held, _ = pool.malloc(8000, "s1")
    other, _ = pool.malloc(8000, "s2")
    pool.free(other)  # 8192 bytes free, on s2's list only
    mine, reused = pool.malloc(8000, "s1")  # s1 has none: s2's are dropped to make room
    assert not reused and (pool.used_bytes(), pool.total_bytes()) == (16384, 16384)
    full = r"^Out of memory allocating 512 bytes \(allocated so far: 16,384 bytes\)\.$"
    with pytest.raises(sim.OutOfMemoryError, match=full):
        pool.malloc(100, "s1")
    assert (pool.used_bytes(), pool.total_bytes()) == (16384, 16384)  # nothing leaked
    pool.set_capacity(None)
    pool.malloc(100, "s1")  # unbounded: the pool grows
    with pytest.raises(ValueError, match=r"nbytes=-1 is invalid"):
        pool.set_capacity(-1)
    del held, mine


@pytest.mark.parametrize("nbytes", ["1 MiB", 1.5, True, float("nan")])
def test_a_pool_capacity_that_is_not_an_int_of_bytes_is_a_value_error_naming_it(nbytes):
    pool = sim.MemoryPool()
    pool.set_capacity(16384)
    with pytest.raises(ValueError, match="^" + re.escape(f"nbytes={nbytes!r} is invalid")):
        pool.set_capacity(nbytes)
    assert pool.get_capacity() == 16384


def test_pool_beyond_its_capacity_collects_garbage_before_it_raises():
    """As CuPy's pool: an array kept only by a reference cycle is collected to make room."""
    pool = sim.get_default_memory_pool()
    pool.free_all_blocks()
    pool.set_capacity(pool.used_bytes() + 8192)
    gc.disable()
    try:
        cycle = [sim.empty(1024)]  # 8192 bytes: the device is full
        cycle.append(cycle)
        del cycle
        again = sim.empty(1024)  # only the collection frees the first
    finally:
        gc.enable()
        pool.set_capacity(None)
    assert again.nbytes == 8192


def test_pool_free_inside_its_own_lock_does_not_deadlock():
    """An array's ``__del__`` may run inside the pool's lock: a garbage collection
    started by an allocation under it (the fuzzer's threaded route hung on this)."""
    pool = sim.MemoryPool()
    block, _ = pool.malloc(8000, "s1")
    done = threading.Event()

    def free_under_the_lock():
        with pool._lock:  # as a finalizer run by malloc's own allocation would
            pool.free(block)
        done.set()

    worker = threading.Thread(target=free_under_the_lock, daemon=True)
    worker.start()
    assert done.wait(10), "free() blocked on the pool's lock held by its own thread"
    assert (pool.used_bytes(), pool.total_bytes()) == (0, 8192)  # filed by the next holder
    again, reused = pool.malloc(8000, "s1")
    assert again is block and reused


def test_arrays_return_their_block_to_the_default_pool():
    pool = sim.get_default_memory_pool()
    x = sim.empty(1000)
    used = pool.used_bytes()
    del x
    assert pool.used_bytes() == used - 8192


def test_pickle_snapshots_without_waiting(streams):
    a, _ = streams
    gate = threading.Event()
    with a:
        x = zeros_then_gated_ones(a, gate)
        t0 = time.perf_counter()
        payload = pickle.dumps(x)
        elapsed = time.perf_counter() - t0
    assert elapsed < GATE_TIMEOUT / 2
    gate.set()
    restored = pickle.loads(payload)
    assert isinstance(restored, sim.SimArray)
    # Arrives complete, with the contents as they were when pickled.
    np.testing.assert_array_equal(restored._view, np.zeros(N))
    with a:
        np.testing.assert_array_equal(x.get(), np.ones(N))


# --- kernel errors ---------------------------------------------------------------------------


def test_kernel_error_surfaces_at_get_with_key_and_is_cleared(streams):
    a, _ = streams
    with a, device.task("producer-1"):
        x = sim.asarray(np.zeros(4))
        sim.launch(boom, x)
        sim.launch(fill(5.0), x)  # skipped: the stream is in error until it is reported
    assert device.current_key() is None
    with a:
        with pytest.raises(KernelError, match=r"^kernel launched by task 'producer-1' failed: "):
            x.get()
        after = x.get()  # reported once, then cleared
        sim.launch(fill(2.0), x)
        fixed = x.get()
    np.testing.assert_array_equal(after, np.zeros(4))
    np.testing.assert_array_equal(fixed, np.full(4, 2.0))


def test_kernel_error_carries_key_and_cause(streams):
    a, _ = streams
    with a, device.task(("chunk", 3)):
        sim.launch(boom)
    with pytest.raises(KernelError) as info:
        a.synchronize()
    err = info.value
    assert err.key == ("chunk", 3)
    assert err.cause == "ValueError: boom"
    assert str(err) == "kernel launched by task ('chunk', 3) failed: ValueError: boom"
    again = pickle.loads(pickle.dumps(err))
    assert (type(again), again.key, again.cause, str(again)) == (
        KernelError,
        ("chunk", 3),
        "ValueError: boom",
        str(err),
    )


def test_kernel_error_without_key():
    sim.launch(boom)
    with pytest.raises(KernelError, match=r"^kernel failed: ValueError: boom$") as info:
        device.synchronize()
    assert info.value.key is None
    device.synchronize()


def test_kernel_error_surfaces_at_event_sync(streams):
    a, _ = streams
    with a, device.task("k"):
        sim.launch(boom)
    event = a.record()
    with pytest.raises(KernelError, match="task 'k' failed: ValueError: boom"):
        event.synchronize()
    a.synchronize()  # cleared once reported
    event.synchronize()


def test_kernel_error_follows_event_waits(streams):
    a, b = streams
    with a, device.task("upstream"):
        sim.launch(boom)
    b.wait_event(a.record())
    with b, device.task("downstream"):
        y = sim.asarray(np.ones(3))
        with pytest.raises(KernelError, match="task 'upstream' failed") as info:
            y.get()
    assert info.value.key == "upstream"
    a.synchronize()  # the same error, already reported, is cleared on a too
    b.synchronize()


def test_kernel_error_is_not_raised_by_an_independent_sync(streams):
    a, b = streams
    with a, device.task("k"):
        sim.launch(boom)
    with b:
        y = sim.asarray(np.ones(3))
        np.testing.assert_array_equal(y.get(), np.ones(3))
    with pytest.raises(KernelError, match="task 'k'"):
        a.synchronize()


def test_a_kernel_skipped_before_another_threads_report_fails_its_own_event(streams):
    """Thread T's kernel is skipped behind a failure; another thread reports it and launches U
    on the same stream before T records its event: U runs, and T's event raises (T's output
    was never written), not only U's clean event."""
    a, _ = streams
    out_t, out_u = np.zeros(3), np.zeros(3)
    with a, device.task("failing"):
        sim.launch(boom)
    failed = a.record()
    launched, report_done = threading.Event(), threading.Event()
    t_events = []

    def task_t():
        with a, device.task("T"):
            sim.launch(fill(1.0), out_t)  # behind the failure: skipped
        launched.set()
        report_done.wait(GATE_TIMEOUT)
        t_events.append(a.record())

    thread = threading.Thread(target=task_t)
    thread.start()
    launched.wait(GATE_TIMEOUT)
    with pytest.raises(KernelError, match="task 'failing'"):
        failed.synchronize()  # reported before T's event is recorded
    with a, device.task("U"):
        sim.launch(fill(2.0), out_u)
    u_event = a.record()
    report_done.set()
    thread.join(GATE_TIMEOUT)
    u_event.synchronize()
    np.testing.assert_array_equal(out_u, np.full(3, 2.0))
    with pytest.raises(KernelError, match="task 'failing'"):
        t_events[0].synchronize()
    assert out_t[0] == 0.0
    a.synchronize()  # nothing left in error


def test_a_reported_error_is_not_passed_on_by_waits_still_queued(streams):
    a, b = streams
    gate = threading.Event()
    with a, device.task("k"):
        sim.launch(boom)
    failed = a.record()
    with b:
        sim.launch(gated(gate))
        b.wait_event(failed)  # runs only after the error has been reported
    with pytest.raises(KernelError, match="task 'k'"):
        a.synchronize()
    gate.set()
    with b:
        y = sim.asarray(np.ones(3))
        np.testing.assert_array_equal(y.get(), np.ones(3))
    b.synchronize()


def test_a_streams_thread_starts_with_its_work_and_ends_when_idle(monkeypatch):
    monkeypatch.setattr(sim.Stream, "idle_timeout", 0.05)
    stream = device.create_stream()
    assert stream.thread is None  # no work yet, no thread
    out = np.zeros(1)
    stream.launch(fill(1.0), (out,), {}, "first")
    first = stream.thread
    stream.synchronize()
    first.join(GATE_TIMEOUT)
    assert not first.is_alive() and out[0] == 1.0
    # Its state outlives the thread: an error put on the stream by a failed kernel stays.
    stream.launch(lambda: 1 / 0, (), {}, "broken")
    failed = stream.thread
    assert failed is not first
    failed.join(GATE_TIMEOUT)
    assert not failed.is_alive()
    with pytest.raises(KernelError, match="broken.*ZeroDivisionError"):
        stream.synchronize()
    stream.launch(fill(2.0), (out,), {}, "again")
    stream.synchronize()
    assert out[0] == 2.0 and stream.thread not in (first, failed)


def test_work_enqueued_while_the_thread_ends_for_idleness_still_runs_in_order(monkeypatch):
    # An idle timeout near the gaps between launches: threads end and start all the time.
    monkeypatch.setattr(sim.Stream, "idle_timeout", 0.0005)
    stream = device.create_stream()
    rng = np.random.default_rng(0)
    ran: list[int] = []
    finished = threading.Event()
    threads = set()
    for i in range(400):
        stream.launch(ran.append, (i,), {}, i)
        threads.add(stream.thread)
        if rng.random() < 0.5:
            time.sleep(float(rng.uniform(0, 0.002)))
    stream.launch(finished.set, (), {}, "last")
    assert finished.wait(GATE_TIMEOUT)
    assert ran == list(range(400))
    assert len(threads) > 10  # the thread did end and start again


def test_a_wait_on_an_event_whose_error_was_reported_proceeds(streams):
    """As CUDA: a completed (even failed) event lets the waiting stream go on, error-free."""
    a, b = streams
    with a, device.task("k"):
        sim.launch(boom)
    failed = a.record()
    with pytest.raises(KernelError, match="task 'k'"):
        failed.synchronize()
    b.wait_event(failed)
    with b:
        y = sim.asarray(np.zeros(3))
        sim.launch(fill(4.0), y)
        np.testing.assert_array_equal(y.get(), np.full(3, 4.0))
    failed.synchronize()  # not raised again
    assert isinstance(failed.wait(), KernelError)  # still returned by a wait


def test_a_wait_that_passes_an_error_on_as_it_is_reported_does_not_keep_it(streams, monkeypatch):
    """A wait that checked the error unreported, then set it after a sync reported it.

    The report found the stream without the error, so nothing cleared it: the
    stream skipped all later work, and its syncs (the error being reported)
    raised nothing. The hook holds the wait between its check and its set
    until the host has reported the error.
    """
    a, b = streams
    with a, device.task("k"):
        sim.launch(boom)
    failed = a.record()
    host = threading.current_thread()
    checked, reported = threading.Event(), threading.Event()
    unhooked = device._reported

    def hooked(error):
        result = unhooked(error)
        if threading.current_thread() is not host and not checked.is_set():
            checked.set()  # on b's thread, inside its wait: the error is not reported yet
            reported.wait(GATE_TIMEOUT)
        return result

    monkeypatch.setattr(device, "_reported", hooked)
    try:
        b.wait_event(failed)
        assert checked.wait(GATE_TIMEOUT)
        with pytest.raises(KernelError, match="task 'k'"):
            failed.synchronize()
    finally:
        reported.set()
    with b:
        y = sim.asarray(np.zeros(3))
        sim.launch(fill(2.0), y)
        np.testing.assert_array_equal(y.get(), np.full(3, 2.0))


def test_a_report_clears_every_stream_it_reached_though_one_closed_meanwhile(streams, monkeypatch):
    """A stream closed between the report's check and its enqueue refuses the clear; the
    streams after it still get theirs and run again (helper-102, stop 59: the loop ended
    there, and a later stream stayed in error, skipping all its work)."""
    a, b = streams
    with a, device.task("k"):
        sim.launch(boom)
    failed = a.record()
    b.wait_event(failed)
    assert b.record().wait() is not None  # b is in error too

    def closed(op):
        raise RuntimeError(f"{a!r} is closed")

    monkeypatch.setattr(a, "enqueue", closed)
    monkeypatch.setattr(device, "_streams", [a, b])  # a's clear first
    with pytest.raises(KernelError, match="task 'k'"):
        failed.synchronize()
    with b:
        y = sim.asarray(np.zeros(3))
        sim.launch(fill(2.0), y)
        np.testing.assert_array_equal(y.get(), np.full(3, 2.0))


def test_two_syncs_at_once_raise_an_error_once(streams, monkeypatch):
    """Both syncs find the error unreported (a barrier holds each after its check); one raises."""
    a, _ = streams
    with a, device.task("k"):
        sim.launch(boom)
    failed = a.record()
    assert failed.wait() is not None
    checked = threading.Barrier(2, timeout=GATE_TIMEOUT)
    unhooked = device._reported

    def hooked(error):
        result = unhooked(error)
        checked.wait()
        return result

    monkeypatch.setattr(device, "_reported", hooked)
    outcomes: list = []

    def sync():
        try:
            failed.synchronize()
            outcomes.append(None)
        except Exception as e:  # noqa: BLE001 - a broken barrier fails the test below
            outcomes.append(e)

    threads = [threading.Thread(target=sync) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(GATE_TIMEOUT)
    assert sorted(type(o).__name__ for o in outcomes) == ["KernelError", "NoneType"]


def test_an_upload_takes_the_kernel_delay_so_a_reader_that_does_not_wait_sees_poison(
    streams, monkeypatch
):
    """A host-to-device copy takes time on a GPU: one on stream A that a reader on stream B
    does not wait for is read unwritten. It sleeps ``kernel_delay`` first, as kernels do."""
    a, b = streams
    monkeypatch.setattr(device, "kernel_delay", (0.3, 0.3))
    with a:
        x = sim.asarray(np.ones(N))
    with b:  # no wait on a
        assert np.isnan(x.get()).all()
    with a:
        np.testing.assert_array_equal(x.get(), np.ones(N))


def test_an_upload_from_pinned_memory_reads_it_when_the_copy_runs(streams):
    """CuPy copies from pinned memory without staging it (``_array_default``): the copy
    reads the buffer when its stream gets there. Pageable memory is staged at the call."""
    a, _ = streams
    gate = threading.Event()
    pinned = sim.alloc_pinned(8 * N).view("float64")
    pageable = np.empty(N)
    pinned[:] = pageable[:] = 1.0
    with a:
        sim.launch(gated(gate))
        from_pinned, from_pageable = sim.asarray(pinned), sim.asarray(pageable)
        from_strided = sim.asarray(pinned[::2])  # not contiguous: NumPy copies it first
    pinned[:] = pageable[:] = 2.0  # too early for pinned memory
    gate.set()
    with a:
        np.testing.assert_array_equal(from_pinned.get(), np.full(N, 2.0))
        np.testing.assert_array_equal(from_pageable.get(), np.ones(N))
        np.testing.assert_array_equal(from_strided.get(), np.ones(N // 2))


def test_a_device_starts_with_the_kernel_delay_of_its_environment(monkeypatch):
    """``GPUSTREAMS_SIM_KERNEL_DELAY`` (seconds) sets a new device's delay; a bad value is an
    error naming the variable, not a device without delay."""
    monkeypatch.setenv("GPUSTREAMS_SIM_KERNEL_DELAY", "0.001,0.004")
    assert sim.Device(1).kernel_delay == (0.001, 0.004)
    for bad in ("0.004,0.001", "-1,1", "0.002", "0,1,2", "a,b", "0,inf", "inf,inf"):
        monkeypatch.setenv("GPUSTREAMS_SIM_KERNEL_DELAY", bad)
        with pytest.raises(ValueError, match=f"GPUSTREAMS_SIM_KERNEL_DELAY='{bad}' is invalid"):
            sim.Device(1)
    monkeypatch.delenv("GPUSTREAMS_SIM_KERNEL_DELAY")
    assert sim.Device(1).kernel_delay == (0.0, 0.0)


@pytest.mark.slow
def test_worker_processes_inherit_the_kernel_delay_of_the_environment(monkeypatch):
    """The delay set in a process does not reach a cluster's worker processes; the variable
    does, so a CI run of a cluster on the sim varies its streams' interleaving too."""
    from distributed import Client, LocalCluster

    monkeypatch.setenv("GPUSTREAMS_SIM_KERNEL_DELAY", "0,0.002")
    with (
        LocalCluster(n_workers=1, threads_per_worker=1, processes=True) as cluster,
        Client(cluster) as client,
    ):
        delays = client.run(lambda: sim.get_device().kernel_delay)
    assert list(delays.values()) == [(0.0, 0.002)]


def test_an_upload_queued_behind_a_failure_another_sync_reported_holds_its_values(streams):
    """An upload runs on a stream in error too: queued after a failure that another sync
    then reports, its array must hold the data (were it skipped as a kernel is, unpickled
    or deserialized data would keep the poison); the kernel this thread launched after it
    was skipped, so this thread's next sync there raises once."""
    a, _ = streams
    failed_gate, later_gate = threading.Event(), threading.Event()
    with a:
        sim.launch(gated(failed_gate, boom))
        failed = a.record()
        x = sim.asarray(np.ones(N))
        sim.launch(gated(later_gate))
    failed_gate.set()
    with pytest.raises(KernelError, match="boom"):
        failed.synchronize()  # reported: the stream runs again
    later_gate.set()
    with a:
        with pytest.raises(KernelError, match="boom"):
            x.get()
        np.testing.assert_array_equal(x.get(), np.ones(N))
