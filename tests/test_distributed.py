"""``StreamsPlugin`` on ``distributed.LocalCluster``, in-process and with worker processes.

Everything runs on the simulated device: kernels sleep before they write and
fresh memory is NaN, and pickling a ``SimArray`` copies its buffer without
waiting for queued work. A result that leaves a worker (peer fetch, gather,
spill) before its kernel finished therefore arrives as NaN or stale values;
the ``*_needs_*`` tests show that each egress path gives such wrong values
without the plugin's wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import operator
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import MutableMapping

import cloudpickle
import dask
import dask.array as da
import numpy as np
import pytest
import tornado.gen
import zict
from dask import delayed
from dask._task_spec import GraphNode, Task, TaskRef, _execute_subgraph
from dask.sizeof import sizeof
from distributed import Client, LocalCluster, wait

from dask_gpustreams import (
    KernelError,
    StreamsConfig,
    StreamsPlugin,
    dask_setup,
    host_task,
    sim,
    to_host,
)
from dask_gpustreams.backends import gpu_visible
from dask_gpustreams.backends.sim import SimBackend
from dask_gpustreams.integrations.distributed.execution import Execution
from tests.test_hosttasks import nested_partial

# Worker processes unpickle these task functions without importing this module.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

CONFIG = {
    "gpustreams.backend": "sim",
    "gpustreams.streams": 4,
    # Only target-based spilling (SpillBuffer); the process-memory monitor stays out.
    "distributed.worker.memory.spill": False,
    "distributed.worker.memory.pause": False,
    "distributed.worker.memory.terminate": False,
}
META = np.array((), dtype="float64")


# --- task functions -------------------------------------------------------------------------


def _fill(out, value, delay):
    time.sleep(delay)
    out[...] = value


def _add(out, a, b, delay):
    time.sleep(delay)
    np.add(a, b, out=out)


def _boom(out, a):
    time.sleep(0.02)
    raise ValueError("boom")


def produce(n, value, delay):
    """A device array of ``n`` times ``value``, written by a slow kernel."""
    out = sim.empty(n)
    sim.launch(_fill, out, value, delay)
    return out


def add(a, b, delay=0.0):
    out = sim.empty(a.shape)
    sim.launch(_add, out, a, b, delay)
    return out


def inc(a, delay=0.0):
    out = sim.empty(a.shape)
    sim.launch(_add, out, a, 1.0, delay)
    return out


def bad(a):
    """Returns at once; its kernel fails later, on the stream."""
    out = sim.empty(a.shape)
    sim.launch(_boom, out, a)
    return out


def fails(a):
    raise ZeroDivisionError("task failed on the host")


def total(*arrays):
    return float(sum(float(np.sum(sim.asnumpy(a))) for a in arrays))


def on_pool_stream(*args):
    device = sim.get_device()
    return device.current_stream() is not device.default_stream


def download(a):
    return to_host(a)


def bad_download(a):
    """Its download raises the failure of the kernel before it, on the task's stream."""
    return to_host(bad(a))


def snapshot(a):
    """Hands its input to host code outside the stream, as a P2P transfer task does."""
    return pickle.dumps(a)


snapshot.__module__ = "hostside_for_tests"  # what ``StreamsPlugin.host_modules`` matches


@host_task
def marked_snapshot(a):
    """:func:`snapshot`, marked as host code (not of ``host_modules``)."""
    return pickle.dumps(a)


def values(result):
    return sim.asnumpy(result) if isinstance(result, sim.SimArray) else np.asarray(result)


# --- cluster helpers ------------------------------------------------------------------------


@contextlib.contextmanager
def cluster(processes=False, n_workers=2, plugin=True, config=None, **kwargs):
    """A LocalCluster (config of the sim device) and a client, with ``StreamsPlugin`` registered."""
    kwargs.setdefault("threads_per_worker", 2)
    with (
        dask.config.set({**CONFIG, **(config or {})}),
        LocalCluster(
            n_workers=n_workers, processes=processes, dashboard_address=":0", **kwargs
        ) as lc,
        Client(lc) as client,
    ):
        if plugin:
            client.register_plugin(StreamsPlugin())
        yield client


def workers(client):
    """The workers' addresses, asked of the scheduler (the client's cached
    ``scheduler_info()`` was seen empty on a loaded machine)."""
    return sorted(client.nthreads())


def plugin_state(dask_worker):
    plugin = dask_worker.plugins.get("gpustreams")
    if plugin is None:
        return None
    runtime = plugin.runtime
    return {
        "registry": len(plugin.registry),
        "failures": len(plugin.failures),
        "taint": len(plugin.provenance.taint),
        "tasks": len(dask_worker.state.tasks),
        "inflight": runtime.collect() if runtime is not None else 0,
        "streams": runtime.pool.n_streams if runtime is not None else None,
        "sim_used": sim.get_default_memory_pool().used_bytes(),
    }


def states(client):
    return client.run(plugin_state)


def settle(client, timeout=10.0):
    """The workers' states once they stop changing (futures dropped, releases done)."""
    gc.collect()  # futures held by reference cycles (e.g. a caught exception's frames)
    deadline = time.monotonic() + timeout
    last = None
    while True:
        st = states(client)
        if st == last:
            return st
        if time.monotonic() > deadline:
            raise AssertionError(f"workers still changing after {timeout} s: {st}")
        last = st
        time.sleep(0.2)


@pytest.fixture(scope="module", params=["in-process", "processes"])
def client(request):
    """Two workers of two threads, shared by the tests of this module that only compute."""
    with cluster(processes=request.param == "processes") as c:
        yield c


# --- execution ------------------------------------------------------------------------------


def test_every_kind_of_task_runs_on_a_pool_stream(client):
    a, b = workers(client)
    x = client.submit(produce, 8, 1.0, 0.01, workers=[a])
    assert client.submit(on_pool_stream, x, workers=[b]).result()  # input fetched from a
    assert all(client.gather(client.map(on_pool_stream, range(4), pure=False)))
    assert delayed(on_pool_stream)(delayed(produce)(8, 2.0, 0.0)).compute()
    st = states(client)
    assert all(s["streams"] == 4 for s in st.values()), st


async def coroutine(x):
    await asyncio.sleep(0)
    return x + 1


@tornado.gen.coroutine  # marked __tornado_coroutine__, which distributed reads as a coroutine
def tornado_style(x):
    return x + 1


def with_attribute(x):
    return on_pool_stream()


with_attribute.note = "a function with a __dict__"


class OnPoolStream:
    def __call__(self, x):
        return on_pool_stream()


class UnhashableOnPoolStream(OnPoolStream):
    __hash__ = None  # the worker cannot keep how its tasks run: it decides at each one


def wrapped_keys(dask_worker, keys):
    """Those of ``keys`` whose task ran on the streams (it recorded an event)."""
    registry = dask_worker.plugins["gpustreams"].registry
    return [k for k in keys if k in registry]


def test_coroutines_stay_unwrapped_and_every_other_callable_runs_on_the_streams(client):
    """Coroutine functions (also a partial of one, a tornado-marked one) run on the event loop
    as in plain distributed; plain functions, builtins and callable objects on the streams.
    The worker keeps the decision per function: a second task of each is decided the same."""
    a, _ = workers(client)
    kinds = {
        "coroutine": (coroutine, 2),
        "partial-coroutine": (functools.partial(coroutine), 2),
        "tornado-style": (tornado_style, 2),
        "plain": (on_pool_stream, True),
        "with-attribute": (with_attribute, True),
        "callable-object": (OnPoolStream(), True),
        "unhashable-object": (UnhashableOnPoolStream(), True),
        "builtin": (operator.neg, -1),
    }
    unwrapped = {"coroutine", "partial-coroutine", "tornado-style"}
    for round_ in range(2):
        futures = {
            kind: client.submit(func, 1, key=f"kind-{kind}-{round_}", workers=[a], pure=False)
            for kind, (func, _) in kinds.items()
        }
        assert {k: f.result() for k, f in futures.items()} == {k: v for k, (_, v) in kinds.items()}
        keys = [f.key for f in futures.values()]
        wrapped = client.run(wrapped_keys, keys=keys, workers=[a])[a]
        assert set(wrapped) == {f"kind-{k}-{round_}" for k in kinds.keys() - unwrapped}


def test_dask_array_with_fused_tasks(client):
    host = np.arange(256.0).reshape(16, 16)
    x = da.from_array(host, chunks=4)
    y = x.map_blocks(sim.asarray, meta=META).map_blocks(inc, 0.002, meta=META)
    z = (y.map_blocks(add, y, meta=META)).map_blocks(sim.asnumpy, meta=META)
    np.testing.assert_array_equal(z.compute(), 2 * (host + 1))
    np.testing.assert_array_equal(z.sum().compute(), (2 * (host + 1)).sum())


def test_cross_worker_dependencies_are_exact(client, rng):
    a, b = workers(client)
    for run in range(8):
        expected, futures = [], []
        for _ in range(4):
            n = int(rng.integers(1, 5000))
            value = float(rng.integers(1, 100))
            slow = float(rng.uniform(0.005, 0.04))
            x = client.submit(produce, n, value, slow, workers=[a], pure=False)
            y = client.submit(inc, x, float(rng.uniform(0, 0.01)), workers=[b], pure=False)
            z = client.submit(add, x, y, 0.0, workers=[a], pure=False)  # b's result back on a
            futures.append(client.submit(total, z, workers=[b], pure=False))
            expected.append(n * (2 * value + 1))
        assert client.gather(futures) == expected, f"run {run}"


def test_gather_returns_complete_data(client):
    producers = [client.submit(produce, 2000, float(i), 0.03, pure=False) for i in range(6)]
    for direct in (False, True):
        results = client.gather(producers, direct=direct)
        for i, r in enumerate(results):
            np.testing.assert_array_equal(values(r), np.full(2000, float(i)))
    graph = delayed(add)(delayed(produce)(100, 3.0, 0.03), delayed(produce)(100, 4.0, 0.01), 0.01)
    np.testing.assert_array_equal(values(client.compute(graph).result()), np.full(100, 7.0))


def test_task_exception_reaches_the_client_as_in_dask(client):
    x = client.submit(produce, 8, 1.0, 0.0, pure=False)
    f = client.submit(fails, x, pure=False)
    g = client.submit(inc, f, pure=False)
    with pytest.raises(ZeroDivisionError, match="task failed on the host"):
        f.result()
    assert "fails" in "".join(traceback.format_tb(f.traceback()))
    with pytest.raises(ZeroDivisionError):
        g.result()  # the dependent is not run: it carries the same error
    assert g.status == "error"
    client.cancel([x, f, g])  # raised exceptions keep their futures alive


def test_kernel_failure_is_the_error_of_its_key(client):
    a, b = workers(client)
    x = client.submit(produce, 100, 1.0, 0.0, workers=[a], pure=False)
    k = client.submit(bad, x, workers=[a], pure=False)
    with pytest.raises(KernelError, match="ValueError: boom") as info:
        k.result(timeout=30)
    assert info.value.key == k.key
    futures = [x, k]
    # Dependents fail with it, on the same worker and through a peer fetch.
    for where in (a, b):
        k = client.submit(bad, x, workers=[a], pure=False)
        d = client.submit(inc, k, workers=[where], pure=False)
        with pytest.raises(KernelError) as info:
            d.result(timeout=30)
        assert info.value.key == k.key
        futures += [k, d]
    # Without restrictions: wherever the scheduler puts and recomputes them.
    graph = client.compute(delayed(inc)(delayed(bad)(delayed(produce)(50, 1.0, 0.0))))
    with pytest.raises(KernelError, match="ValueError: boom"):
        graph.result(timeout=30)
    # The workers stay usable.
    np.testing.assert_array_equal(values(client.submit(inc, x).result()), np.full(100, 2.0))
    client.cancel([*futures, graph])  # raised exceptions keep their futures alive


def test_wanted_dependent_gathered_after_its_failed_input_raises(client):
    """The dependent's result derives from the failed kernel: once the failed key has
    erred, the dependent cannot be recomputed, and must err too instead of hanging."""
    a, _ = workers(client)
    x = client.submit(produce, 100, 1.0, 0.0, workers=[a], pure=False)
    futures = [x]
    for _ in range(3):
        k = client.submit(bad, x, workers=[a], pure=False)
        d = client.submit(inc, k, workers=[a], pure=False)
        wait([k, d], timeout=30)  # both in memory: the kernel failure is not seen yet
        with pytest.raises(KernelError) as info:
            k.result(timeout=30)
        assert info.value.key == k.key
        with pytest.raises(KernelError) as info:
            d.result(timeout=30)
        assert info.value.key == k.key
        futures += [k, d]
    client.cancel(futures)


def test_random_dags_with_a_failing_kernel_leave_no_future_pending(client):
    """Every wanted key resolves with its value or raises the KernelError of the failed
    key, whatever the order in which the futures are gathered. Keys derived from the
    failed kernel raise; others may too (a stream in error skips work launched on it
    before the error is cleared, as after a sticky CUDA error), but never hang."""
    rng = np.random.default_rng(11)
    names = workers(client)
    for _ in range(8):
        futures, expected, poisoned = [], [], []
        bad_at = int(rng.integers(2, 10))
        for i in range(12):
            where = [names[int(rng.integers(0, 2))]]
            if i < 2:
                f = client.submit(produce, 16, float(i + 1), 0.0, workers=where, pure=False)
                value, tainted = float(i + 1), False
            elif i == bad_at:
                j = int(rng.integers(0, i))
                f = client.submit(bad, futures[j], workers=where, pure=False)
                value, tainted = None, True
                bad_key = f.key
            else:
                j, k = rng.integers(0, i, 2)
                f = client.submit(add, futures[j], futures[k], workers=where, pure=False)
                value = (
                    None
                    if expected[j] is None or expected[k] is None
                    else (expected[j] + expected[k])
                )
                tainted = poisoned[j] or poisoned[k]
            futures.append(f)
            expected.append(value)
            poisoned.append(tainted)
        for i in rng.permutation(len(futures)):
            if poisoned[i]:
                with pytest.raises(KernelError) as info:
                    futures[i].result(timeout=30)
                assert info.value.key == bad_key
            else:
                try:
                    got = values(futures[i].result(timeout=30))
                except KernelError as e:
                    assert e.key == bad_key
                else:
                    np.testing.assert_array_equal(got, np.full(16, expected[i]))
        client.cancel(futures)


def test_failure_reported_inside_a_task_still_fails_the_other_consumers(client):
    """A sync inside ``total`` reports the failure first; the device then no longer passes it
    on to work waiting for it, yet neither the failed key nor its other consumer is served."""
    a, _ = workers(client)
    x = client.submit(produce, 100, 1.0, 0.0, workers=[a], pure=False)
    futures = [x]
    for _ in range(5):
        k = client.submit(bad, x, workers=[a], pure=False)
        t = client.submit(total, k, workers=[a], pure=False)
        d = client.submit(inc, k, workers=[a], pure=False)
        for f in (t, d, k):
            with pytest.raises(KernelError) as info:
                f.result(timeout=30)
            assert info.value.key == k.key
        futures += [k, t, d]
    client.cancel(futures)


@pytest.mark.parametrize("found_by", ["the worker", "a download"])
def test_the_next_graph_does_not_raise_the_error_of_a_failed_kernel(monkeypatch, found_by):
    """Once a failure has reached the client, the next graph's tasks on the streams it
    reached run: whoever found the error (the worker's checks, a download's) reported it,
    and did not leave that to the egress threads' clear, which may run later (held back
    here). One compute stream, one copy stream: the next graph lands on both."""
    held = threading.Event()
    synchronize_stream = SimBackend.synchronize_stream

    def later_on_egress_threads(self, stream):
        if threading.current_thread().name.startswith("gpustreams-egress"):
            held.wait(30)
        synchronize_stream(self, stream)

    monkeypatch.setattr(SimBackend, "synchronize_stream", later_on_egress_threads)
    with cluster(n_workers=1, config={"gpustreams.streams": 1}) as client:
        try:
            x = client.submit(produce, 100, 1.0, 0.0, pure=False)
            failing = bad if found_by == "the worker" else bad_download
            k = client.submit(failing, x, pure=False)
            with pytest.raises(KernelError) as info:
                k.result(timeout=30)
            assert info.value.key == k.key
            for i in range(3):  # the next graphs
                y = client.submit(inc, x, float(i), pure=False)
                np.testing.assert_array_equal(values(y.result(timeout=30)), np.full(100, 2.0))
                h = client.submit(download, y, pure=False)
                np.testing.assert_array_equal(h.result(timeout=30), np.full(100, 2.0))
        finally:
            held.set()


def test_many_graphs_leave_registry_and_memory_flat(client):
    def run(i):
        x = delayed(produce)(64, float(i), 0.0)
        y = delayed(inc)(x)
        z = delayed(add)(x, y)
        assert client.compute(delayed(total)(z, y)).result() == 64 * (3 * i + 2)

    for i in range(20):
        run(i)
    before = settle(client)
    for i in range(180):
        run(i)
    after = settle(client)
    for addr, state in after.items():
        # Each graph added registry entries and tasks on the workers: all gone again.
        for field in ("registry", "taint", "tasks", "failures"):
            assert state[field] == before[addr][field], (field, before[addr], state)
        assert state["inflight"] == 0, state
        assert state["sim_used"] <= before[addr]["sim_used"], (before[addr], state)


# --- spilling -------------------------------------------------------------------------------

# 1 MiB arrays against a target of 0.02 * 32 MiB: each result is spilled as it is stored.
SPILL = {"distributed.worker.memory.target": 0.02}
N_SPILL = 131072


@pytest.mark.parametrize("processes", [False, True], ids=["in-process", "processes"])
def test_spilled_results_are_complete(processes):
    with cluster(processes=processes, config=SPILL, memory_limit="32 MiB") as client:
        a, b = workers(client)
        xs = [
            client.submit(produce, N_SPILL, float(i), 0.03, workers=[a], pure=False)
            for i in range(4)
        ]
        ys = [client.submit(inc, x, workers=[b], pure=False) for x in xs]  # unspill + fetch
        wait(xs + ys)
        spilled = client.run(lambda dask_worker: len(dask_worker.data.slow))
        # b's fetches read a's results back from disk, and a spills them again only at its
        # next store or memory check: some of a's may be in memory now (1 of 4 seen on a
        # loaded 2-core machine).
        assert spilled[a] >= 1 and spilled[b] >= 4, spilled
        for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
            np.testing.assert_array_equal(values(x.result()), np.full(N_SPILL, float(i)))
            np.testing.assert_array_equal(values(y.result()), np.full(N_SPILL, i + 1.0))


class DeviceHostFileLike(MutableMapping):
    """Shaped like dask-cuda's ``DeviceHostFile``: a ``device_buffer`` zict.Buffer spilling
    device objects to a host mapping with ``device_to_host`` serialization."""

    def __init__(self, device_memory_limit):
        self.host_buffer = {}
        self.device_host_func = zict.Func(pickle.dumps, pickle.loads, self.host_buffer)
        self.device_buffer = zict.Buffer(
            {}, self.device_host_func, device_memory_limit, weight=lambda k, v: sizeof(v)
        )

    def __getitem__(self, key):
        return self.device_buffer[key]

    def __setitem__(self, key, value):
        self.device_buffer[key] = value

    def __delitem__(self, key):
        del self.device_buffer[key]

    def __iter__(self):
        return iter(self.device_buffer)

    def __len__(self):
        return len(self.device_buffer)


def test_device_host_file_spills_are_complete():
    data = (DeviceHostFileLike, {"device_memory_limit": 2**19})
    with cluster(n_workers=1, data=data) as client:
        xs = [client.submit(produce, N_SPILL, float(i), 0.03, pure=False) for i in range(3)]
        wait(xs)
        assert client.run(lambda dask_worker: len(dask_worker.data.host_buffer)) == {
            workers(client)[0]: 3
        }
        for i, x in enumerate(xs):
            np.testing.assert_array_equal(values(x.result()), np.full(N_SPILL, float(i)))


# --- the same runs without the plugin's waits give wrong values -----------------------------


def _without_get_data_wait(dask_worker):
    dask_worker.handlers["get_data"] = dask_worker.get_data


def _without_spill_wait(dask_worker):
    plugin = dask_worker.plugins["gpustreams"]
    for lru in plugin.egress.evicting:
        lru.on_evict.remove(plugin.egress.before_spill)


def test_plain_dask_sends_a_result_after_its_kernels():
    """Without the plugin a result leaves its worker (peer fetch, gather) as distributed's CuPy
    serializer copies it, on the serializing thread's stream: the default stream, where its
    kernels are queued, so after them."""
    with cluster(processes=True, n_workers=2, threads_per_worker=1, plugin=False) as client:
        a, b = workers(client)
        wait([client.submit(produce, 1, 0.0, 0.0, workers=[w], pure=False) for w in (a, b)])
        x = client.submit(produce, 1000, 5.0, 0.3, workers=[a], pure=False)
        y = client.submit(inc, x, workers=[b], pure=False)
        assert (values(y.result()) == 6.0).all()  # fetched from a
        z = client.submit(produce, 1000, 7.0, 0.3, workers=[a], pure=False)
        assert (values(z.result()) == 7.0).all()  # gathered


def test_peer_fetch_needs_the_egress_wait():
    with cluster() as client:
        client.run(_without_get_data_wait)
        a, b = workers(client)
        x = client.submit(produce, 1000, 5.0, 0.1, workers=[a], pure=False)
        y = client.submit(inc, x, workers=[b], pure=False)
        assert np.isnan(values(y.result())).all()


def test_spilling_needs_the_spill_wait():
    with cluster(n_workers=1, config=SPILL, memory_limit="32 MiB") as client:
        client.run(_without_spill_wait)
        x = client.submit(produce, N_SPILL, 5.0, 0.1, pure=False)
        assert np.isnan(values(x.result())).all()


@pytest.mark.parametrize("blocks", ["auto", "off"])
def test_host_side_tasks_wait_for_their_inputs(monkeypatch, blocks):
    """Tasks of ``host_modules`` (P2P) run after their inputs' events, off the streams; no
    stream block takes them, even in one graph with their producer."""
    with cluster(n_workers=1, config={"gpustreams.blocks": blocks}) as client:
        for host_modules, complete in (((), False), (("hostside_for_tests",), True)):
            # In-process: the workers share this class. Read at setup.
            monkeypatch.setattr(StreamsPlugin, "host_modules", host_modules)
            client.register_plugin(StreamsPlugin())
            x = client.submit(produce, 100, 3.0, 0.1, pure=False)
            got = values(pickle.loads(client.submit(snapshot, x, pure=False).result()))
            assert (got == 3.0).all() == complete
            one_graph = delayed(snapshot, pure=False)(delayed(produce, pure=False)(100, 3.0, 0.1))
            got = values(pickle.loads(one_graph.compute()))
            assert (got == 3.0).all() == complete


@pytest.mark.parametrize("blocks", ["auto", "off"])
def test_a_host_task_runs_after_its_inputs_work(blocks):
    """A ``host_task`` that reads its input other than through its stream (the sim's pickle
    reads the buffer, as a file write through GDS would) sees it whole, alone (one task per
    key) or in one graph with its producer, as on the launcher."""
    with cluster(n_workers=1, config={"gpustreams.blocks": blocks}) as client:
        x = client.submit(produce, 100, 3.0, 0.1, pure=False)
        got = values(pickle.loads(client.submit(marked_snapshot, x, pure=False).result()))
        np.testing.assert_array_equal(got, np.full(100, 3.0))
        one_graph = delayed(marked_snapshot, pure=False)(
            delayed(produce, pure=False)(100, 3.0, 0.1)
        )
        np.testing.assert_array_equal(values(pickle.loads(one_graph.compute())), np.full(100, 3.0))


def _ident(v):
    return v


def test_a_host_task_fused_with_its_dependent_runs_after_its_inputs_work():
    """One task per key: a fused task that calls a ``host_task`` waits on the host for its
    inputs' work, as the launcher's does (its function is ``_execute_subgraph``)."""
    with cluster(n_workers=1, config={"gpustreams.blocks": "off"}) as client:
        read = Task("read", marked_snapshot, TaskRef("x"))
        out = Task("out", _ident, TaskRef("read"))
        dsk = {"x": Task("x", produce, 100, 3.0, 0.1), "out": GraphNode.fuse(read, out)}
        got = values(pickle.loads(client.get(dsk, "out")))
        np.testing.assert_array_equal(got, np.full(100, 3.0))


@pytest.mark.parametrize("blocks", ["auto", "off"])
def test_a_host_task_fused_with_its_producer_runs_after_its_work(blocks):
    """A ``host_task`` fused into one task with the kernel that makes its input (dask.array's
    blockwise fusion of ``map_blocks``) reads it whole: the host wait for the fused task's
    inputs from outside does not cover the inner kernels (before: unwritten, NaN)."""
    with cluster(n_workers=1, config={"gpustreams.blocks": blocks}) as client:
        produced = Task("x", produce, 100, 3.0, 0.1)
        read = Task("read", marked_snapshot, TaskRef("x"))
        got = values(pickle.loads(client.get({"read": GraphNode.fuse(produced, read)}, "read")))
        np.testing.assert_array_equal(got, np.full(100, 3.0))


@pytest.mark.parametrize("blocks", ["auto", "off"])
def test_a_host_task_on_a_task_nested_in_its_arguments_runs_after_its_work(blocks):
    """``Task(k, host_fn, Task(None, produce, ...))``: the nested task's kernel runs on the
    task's stream, and the host task after a host wait for it: alone (a worker's host task)
    and after its producer (in a stream block with it, or one task per key)."""
    with cluster(n_workers=1, config={"gpustreams.blocks": blocks}) as client:
        read = Task("read", marked_snapshot, Task(None, produce, 100, 3.0, 0.1))
        got = values(pickle.loads(client.get({"read": read}, "read")))
        np.testing.assert_array_equal(got, np.full(100, 3.0))
        read = Task("read-x", marked_snapshot, Task(None, inc, TaskRef("x"), 0.1))
        dsk = {"x": Task("x", produce, 100, 3.0, 0.1), "read-x": read}  # keys of their own
        np.testing.assert_array_equal(values(pickle.loads(client.get(dsk, "read-x"))), 4.0)


@pytest.mark.parametrize("blocks", ["auto", "off"])
def test_a_host_task_nested_in_another_task_s_arguments_runs_after_its_work(blocks):
    """``Task(k, g, Task(None, host_fn, ...))``: the nested ``host_task`` reads its input whole,
    made by a task nested in it or by another task (before: unwritten, NaN)."""
    with cluster(n_workers=1, config={"gpustreams.blocks": blocks}) as client:
        nested = Task(None, marked_snapshot, Task(None, produce, 100, 3.0, 0.1))
        got = values(pickle.loads(client.get({"out": Task("out", _ident, nested)}, "out")))
        np.testing.assert_array_equal(got, np.full(100, 3.0))
        read = Task(None, marked_snapshot, TaskRef("x"))
        dsk = {"x": Task("x", produce, 100, 4.0, 0.1), "out-x": Task("out-x", _ident, read)}
        got = values(pickle.loads(client.get(dsk, "out-x")))  # a key of its own
        np.testing.assert_array_equal(got, np.full(100, 4.0))


#: A partial of a marked function, and a partial of a partial of one.
PARTIAL_SNAPSHOT = functools.partial(marked_snapshot)
PARTIAL_OF_A_PARTIAL_SNAPSHOT = nested_partial(marked_snapshot)


def _alone(client, reader):
    x = client.submit(produce, 100, 3.0, 0.1, pure=False)
    return client.submit(reader, x, pure=False).result()


def _in_one_graph(client, reader):
    return delayed(reader, pure=False)(delayed(produce, pure=False)(100, 3.0, 0.1)).compute()


def _fused_with_its_producer(client, reader):
    produced = Task("x", produce, 100, 3.0, 0.1)
    read = Task("read", reader, TaskRef("x"))
    return client.get({"read": GraphNode.fuse(produced, read)}, "read")


def _nested_in_another_task_s_arguments(client, reader):
    nested = Task(None, reader, TaskRef("x"))
    dsk = {"x": Task("x", produce, 100, 3.0, 0.1), "out": Task("out", _ident, nested)}
    return client.get(dsk, "out")


@pytest.mark.parametrize(
    ("blocks", "processes"),
    [("auto", False), ("off", False), ("off", True)],
    ids=["auto", "off", "off-processes"],
)
@pytest.mark.parametrize(
    "case", [_alone, _in_one_graph, _fused_with_its_producer, _nested_in_another_task_s_arguments]
)
@pytest.mark.parametrize(
    "reader", [PARTIAL_SNAPSHOT, PARTIAL_OF_A_PARTIAL_SNAPSHOT], ids=["partial", "partial2"]
)
def test_a_partial_of_a_host_task_runs_after_its_inputs_work(blocks, processes, case, reader):
    """``functools.partial(host_fn)`` (and a partial of one) is a ``host_task``: alone, in one
    graph with its producer, fused with it and nested in another task's arguments (before:
    unwritten, NaN; the mark was looked up on the partial only). In worker processes each
    task's partial is unpickled anew (decided by the function it wraps)."""
    config = {"gpustreams.blocks": blocks}
    with cluster(n_workers=1, processes=processes, config=config) as client:
        got = values(pickle.loads(case(client, reader)))
        np.testing.assert_array_equal(got, np.full(100, 3.0))


def _nested_fused_read_of_an_inner_value():
    """``Task(k, _ident, <fused: host_fn(produce(...))>)``: a value of its fused task."""
    produced = Task("p", produce, 100, 3.0, 0.1)
    read = Task("q", marked_snapshot, TaskRef("p"))
    nested = Task(None, _execute_subgraph, *GraphNode.fuse(produced, read).args)
    return {"out": Task("out", _ident, nested)}, "out"


def _nested_fused_read_of_an_input():
    """``Task(k, _ident, <fused: _ident(host_fn(x))>)``, ``x`` a key of its own."""
    read = Task("q", marked_snapshot, TaskRef("x"))
    out = Task("o", _ident, TaskRef("q"))
    nested = Task(None, _execute_subgraph, *GraphNode.fuse(read, out).args)
    return {"x": Task("x", produce, 100, 3.0, 0.1), "out": Task("out", _ident, nested)}, "out"


@pytest.mark.parametrize("blocks", ["auto", "off"])
@pytest.mark.parametrize(
    "graph", [_nested_fused_read_of_an_inner_value, _nested_fused_read_of_an_input]
)
def test_a_host_task_in_a_fused_task_nested_in_arguments_runs_after_its_work(blocks, graph):
    """``Task(k, g, <fused task calling host_fn>)``: the nested fused task's ``host_task``
    reads its input whole, made inside that fused task or by another task (before:
    unwritten, NaN; a nested fused task's steps were not searched)."""
    with cluster(n_workers=1, config={"gpustreams.blocks": blocks}) as client:
        got = values(pickle.loads(client.get(*graph())))
        np.testing.assert_array_equal(got, np.full(100, 3.0))


# --- worker failure -------------------------------------------------------------------------


def test_killed_worker_process_mid_graph_gives_the_right_result():
    with cluster(processes=True, threads_per_worker=1) as client:
        a, b = workers(client)
        pid_b = client.run(os.getpid, workers=[b])[b]
        xs = [client.submit(produce, 100, float(i), 0.05, pure=False) for i in range(12)]
        ys = [client.submit(inc, x, 0.05, pure=False) for x in xs]
        result = client.submit(total, *ys, pure=False)
        deadline = time.monotonic() + 10
        while sum(f.status == "finished" for f in xs) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(pid_b, signal.SIGKILL)
        assert result.result(timeout=60) == sum(100 * (i + 1.0) for i in range(12))
        client.wait_for_workers(2, timeout=30)
        assert pid_b not in client.run(os.getpid).values()  # b was restarted by its nanny
        assert all(s is not None for s in states(client).values())  # the new worker has it


# --- enabling routes ------------------------------------------------------------------------


def test_register_plugin_reaches_workers_that_join_later():
    with cluster(n_workers=1) as client:
        client.cluster.scale(2)
        client.wait_for_workers(2)
        assert all(s is not None for s in states(client).values())
        assert all(client.gather(client.map(on_pool_stream, range(8), pure=False)))


@pytest.mark.parametrize("processes", [False, True], ids=["in-process", "processes"])
def test_enabled_config_before_the_client(processes):
    config = {"gpustreams.enabled": True}
    with cluster(processes=processes, n_workers=1, plugin=False, config=config) as client:
        assert client.submit(on_pool_stream, pure=False).result()
        client.cluster.scale(2)
        client.wait_for_workers(2)
        assert all(s is not None for s in states(client).values())
        a, b = workers(client)
        x = client.submit(produce, 100, 2.0, 0.05, workers=[a], pure=False)
        assert client.submit(total, client.submit(inc, x, workers=[b])).result() == 300.0


def worker_settings(dask_worker):
    config = dask_worker.plugins["gpustreams"].config
    return config.streams, config.blocks, config.timeline


def test_enabled_config_carries_the_clients_settings_to_workers_made_before():
    """Worker processes made before the settings read their own config, where the
    settings are not: the client's registration carries them as the plugin's arguments."""
    with cluster(processes=True, n_workers=1, plugin=False) as client:
        client.close()
        settings = {"gpustreams.streams": 3, "gpustreams.blocks": "off", "gpustreams.timeline": 1}
        with dask.config.set({"gpustreams.enabled": True, **settings}), Client(client.cluster) as c:
            assert list(c.run(worker_settings).values()) == [(3, "off", True)]
            assert c.submit(on_pool_stream, pure=False).result()


def test_without_enabled_config_nothing_is_installed():
    with cluster(n_workers=1, plugin=False) as client:
        assert states(client) == {workers(client)[0]: None}
        assert not client.submit(on_pool_stream, pure=False).result()


def test_local_cluster_preload_tolerates_dask_cuda_argv():
    kwargs = {"preload": ["dask_gpustreams"], "preload_argv": ["--create-cuda-context"]}
    with cluster(n_workers=1, plugin=False, **kwargs) as client:
        assert client.submit(on_pool_stream, pure=False).result()


def test_worker_preload_config_key():
    config = {"distributed.worker.preload": ["dask_gpustreams"]}
    with cluster(n_workers=1, plugin=False, config=config) as client:
        assert client.submit(on_pool_stream, pure=False).result()


def test_scheduler_preload():
    scheduler_kwargs = {"preload": ["dask_gpustreams"]}
    with cluster(n_workers=1, plugin=False, scheduler_kwargs=scheduler_kwargs) as client:
        client.cluster.scale(2)
        client.wait_for_workers(2)
        assert all(s is not None for s in states(client).values())


def test_dask_setup_ignores_a_nanny():
    class Nanny:
        pass

    assert dask_setup.callback(Nanny()) is None


# --- the plugin object ----------------------------------------------------------------------


def test_settings_are_validated_on_the_client():
    with pytest.raises(ValueError, match=r"gpustreams.streams=0 is invalid"):
        StreamsPlugin(streams=0)
    with pytest.raises(ValueError, match=r"gpustreams.policy='nope' is invalid"):
        StreamsPlugin(policy="nope")


@pytest.mark.parametrize(
    "name, hint", [("stream", " did you mean 'streams'?"), ("nope", "")], ids=["close", "far"]
)
def test_an_unknown_keyword_argument_names_the_closest_setting(name, hint):
    allowed = ", ".join(StreamsConfig.__dataclass_fields__)
    with pytest.raises(TypeError) as raised:
        StreamsPlugin(**{name: 4})
    assert str(raised.value) == (
        f"StreamsPlugin() got an unexpected keyword argument {name!r};{hint} allowed: {allowed}"
    )


def test_plugin_pickles_its_settings_only():
    plugin = StreamsPlugin(streams=2, policy="round-robin")
    copy = pickle.loads(pickle.dumps(plugin))
    assert copy.overrides == {"streams": 2, "policy": "round-robin"}
    assert vars(copy) == {"overrides": copy.overrides}
    assert (StreamsPlugin.name, StreamsPlugin.idempotent) == ("gpustreams", False)


def test_keyword_arguments_override_the_worker_config():
    with cluster(n_workers=1, plugin=False) as client:
        client.register_plugin(StreamsPlugin(streams=2, policy="round-robin"))
        client.submit(on_pool_stream, pure=False).result()
        assert [s["streams"] for s in states(client).values()] == [2]


def test_a_backend_that_cannot_start_fails_the_task():
    with cluster(n_workers=1, plugin=False) as client:
        if gpu_visible()[0]:
            pytest.skip("a GPU is visible: the cupy backend starts here")
        client.register_plugin(StreamsPlugin(backend="cupy"))
        with pytest.raises(ValueError, match="gpustreams.backend='cupy' cannot start"):
            client.submit(on_pool_stream, pure=False).result()


def test_a_failure_while_wrapping_fails_the_task_instead_of_running_it_unwrapped(monkeypatch):
    def broken(self, key):
        raise RuntimeError(f"cannot wrap {key}")

    monkeypatch.setattr(Execution, "prepare", broken)
    with cluster(n_workers=1) as client:  # in-process workers share the patched class
        future = client.submit(on_pool_stream, pure=False, key="victim")
        with pytest.raises(RuntimeError, match="cannot wrap victim"):
            future.result()


def test_unregistering_restores_the_worker():
    with cluster(n_workers=1) as client:
        x = client.submit(produce, 1000, 1.0, 0.1, pure=False)
        wait(x)
        client.unregister_worker_plugin("gpustreams")

        def restored(dask_worker):
            handler = dask_worker.handlers["get_data"]
            hooks = [cb for cb in dask_worker.data.fast.on_evict if "before_spill" in repr(cb)]
            return handler == dask_worker.get_data and not hooks

        assert all(client.run(restored).values())
        # Work wrapped before the removal was waited for: the result is complete.
        np.testing.assert_array_equal(values(x.result()), np.full(1000, 1.0))
        assert not client.submit(on_pool_stream, pure=False).result()
