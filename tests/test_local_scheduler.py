"""The local threaded scheduler through the stream runtime, on the simulated device.

Every test here names the threaded scheduler (the ``scheduler`` config key, below):
with ``gpustreams.enabled`` and no scheduler named, a compute runs on the stream
launcher instead (``tests/test_enabling.py``).

Kernels sleep for seeded random times before they write, and freshly
allocated memory is NaN, so a consumer that is not ordered after its producer,
or an input block reused while still read, shows up as a wrong value.
"""

from __future__ import annotations

import copy
import gc
import logging
import pickle
import threading
import time
import weakref

import dask
import dask.array as da
import dask.local
import dask.threaded
import numpy as np
import pytest
from dask import delayed
from dask._task_spec import Alias, Task, TaskRef
from dask.callbacks import Callback

from dask_gpustreams import KernelError, sim
from dask_gpustreams.integrations.local import hook
from dask_gpustreams.integrations.tasks import ComputeRegistry, StreamTask, wrap_task
from dask_gpustreams.runtime import EventRegistry, StreamPool, get_runtime, live_runtimes
from dask_gpustreams.runtime.policies import make_policy, policy_names

META = np.array((), dtype="float64")
MAX_DELAY = 0.002

device = sim.get_device()


@pytest.fixture(autouse=True)
def _threaded_scheduler():
    """The threaded route: Dask's threaded scheduler, named (see the module's docstring)."""
    with dask.config.set(scheduler=dask.threaded.get):
        yield


#: The policies shipped with the package (another test module may register more).
BUILTIN_POLICIES = tuple(
    name
    for name in policy_names()
    if type(make_policy(name)).__module__.startswith("dask_gpustreams")
)


# --- kernels and task functions --------------------------------------------------------------


def slow_fill(out, value, delay):
    time.sleep(delay)
    out[...] = value


def slow_scale(out, x, factor, delay):
    time.sleep(delay)
    np.multiply(x, factor, out=out)


def slow_add(out, a, b, delay):
    time.sleep(delay)
    np.add(a, b, out=out)


def upload_scaled(block, delays, factor, block_id=None):
    x = sim.asarray(block)
    out = sim.empty(block.shape, block.dtype)
    sim.launch(slow_scale, out, x, factor, delays[block_id[0]])
    return out


def add_blocks(a, b, delays, block_id=None):
    out = sim.empty(a.shape, a.dtype)
    sim.launch(slow_add, out, a, b, delays[block_id[0]])
    return out


def download(block):
    return block.get()


def leaf(value, n, delay):
    out = sim.empty(n)
    sim.launch(slow_fill, out, value, delay)
    return out


def combine(a, b, delay):
    out = sim.empty(a.shape)
    sim.launch(slow_add, out, a, b, delay)
    return out


def to_host(x):
    return x.get()


def tree(nodes, rng):
    while len(nodes) > 1:
        pairs = zip(nodes[::2], nodes[1::2], strict=True)
        nodes = [delayed(combine)(a, b, rng.uniform(0, MAX_DELAY)) for a, b in pairs]
    return nodes[0]


# --- workloads -------------------------------------------------------------------------------


def array_workload(rng, n_chunks=8, chunk=64):
    """``4 A + 3 B`` from eight chunks, each kernel on its own task; returns (array, expected)."""
    A = rng.integers(0, 100, n_chunks * chunk).astype("float64")
    B = rng.integers(0, 100, n_chunks * chunk).astype("float64")

    def delays():
        return tuple(rng.uniform(0, MAX_DELAY, n_chunks))

    a = da.from_array(A, chunks=chunk).map_blocks(upload_scaled, delays(), 2.0, meta=META)
    b = da.from_array(B, chunks=chunk).map_blocks(upload_scaled, delays(), 3.0, meta=META)
    s = da.map_blocks(add_blocks, a, b, delays(), meta=META)
    t = da.map_blocks(add_blocks, s, a, delays(), meta=META)  # a has a second reader
    return t, 4 * A + 3 * B


def tree_workload(rng, n_leaves=16, n=32):
    """A pairwise sum of ``n_leaves`` device arrays; returns (delayed, expected)."""
    values = rng.integers(0, 1000, n_leaves).astype("float64")
    leaves = [delayed(leaf)(float(v), n, rng.uniform(0, MAX_DELAY)) for v in values]
    return delayed(to_host)(tree(leaves, rng)), np.full(n, values.sum())


def run_workloads(rng, runs):
    """Both workloads ``runs`` times; True if every result was exact."""
    exact = True
    for _ in range(runs):
        t, expected_t = array_workload(rng)
        tr, expected_tr = tree_workload(rng)
        got_t, got_tr = dask.compute(t.map_blocks(download, meta=META), tr, optimize_graph=False)
        exact &= np.array_equal(got_t, expected_t) and np.array_equal(got_tr, expected_tr)
    return exact


# --- ordering --------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", BUILTIN_POLICIES)
@pytest.mark.parametrize("streams", range(1, 9))
def test_results_are_exact_for_every_stream_count_and_policy(gpustreams, rng, streams, policy):
    with gpustreams(streams=streams, policy=policy):
        assert run_workloads(rng, runs=3)
        rt = get_runtime()
    assert rt.pool.n_streams == streams
    assert rt.collect() == 0


def test_workloads_detect_missing_event_waits(gpustreams, rng, monkeypatch):
    """The sweep above is meaningful: without the device-side waits it gives wrong values."""
    monkeypatch.setattr(StreamPool, "wait", lambda self, slot, producer, event, seq: None)
    with gpustreams(streams=4, policy="round-robin"):
        assert not run_workloads(rng, runs=3)


def test_optimized_array_graph_with_fused_tasks_and_aliases(gpustreams, rng):
    """Default optimization fuses each chunk's tasks into one whose output key is an
    alias; consumers of those aliases (here a delayed tree) must still be ordered."""
    A = rng.integers(0, 100, 8 * 64).astype("float64")
    with gpustreams(streams=4, policy="round-robin"):
        for _ in range(5):
            delays = tuple(rng.uniform(0.005, 0.01, 8))
            x = da.from_array(A, chunks=64).map_blocks(upload_scaled, delays, 2.0, meta=META)
            total = delayed(to_host)(tree(x.to_delayed().ravel().tolist(), rng))
            graph = dict(total.__dask_graph__())
            assert any(isinstance(node, Alias) for node in graph.values())
            np.testing.assert_array_equal(total.compute(), 2 * A.reshape(8, 64).sum(axis=0))
            np.testing.assert_array_equal(x.map_blocks(download, meta=META).compute(), 2 * A)


def test_dask_compute_of_several_collections(gpustreams, rng):
    with gpustreams(streams=3, policy="round-robin"):
        t, expected_t = array_workload(rng)
        tr, expected_tr = tree_workload(rng)
        got_t, got_tr = dask.compute(t.map_blocks(download, meta=META), tr)
    np.testing.assert_array_equal(got_t, expected_t)
    np.testing.assert_array_equal(got_tr, expected_tr)


@pytest.mark.parametrize(
    "scheduler", ["synchronous", pytest.param(dask.local.get_sync, id="get_sync")]
)
def test_synchronous_scheduler(gpustreams, rng, scheduler):
    with gpustreams(streams=3, policy="round-robin"):
        tr, expected = tree_workload(rng)
        np.testing.assert_array_equal(tr.compute(scheduler=scheduler), expected)


# --- results are complete --------------------------------------------------------------------


def test_delayed_result_is_complete_when_compute_returns(gpustreams):
    with gpustreams(streams=2):
        x = delayed(leaf)(5.0, 100, 0.05).compute()
    assert isinstance(x, sim.SimArray)
    np.testing.assert_array_equal(x._view, np.full(100, 5.0))


def test_single_chunk_array_result_is_complete(gpustreams):
    """A one-chunk array computes to its chunk through an alias of the fused task."""
    A = np.arange(64.0)
    with gpustreams(streams=4, policy="round-robin"):
        x = da.from_array(A, chunks=64).map_blocks(upload_scaled, (0.05,), 2.0, meta=META)
        result = x.compute()
        (first,) = dask.compute(x.blocks[0])
    np.testing.assert_array_equal(result._view, 2 * A)
    np.testing.assert_array_equal(first._view, 2 * A)


def test_persisted_chunks_are_complete(gpustreams, rng):
    A = np.arange(256.0)
    delays = tuple(rng.uniform(0.02, 0.04, 4))
    with gpustreams(streams=4, policy="round-robin"):
        x = da.from_array(A, chunks=64).map_blocks(upload_scaled, delays, 2.0, meta=META)
        persisted = x.persist()
        chunks = [persisted.__dask_graph__()[k] for k in persisted.__dask_keys__()]
        views = [c._view.copy() for c in chunks]
        again = persisted.map_blocks(download, meta=META).compute()
    assert all(isinstance(c, sim.SimArray) for c in chunks)
    np.testing.assert_array_equal(np.concatenate(views), 2 * A)
    np.testing.assert_array_equal(again, 2 * A)


def test_several_results_are_complete(gpustreams):
    with gpustreams(streams=4, policy="round-robin"):
        results = dask.compute(*[delayed(leaf)(float(i), 10, 0.02) for i in range(6)])
    assert [r._view.tolist() for r in results] == [[float(i)] * 10 for i in range(6)]


# --- memory lifetime -------------------------------------------------------------------------

N = 1000


def produce():
    return sim.asarray(np.full(N, 3.0))


def slow_double(x, delay):
    out = sim.empty(N)
    sim.launch(slow_scale, out, x, 2.0, delay)
    return out


def allocate_after(gate):
    # Runs once the scheduler has released `produce`'s output (see ReleaseGate).
    assert gate.wait(5), "the consumer never finished"
    return sim.empty(N)


def final(y, z):
    return y.get()


class ReleaseGate(Callback):
    """Opens ``gate`` after ``key`` finished on the host and its inputs were released."""

    def __init__(self, key, gate):
        super().__init__()
        self.key, self.gate = key, gate

    def _posttask(self, key, result, dsk, state, worker_id):
        if key == self.key:
            self.gate.set()


def reuse_scenario(gpustreams, by_key, rng, runs):
    """x on stream 0, a slow reader on stream 1; dask drops x as soon as the reader
    returns on the host, then stream 0 allocates a block of x's size. Returns how
    many runs read poison."""
    by_key.update({"produce": 0, "consume": 1, "allocate": 0, "final": 2})
    poisoned = 0
    with gpustreams(streams=3, policy="test-placement"), dask.config.set(num_workers=3):
        for _ in range(runs):
            gate = threading.Event()
            x = delayed(produce, pure=False)(dask_key_name="produce")
            y = delayed(slow_double)(x, rng.uniform(0.01, 0.03), dask_key_name="consume")
            z = delayed(allocate_after)(gate, dask_key_name="allocate")
            with ReleaseGate("consume", gate):
                out = delayed(final)(y, z, dask_key_name="final").compute()
            assert np.isnan(out).all() or (out == 6.0).all()
            poisoned += bool(np.isnan(out).any())
    return poisoned


def test_inputs_are_held_until_the_consumer_event(gpustreams, by_key, rng):
    assert reuse_scenario(gpustreams, by_key, rng, runs=10) == 0


def test_reuse_scenario_reads_poison_without_holding(gpustreams, by_key, rng, monkeypatch):
    """The test above is meaningful: dropping the held inputs gives poison."""
    record = StreamPool.record
    monkeypatch.setattr(
        StreamPool,
        "record",
        lambda self, slot, event, refs, *a: record(self, slot, event, None, *a),
    )
    assert reuse_scenario(gpustreams, by_key, rng, runs=10) >= 1


def add_a_nested_result(x, scheduler):
    """``x`` plus a value computed by a nested compute (key ``inner``) on ``scheduler``,
    read by a slow kernel on this task's stream after the task has returned."""
    (y,) = dask.compute(delayed(leaf)(1.0, x.size, 0.0, dask_key_name="inner"), scheduler=scheduler)
    out = sim.empty(x.shape)
    sim.launch(slow_add, out, x, y, 0.05)
    return out


def download_after(block, _):
    """``block`` on the host, once the task passed second has run."""
    return block.get()


@pytest.mark.parametrize(
    "outer",
    [
        pytest.param(dask.threaded.get, id="threads"),
        pytest.param(dask.local.get_sync, id="get_sync"),
        "sync",
        "gpustreams",
    ],
)
@pytest.mark.parametrize(
    "inner",
    [
        pytest.param(dask.threaded.get, id="threads"),
        pytest.param(dask.local.get_sync, id="get_sync"),
        "sync",
        "gpustreams",
    ],
)
def test_a_nested_computes_result_is_held_until_the_task_reading_it_is_done(
    gpustreams, by_key, outer, inner
):
    """The nested result comes from stream 1 and its last reference goes when the outer
    task (stream 0) returns, before its kernel reads it; the task run next, on stream 1,
    allocates a block of its size. Held as the task's inputs are, the nested result is
    not handed out meanwhile (its poison would be read). Exact, 3 times."""
    by_key.update({"outer": 0, "inner": 1, "fast": 1})
    x = sim.asarray(np.full(4096, 2.0))
    with gpustreams(streams=2, policy="test-placement", **{"shared-blocks": 0}):
        for _ in range(3):
            task = delayed(add_a_nested_result)(x, inner, dask_key_name="outer")
            fast = delayed(leaf)(7.0, x.size, 0.0, dask_key_name="fast")
            got = delayed(download_after)(task, fast, dask_key_name="get").compute(
                scheduler=outer, num_workers=1
            )
            np.testing.assert_array_equal(got, np.full(x.size, 3.0))


def test_inputs_are_released_after_the_compute(gpustreams):
    with gpustreams(streams=2, policy="round-robin"):
        x = delayed(leaf)(1.0, 10, 0.0).persist()
        (ref,) = [weakref.ref(v) for v in x.__dask_graph__().values()]
        total = delayed(combine)(x, x, 0.01).compute()
        del x
    np.testing.assert_array_equal(total._view, np.full(10, 2.0))
    assert ref() is None


# --- kernel errors ---------------------------------------------------------------------------


def failing(n):
    out = sim.empty(n)
    sim.launch(lambda v: v.fill(1 / 0), out)
    return out


def test_kernel_error_surfaces_at_the_final_sync(gpustreams):
    with gpustreams(streams=2, policy="round-robin"):
        x = delayed(failing)(4, dask_key_name="bad-producer")
        y = delayed(combine)(x, x, 0.0, dask_key_name="consumer")
        with pytest.raises(KernelError, match=r"launched by task 'bad-producer' failed: Zero") as e:
            y.compute()
        assert e.value.key == "bad-producer"
        # Reported once: the runtime keeps working.
        np.testing.assert_array_equal(delayed(leaf)(1.0, 4, 0.0).compute()._view, np.ones(4))
        assert get_runtime().collect() == 0
    assert hook._runs == {}


def test_kernel_error_surfaces_at_a_get_inside_the_graph(gpustreams):
    A = np.arange(8.0)
    with gpustreams(streams=3, policy="round-robin"):
        x = da.from_array(A, chunks=4).map_blocks(lambda b: failing(b.shape), meta=META)
        y = x.map_blocks(download, meta=META)
        with pytest.raises(KernelError, match=r"^kernel launched by task \(") as e:
            y.compute(optimize_graph=False)
    assert isinstance(e.value.key, tuple)
    assert e.value.key[0].startswith("lambda-")
    assert e.value.cause == "ZeroDivisionError: division by zero"
    assert hook._runs == {}


def test_host_exception_in_a_task_propagates_unchanged(gpustreams):
    def broken(x):
        raise LookupError("host side")

    with gpustreams(streams=2):
        with pytest.raises(LookupError, match="host side"):
            delayed(broken)(delayed(leaf)(1.0, 4, 0.01)).compute()
        assert hook._runs == {}
        np.testing.assert_array_equal(delayed(to_host)(delayed(leaf)(2.0, 4, 0)).compute(), [2] * 4)


def test_kernel_error_left_by_a_failed_compute_does_not_reach_the_next_one(gpustreams):
    def broken(x, y):
        raise LookupError("host side")

    with gpustreams(streams=1):
        bad = delayed(failing)(4, dask_key_name="silent-failure")
        with pytest.raises(LookupError, match="host side"):
            delayed(broken)(bad, delayed(leaf)(1.0, 4, 0.05)).compute()
        # The next graph on the same (single) stream runs and is not blamed.
        np.testing.assert_array_equal(delayed(to_host)(delayed(leaf)(3.0, 4, 0)).compute(), [3] * 4)


def test_kernel_error_of_a_task_still_running_when_the_compute_fails_stays_with_it(gpustreams):
    """Dask's ``get_async`` raises a task's exception while another task of the graph still
    runs in its pool: that task's failing kernel is reported by the failed compute's drain.
    Before, the compute returned without waiting for it, and the next compute on the stream
    raised its ``KernelError`` (a key of the failed graph) instead of its value."""
    raised, returned, launched = threading.Event(), threading.Event(), threading.Event()

    def broken():
        raised.set()
        raise LookupError("host side")

    def fails_late():
        raised.wait()
        # Until the failed compute returns (at once, before the fix). With the fix it waits
        # for this task, so the wait ends at the timeout: either way the kernel is launched
        # after the other task raised.
        returned.wait(timeout=0.5)
        out = failing(4)
        launched.set()
        return out

    with gpustreams(streams=1):
        late = delayed(fails_late)(dask_key_name="late-failure")
        with pytest.raises(LookupError, match="host side"):
            dask.compute(delayed(broken)(), late, num_workers=2)
        returned.set()
        assert launched.wait(timeout=10)
        np.testing.assert_array_equal(delayed(to_host)(delayed(leaf)(3.0, 4, 0)).compute(), [3] * 4)
        assert get_runtime().collect() == 0
    assert hook._runs == {}


class StillRunningWarning(logging.Handler):
    """Catches the package's WARNING that a failed compute waits for tasks still running:
    :attr:`seen` is set once it is logged, :attr:`message` holds it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = threading.Event()
        self.message = ""

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno == logging.WARNING and "still running" in record.getMessage():
            self.message = record.getMessage()
            self.seen.set()

    def __enter__(self) -> StillRunningWarning:
        logging.getLogger("dask_gpustreams").addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger("dask_gpustreams").removeHandler(self)


def test_a_failed_compute_waiting_for_a_running_task_says_so(gpustreams, monkeypatch):
    """A failed compute waits for its tasks still running in Dask's threads; a task that
    waits for the caller would hang it, so the wait logs a warning that says what it waits
    for. Here the running task returns only once that warning is logged."""
    monkeypatch.setattr(ComputeRegistry, "warn_after", 0.01)
    raised = threading.Event()

    def broken():
        raised.set()
        raise LookupError("host side")

    with StillRunningWarning() as warning:

        def waits_for_the_warning():
            raised.wait(timeout=10)
            return warning.seen.wait(timeout=10)

        with gpustreams(streams=1), pytest.raises(LookupError, match="host side"):
            dask.compute(delayed(broken)(), delayed(waits_for_the_warning)(), num_workers=2)
    assert warning.seen.is_set()
    assert "the 1 task(s) of the compute still running in Dask's threads" in warning.message
    assert hook._runs == {}


def test_a_compute_whose_start_fails_releases_the_runtime(gpustreams, monkeypatch):
    """The start hook acquires the runtime, then orders the streams after the caller's
    work; if that raises, the compute raises it and the runtime is released (a later
    ``close`` does not wait for it). Before, nothing released it: ``close`` timed out."""
    with gpustreams(streams=2):
        runtime = get_runtime()

        def broken(self):
            raise LookupError("caller's stream")

        monkeypatch.setattr(type(runtime), "order_after_caller", broken)
        with pytest.raises(LookupError, match="caller's stream"):
            delayed(leaf)(1.0, 4, 0).compute(scheduler=dask.threaded.get)
        monkeypatch.undo()
        np.testing.assert_array_equal(delayed(to_host)(delayed(leaf)(3.0, 4, 0)).compute(), [3] * 4)
        runtime.close(timeout=5)
    assert hook._runs == {}


def test_second_kernel_error_of_a_compute_does_not_reach_the_next_one(gpustreams):
    """Two outputs whose kernels fail, each on its own stream, and no Python exception: the
    final sync raises the first output's ``KernelError``, and the other failure is reported
    by that compute too (the fuzzer's seed 11, threaded DAGs 429 and 430). Before, the
    sync raised at the first failure and left the second on its stream: the next compute
    there raised it (a key of the failed graph) instead of its value."""
    with gpustreams(streams=2, policy="round-robin"):
        first = delayed(failing)(4, dask_key_name="first-failure")
        second = delayed(failing)(4, dask_key_name="second-failure")
        with pytest.raises(KernelError) as e:
            dask.compute(first, second)
        assert e.value.key in ("first-failure", "second-failure")
        for value in (3.0, 5.0):  # on each stream
            got = delayed(to_host)(delayed(leaf)(value, 4, 0)).compute()
            np.testing.assert_array_equal(got, [value] * 4)
        assert get_runtime().collect() == 0
    assert hook._runs == {}


def test_kernel_error_of_a_task_rerun_locally_does_not_reach_the_next_compute(gpustreams):
    """With Dask's ``rerun_exceptions_locally``, ``get_async`` runs a failed task again on the
    calling thread before it raises: each run launches a failing kernel, each on its own
    stream. The failed compute reports both. Before, the rerun's record replaced the first
    run's in the compute's registry, so the drain left the first run's failure on its
    stream: the next compute there raised its ``KernelError`` (a key of the failed graph)
    instead of its value."""

    def fails_then_raises():
        failing(4)
        raise LookupError("after a failing kernel")

    with gpustreams(streams=2, policy="round-robin"):
        task = delayed(fails_then_raises)(dask_key_name="rerun-failure")
        rerun = dask.config.set(rerun_exceptions_locally=True)
        with rerun, pytest.raises(LookupError, match="after a failing kernel"):
            dask.compute(task, num_workers=2)
        for value in (3.0, 5.0):  # on each stream
            got = delayed(to_host)(delayed(leaf)(value, 4, 0)).compute()
            np.testing.assert_array_equal(got, [value] * 4)
        assert get_runtime().collect() == 0
    assert hook._runs == {}


# --- switching on and off --------------------------------------------------------------------


def where_am_i():
    """The index of the pool stream current in this task, or None on the default stream."""
    stream = device.current_stream()
    if stream is device.default_stream:
        return None
    (rt,) = live_runtimes()
    return [s.stream for s in rt.pool.slots].index(stream)


class SeenTasks(Callback):
    def __init__(self):
        super().__init__()
        self.funcs = []

    def _pretask(self, key, dsk, state):
        self.funcs.append(dsk[key])


def test_enabled_through_dask_config_runs_tasks_on_pool_streams(gpustreams):
    with gpustreams(streams=3, policy="round-robin"), SeenTasks() as seen:
        slots = dask.compute(*[delayed(where_am_i, pure=False)() for _ in range(6)])
    assert sorted(slots) == [0, 0, 1, 1, 2, 2]
    assert all(isinstance(f, StreamTask) for f in seen.funcs)


def test_disabled_wraps_nothing(rng):
    A = np.arange(16.0)
    with SeenTasks() as seen:
        slots = dask.compute(*[delayed(where_am_i, pure=False)() for _ in range(3)])
        result = da.from_array(A, chunks=4).map_blocks(np.negative).compute()
        x = delayed(leaf)(1.0, 4, 0.0).compute()
    assert slots == (None, None, None)
    assert type(result) is np.ndarray
    np.testing.assert_array_equal(result, -A)
    assert isinstance(x, sim.SimArray)
    assert seen.funcs and not any(isinstance(f, StreamTask) for f in seen.funcs)
    assert live_runtimes() == []
    assert hook._runs == {}


def test_enabled_false_inside_enabled_block(gpustreams):
    with gpustreams(streams=2), dask.config.set({"gpustreams.enabled": False}):
        assert delayed(where_am_i, pure=False)().compute() is None
    assert live_runtimes() == []


# --- concurrency -----------------------------------------------------------------------------


def eight_sleepy_tasks():
    tasks = [delayed(leaf)(float(i), 4, 0.2) for i in range(8)]
    t0 = time.perf_counter()
    results = dask.compute(*tasks)
    elapsed = time.perf_counter() - t0
    assert [r._view.tolist() for r in results] == [[float(i)] * 4 for i in range(8)]
    return elapsed


@pytest.mark.parametrize("policy", ["round-robin", "auto"])
def test_independent_tasks_run_concurrently_on_eight_streams(gpustreams, policy):
    with gpustreams(streams=8, policy=policy):
        assert eight_sleepy_tasks() < 0.5


def test_independent_tasks_serialize_on_one_stream(gpustreams):
    with gpustreams(streams=1):
        assert eight_sleepy_tasks() >= 1.6


# --- state left behind -----------------------------------------------------------------------


def test_no_state_is_left_after_compute(gpustreams, rng):
    with gpustreams(streams=4, policy="auto"):
        t, expected = array_workload(rng)
        np.testing.assert_array_equal(t.map_blocks(download, meta=META).compute(), expected)
        rt = get_runtime()
    assert hook._runs == {}
    assert rt.collect() == 0
    assert all(len(slot.inflight) == 0 for slot in rt.pool.slots)


def test_memory_stays_flat_over_many_graphs(gpustreams, rng):
    pool = sim.get_default_memory_pool()
    live = weakref.WeakSet()  # every device array the graphs create

    def tracked(fn):
        def task(*args):
            out = fn(*args)
            live.add(out)
            return out

        return task

    def small_graph():
        values = rng.integers(0, 1000, 4).astype("float64")
        nodes = [delayed(tracked(leaf))(float(v), 64, rng.uniform(0, MAX_DELAY)) for v in values]
        while len(nodes) > 1:
            pairs = zip(nodes[::2], nodes[1::2], strict=True)
            nodes = [delayed(tracked(combine))(a, b, rng.uniform(0, MAX_DELAY)) for a, b in pairs]
        np.testing.assert_array_equal(delayed(to_host)(nodes[0]).compute(), [values.sum()] * 64)

    with gpustreams(streams=4, policy="round-robin"):
        for _ in range(10):
            small_graph()
        gc.collect()
        used = pool.used_bytes()
        for _ in range(90):
            small_graph()
            assert len(live) == 0  # nothing the graph allocated outlives its compute
        assert get_runtime().collect() == 0
        gc.collect()
    # Other tests' leftovers may still be freed meanwhile, never allocated.
    assert pool.used_bytes() <= used
    assert hook._runs == {}


def test_wrapped_tasks_stay_wrapped_when_copied_and_unwrap_when_pickled(gpustreams):
    with gpustreams(streams=2):
        node = Task("y", np.negative, TaskRef("x"))
        wrapped = wrap_task(node, get_runtime(), EventRegistry())
        for clone in (copy.copy(wrapped), copy.deepcopy(wrapped), wrapped.copy()):
            assert isinstance(clone, StreamTask) and clone.node is node
        assert isinstance(wrapped.substitute({"x": "z"}), StreamTask)
        assert wrapped.substitute({"x": "z"}).dependencies == {"z"}
        assert wrap_task(wrapped, get_runtime(), EventRegistry()) is wrapped
        unpickled = pickle.loads(pickle.dumps(wrapped))
        assert type(unpickled) is Task and unpickled.key == "y"
        np.testing.assert_array_equal(unpickled({"x": np.arange(3.0)}), -np.arange(3.0))
