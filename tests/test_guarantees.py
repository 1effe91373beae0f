"""Guarantees that the docs give and no other test checked (issue 12's list).

- a ``get_data`` waiting for a result's event leaves the worker's event loop serving;
- the failure records' limits (``max_failures``, ``failure_ttl``) and their expiry;
- a local compute syncs the host once at the end, never per task;
- the pinned pool's waits when it is full;
- the plugin's teardown waits for the wrapped tasks still running;
- ``backend: auto`` logs its choice once per process;
- a corrupt result that a dependent still needs is released once it has left;
- a kernel failure that nothing reads fails no later task.

The cluster tests run in-process, so that a gate (a ``threading.Event`` that a
kernel or a task waits for) holds work back exactly as long as the test needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import multiprocessing
import os
import sys
import threading
import time
import weakref
from collections import deque
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from functools import partial
from types import SimpleNamespace

import dask
import dask.threaded
import numpy as np
import pytest
from dask import delayed
from distributed import Client, LocalCluster, WorkerPlugin, wait
from distributed.core import Status
from distributed.worker import get_data_from_worker

from dask_gpustreams import StreamsConfig, StreamsPlugin, get_runtime, sim
from dask_gpustreams.backends import gpu_visible
from dask_gpustreams.backends.sim import SimBackend
from dask_gpustreams.errors import KernelError
from dask_gpustreams.integrations.distributed import failures
from dask_gpustreams.integrations.distributed.egress import Egress
from dask_gpustreams.integrations.distributed.erred_inputs import STIMULUS_PREFIX
from dask_gpustreams.integrations.distributed.failures import FailureRecords
from dask_gpustreams.integrations.distributed.provenance import Provenance
from dask_gpustreams.integrations.distributed.withheld import WithheldKeys
from dask_gpustreams.runtime import StreamPool, TaskRecord, runtimes
from dask_gpustreams.runtime.pinned import PinnedPool
from tests.conftest import forget_closed_servers
from tests.sim_tasks import fails_on_the_device, ones
from tests.test_distributed import DeviceHostFileLike

#: Opened by the test that closes it, and by the ``gate`` fixture at the end (a failed
#: test leaves no kernel or task waiting). Tasks find it by reference: in-process workers.
GATE = threading.Event()
#: Set by :func:`gated_task` once it runs, inside the runtime, on its worker thread.
ENTERED = threading.Event()

CONFIG = {
    "gpustreams.backend": "sim",
    "gpustreams.streams": 4,
    "gpustreams.policy": "round-robin",
    "distributed.worker.memory.spill": False,
}


@pytest.fixture
def gate():
    GATE.clear()
    ENTERED.clear()
    yield GATE
    GATE.set()


def _fill(out, value, seconds):
    time.sleep(seconds)
    out[...] = value


def _fill_after_gate(out, value):
    GATE.wait()
    out[...] = value


def produce(n, value, seconds=0.0):
    out = sim.empty(n)
    sim.launch(_fill, out, value, seconds)
    return out


def gated_kernel(n, value):
    """Returns at once; its kernel waits for :data:`GATE`, then writes ``value``."""
    out = sim.empty(n)
    sim.launch(_fill_after_gate, out, value)
    return out


def gated_task(n, value):
    """Waits for :data:`GATE` in its worker thread, on its stream, then launches its kernel."""
    ENTERED.set()
    GATE.wait()
    return produce(n, value)


def _add(out, a, b, seconds):
    time.sleep(seconds)
    np.add(a, b, out=out)


def add(a, b, seconds=0.0):
    out = sim.empty(a.shape)
    sim.launch(_add, out, a, b, seconds)
    return out


def values(array):
    return sim.asnumpy(array)


def until(condition, timeout=30.0):
    """Poll ``condition`` (an observable state, not a delay) until true; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not true after {timeout} s: {condition}"
        time.sleep(0.01)


@contextlib.contextmanager
def sim_cluster(
    n_workers: int, threads: int, config: dict | None = None, plugin: bool = True, **kwargs
):
    """In-process workers with the plugin (sim, 4 streams, round-robin; ``plugin=False``:
    none yet) and a client; ``kwargs`` go to the ``LocalCluster``."""
    with (
        dask.config.set({**CONFIG, **(config or {})}),
        LocalCluster(
            n_workers=n_workers,
            threads_per_worker=threads,
            processes=False,
            dashboard_address=":0",
            **kwargs,
        ) as lc,
        Client(lc) as client,
    ):
        if plugin:
            client.register_plugin(StreamsPlugin())
        yield lc, client


@pytest.fixture
def cluster():
    """One in-process worker of two threads and a client: ``(client, worker)``."""
    with sim_cluster(1, 2) as (lc, client):
        [worker] = lc.workers.values()
        yield client, worker


# --- (a) get_data waits off the event loop --------------------------------------------------


def test_a_get_data_waiting_for_an_event_leaves_the_event_loop_serving(cluster, gate, monkeypatch):
    client, worker = cluster
    done = client.submit(produce, 100, 1.0, pure=False)
    wait(done)
    x = client.submit(gated_kernel, 100, 2.0, pure=False)
    wait(x)  # in the worker's memory; its kernel waits for the gate
    backend = worker.plugins["gpustreams"].runtime.backend
    egress_waiting = threading.Event()
    event_error = backend.event_error

    def observed(event):  # a backend wrapper: the egress threads' blocking waits
        if threading.current_thread().name.startswith("gpustreams-egress"):
            egress_waiting.set()
        return event_error(event)

    monkeypatch.setattr(backend, "event_error", observed)
    with ThreadPoolExecutor(3) as threads:
        gathered = threads.submit(x.result)
        assert egress_waiting.wait(30)  # x's get_data waits for its kernel's event
        # Meanwhile the worker's event loop serves: a run, another get_data, a new task.
        ran = threads.submit(client.run, lambda: "served", workers=[worker.address])
        assert ran.result(timeout=30) == {worker.address: "served"}
        np.testing.assert_array_equal(values(done.result(timeout=30)), np.full(100, 1.0))
        y = client.submit(np.add, 1, 2, pure=False)
        assert y.result(timeout=30) == 3
        assert not gathered.done()
        gate.set()
        np.testing.assert_array_equal(values(gathered.result(timeout=30)), np.full(100, 2.0))


# --- (b) the failure records' limits ---------------------------------------------------------


@pytest.fixture
def clock(monkeypatch):
    """The monotonic clock of the failure records, set by the test (``clock.now``)."""
    fake = SimpleNamespace(now=1000.0, time=time.time)
    fake.monotonic = lambda: fake.now
    monkeypatch.setattr(failures, "time", fake)
    return fake


def test_failure_records_keep_the_newest_max_failures_and_expire_after_failure_ttl(clock):
    limits = FailureRecords(max_failures=2, ttl=60.0)  # its attributes are read when used
    stopped = SimpleNamespace(status=Status.closed)  # nothing to release on the worker
    records = Provenance(stopped, StreamsConfig(backend="sim"), None, limits)
    errors = {key: KernelError(key, "failed") for key in "abcd"}

    records.drop_corrupt({"a": errors["a"]})
    clock.now += 10
    records.drop_corrupt({"b": errors["b"]})
    clock.now += 10
    records.drop_corrupt({"c": errors["c"]})  # a third: the oldest, a, goes
    assert list(records.failures) == ["b", "c"]
    clock.now += 10
    records.drop_corrupt({"b": errors["b"]})  # b fails again: now the newest, c goes next
    records.drop_corrupt({"d": errors["d"]})
    assert list(records.failures) == ["b", "d"]
    assert records.failures["b"] == (errors["b"], 1030.0)

    clock.now = 1030.0 + 60.0  # b and d are exactly failure_ttl old: kept
    records.failures.expire()
    assert list(records.failures) == ["b", "d"]
    clock.now += 0.5
    records.failures.expire()
    assert records.failures == {}
    assert records.failures.take("b") is None

    limits.ttl = 5.0  # read at each use
    records.drop_corrupt({"a": errors["a"]})
    clock.now += 5.5
    records.failures.expire()
    assert records.failures == {}


def test_kernel_failures_count_each_failed_run_once_however_often_it_is_found():
    """Two runs of one key that both fail are two failures; finding one again is not."""
    stopped = SimpleNamespace(status=Status.closed)
    with ThreadPoolExecutor(1) as threads:
        provenance = Provenance(stopped, StreamsConfig(backend="sim"), threads, None)
        runtime = provenance.task_runtime()
        runs = []
        for _ in range(2):
            runtime.run("bad", lambda _: fails_on_the_device(ones(4)), {}, provenance.registry)
            runs.append(provenance.registry.get("bad"))
        for record in [*runs, runs[1], runs[0]]:
            error = provenance.wait(record)
            assert isinstance(error, KernelError) and error.key == "bad"
        assert provenance.kernel_failures == 2
        runtime.close()


def test_the_plugin_gives_its_failure_limits_to_each_workers_records(monkeypatch):
    # Not the defaults: records made with hard-coded limits would not pass.
    monkeypatch.setattr(StreamsPlugin, "max_failures", 7)
    monkeypatch.setattr(StreamsPlugin, "failure_ttl", 12.5)
    with (
        dask.config.set(CONFIG),
        LocalCluster(n_workers=1, processes=False, dashboard_address=":0") as lc,
        Client(lc) as client,
    ):
        client.register_plugin(StreamsPlugin())

        def limits(dask_worker):
            records = dask_worker.plugins["gpustreams"].failures
            return type(records).__name__, records.max_failures, records.ttl

        (got,) = client.run(limits).values()
    assert got == ("FailureRecords", 7, 12.5)


# --- (c) one host sync at the end, none per task ---------------------------------------------


@pytest.mark.parametrize("scheduler", ["gpustreams", pytest.param(dask.threaded.get, id="threads")])
def test_a_local_compute_syncs_the_host_once_at_the_end(gpustreams, monkeypatch, rng, scheduler):
    with gpustreams(streams=4, policy="round-robin"):
        runtime = get_runtime()  # the one the compute uses: same settings
        # A call stalled past the threshold on a loaded host would make its group host
        # work, whose inputs are waited for on the host by design: not what is counted.
        monkeypatch.setattr(runtime.host_tasks, "threshold_s", 60.0)
        syncs = []
        for name in ("synchronize_event", "synchronize_stream", "event_error"):
            monkeypatch.setattr(runtime.backend, name, _counted(name, runtime.backend, syncs))
        leaves = [
            delayed(produce)(64, float(i), rng.uniform(0, 0.003), dask_key_name=f"leaf-{i}")
            for i in range(32)
        ]
        while len(leaves) > 1:  # a tree of 63 tasks, one result
            leaves = [
                delayed(add)(leaves[i], leaves[i + 1], rng.uniform(0, 0.002))
                for i in range(0, len(leaves), 2)
            ]
        result = leaves[0].compute(scheduler=scheduler)
        assert syncs == ["event_error"]  # the result's event, once, at the end
    np.testing.assert_array_equal(values(result), np.full(64, float(sum(range(32)))))


def _counted(name, backend, calls):
    call = getattr(backend, name)

    def counted(*args, **kwargs):
        calls.append(name)
        return call(*args, **kwargs)

    return counted


# --- (d) the pinned pool when it is full -----------------------------------------------------


def _blocked_in(thread: threading.Thread, function: str) -> bool:
    """Whether ``thread`` is inside ``threading``'s ``function`` (a ``Condition`` wait, say)."""
    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        if frame.f_code.co_name == function and frame.f_code.co_filename == threading.__file__:
            return True
        frame = frame.f_back
    return False


def test_a_full_pinned_pool_waits_for_a_buffer_staged_in_another_thread():
    pool = PinnedPool(SimBackend(), limit=1 << 16)  # room for one buffer
    held = pool.acquire(1000)  # being staged by another thread: no copy in flight yet
    got = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire(1000)))
    waiter.start()
    until(lambda: _blocked_in(waiter, "wait"))  # nothing to wait for on the device
    assert not got
    pool.release(held, None)  # no copy was enqueued: free at once, and the waiter woken
    waiter.join(timeout=30)
    assert len(got) == 1 and got[0] is held
    assert pool.total_bytes() == 1 << 16


def test_a_full_pinned_pool_waits_for_the_oldest_copy_in_flight(monkeypatch):
    backend = SimBackend()
    pool = PinnedPool(backend, limit=2 << 16)  # room for two buffers
    stream = backend.create_stream()
    gates = [threading.Event(), threading.Event()]
    buffers = [pool.acquire(1000), pool.acquire(1000)]
    events = []
    for buffer, copy_gate in zip(buffers, gates, strict=True):
        stream.launch(copy_gate.wait, (), {}, None)  # the copy of this buffer, held back
        event = backend.create_event()
        backend.record(event, stream)
        pool.release(buffer, event)
        events.append(event)
    synced = []
    monkeypatch.setattr(
        backend, "synchronize_event", _counted("synchronize_event", backend, synced)
    )
    got = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire(1000)))
    waiter.start()
    try:
        until(
            lambda: synced == ["synchronize_event"]
        )  # it waits on the device, for the oldest copy
        assert not got and not events[0].done
        gates[0].set()
        waiter.join(timeout=30)
        assert len(got) == 1 and got[0] is buffers[0]  # that copy's buffer, once it is done
        assert synced == ["synchronize_event"] and not events[1].done
        assert pool.total_bytes() == 2 << 16  # no buffer beyond the limit
    finally:
        for copy_gate in gates:
            copy_gate.set()


def test_a_full_pinned_pool_drops_free_buffers_of_other_sizes():
    pool = PinnedPool(SimBackend(), limit=2 << 16)
    small = pool.acquire(1000)  # 64 KiB
    pool.release(small, None)
    large = pool.acquire(100_000)  # 128 KiB: only once the free small one is dropped
    assert large.nbytes == 2 << 16 and pool.total_bytes() == 2 << 16
    pool.release(large, None)
    assert pool.trim() == 2 << 16


# --- (e) teardown waits for the wrapped tasks still running ----------------------------------


def test_teardown_waits_for_the_wrapped_tasks_still_running(cluster, gate):
    client, worker = cluster
    x = client.submit(gated_task, 100, 2.0, pure=False)
    assert ENTERED.wait(30)  # running inside the runtime, on its worker thread
    runtime = worker.plugins["gpustreams"].runtime
    with ThreadPoolExecutor(1) as threads:
        try:
            removing = threads.submit(client.unregister_worker_plugin, "gpustreams")
            until(lambda: "gpustreams" not in worker.plugins)  # removed: its teardown runs
            assert not removing.done() and not runtime.closed  # ... and waits for the task
        finally:
            gate.set()
        removing.result(timeout=30)
    assert runtime.closed
    # The task ran to its end on its stream before the streams were closed.
    np.testing.assert_array_equal(values(x.result(timeout=30)), np.full(100, 2.0))


def test_teardown_waits_for_a_wrapped_task_whose_execute_has_not_started(cluster):
    """A task is wrapped as it transitions to executing; ``Worker.execute`` (held here)
    starts on a later turn of the event loop. A teardown in between must wait for it too.
    Before, it looked only at ``active_keys``, closed the runtime, and the task then raised
    "this stream pool is closed" (fuzz_registrations --failing, seeds 70122-70124)."""
    client, worker = cluster
    plugin = worker.plugins["gpustreams"]
    execute = worker.execute
    held = asyncio.Event()
    started = threading.Event()

    async def held_execute(key, **kwargs):
        started.set()
        await held.wait()
        return await execute(key, **kwargs)

    running_wrapped = plugin.execution.running_wrapped
    waited = threading.Event()

    def observed():
        running = running_wrapped()
        if running:
            waited.set()
        return running

    worker.execute = held_execute
    plugin.execution.running_wrapped = observed
    try:
        x = client.submit(produce, 100, 2.0, pure=False)
        assert started.wait(30)  # wrapped, its execute held
        runtime = plugin.runtime  # made by its wrapping
        [ts] = [ts for ts in worker.state.tasks.values() if ts.key == x.key]
        assert ts.state == "executing" and x.key not in worker.active_keys
        with ThreadPoolExecutor(1) as threads:
            try:
                removing = threads.submit(client.unregister_worker_plugin, "gpustreams")
                until(lambda: removing.done() or waited.is_set())
                assert not runtime.closed  # the teardown waits for the task
            finally:
                client.sync(_set, held)
            removing.result(timeout=30)
    finally:
        worker.execute = execute
    assert runtime.closed
    np.testing.assert_array_equal(values(x.result(timeout=30)), np.full(100, 2.0))


def test_a_teardown_waiting_for_a_task_ends_when_the_worker_closes_meanwhile(cluster, gate):
    """A teardown that waits for a wrapped task, and then the worker closes: the close
    cancels the task's ``Worker.execute`` (its key leaves ``active_keys``; the task stays in
    ``executing`` for good: a cancelled instruction sends no event), and the teardown goes on
    as a closing worker's, within ``close_timeout``. Before, it waited for the ``executing``
    set forever (polling every 10 ms) until the server's close cancelled it: the runtime
    was never closed."""
    client, worker = cluster
    plugin = worker.plugins["gpustreams"]
    x = client.submit(gated_task, 100, 2.0, pure=False)
    assert ENTERED.wait(30)  # running inside the runtime, on its worker thread
    runtime = plugin.runtime
    with ThreadPoolExecutor(2) as threads:
        try:
            removing = threads.submit(client.unregister_worker_plugin, "gpustreams")
            until(lambda: plugin._teardown_ended is not None)  # its teardown waits for x
            closing = threads.submit(client.sync, worker.close)
            # The close has cancelled x's execute; x's thread still runs (the gate).
            until(lambda: worker.status == Status.closing and x.key not in worker.active_keys)
        finally:
            gate.set()
        closing.result(timeout=60)
        with contextlib.suppress(Exception):  # the worker went while it answered
            removing.result(timeout=60)
    until(lambda: plugin._teardown_ended.done())
    assert runtime.closed


def _add_later(out, a, b):
    total = a + b
    time.sleep(0.2)
    out[...] = total


def add_later(a, b):
    """``a + b`` by a kernel on the thread's current stream that reads its inputs at once
    and writes its output 0.2 s later."""
    out = sim.empty(a.shape)
    sim.launch(_add_later, out, a, b)
    return out


async def first_value(x):
    """A coroutine task that reads its device input on the host."""
    return float(values(x)[0])


def test_a_coroutine_task_waits_for_its_inputs_work():
    """A coroutine task runs on the worker's event loop, off the streams: it waits (in a
    thread) for its input's kernel before it runs, as a host-side task does. Before, it read
    x unwritten (NaN) while x's kernel still waited for the gate."""
    GATE.clear()
    with sim_cluster(1, 2) as (lc, client):
        [worker] = lc.workers.values()
        x = client.submit(gated_kernel, 100, 2.0, pure=False)
        wait(x)  # in memory; its kernel waits for the gate
        y = client.submit(first_value, x, pure=False)

        def started():
            ts = worker.state.tasks.get(y.key)
            return ts is not None and ts.state in ("executing", "memory")

        until(started)
        GATE.set()
        assert y.result(timeout=30) == 2.0


@pytest.mark.parametrize("then", ["replace", "unregister"])
def test_a_task_that_starts_during_the_teardown_waits_for_its_inputs_and_its_own_work(
    cluster, gate, then
):
    """Removed (or replaced by a plugin with new settings) while a graph runs, the plugin's
    teardown waits for the wrapped tasks; a task that starts meanwhile runs unwrapped. It
    waits on the host for its inputs' work (x's kernel, held back by the gate) and, before
    it returns, for the work it queued on its own stream (no event of its result tells a
    later reader to wait). Before, it read x unwritten (NaN), and its reader read its
    result before its kernel had run."""
    client, worker = cluster
    x = client.submit(gated_kernel, 100, 2.0, pure=False)
    wait(x)  # in memory; its kernel waits for the gate
    busy = client.submit(gated_task, 100, 1.0, pure=False)  # the teardown waits for it
    assert ENTERED.wait(30)
    with ThreadPoolExecutor(1) as threads:
        try:
            removing = (
                threads.submit(client.register_plugin, StreamsPlugin(streams=2))
                if then == "replace"
                else threads.submit(client.unregister_worker_plugin, "gpustreams")
            )
            until(lambda: any(n.startswith("gpustreams-withheld") for n in worker.plugins))
            y = client.submit(add_later, x, x, pure=False)  # starts unwrapped, reads x
            until(
                lambda: (
                    worker.state.tasks.get(y.key) is not None
                    and worker.state.tasks[y.key].state in ("executing", "memory")
                )
            )
        finally:
            gate.set()
        removing.result(timeout=30)
    z = client.submit(add, y, y, pure=False)  # on the new plugin's streams, or plain
    np.testing.assert_array_equal(values(y.result(timeout=30)), np.full(100, 4.0))
    np.testing.assert_array_equal(values(z.result(timeout=30)), np.full(100, 8.0))
    np.testing.assert_array_equal(values(busy.result(timeout=30)), np.full(100, 1.0))
    if then == "unregister":
        client.register_plugin(StreamsPlugin())


def test_a_task_of_a_process_pool_executor_that_starts_during_the_teardown_runs_as_is(
    cluster, gate
):
    """A task that the worker runs in another process (an ``executor`` annotation naming a
    process pool) is left as it is by the teardown's guard, as the plugin leaves it: the
    guard's wrapper holds the runtime, which the pool cannot pickle (the task failed)."""
    client, worker = cluster
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=context) as processes:
        worker.executors["processes"] = processes
        try:
            busy = client.submit(gated_task, 100, 1.0, pure=False)  # the teardown waits for it
            assert ENTERED.wait(30)
            with ThreadPoolExecutor(1) as threads:
                try:
                    removing = threads.submit(client.register_plugin, StreamsPlugin(streams=2))
                    until(lambda: any(n.startswith("gpustreams-withheld") for n in worker.plugins))
                    with dask.annotate(executor="processes"):
                        pid = client.submit(os.getpid, pure=False)  # starts during the teardown
                    wait(pid, timeout=60)
                finally:
                    gate.set()
                removing.result(timeout=30)
            assert pid.result(timeout=30) != os.getpid()
            np.testing.assert_array_equal(values(busy.result(timeout=30)), np.full(100, 1.0))
        finally:
            del worker.executors["processes"]


def overlap_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "registrations overlapped" in r.getMessage()]


def overlapping(gate, *steps) -> None:
    """Client calls that overlap while the gate holds a teardown they wait for: each
    ``(call, until_true)`` step starts ``call`` in a thread of its own once the step before
    it observably took effect (``until_true``); then the gate opens and every call ends."""
    with ThreadPoolExecutor(len(steps)) as threads:
        calls = []
        try:
            for call, took_effect in steps:
                calls.append(threads.submit(call))
                until(took_effect)
        finally:
            gate.set()
        for call in calls:
            call.result(timeout=30)


def test_registrations_that_overlap_leave_one_plugin_set_up(cluster, gate, caplog):
    """A registration that comes while an earlier one waits for the old plugin's teardown
    finds the name free in distributed's ``plugin_add``: its plugin is installed and set
    up, then replaced by the earlier one's without a teardown. Before, that plugin stayed
    set up (its get_data wrapper stayed after the plugin was unregistered); now a setup
    waits for the teardown that runs, one plugin is set up, and a warning says so."""
    client, worker = cluster
    x = client.submit(gated_task, 100, 2.0, pure=False)
    assert ENTERED.wait(30)  # the old plugin's teardown waits for it
    with caplog.at_level(logging.WARNING, logger="dask_gpustreams"):
        overlapping(
            gate,
            # the old one's teardown runs
            (
                partial(client.register_plugin, StreamsPlugin(streams=2)),
                lambda: "gpustreams" not in worker.plugins,
            ),
            # the second, installed meanwhile
            (
                partial(client.register_plugin, StreamsPlugin(streams=3)),
                lambda: "gpustreams" in worker.plugins,
            ),
        )
    installed = worker.plugins["gpustreams"]
    y = client.submit(add, x, x, pure=False)
    np.testing.assert_array_equal(values(y.result(timeout=30)), np.full(100, 4.0))
    assert installed.runtime.pool.n_streams == installed.config.streams
    client.unregister_worker_plugin("gpustreams")
    assert worker.handlers["get_data"] == worker.get_data  # no plugin left wrapping it
    [warning] = overlap_warnings(caplog)
    assert f"on worker {worker.address}" in warning
    client.register_plugin(StreamsPlugin())


def test_a_registration_during_an_unregisters_teardown_is_set_up(cluster, gate, caplog):
    """A plugin registered while the unregistered one's teardown still runs (the name is
    free at once) waits for that teardown, then runs the tasks: it is the one registered.
    Before, the teardown's end took it out of ``LATEST``, so its setup found itself
    "replaced or removed" and set nothing up, and tasks ran off the streams."""
    client, worker = cluster
    x = client.submit(gated_task, 100, 2.0, pure=False)
    assert ENTERED.wait(30)  # the old plugin's teardown waits for it
    with caplog.at_level(logging.WARNING, logger="dask_gpustreams"):
        overlapping(
            gate,
            # its teardown runs
            (
                partial(client.unregister_worker_plugin, "gpustreams"),
                lambda: "gpustreams" not in worker.plugins,
            ),
            # installed, its setup waits
            (
                partial(client.register_plugin, StreamsPlugin(streams=2)),
                lambda: "gpustreams" in worker.plugins,
            ),
        )
    installed = worker.plugins["gpustreams"]
    y = client.submit(add, x, x, pure=False)
    np.testing.assert_array_equal(values(y.result(timeout=30)), np.full(100, 4.0))
    assert client.submit(on_a_pool_stream, pure=False).result()
    assert installed.runtime.pool.n_streams == 2
    assert overlap_warnings(caplog) == []


def test_a_plugin_set_up_under_a_second_name_tears_the_first_down(cluster, caplog):
    """Two StreamsPlugins never run a worker's tasks: the one set up last tears the other
    down, with a warning that names both."""
    client, worker = cluster
    x = client.submit(produce, 100, 1.0, pure=False)
    wait(x)
    old = worker.plugins["gpustreams"]
    new = StreamsPlugin(streams=2)
    with caplog.at_level(logging.WARNING, logger="dask_gpustreams"):
        client.register_plugin(new, name="gpustreams-2")
    assert old.runtime.closed
    y = client.submit(add, x, x, pure=False)
    np.testing.assert_array_equal(values(y.result(timeout=30)), np.full(100, 2.0))
    assert worker.plugins["gpustreams-2"].runtime.pool.n_streams == 2
    client.unregister_worker_plugin("gpustreams-2")
    client.unregister_worker_plugin("gpustreams")
    assert worker.handlers["get_data"] == worker.get_data
    [warning] = overlap_warnings(caplog)
    assert warning.startswith(
        f"gpustreams: {new!r} is set up on worker {worker.address} while {old!r} still was"
    )
    client.register_plugin(StreamsPlugin())


def on_a_pool_stream():
    device = sim.get_device()
    return device.current_stream() is not device.default_stream


def test_one_plugin_object_given_to_several_in_process_workers_sets_up_each():
    """``LocalCluster(processes=False, plugins={plugin})`` hands the same object to every
    worker, unpickled: each worker gets a copy of its settings, set up there, and runs its
    tasks on its own pool streams, exact across workers. Before, the second setup replaced
    the first worker's state in the shared object: that worker's tasks ran off the pool
    streams, with no warning."""
    plugin = StreamsPlugin(streams=3)
    with (
        dask.config.set(CONFIG),
        LocalCluster(
            n_workers=2,
            threads_per_worker=2,
            processes=False,
            dashboard_address=":0",
            plugins={plugin},
        ) as lc,
        Client(lc) as client,
    ):
        workers = list(lc.workers.values())
        plugins = [w.plugins["gpustreams"] for w in workers]
        assert plugins[0] is not plugins[1]
        assert plugin in plugins
        assert [p.overrides for p in plugins] == [{"streams": 3}] * 2
        for w in workers:
            assert client.submit(on_a_pool_stream, pure=False, workers=[w.address]).result()
        xs = [
            client.submit(produce, 100, 1.0 + i, 0.05, pure=False, workers=[w.address])
            for i, w in enumerate(workers)
        ]
        ys = [client.submit(add, xs[0], xs[1], pure=False, workers=[w.address]) for w in workers]
        for y in ys:
            np.testing.assert_array_equal(client.submit(values, y).result(), np.full(100, 3.0))
    assert all(p.runtime is None or p.runtime.closed for p in plugins)


class _StubWorker:
    """As much of a worker as a setup with bad settings reads."""

    def __init__(self, address):
        self.address = address
        self.plugins = {}
        self.state = SimpleNamespace(tasks={})


def test_each_in_process_worker_of_one_failing_plugin_object_names_only_itself():
    """One plugin object whose settings are bad, given to two in-process workers: the second
    worker's copy carries the settings as given, so its error names that worker alone.
    Before, the copy carried the first worker's error, which the second prefixed again:
    "cannot start on worker w2: gpustreams cannot start on worker w1: bad"."""
    plugin = StreamsPlugin.failing(ValueError("bad"))
    workers = [_StubWorker("inproc://w1"), _StubWorker("inproc://w2")]
    errors = []
    for w in workers:
        w.plugins["gpustreams"] = plugin
        with pytest.raises(ValueError) as e:
            asyncio.run(plugin.setup(w))
        errors.append(str(e.value))
    assert errors == [f"gpustreams cannot start on worker {w.address}: bad" for w in workers]
    copied = workers[1].plugins["gpustreams"]
    assert copied is not plugin and copied.error is not plugin.error
    assert str(copied.error) == errors[1]


# --- results made while no plugin was set up ---------------------------------------------------

#: Opened by the test: the kernel of :func:`task_then_kernel_gated` waits for it.
KERNEL_GATE = threading.Event()


def _fill_after(out, value, gate):
    gate.wait()
    out[...] = value


def task_then_kernel_gated(n, value):
    """Waits in its thread for :data:`GATE`, then launches a kernel that waits for
    :data:`KERNEL_GATE` and returns at once."""
    ENTERED.set()
    GATE.wait()
    out = sim.empty(n)
    sim.launch(_fill_after, out, value, KERNEL_GATE)
    return out


@contextlib.contextmanager
def unplugged_cluster(n_workers: int, **kwargs):
    """In-process workers of two threads with no plugin (yet), and a client."""
    KERNEL_GATE.clear()
    try:
        with sim_cluster(n_workers, 2, plugin=False, **kwargs) as (lc, client):
            yield client, list(lc.workers.values())
    finally:
        KERNEL_GATE.set()


def settling(worker, monkeypatch) -> threading.Event:
    """Set once the worker's plugin records its wait for work made with no plugin set up."""
    backend = worker.plugins["gpustreams"].runtime.backend
    seen = threading.Event()
    unpooled_stream = backend.unpooled_stream

    def observed():
        seen.set()
        return unpooled_stream()

    monkeypatch.setattr(backend, "unpooled_stream", observed)
    return seen


def test_a_result_made_before_the_plugin_is_set_up_is_read_once_written(gate, monkeypatch):
    """Found by benchmarks/fuzz_registrations.py (helper-114, a known limit until stop 63). A
    result made with no plugin set up has no event; its kernel, on the sim's default stream
    (as on a per-thread default stream with CuPy), does not order the pool's streams. A task
    reading it on a pool stream read it unwritten (NaN) before; now it waits for it first."""
    with unplugged_cluster(1) as (client, [worker]):
        x = client.submit(gated_kernel, 100, 2.0, pure=False)
        wait(x)  # in memory; its kernel waits for the gate
        client.register_plugin(StreamsPlugin())
        seen = settling(worker, monkeypatch)
        y = client.submit(add, x, x, pure=False)  # on a pool stream
        until(lambda: seen.is_set() or y.done())
        gate.set()
        np.testing.assert_array_equal(values(y.result(timeout=30)), np.full(100, 4.0))
        z = client.submit(add, x, y, pure=False)  # waited for once: no second wait
        np.testing.assert_array_equal(values(z.result(timeout=30)), np.full(100, 6.0))
        assert not worker.plugins["gpustreams"].provenance.unpooled


def test_a_result_of_a_task_running_at_setup_is_read_once_written(gate, monkeypatch):
    """A task that started with no plugin set up returns after the setup, its kernel on the
    default stream still to run: its readers wait for it too."""
    with unplugged_cluster(1) as (client, [worker]):
        x = client.submit(task_then_kernel_gated, 100, 2.0, pure=False)
        assert ENTERED.wait(30)
        client.register_plugin(StreamsPlugin())
        seen = settling(worker, monkeypatch)
        gate.set()
        wait(x)  # in memory; its kernel waits for KERNEL_GATE
        y = client.submit(add, x, x, pure=False)
        until(lambda: seen.is_set() or y.done())
        KERNEL_GATE.set()
        np.testing.assert_array_equal(values(y.result(timeout=30)), np.full(100, 4.0))


def test_a_result_made_before_the_plugin_is_set_up_is_spilled_once_written(gate, monkeypatch):
    """A spill of such a result (here into a ``DeviceHostFile``-like mapping: pickled once a
    later result pushes it out of a device buffer of 1.5 arrays) waits for its work first."""
    data = (DeviceHostFileLike, {"device_memory_limit": 3 * 2**19})  # bytes: 1.5 arrays
    with unplugged_cluster(1, data=data) as (client, [worker]):
        x = client.submit(gated_kernel, 2**17, 2.0, pure=False)
        wait(x)  # in the device buffer; its kernel waits for the gate
        client.register_plugin(StreamsPlugin())
        seen = settling(worker, monkeypatch)
        y = client.submit(produce, 2**17, 3.0, pure=False)  # its store spills x
        until(lambda: seen.is_set() or y.done())
        gate.set()
        wait(y)
        assert len(worker.data.host_buffer) == 1  # x, spilled
        np.testing.assert_array_equal(values(x.result(timeout=30)), np.full(2**17, 2.0))


def test_a_result_made_before_the_plugin_is_set_up_leaves_its_worker_written(gate, monkeypatch):
    """``get_data`` of such a result (a peer's fetch: in-process, the array itself) waits
    for its work first, so a reader on another worker's pool stream finds it written."""
    with unplugged_cluster(2) as (client, [a, b]):
        x = client.submit(gated_kernel, 100, 2.0, pure=False, workers=[a.address])
        wait(x)
        client.register_plugin(StreamsPlugin())
        seen = settling(a, monkeypatch)
        y = client.submit(add, x, x, pure=False, workers=[b.address])
        until(lambda: seen.is_set() or y.done())
        gate.set()
        np.testing.assert_array_equal(values(y.result(timeout=30)), np.full(100, 4.0))


async def snapshot_first(x):
    """A coroutine task that reads its device input's buffer on the host with no stream and
    no wait for queued work (as a pickle's snapshot does)."""
    return float(x._view[0])


def test_a_result_made_before_the_plugin_is_set_up_is_read_once_written_by_a_coroutine(
    gate, monkeypatch
):
    """A coroutine task (off the streams, as a host-side one) reading such a result waits
    for its work in a thread before it runs (``Execution.prepare``, ``wait_inputs``)."""
    with unplugged_cluster(1) as (client, [worker]):
        x = client.submit(gated_kernel, 100, 2.0, pure=False)
        wait(x)  # in memory; its kernel waits for the gate
        client.register_plugin(StreamsPlugin())
        seen = settling(worker, monkeypatch)
        y = client.submit(snapshot_first, x, pure=False)
        until(lambda: seen.is_set() or y.done())
        gate.set()
        assert y.result(timeout=30) == 2.0


def task_gated_by_kernel_gate(n, value):
    """Waits in its thread for :data:`KERNEL_GATE`, then launches its kernel."""
    ENTERED.set()
    KERNEL_GATE.wait()
    return produce(n, value)


def read_during_replacement(client, x, seen, gate, teardown_reached) -> None:
    """Replace the plugin (``streams=2``); once ``teardown_reached()`` has waited for the old
    one's teardown to be where the test wants it (False: it timed out), read ``x`` (its
    kernel held by ``gate``) and check it is read once written: 2.0, not the sim's poison."""
    with ThreadPoolExecutor(1) as threads:
        try:
            removing = threads.submit(client.register_plugin, StreamsPlugin(streams=2))
            assert teardown_reached() is not False
            y = client.submit(snapshot_first, x, pure=False)
            until(lambda: seen.is_set() or y.done())
        finally:
            gate.set()
            KERNEL_GATE.set()
        removing.result(timeout=30)
    assert y.result(timeout=30) == 2.0


def test_a_result_made_before_the_plugin_is_set_up_is_read_once_written_during_its_teardown(
    gate, monkeypatch
):
    """The plugin is replaced while such a result is still noted, its kernel not run yet: a
    task that starts during the teardown (unwrapped, under the guard) waits for it too."""
    with unplugged_cluster(1) as (client, [worker]):
        x = client.submit(gated_kernel, 100, 2.0, pure=False)
        wait(x)  # in memory; its kernel waits for the gate
        client.register_plugin(StreamsPlugin())
        seen = settling(worker, monkeypatch)
        busy = client.submit(task_gated_by_kernel_gate, 100, 1.0, pure=False)
        assert ENTERED.wait(30)  # wrapped: the teardown waits for it
        read_during_replacement(
            client,
            x,
            seen,
            gate,
            # the teardown has begun: the task below starts during it
            lambda: until(lambda: any(n.startswith("gpustreams-withheld") for n in worker.plugins)),
        )
        np.testing.assert_array_equal(values(busy.result(timeout=30)), np.full(100, 1.0))


def test_a_result_made_before_the_plugin_is_set_up_is_read_once_written_after_its_teardown_clears(
    gate, monkeypatch
):
    """The same, for a task that starts once the teardown has forgotten the plugin's keys
    (``Provenance.close``), while its runtime still closes: the noted keys stay noted."""
    with unplugged_cluster(1) as (client, [worker]):
        x = client.submit(gated_kernel, 100, 2.0, pure=False)
        wait(x)  # in memory; its kernel waits for the gate
        client.register_plugin(StreamsPlugin())
        plugin = worker.plugins["gpustreams"]
        seen = settling(worker, monkeypatch)
        closing = threading.Event()
        close = plugin.runtime.close

        def held_close(*args, **kwargs):  # the runtime's close waits for KERNEL_GATE
            closing.set()
            KERNEL_GATE.wait()
            return close(*args, **kwargs)

        monkeypatch.setattr(plugin.runtime, "close", held_close)
        # the keys are forgotten and the teardown goes on: the task below starts under the guard
        read_during_replacement(client, x, seen, gate, lambda: closing.wait(30))


def test_a_result_made_before_the_plugin_is_set_up_and_never_read_costs_no_other_reader(
    monkeypatch,
):
    """A noted key that nothing reads stays noted: the tasks and the ``get_data`` requests
    that do not read it must not wait for it (no call of ``settle_unpooled``, no hop to an
    egress thread per request)."""
    with unplugged_cluster(1) as (client, [worker]):
        x = client.submit(produce, 100, 1.0, pure=False)
        wait(x)  # held, never read below
        client.register_plugin(StreamsPlugin())
        provenance = worker.plugins["gpustreams"].provenance
        assert list(provenance.unpooled) == [x.key]
        settles = []
        settle = provenance.settle_unpooled
        monkeypatch.setattr(
            provenance, "settle_unpooled", lambda keys: (settles.append(keys), settle(keys))
        )
        ys = [client.submit(produce, 10, float(i), pure=False) for i in range(5)]
        zs = [client.submit(add, y, y, pure=False) for y in ys]
        got = client.gather(zs)  # get_data
        assert [float(values(z)[0]) for z in got] == [0.0, 2.0, 4.0, 6.0, 8.0]
        assert settles == []
        assert list(provenance.unpooled) == [x.key]


def test_unregistering_the_second_name_leaves_the_first_registration_running(cluster, caplog):
    """The plugin under a second name tore the first down (one plugin runs the tasks); once
    it is unregistered, the plugin still registered as "gpustreams" must run them again,
    rather than sit in worker.plugins set up for nothing while tasks run off the streams
    with no word."""
    client, worker = cluster
    assert client.submit(on_a_pool_stream, pure=False).result()
    with caplog.at_level(logging.WARNING, logger="dask_gpustreams"):
        client.register_plugin(StreamsPlugin(streams=2), name="gpustreams-2")
    client.unregister_worker_plugin("gpustreams-2")
    assert "gpustreams" in worker.plugins  # still registered, for this worker and new ones
    assert client.submit(on_a_pool_stream, pure=False).result()
    assert not worker.plugins["gpustreams"].runtime.closed  # a new one, of the set-up again
    again = [r.getMessage() for r in caplog.records if "is set up again" in r.getMessage()]
    assert again == [
        f"gpustreams: StreamsPlugin(streams=2) is removed from worker {worker.address}; "
        "StreamsPlugin(), still registered there, is set up again"
    ]


def test_a_setup_that_gives_way_under_a_second_name_is_set_up_again_when_its_rival_goes(
    cluster, gate, caplog
):
    """Found by benchmarks/fuzz_registrations.py (seed 3). A plugin registered under a second
    name while a re-registration of the first name waits for the old plugin's teardown waits
    for that teardown too; the re-registered plugin's setup then starts first and the second-name
    plugin gives way ("sets nothing up") while it stays registered. Once the first name is
    unregistered, the second-name plugin must run the tasks again, as a displaced one is
    (``_set_up_displaced``), rather than sit registered and never set up while tasks run
    off the streams."""
    client, worker = cluster
    x = client.submit(gated_task, 100, 2.0, pure=False)
    assert ENTERED.wait(30)  # the old plugin's teardown waits for it
    with caplog.at_level(logging.WARNING, logger="dask_gpustreams"):
        overlapping(
            gate,
            # the old one's teardown runs
            (
                partial(client.register_plugin, StreamsPlugin(streams=2)),
                lambda: "gpustreams" not in worker.plugins,
            ),
            # its setup waits for that teardown
            (
                partial(client.register_plugin, StreamsPlugin(streams=3), name="gpustreams-2"),
                lambda: "gpustreams-2" in worker.plugins,
            ),
        )
    np.testing.assert_array_equal(values(x.result(timeout=30)), np.full(100, 2.0))
    until(lambda: "gpustreams" in worker.plugins)
    assert [p._active for p in worker.plugins.values() if isinstance(p, StreamsPlugin)].count(
        True
    ) == 1
    client.unregister_worker_plugin("gpustreams")
    assert "gpustreams-2" in worker.plugins  # still registered
    assert worker.plugins["gpustreams-2"]._active
    assert client.submit(on_a_pool_stream, pure=False).result(timeout=30)
    client.unregister_worker_plugin("gpustreams-2")
    assert worker.handlers["get_data"] == worker.get_data
    client.register_plugin(StreamsPlugin())


def test_a_second_name_removed_while_its_setup_waits_leaves_the_displaced_plugin_set_up(
    cluster, gate, caplog
):
    """Found by benchmarks/fuzz_registrations.py (seeds 5, 7, 9, 10). "gpustreams-2" tore
    "gpustreams" down (displaced); while its unregistration's teardown runs, "gpustreams-2"
    is registered again, and that plugin is unregistered while its setup still waits for the
    teardown. The teardown that ends is not the latest setup's, and the waiting setup gives
    way as removed: nobody sets "gpustreams" up again, and it sits registered while tasks
    run off the streams."""
    client, worker = cluster
    client.register_plugin(StreamsPlugin(streams=2), name="gpustreams-2")  # tears it down
    assert not worker.plugins["gpustreams"]._active
    x = client.submit(gated_task, 100, 2.0, pure=False)
    assert ENTERED.wait(30)  # the teardown of "gpustreams-2" waits for it
    registered = lambda: "gpustreams-2" in worker.plugins  # noqa: E731
    removed = lambda: "gpustreams-2" not in worker.plugins  # noqa: E731
    with caplog.at_level(logging.WARNING, logger="dask_gpustreams"):
        overlapping(
            gate,
            (partial(client.unregister_worker_plugin, "gpustreams-2"), removed),  # teardown runs
            # its setup waits for the teardown
            (
                partial(client.register_plugin, StreamsPlugin(streams=3), name="gpustreams-2"),
                registered,
            ),
            (partial(client.unregister_worker_plugin, "gpustreams-2"), removed),
        )
    np.testing.assert_array_equal(values(x.result(timeout=30)), np.full(100, 2.0))
    assert [n for n, p in worker.plugins.items() if isinstance(p, StreamsPlugin)] == ["gpustreams"]
    assert worker.plugins["gpustreams"]._active  # set up again
    assert client.submit(on_a_pool_stream, pure=False).result(timeout=30)


def test_a_failing_plugin_under_a_second_name_once_removed_leaves_the_first_set_up_again(
    cluster,
):
    """A plugin with bad settings registered under a second name tears the first down before
    its settings fail (its tasks then fail with their error, as documented). Once it is
    unregistered, the plugin still registered as "gpustreams" must run the tasks again:
    before, it stayed torn down (``_displaced``), and tasks ran off the streams."""
    client, worker = cluster
    with pytest.raises(ValueError, match="cannot start"):
        client.register_plugin(StreamsPlugin.failing(ValueError("bad")), name="gpustreams-2")
    client.unregister_worker_plugin("gpustreams-2")
    assert worker.plugins["gpustreams"]._active
    assert client.submit(on_a_pool_stream, pure=False).result(timeout=30)


@contextlib.contextmanager
def _first_register_held(sched, plugin: str | None = None):
    """The scheduler's first ``register_scheduler_plugin`` call (of ``plugin``, if named) held
    until the yielded event is set; also yields the names those calls registered, in order."""
    register = sched.handlers["register_scheduler_plugin"]
    held = asyncio.Event()
    calls = []

    async def held_register(*args, name=None, **kwargs):
        if plugin is None or name == plugin:
            calls.append(name)
            if len(calls) == 1:
                await held.wait()
        return await register(*args, name=name, **kwargs)

    sched.handlers["register_scheduler_plugin"] = held_register
    try:
        yield held, calls
    finally:
        sched.handlers["register_scheduler_plugin"] = register


def test_a_plugin_torn_down_during_its_setup_leaves_its_successors_blocks_setting(cluster):
    """The setup of a plugin torn down while it awaited the scheduler (a plugin under a second
    name set up meanwhile) does not go on to tell the scheduler its ``blocks`` setting:
    the successor's stays. Before, the late ``auto`` overwrote the successor's ``off``."""
    client, worker = cluster
    sched = client.cluster.scheduler  # in-process
    with (
        _first_register_held(sched, "gpustreams-blocks") as (held, calls),
        ThreadPoolExecutor(1) as threads,
    ):
        first = StreamsPlugin(blocks="auto")
        registering = threads.submit(client.register_plugin, first, name="gpustreams-a")
        until(lambda: len(calls) == 1)  # its setup awaits the scheduler
        client.register_plugin(StreamsPlugin(blocks="off"), name="gpustreams-b")
        client.sync(_set, held)
        registering.result(timeout=30)
    assert sched.plugins["gpustreams-blocks"].modes[worker.address] == "off"


async def _set(event: asyncio.Event) -> None:
    event.set()


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_a_plugin_torn_down_before_the_scheduler_has_blocks_sends_it_nothing():
    """Unregistered while its setup awaits the scheduler's plugins, on a scheduler that never
    had :class:`.StreamBlocks` (the first registration): the teardown has nothing to undo.
    Before, it told the scheduler ``mode=None``, which had no handler yet and logged
    "No handler gpustreams_blocks found in Scheduler" with a traceback (fuzz_registrations
    --failing, seed 70111)."""
    with sim_cluster(1, 2, plugin=False) as (lc, client):
        [worker] = lc.workers.values()
        sched = lc.scheduler
        lines = _Lines()
        logging.getLogger("distributed").addHandler(lines)
        try:
            with _first_register_held(sched) as (held, calls), ThreadPoolExecutor(1) as threads:
                registering = threads.submit(client.register_plugin, StreamsPlugin())
                until(lambda: len(calls) == 1)  # its setup awaits the scheduler
                assert "gpustreams_blocks" not in sched.handlers
                client.unregister_worker_plugin("gpustreams")  # its teardown ends
                client.sync(_set, held)
                registering.result(timeout=30)
        finally:
            logging.getLogger("distributed").removeHandler(lines)
        assert not [line for line in lines.lines if "gpustreams_blocks" in line]
        assert sched.plugins["gpustreams-blocks"].modes == {}
        assert "gpustreams" not in worker.plugins


class _Watched(asyncio.Future):
    """A future that says when something waits for it: whatever awaits a future (a task,
    ``asyncio.shield``) adds a done callback to it, through this public method."""

    def __init__(self, *, loop):
        super().__init__(loop=loop)
        self.awaited = threading.Event()

    def add_done_callback(self, fn, *, context=None):
        self.awaited.set()
        super().add_done_callback(fn, context=context)


async def _watch_told(plugin) -> _Watched | None:
    """Put a :class:`_Watched` future done with the setup's ``_told`` in its place (None:
    no ``_told``)."""
    told = getattr(plugin, "_told", None)
    if told is None:
        return None
    watched = _Watched(loop=asyncio.get_running_loop())
    told.add_done_callback(lambda _: watched.set_result(None))
    plugin._told = watched
    return watched


def test_a_teardown_undoes_the_blocks_setting_after_it_has_arrived(cluster):
    """The setup's ``blocks`` setting and the teardown's ``None`` go to the scheduler on two
    comms: a teardown while the setting travels waits for it, so that it arrives first.
    Before, a late setting (held here at the scheduler) stayed after the teardown: the
    scheduler counted a worker with no plugin as one with ``blocks: auto``."""
    client, worker = cluster
    sched = client.cluster.scheduler  # in-process, StreamBlocks there already
    client.unregister_worker_plugin("gpustreams")
    blocks = sched.plugins["gpustreams-blocks"]
    assert blocks.modes == {}
    set_mode = sched.handlers["gpustreams_blocks"]
    held = asyncio.Event()
    calls = []

    async def held_set_mode(*args, mode=None, **kwargs):
        calls.append(mode)
        if mode is not None:
            await held.wait()
        return set_mode(*args, mode=mode, **kwargs)

    sched.handlers["gpustreams_blocks"] = held_set_mode
    try:
        with ThreadPoolExecutor(2) as threads:
            registering = threads.submit(
                client.register_plugin, StreamsPlugin(blocks="auto"), name="gpustreams"
            )
            until(lambda: calls == ["auto"])  # its setting is on its way
            plugin = worker.plugins["gpustreams"]
            told = client.sync(_watch_told, plugin)
            removing = threads.submit(client.unregister_worker_plugin, "gpustreams")
            # The teardown's None arrives (before) or the teardown waits for the setting.
            until(lambda: None in calls or (told is not None and told.awaited.is_set()))
            client.sync(_set, held)
            registering.result(timeout=30)
            removing.result(timeout=30)
    finally:
        sched.handlers["gpustreams_blocks"] = set_mode
    assert calls == ["auto", None]
    assert blocks.modes == {}
    assert not blocks.active()


def test_a_setup_overtaken_by_its_own_set_up_again_leaves_the_teardown_the_last_word():
    """One plugin, two setups at once, through the client: "gpustreams-2", registered while
    the setup of "gpustreams" awaits the scheduler, tears it down; unregistering
    "gpustreams-2" sets it up again (``_set_up_displaced``) while the first setup still
    awaits. That setup, once it resumes, must do nothing: before, it found the plugin set up
    (by the second) and told the scheduler ``blocks`` again, in place of the second's
    ``_told``, so the teardown waited for its own setting and not the second's. The second's,
    held here at the scheduler, arrived after the teardown's ``None``: the scheduler counted
    a worker with no plugin as one with ``blocks: auto``."""
    with sim_cluster(1, 2, plugin=False) as (lc, client):
        [worker] = lc.workers.values()
        sched = lc.scheduler
        held_mode = asyncio.Event()
        modes = []

        async def held_first_auto(*args, mode=None, **kwargs):
            modes.append(mode)
            if mode == "auto" and modes.count("auto") == 1:
                await held_mode.wait()
            return set_mode(*args, mode=mode, **kwargs)

        try:
            with (
                _first_register_held(sched) as (held_register, registers),
                ThreadPoolExecutor(3) as threads,
            ):
                first = StreamsPlugin(blocks="auto")
                registering = threads.submit(client.register_plugin, first, name="gpustreams")
                until(lambda: len(registers) == 1)  # the first setup awaits the scheduler
                client.register_plugin(StreamsPlugin(blocks="off"), name="gpustreams-2")
                plugin = worker.plugins["gpustreams"]
                assert plugin._displaced
                set_mode = sched.handlers["gpustreams_blocks"]
                sched.handlers["gpustreams_blocks"] = held_first_auto
                # Its teardown sets "gpustreams" up again, whose setting is held on its way.
                removing = threads.submit(client.unregister_worker_plugin, "gpustreams-2")
                until(lambda: modes == [None, "auto"])
                client.sync(_set, held_register)  # the first setup resumes
                registering.result(timeout=30)
                told = client.sync(_watch_told, plugin)
                unregistering = threads.submit(client.unregister_worker_plugin, "gpustreams")
                # The teardown's None arrives (before) or the teardown waits for the setting.
                until(lambda: modes.count(None) == 2 or told.awaited.is_set())
                client.sync(_set, held_mode)
                removing.result(timeout=30)
                unregistering.result(timeout=30)
        finally:
            if sched.handlers.get("gpustreams_blocks") is held_first_auto:
                sched.handlers["gpustreams_blocks"] = set_mode
        assert not worker.plugins.keys() & {"gpustreams", "gpustreams-2"}
        assert sched.plugins["gpustreams-blocks"].modes == {}
        assert modes == [None, "auto", None]


def _plus_one(x):
    return x + 1


@pytest.mark.parametrize("mode", ["auto", "off"])
def test_a_teardown_the_scheduler_does_not_hear_says_so_and_blocks_stay_exact(mode):
    """A teardown whose ``None`` fails to reach the scheduler (unreachable, restarted) logs
    it, naming the worker, the cause and the setting the scheduler still counts for it.
    Before, the failure was swallowed. With ``auto`` the blocks the scheduler then forms
    there run on the host, one task at a time; with ``off`` it forms none (only ``auto``
    does), and the warning says so. Either way the values are exact."""
    with sim_cluster(1, 2, plugin=False) as (lc, client):
        [worker] = lc.workers.values()
        client.register_plugin(StreamsPlugin(blocks=mode))
        sched = lc.scheduler
        blocks = sched.plugins["gpustreams-blocks"]
        assert blocks.modes == {worker.address: mode}
        set_mode = sched.handlers["gpustreams_blocks"]

        def unheard(*args, mode=None, **kwargs):
            if mode is None:
                raise OSError("the scheduler did not answer")
            return set_mode(*args, mode=mode, **kwargs)

        sched.handlers["gpustreams_blocks"] = unheard
        lines = _Lines()
        logging.getLogger("dask_gpustreams").addHandler(lines)
        try:
            client.unregister_worker_plugin("gpustreams")
        finally:
            logging.getLogger("dask_gpustreams").removeHandler(lines)
            sched.handlers["gpustreams_blocks"] = set_mode
        [line] = [line for line in lines.lines if "could not tell the scheduler" in line]
        assert worker.address in line
        assert "the scheduler did not answer" in line
        assert f"'blocks: {mode}'" in line
        assert ("without streams" in line) == (mode == "auto")
        assert ("which forms no stream blocks" in line) == (mode == "off")
        assert "gpustreams" not in worker.plugins
        assert blocks.modes == {worker.address: mode}  # the stale setting the warning names
        formed = blocks.blocks_formed
        x = dask.delayed(np.arange)(8.0)
        for _ in range(6):
            x = dask.delayed(_plus_one)(x)
        np.testing.assert_array_equal(client.compute(x, sync=True), np.arange(8.0) + 6)
        assert (blocks.blocks_formed > formed) == (mode == "auto")


# --- (f) backend auto is logged once ---------------------------------------------------------


def test_backend_auto_logs_its_choice_once_per_process(caplog):
    if gpu_visible()[0]:
        pytest.skip("a GPU is visible: auto is cupy, and says nothing")
    with caplog.at_level(logging.INFO, logger="dask_gpustreams"):
        for streams in (1, 2, 3):
            get_runtime(StreamsConfig(backend="auto", streams=streams))
        owned = runtimes.create(StreamsConfig(backend="auto", streams=2))
        owned.close()
    said = [r for r in caplog.records if "using the simulated stream device" in r.getMessage()]
    assert len(said) == 1


# --- (g) a corrupt result still needed by a dependent is released once it has left ----------

#: Opened by the test (and by the ``fail_gate`` fixture at the end): :func:`failing_later`'s
#: kernel then fails.
FAIL = threading.Event()
#: ``(key, finish, the watched dependent's state)`` each time :class:`LeavesMemory`'s key
#: leaves memory.
LEFT_MEMORY: list = []


@pytest.fixture
def fail_gate():
    FAIL.clear()
    LEFT_MEMORY.clear()
    yield FAIL
    FAIL.set()


def _fail_after_gate(out, a):
    FAIL.wait()
    raise ValueError("boom")


def failing_later(a):
    """Returns at once; its kernel fails once :data:`FAIL` opens."""
    out = sim.empty(a.shape)
    sim.launch(_fail_after_gate, out, a)
    return out


def holds_its_input(a):
    """Executes, its input held for it, until :data:`GATE` opens (it does not read it)."""
    ENTERED.set()
    GATE.wait()
    return 1


class LeavesMemory(WorkerPlugin):
    """Records in :data:`LEFT_MEMORY` the state of ``dependent`` whenever ``key`` leaves memory."""

    name = "leaves-memory"

    def __init__(self, key, dependent):
        self.key = key
        self.dependent = dependent

    def setup(self, worker):
        self.tasks = worker.state.tasks

    def transition(self, key, start, finish, **kwargs):
        if key == self.key and start == "memory":
            ts = self.tasks.get(self.dependent)
            LEFT_MEMORY.append((key, finish, ts.state if ts is not None else None))


def test_a_corrupt_result_is_released_when_its_last_dependent_leaves(cluster, gate, fail_gate):
    """Found corrupt (by one peer-style ``get_data``) while a dependent executes with it, the
    key stays in memory, held, and is released through the plugin's route as soon as that
    dependent has left, with no further request (a gather would drop it again)."""
    client, worker = cluster
    x = client.submit(produce, 100, 1.0, pure=False)
    k = client.submit(failing_later, x, pure=False)
    d = client.submit(holds_its_input, k, pure=False)
    assert ENTERED.wait(30)  # d executes: it needs k on this worker
    client.register_plugin(LeavesMemory(k.key, d.key))
    provenance = worker.plugins["gpustreams"].provenance
    fail_gate.set()
    try:
        got = client.sync(get_data_from_worker, client.rpc, [k.key], worker.address)
        assert got["data"] == {}  # not served: corrupt
        assert k.key in provenance.held  # and held for d
        assert worker.state.tasks[k.key].state == "memory"
        assert worker.state.tasks[d.key].state == "executing"
    finally:
        gate.set()
    until(lambda: LEFT_MEMORY)
    assert list(LEFT_MEMORY) == [(k.key, "released", "memory")]  # once d had finished
    released = [e for e in worker.state.log if e[0] == k.key and e[1] == "remove-replica"]
    assert len(released) == 1 and released[0][2].startswith(STIMULUS_PREFIX), released
    assert not provenance.held
    for future in (k, d):  # k recomputed, raising its recorded failure; d derives from it
        with pytest.raises(KernelError) as info:
            future.result(timeout=30)
        assert info.value.key == k.key
    client.cancel([x, k, d])


def test_held_entries_go_when_the_key_leaves_memory_on_its_own_or_at_teardown():
    released = []
    worker = SimpleNamespace(
        status=Status.running,
        state=SimpleNamespace(tasks={}),
        loop=SimpleNamespace(add_callback=lambda f, keys: released.append(keys)),
    )
    provenance = Provenance(worker, StreamsConfig(backend="sim"), None, FailureRecords(10, 60.0))
    for key in "ab":
        dependent = SimpleNamespace(key=f"{key}-dependent", state="waiting")
        worker.state.tasks[key] = SimpleNamespace(state="memory", dependents=[dependent])
    provenance.drop_corrupt({key: KernelError(key, "failed") for key in "ab"})
    assert provenance.held == {"a": {"a-dependent"}, "b": {"b-dependent"}}
    provenance.transitioned("a-dependent", "ready")  # still needs a
    provenance.transitioned("a", "released")  # a left memory on its own
    assert provenance.held == {"b": {"b-dependent"}}
    provenance.transitioned("a-dependent", "memory")
    assert released == []  # a is no longer held: nothing to release
    provenance.clear()  # teardown
    assert provenance.held == {}
    provenance.transitioned("b-dependent", "memory")
    assert released == []


class _Referenced:
    """An event stand-in that a weak reference can watch."""


def test_forgotten_keys_records_are_freed_at_free_retired_not_on_the_event_loop():
    """Freeing a record frees its event (a driver call): the event loop only moves the records
    of a forgotten key, its own and its taint's, aside; a task thread frees them."""
    worker = SimpleNamespace(status=Status.running, state=SimpleNamespace(tasks={}))
    provenance = Provenance(worker, StreamsConfig(backend="sim"), None, FailureRecords(10, 60.0))
    slot = StreamPool(SimBackend(), 1).slots[0]
    events = {key: _Referenced() for key in ("input", "key")}
    watched = [weakref.ref(e) for e in events.values()]
    records = {key: TaskRecord(key, slot, event, 1) for key, event in events.items()}
    for record in records.values():
        provenance.registry.add(record)
    provenance.note_pending("key", (records["input"],))
    del events, records, record
    provenance.forget("input")
    provenance.free_retired()  # the input's record lives on in the key's taint
    for key in ("key", "never-seen"):
        provenance.forget(key)
    assert (len(provenance.registry), [w() is not None for w in watched]) == (0, [True, True])
    provenance.free_retired()
    assert [w() for w in watched] == [None, None]


def test_the_collector_frees_forgotten_keys_records_in_an_egress_thread():
    """With no task started since, the periodic collect (on the event loop) hands the records
    of forgotten keys to an egress thread to free."""
    worker = SimpleNamespace(status=Status.running, state=SimpleNamespace(tasks={}))
    threads = ThreadPoolExecutor(1, thread_name_prefix="egress-for-test")
    provenance = Provenance(worker, StreamsConfig(backend="sim"), threads, FailureRecords(10, 60))
    slot = StreamPool(SimBackend(), 1).slots[0]
    freed_in = []
    event = _Referenced()
    weakref.finalize(event, lambda: freed_in.append(threading.current_thread().name))
    provenance.registry.add(TaskRecord("key", slot, event, 1))
    del event
    provenance.forget("key")
    provenance.collect()
    threads.shutdown(wait=True)
    assert len(freed_in) == 1 and freed_in[0].startswith("egress-for-test"), freed_in


def test_a_removed_plugins_guard_fails_the_readers_of_held_keys_and_withholds_them():
    """distributed takes a plugin out of worker.plugins before its teardown: the teardown's
    guard (WithheldKeys) makes every task that starts reading a held corrupt key raise its
    recorded error (one that arrives later too), get_data leaves the key out, the key is
    released once its last reader has left, and then the guard goes and get_data is the
    worker's own again."""
    handled, failed, asked = [], [], []

    async def worker_get_data(comm, keys, who=None, serializers=None):
        asked.append(sorted(keys))

    worker = SimpleNamespace(
        status=Status.running,
        state=SimpleNamespace(tasks={}),
        loop=SimpleNamespace(add_callback=lambda f, *args: f(*args)),
        handle_stimulus=lambda event: handled.append(sorted(event.keys)),
        handlers={"get_data": worker_get_data},
        data={},
        plugins={},
    )
    provenance = Provenance(worker, StreamsConfig(backend="sim"), None, FailureRecords(10, 60.0))
    egress = Egress(worker, provenance, None)
    egress.install()
    k = SimpleNamespace(key="k", state="memory", dependents=[])
    tasks = worker.state.tasks
    for name, state in (("queued", "waiting"), ("running", "executing")):
        tasks[name] = SimpleNamespace(key=name, state=state, dependencies=[k])
        k.dependents.append(tasks[name])
    tasks["k"] = k
    error = KernelError("k", "failed")
    provenance.drop_corrupt({"k": error})
    assert provenance.held == {"k": {"queued", "running"}}
    # The plugin's teardown, as StreamsPlugin.teardown does it:
    guard = WithheldKeys(worker, provenance, egress, lambda key, exc: failed.append((key, exc)))
    guard.install()
    egress.uninstall(withheld=provenance.held)
    asyncio.run(provenance.close(1.0))
    guard.torn_down()
    assert worker.plugins == {guard.name: guard} and provenance.held
    asyncio.run(worker.handlers["get_data"](None, keys=["k", "other"]))
    assert asked == [["other"]]  # k is not served
    tasks["late"] = SimpleNamespace(key="late", state="executing", dependencies=[k])
    k.dependents.append(tasks["late"])
    for name in ("queued", "late"):  # each starts executing: it raises k's error instead
        tasks[name].state = "executing"
        guard.transition(name, "ready", "executing")
    assert failed == [("queued", error), ("late", error)]
    for name, finish in (("running", "memory"), ("queued", "error"), ("late", "error")):
        tasks[name].state = finish
        guard.transition(name, "executing", finish)
    assert handled == [["k"]]  # released once its last reader had left
    k.state = "released"
    guard.transition("k", "memory", "released")
    assert not provenance.held and worker.plugins == {}
    assert worker.handlers["get_data"] is worker_get_data  # the worker's own again


def test_a_plugin_registered_before_the_release_serves_the_keys_once_released():
    """A new plugin's egress, set up while the old one withholds a key, wraps the filter as
    the worker's handler: once the old one restores, the filter lets every key through."""
    asked = []

    async def worker_get_data(comm, keys, who=None, serializers=None):
        asked.append(sorted(keys))

    worker = SimpleNamespace(handlers={"get_data": worker_get_data}, data={})
    old = Egress(worker, SimpleNamespace(registry=(), unpooled=()), None)  # closed: no record
    old.install()
    old.uninstall(withheld={"k"})
    new = Egress(worker, None, None)
    new.install()  # its "worker's own" get_data is the old filter
    old.restore()
    assert worker.handlers["get_data"] == new.get_data  # the new wrapper stays in place
    asyncio.run(new._worker_get_data(None, keys=["k"]))
    assert asked == [["k"]]  # recomputed, k is served again


def reads(a):
    """Reads its input on the host: a wrong value would show as a result."""
    return float(sim.asnumpy(a)[0])


def test_a_corrupt_key_held_at_teardown_is_neither_read_nor_served(cluster, gate, fail_gate):
    """The plugin is removed while a corrupt key is held for a dependent that executes: a
    task that reads the key and starts meanwhile raises its KernelError, get_data leaves the
    key out, and it is released once that dependent has left."""
    client, worker = cluster
    x = client.submit(produce, 100, 1.0, pure=False)
    k = client.submit(failing_later, x, pure=False)
    d = client.submit(holds_its_input, k, pure=False)
    assert ENTERED.wait(30)  # d executes (wrapped): the teardown waits for it
    fail_gate.set()
    got = client.sync(get_data_from_worker, client.rpc, [k.key], worker.address)
    assert got["data"] == {} and k.key in worker.plugins["gpustreams"].provenance.held
    removing = threading.Thread(target=client.unregister_worker_plugin, args=("gpustreams",))
    removing.start()
    try:
        until(lambda: "gpustreams" not in worker.plugins)  # popped before its teardown
        late = client.submit(reads, k, pure=False)  # starts during the teardown
        with pytest.raises(KernelError) as info:
            late.result(timeout=30)
        assert info.value.key == k.key
        got = client.sync(get_data_from_worker, client.rpc, [k.key], worker.address)
        assert got["data"] == {}  # withheld
    finally:
        gate.set()
        removing.join(30)
    assert d.result(timeout=30) == 1

    def released():
        return [e for e in worker.state.log if e[0] == k.key and e[1] == "remove-replica"]

    until(released)  # by the guard, once d had left
    assert released()[0][2].startswith(STIMULUS_PREFIX)
    until(lambda: not any(n.startswith("gpustreams-withheld") for n in worker.plugins))
    client.cancel([x, k, d, late])


def test_a_closing_workers_get_data_still_waits_for_the_keys_work(cluster, gate):
    """A closing worker tears its plugin down while it still serves ``get_data``
    (distributed removes the plugins before it stops listening): a key whose kernel is
    still queued leaves only once that kernel is done, as before the close."""
    client, worker = cluster
    x = client.submit(gated_kernel, 100, 2.0, pure=False)
    wait(x)  # in the worker's memory; its kernel waits for the gate
    egress = worker.plugins["gpustreams"].egress
    served_early = []  # whether the worker's own get_data ran before the kernel could end
    waits = []
    own_get_data, wait_for = egress._worker_get_data, egress.wait_for

    async def observed_get_data(*args, **kwargs):
        served_early.append(not gate.is_set())
        return await own_get_data(*args, **kwargs)

    async def observed_wait_for(keys):
        waits.append(list(keys))  # the teardown's, then get_data's
        return await wait_for(keys)

    egress._worker_get_data, egress.wait_for = observed_get_data, observed_wait_for
    with ThreadPoolExecutor(2) as threads:
        try:
            closing = threads.submit(client.cluster.sync, worker.close)
            until(lambda: "gpustreams" not in worker.plugins)  # its teardown runs
            got = threads.submit(
                client.cluster.sync, get_data_from_worker, worker.rpc, [x.key], worker.address
            )
            until(lambda: served_early or len(waits) >= 2)
            assert not served_early, "the key left the closing worker before its kernel ended"
        finally:
            gate.set()
        response = got.result(timeout=30)
        closing.result(timeout=30)
    np.testing.assert_array_equal(values(response["data"][x.key]), np.full(100, 2.0))


def test_a_closing_worker_withholds_the_corrupt_keys_its_teardown_finds(cluster, gate, fail_gate):
    """The teardown of a closing worker finds a key's kernel failed: until the worker has
    closed, its ``get_data`` leaves that key out (the close waits here for other work)."""
    client, worker = cluster
    x = client.submit(produce, 100, 1.0, pure=False)
    k = client.submit(failing_later, x, pure=False)
    wait(k)
    y = client.submit(gated_kernel, 100, 2.0, pure=False)
    wait(y)
    y.release()  # its kernel stays queued: the runtime's close waits for it
    until(lambda: y.key not in worker.data)
    fail_gate.set()  # k's kernel fails; no sync has seen it yet
    plugin = worker.plugins["gpustreams"]
    with ThreadPoolExecutor(1) as threads:
        try:
            closing = threads.submit(client.cluster.sync, worker.close)
            egress = plugin.egress
            # Until the teardown has unhooked its egress: keys withheld, or get_data restored.
            until(lambda: egress.withheld or worker.handlers["get_data"] != egress.get_data)
            got = client.sync(get_data_from_worker, client.rpc, [k.key], worker.address)
            assert got["data"] == {}
        finally:
            gate.set()
        closing.result(timeout=30)


@pytest.fixture
def two_workers():
    """Two in-process workers of one thread with the plugin: ``(client, a, b, worker a)``."""
    with sim_cluster(2, 1) as (lc, client):
        a, b = sorted(lc.scheduler.workers)
        [worker_a] = [w for w in lc.workers.values() if w.address == a]
        yield client, a, b, worker_a


def test_retiring_a_worker_that_holds_a_corrupt_key_ends_and_the_key_raises(two_workers, fail_gate):
    """Retiring a worker (``retire_workers``, as adaptive scaling does) copies its results to
    the others; one whose kernel failed cannot be copied. The retiring worker drops it, as a
    running worker does, so the retirement ends, and the key raises its KernelError."""
    client, a, b, worker_a = two_workers
    x = client.submit(produce, 100, 1.0, workers=[a], pure=False)
    k = client.submit(failing_later, x, workers=[a], allow_other_workers=True, pure=False)
    wait(k)  # in a's memory; its kernel waits for the fail gate
    with ThreadPoolExecutor(1) as threads:
        retiring = threads.submit(client.retire_workers, [a])
        try:
            until(lambda: worker_a.status == Status.closing_gracefully)
            fail_gate.set()  # found failed while a retires: its copy to b waits for the kernel
            until(lambda: retiring.done(), timeout=20)
        finally:
            if not retiring.done():  # end the retirement: a goes
                client.cluster.sync(worker_a.close)
            retiring.result(timeout=30)
    assert list(retiring.result()) == [a] and set(client.nthreads()) == {b}
    with pytest.raises(KernelError) as info:
        k.result(timeout=30)
    assert info.value.key == k.key
    np.testing.assert_array_equal(values(x.result(timeout=30)), np.full(100, 1.0))


def test_retiring_a_worker_whose_corrupt_key_a_queued_dependent_needs_ends(
    two_workers, gate, fail_gate
):
    """A retiring worker is paused: a dependent queued there (ready) never runs, so a corrupt
    key held for it would be held until the worker closes, and retire_workers, which copies
    it, would never end. The retirement ends, and both keys raise the KernelError."""
    client, a, b, worker_a = two_workers
    x = client.submit(produce, 100, 1.0, workers=[a], pure=False)
    k = client.submit(failing_later, x, workers=[a], allow_other_workers=True, pure=False)
    wait(k)  # in a's memory; its kernel waits for the fail gate
    busy = client.submit(holds_its_input, 0, workers=[a], pure=False)
    assert ENTERED.wait(30)  # a's one thread is taken
    d = client.submit(reads, k, workers=[a], pure=False)  # not stolen: it stays queued
    tasks = worker_a.state.tasks
    until(lambda: d.key in tasks and tasks[d.key].state == "ready")
    with ThreadPoolExecutor(1) as threads:
        retiring = threads.submit(client.retire_workers, [a])
        try:
            until(lambda: worker_a.status == Status.closing_gracefully)
            fail_gate.set()  # found failed while a retires; d, queued on a, needs it
            until(lambda: retiring.done(), timeout=20)
        finally:
            gate.set()
            if not retiring.done():  # end the retirement: a goes
                client.cluster.sync(worker_a.close)
            retiring.result(timeout=30)
    assert set(client.nthreads()) == {b}
    story = [e[:2] for e in worker_a.state.story(k.key, d.key)]
    # The scheduler forgot a's replica and freed d there; d's release released k.
    freed = story.index(("free-keys", [d.key]))
    assert story[freed + 1 : freed + 4] == [
        (d.key, "ready"),
        (d.key, "released"),
        (k.key, "remove-replica"),
    ], story
    for future in (k, d):
        with pytest.raises(KernelError) as info:
            future.result(timeout=30)
        assert info.value.key == k.key
    client.cancel([busy])


def test_a_closing_workers_teardown_waits_at_most_close_timeout_in_all(cluster, gate, caplog):
    """A kernel that never ends on a closing worker: the teardown's wait for the work of what
    is in memory and the runtime's close share the one ``close_timeout``, not one each."""
    client, worker = cluster
    x = client.submit(gated_kernel, 100, 2.0, pure=False)
    wait(x)  # in memory; its kernel waits for the gate (until the test's end)
    plugin = worker.plugins["gpustreams"]
    plugin.close_timeout = 0.5
    close, given = plugin.provenance.close, []

    async def observed_close(timeout):
        given.append(timeout)
        await close(timeout)

    plugin.provenance.close = observed_close
    try:
        with caplog.at_level(logging.WARNING, logger="dask_gpustreams"):
            client.cluster.sync(worker.close)
        assert "did not end within 0.5 s" in caplog.text  # the whole budget went there
        assert len(given) == 1 and given[0] < 0.25, given  # what was left of it
    finally:
        gate.set()


def test_a_kernel_that_never_ends_on_a_closing_worker_gives_one_warning(cluster, gate, caplog):
    """One cause, one warning: the kernel that keeps the results' work from ending in
    ``close_timeout`` also keeps the runtime from closing. The warning says both, naming the
    worker and the runtime. Before, each logged its own, the second "did not close within
    0.0 s" (the budget spent) with no reason."""
    client, worker = cluster
    x = client.submit(gated_kernel, 100, 2.0, pure=False)
    wait(x)  # in memory; its kernel waits for the gate (until the test's end)
    plugin = worker.plugins["gpustreams"]
    plugin.close_timeout = 0.5
    runtime = repr(plugin.runtime)
    try:
        with caplog.at_level(logging.WARNING, logger="dask_gpustreams"):
            client.cluster.sync(worker.close)
        [record] = [r for r in caplog.records if r.name.startswith("dask_gpustreams")]
        message = record.getMessage()
        assert f"closing worker {worker.address} did not end within 0.5 s" in message
        assert f"{runtime} did not close within 0 s: work still runs" in message
    finally:
        gate.set()


LEFT_OPEN = """
import sys

sys.stderr = sys.stdout  # distributed's log handlers, made at import, write to stdout
import dask, numpy as np
from distributed import Client, LocalCluster
from dask_gpustreams import sim
from dask_gpustreams.integrations.distributed import StreamsPlugin

cluster = LocalCluster(n_workers=1, threads_per_worker=2, processes=False, dashboard_address=":0")
client = Client(cluster)
client.register_plugin(StreamsPlugin(backend="sim", streams=4))
x = dask.delayed(sim.asarray)(np.arange(10.0)) * 2
print(float(sim.asnumpy(x.compute()).sum()))
"""


def test_an_in_process_cluster_left_open_at_exit_closes_without_an_error(run_python):
    """A script that never closes its in-process cluster: the worker's teardown runs while
    the interpreter exits, when no executor takes new work, and closes the runtime itself
    (before, it logged "Worker plugin gpustreams failed to teardown" with a traceback).
    distributed's own warning that closing the worker lost the computed ``mul`` task (from
    2026.8.0, at times; plain Dask too) is no error of the plugin's."""
    first, *logged = run_python(LEFT_OPEN, timeout=60).splitlines()
    assert first == "90.0"
    lost = "distributed.scheduler - WARNING - Removing worker"
    assert [line for line in logged if lost not in line] == []


def test_a_closed_workers_results_go_back_to_the_pool():
    """A worker closed with results in its memory (in-process, as in a notebook): once
    distributed's own caches of handlers forget it, nothing of the plugin's keeps it, or
    the device memory of those results, alive."""
    pool = sim.get_default_memory_pool()
    gc.collect()
    before = pool.used_bytes()
    with sim_cluster(1, 1) as (lc, client):
        futures = client.map(produce, [1000] * 4, [1.0, 2.0, 3.0, 4.0], pure=False)
        got = client.gather(futures)  # get_data, with serializers: the handler is cached
        assert [float(values(g)[0]) for g in got] == [1.0, 2.0, 3.0, 4.0]
        del got
        [worker] = lc.workers.values()
        lc.sync(worker.close)  # the results still in its memory
        del worker, futures
    forget_closed_servers()
    gc.collect()
    assert pool.used_bytes() == before


def _failing_key_held(client, worker):
    """A key in ``worker``'s memory whose kernel fails once ``fail_gate`` is set, its input,
    and the worker plugin's provenance and egress."""
    x = client.submit(produce, 100, 1.0, pure=False)
    k = client.submit(failing_later, x, pure=False)
    wait(k)
    plugin = worker.plugins["gpustreams"]
    return x, k, plugin.provenance, plugin.egress


def test_a_get_data_waiting_when_the_teardown_runs_does_not_serve_the_key_it_found_corrupt(
    cluster, fail_gate
):
    """A ``get_data`` waits for a key's kernel when the worker closes: the teardown's own
    wait finds the kernel failed, withholds the key and clears the registry before that
    ``get_data`` looks again (the loss route of the fuzzer, blocks off). The ``get_data``
    must leave the key out, not serve it as if nothing had failed. Here what the teardown
    does runs on the event loop just before the ``get_data``'s wait returns."""
    client, worker = cluster
    x, k, provenance, egress = _failing_key_held(client, worker)
    wait_all = provenance.wait_all
    entered = threading.Event()

    def torn_down_meanwhile():  # Plugin.teardown's effects: corrupt keys withheld, clear
        egress.uninstall(withheld={k.key: set()})
        provenance.clear(keep_held=True)

    def wait_all_then_teardown(records):
        entered.set()
        wait_all(records)
        worker.loop.add_callback(torn_down_meanwhile)  # runs before get_data resumes

    provenance.wait_all = wait_all_then_teardown
    with ThreadPoolExecutor(1) as threads:
        try:
            got = threads.submit(
                client.cluster.sync, get_data_from_worker, worker.rpc, [k.key], worker.address
            )
            assert entered.wait(30)  # get_data waits for k's kernel
        finally:
            fail_gate.set()
        response = got.result(timeout=30)
    assert k.key not in response["data"], "a corrupt key was served after the teardown"
    client.cancel([x, k])


def test_a_wait_for_keeps_the_records_a_clear_drops_meanwhile(cluster, fail_gate):
    """The teardown clears the registry while ``Egress.wait_for`` waits: the failure of
    the records it was waiting for is still found (the key stays in memory, withheld
    only once found corrupt)."""
    client, worker = cluster
    x, k, provenance, egress = _failing_key_held(client, worker)
    wait_all = provenance.wait_all

    def wait_all_then_clear(records):
        fail_gate.set()
        wait_all(records)
        provenance.clear(keep_held=True)  # as Provenance.close does, at teardown

    provenance.wait_all = wait_all_then_clear
    failed = client.cluster.sync(egress.wait_for, [k.key])
    assert list(failed) == [k.key] and isinstance(failed[k.key], KernelError)
    client.cancel([x, k])


# --- (h) a kernel failure that nothing reads fails no later task -----------------------------


@pytest.mark.parametrize(
    "fails", ["before the release", "after the release", "held, never gathered"]
)
@pytest.mark.parametrize("blocks", ["off", "auto"])
def test_a_failure_nothing_reads_fails_no_later_task(fail_gate, blocks, fails):
    """A key whose kernel failed is never read (no gather, no dependent): released, or held
    by a future never gathered. No check finds its failure, and on the sim its stream stays
    in error until a sync reports it; the worker reports it before its next launch, so the
    12 tasks that follow, round-robin over the 4 streams (3 on the failed one), all give
    their values and none raises that key's error (before the fix, the first on that stream
    did). The kernel fails before the 12 start: before the release, or after it. Lone tasks
    run per key with blocks on too (no block to group them in)."""
    with sim_cluster(1, 2, {"gpustreams.blocks": blocks}) as (lc, client):
        [worker] = lc.workers.values()
        provenance = worker.plugins["gpustreams"].provenance
        x = client.submit(produce, 100, 1.0, pure=False)
        k = client.submit(failing_later, x, pure=False)
        wait([x, k])  # in memory: its kernel waits for the gate
        key, record = k.key, provenance.registry.get(k.key)
        if fails != "after the release":
            fail_gate.set()
            error = provenance.runtime.wait(record)  # returns the error, reports nothing
            assert isinstance(error, KernelError) and error.key == key
        if fails != "held, never gathered":
            k.release()
            until(lambda: key not in worker.state.tasks)  # forgotten, never read
        if fails == "after the release":
            fail_gate.set()
            error = provenance.runtime.wait(record)
            assert isinstance(error, KernelError) and error.key == key
        got = []
        for y in [client.submit(add, x, x, pure=False) for _ in range(12)]:
            try:
                got.append(float(values(y.result(timeout=30)).sum()))
            except KernelError as e:  # the key whose error it raised
                got.append(e.key)
        assert got == [200.0] * 12
        assert provenance.kernel_failures == 0  # no failure was found


def _launch_then_wait_for_the_gate(a):
    """Launches its kernel, then holds its worker thread until :data:`GATE` opens: its event
    is recorded only after that."""
    out = add(a, a)
    ENTERED.set()
    assert GATE.wait(30)
    return out


def test_a_task_whose_kernel_a_failure_skipped_raises_after_another_threads_report(fail_gate):
    """T's kernel is queued behind k's failing kernel on the one stream, and T's worker thread
    has not recorded its event when the failure is reported by U's thread (its report of
    unread failures before it launches): T raises k's error, not its unwritten output, and
    U, launched after the report, gives its value. helper-80's repro: T returned NaN."""
    GATE.clear()
    ENTERED.clear()
    try:
        with sim_cluster(1, 2, {"gpustreams.streams": 1, "gpustreams.blocks": "off"}) as (
            lc,
            client,
        ):
            [worker] = lc.workers.values()
            provenance = worker.plugins["gpustreams"].provenance
            x = client.submit(produce, 100, 1.0, pure=False)
            k = client.submit(failing_later, x, pure=False)
            wait([x, k])
            t = client.submit(_launch_then_wait_for_the_gate, x, pure=False)
            until(ENTERED.is_set)
            fail_gate.set()
            error = provenance.runtime.wait(provenance.registry.get(k.key))
            assert isinstance(error, KernelError) and error.key == k.key
            u = client.submit(add, x, x, pure=False)
            assert float(values(u.result(timeout=30)).sum()) == 200.0
            GATE.set()
            with pytest.raises(KernelError) as info:
                t.result(timeout=30)
            assert info.value.key == k.key
    finally:
        GATE.set()


def _wait_for_the_gate_then_double(a):
    """Holds its worker thread, its input checked, until :data:`GATE` opens; then launches."""
    ENTERED.set()
    assert GATE.wait(30)
    return add(a, a)


def test_a_consumer_launched_after_a_gather_reported_the_failure_it_reads_raises(fail_gate, gate):
    """B's kernel is skipped behind k's failing kernel on the one stream. C, which reads B,
    passes its input check while B's event is pending, then launches on B's unwritten output
    after the client's gather of k reported (and so cleared) the failure: C's own event is
    clean, its value NaN on the worker. The client gets k's error for C, not the NaN: C's
    taint holds B's event, which its egress checks (helper-101, stop 59; local computes
    check every event of their work instead)."""
    with sim_cluster(1, 2, {"gpustreams.streams": 1, "gpustreams.blocks": "off"}) as (_, client):
        x = client.submit(produce, 4, 1.0, pure=False)
        k = client.submit(failing_later, x, pure=False)
        wait([x, k])  # k's kernel is queued: B's comes after it on the one stream
        b = client.submit(add, x, x, pure=False)
        c = client.submit(_wait_for_the_gate_then_double, b, pure=False)
        until(ENTERED.is_set)
        fail_gate.set()
        with pytest.raises(KernelError) as info:
            k.result(timeout=30)  # its egress reports the failure
        assert info.value.key == k.key
        gate.set()
        with pytest.raises(KernelError) as info:
            c.result(timeout=30)
        assert info.value.key == k.key


class _ClearedBeforeItsFirstPop(deque):
    """A deque of watched records that a teardown's clear (on the event loop) empties after
    a report (in a worker thread) has found it not empty, just before it pops."""

    def __init__(self, provenance):
        super().__init__()
        self.provenance = provenance
        self.cleared = False

    def popleft(self):
        if not self.cleared:
            self.cleared = True
            self.provenance.clear(keep_held=True)
        return super().popleft()


def test_a_report_of_watched_records_that_a_teardown_clears_meanwhile_raises_nothing():
    """The teardown clears the watched records on the event loop while a task thread (of a
    closing worker) or an egress thread reports them: the report ends, raising nothing (an
    IndexError from an emptied deque would fail the task that made it). helper-70."""
    worker = SimpleNamespace(status=Status.running, state=SimpleNamespace(tasks={}))
    provenance = Provenance(worker, StreamsConfig(backend="sim"), None, FailureRecords(10, 60.0))
    slot = StreamPool(SimBackend(), 1).slots[0]
    provenance._runtime = SimpleNamespace(state=lambda r: (True, None), report=lambda r: None)
    provenance._watching = True
    provenance._launched = _ClearedBeforeItsFirstPop(provenance)
    provenance.registry.add(TaskRecord("key", slot, object(), 1))
    provenance.watch("key")
    provenance.report_unread()
    assert provenance._launched.cleared
    assert not provenance._launched and not provenance._unsettled


def test_collect_queues_one_report_of_unread_failures_at_a_time():
    """A kernel that never ends keeps its record unsettled, and the worker's periodic
    collect would queue a report every 0.5 s: with the egress threads all waiting (on that
    kernel), the queue would grow without end. One is queued until it has run. helper-70."""
    queued = []
    threads = SimpleNamespace(submit=queued.append)
    worker = SimpleNamespace(status=Status.running, state=SimpleNamespace(tasks={}))
    provenance = Provenance(worker, StreamsConfig(backend="sim"), threads, FailureRecords(10, 60.0))
    slot = StreamPool(SimBackend(), 1).slots[0]
    provenance._runtime = SimpleNamespace(
        state=lambda r: (False, None), report=lambda r: None, collect=lambda: 0
    )
    provenance._watching = True
    provenance.registry.add(TaskRecord("key", slot, object(), 1))
    provenance.watch("key")
    provenance.collect()
    provenance.collect()
    assert len(queued) == 1
    queued.pop()()  # it runs: the kernel still has not ended
    provenance.collect()
    assert len(queued) == 1


def test_a_key_forgotten_before_its_task_watches_it_still_has_its_failure_reported():
    """A task's key can be forgotten (cancelled) between its launch and its task's watch of
    the record, which then finds none: the forget watches it instead, so a failure of it is
    still reported before the next launch. A key forgotten after its watch is watched twice:
    reported twice (a report is a sync of its event), never comparing two records."""
    reported = []
    worker = SimpleNamespace(status=Status.running, state=SimpleNamespace(tasks={}))
    provenance = Provenance(worker, StreamsConfig(backend="sim"), None, FailureRecords(10, 60.0))
    slot = StreamPool(SimBackend(), 1).slots[0]
    provenance._runtime = SimpleNamespace(
        state=lambda r: (True, KernelError(r.key, ValueError("boom"))), report=reported.append
    )
    provenance._watching = True
    record = TaskRecord("key", slot, object(), 1)
    provenance.registry.add(record)
    provenance.forget("key")
    provenance.watch("key")  # after the forget: nothing left to find
    provenance.report_unread()
    assert reported == [record]
    again = TaskRecord("again", slot, object(), 2)
    provenance.registry.add(again)
    provenance.watch("again")
    provenance.forget("again")
    provenance.report_unread()
    assert reported == [record, again, again]
