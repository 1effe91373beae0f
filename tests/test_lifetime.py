"""Runtime lifetime: close(), the bounded cache of shared runtimes, and the plugin's own runtime.

Threads are waited for with ``join(timeout)``, never with sleeps. A closed
runtime's simulated streams have ended when ``close()`` returns, whoever still
refers to them.
"""

from __future__ import annotations

import threading

import dask
import dask.threaded
import distributed
import numpy as np
import pytest
from dask import delayed
from distributed.utils_test import gen_cluster

from dask_gpustreams import StreamsConfig, StreamsPlugin, sim
from dask_gpustreams.runtime import Runtimes, get_runtime, live_runtimes, runtimes
from dask_gpustreams.runtime.hostthreads import HostThreads

TIMEOUT = 10.0


def _fill(out, value):
    out.fill(value)


def _add(out, a, b):
    np.add(a, b, out=out)


def produce(n, value):
    out = sim.empty(n)
    sim.launch(_fill, out, value)
    return out


def inc(a):
    out = sim.empty(a.shape)
    sim.launch(_add, out, a, 1.0)
    return out


def total(a):
    return float(np.sum(sim.asnumpy(a)))


def ours() -> set[threading.Thread]:
    """The threads of the simulated streams and of gpustreams (host, egress)."""
    return {t for t in threading.enumerate() if t.name.startswith(("sim-stream-", "gpustreams-"))}


def runtime_threads(rt) -> set[threading.Thread]:
    """The threads of ``rt``'s compute and copy streams and host tasks that run now."""
    pools = (rt.pool, rt.transfers.h2d, rt.transfers.d2h)
    threads = {s.stream.thread for p in pools if p.started() for s in p.slots}
    if rt._host_executor is not None:
        threads |= rt._host_executor.threads()
    return {t for t in threads if t is not None and t.is_alive()}


def join_all(threads) -> list[threading.Thread]:
    """Join ``threads`` (each within TIMEOUT); return those still alive."""
    for t in threads:
        t.join(TIMEOUT)
    return [t for t in threads if t.is_alive()]


def chain_graph(n=6):
    """An upload, ``n`` kernels and a download (a host task on the launcher): 1000 * (n + 1)."""
    x = delayed(sim.asarray)(np.ones(1000))
    for _ in range(n):
        x = delayed(inc)(x)
    return delayed(np.sum)(delayed(sim.asnumpy)(x))


@pytest.fixture
def threads_stay(monkeypatch):
    """Threads that end only when closed, not when idle: a slow test still sees them all."""
    monkeypatch.setattr(sim.Stream, "idle_timeout", 600.0)
    monkeypatch.setattr(HostThreads, "idle_timeout", 600.0)


# --- close() -------------------------------------------------------------------------------


def test_close_ends_the_streams_and_threads_and_is_idempotent(gpustreams, threads_stay):
    before = ours()
    with gpustreams(streams=3):
        assert chain_graph().compute(scheduler="gpustreams") == 7000.0
        rt = get_runtime()
    threads = ours() - before
    assert threads == runtime_threads(rt)
    names = sorted(t.name.rstrip("0123456789_") for t in threads)
    assert names.count("sim-stream-") == 3 + 2 * rt.config.copy_streams  # compute and copies
    assert "gpustreams-host" in names  # the download ran as a host task
    assert rt in live_runtimes()
    rt.close()
    assert rt.closed and rt not in live_runtimes()
    assert join_all(threads) == []
    assert rt.transfers.pinned.total_bytes() == 0 and len(rt.events) == 0
    rt.close()  # idempotent
    with pytest.raises(RuntimeError, match="is closed"):
        rt.acquire()
    with pytest.raises(RuntimeError, match="closed"):
        _ = rt.pool.slots
    with pytest.raises(RuntimeError, match="closed"):
        rt.host_executor()
    with gpustreams(streams=3):  # the next compute gets a new runtime
        assert chain_graph().compute(scheduler="gpustreams") == 7000.0
        assert get_runtime() is not rt


def test_close_ends_the_stream_threads_before_it_returns_though_streams_are_referenced(
    gpustreams, threads_stay
):
    # A closed worker's task states keep the records of its last tasks, which refer to the
    # slots and their streams (distributed's thread-leak check failed on those threads).
    with gpustreams(streams=2):
        assert chain_graph().compute(scheduler="gpustreams") == 7000.0
        rt = get_runtime()
    kept = [s.stream for p in (rt.pool, rt.transfers.h2d, rt.transfers.d2h) for s in p.slots]
    threads = runtime_threads(rt)
    rt.close()
    assert [t for t in threads if t.is_alive()] == []  # joined by close(), no waiting here
    for stream in kept:  # each refuses work now
        with pytest.raises(RuntimeError, match="is closed"):
            stream.launch(_fill, (np.empty(1), 1.0), {}, "late")


def test_a_closed_sim_stream_runs_its_queued_work_then_its_thread_ends():
    stream = sim.get_device().create_stream()
    out = np.zeros(1)
    stream.launch(lambda: (threading.Event().wait(0.05), out.fill(1.0)), (), {}, "k")
    stream.close(TIMEOUT)
    assert out[0] == 1.0 and not stream.thread.is_alive()
    stream.close()  # idempotent
    with pytest.raises(RuntimeError, match="is closed"):
        stream.record()


@pytest.mark.parametrize("scheduler", ["gpustreams", pytest.param(dask.threaded.get, id="threads")])
def test_close_while_a_compute_runs_waits_for_it_and_results_stay_exact(
    gpustreams, scheduler, monkeypatch
):
    monkeypatch.setattr(sim.get_device(), "kernel_delay", (0.0, 0.002))
    started, proceed = threading.Event(), threading.Event()

    def gate(x):
        started.set()
        assert proceed.wait(TIMEOUT)
        return x

    x = delayed(produce)(1000, 1.0)
    for i in range(20):
        x = delayed(inc)(x)
        if i == 10:
            x = delayed(gate)(x)
    graph = delayed(total)(x)
    box: dict = {}
    with gpustreams(streams=4):
        config = StreamsConfig.from_dask_config()

        def compute():
            box["result"] = graph.compute(scheduler=scheduler)

        worker = threading.Thread(target=compute)
        worker.start()
        assert started.wait(TIMEOUT)
        rt = get_runtime(config)
        with pytest.raises(TimeoutError, match="computes still use"):
            rt.close(timeout=0)  # refused: the compute holds it
        assert not rt.closed
        closer = threading.Thread(target=rt.close)
        closer.start()
        proceed.set()
        worker.join(TIMEOUT)
        closer.join(TIMEOUT)
    assert not worker.is_alive() and not closer.is_alive()
    assert box["result"] == 21000.0
    assert rt.closed


# --- the shared runtimes: bounded -----------------------------------------------------------


@pytest.mark.parametrize("scheduler", ["gpustreams", pytest.param(dask.threaded.get, id="threads")])
def test_a_computes_threads_end_when_idle_though_its_runtime_stays_open(gpustreams, scheduler):
    before = ours()
    with gpustreams(streams=3, policy="least-loaded"):
        for _ in range(2):  # the second compute starts the threads again
            assert chain_graph().compute(scheduler=scheduler) == 7000.0
            rt = get_runtime()
            started = ours() - before
            assert started and started <= runtime_threads(rt)
            # Each ends within the idle timeouts (0.5 s) of its last work; the runtime stays.
            assert sim.Stream.idle_timeout == HostThreads.idle_timeout == 0.5
            assert join_all(started) == []
            assert not rt.closed and rt in live_runtimes() and get_runtime() is rt
    assert ours() - before == set()


def test_many_distinct_settings_keep_runtimes_and_threads_bounded(gpustreams):
    before = set(threading.enumerate())
    made = []
    for i in range(24):
        scheduler = "gpustreams" if i % 2 else dask.threaded.get
        with gpustreams(streams=1 + i % 6, policy=["round-robin", "least-loaded"][i // 12]):
            assert chain_graph(2).compute(scheduler=scheduler) == 3000.0
            made.append(get_runtime())
    assert len(set(made)) == 24  # each setting got its runtime
    live = live_runtimes()
    assert len(live) <= Runtimes.max_idle + 1
    assert all(rt.closed for rt in made[: -Runtimes.max_idle - 1])
    # The threads of the closed ones end; those of the open ones are all that remain.
    remaining = {t for rt in live for t in runtime_threads(rt)}
    assert join_all(ours() - before - remaining) == []
    assert ours() - before <= remaining
    per_runtime = 6 + 2 + StreamsConfig.host_threads  # compute, copy and host threads at most
    assert len(remaining) <= (Runtimes.max_idle + 1) * per_runtime


def test_an_evicted_runtimes_threads_end(gpustreams, threads_stay):
    with gpustreams(streams=5):
        assert chain_graph(2).compute(scheduler="gpustreams") == 3000.0
        first = get_runtime()
    threads = runtime_threads(first)
    assert len(threads) > 5  # compute, copy and host threads
    for i in range(Runtimes.max_idle + 1):
        with gpustreams(streams=1, policy="least-loaded", launch_ahead=(2 + i) << 20):
            assert chain_graph(1).compute(scheduler="gpustreams") == 2000.0
    assert first.closed
    assert join_all(threads) == []


def test_a_runtime_held_by_a_compute_is_never_evicted():
    held = runtimes.acquire(StreamsConfig(backend="sim", streams=2))
    try:
        for i in range(Runtimes.max_idle + 3):
            get_runtime(StreamsConfig(backend="sim", streams=3, launch_ahead=(2 + i) << 20))
        assert not held.closed
        assert held is get_runtime(StreamsConfig(backend="sim", streams=2))
    finally:
        held.release()


# --- the distributed plugin owns its runtime ------------------------------------------------

CONFIG = {"gpustreams.backend": "sim", "gpustreams.streams": 3}


@gen_cluster(client=True, nthreads=[("127.0.0.1", 2)] * 2, config=CONFIG)
async def test_removing_the_plugin_closes_each_workers_runtime(c, s, a, b):
    # gen_cluster's thread-leak check fails the test if any thread started here remains.
    await c.register_plugin(StreamsPlugin())
    futures = [
        c.submit(total, c.submit(inc, c.submit(produce, 100, i), workers=[w]))
        for i, w in enumerate([a.address, b.address] * 2)
    ]
    assert await c.gather(futures) == [100.0 * (i + 1) for i in range(4)]
    rts = [a.plugins["gpustreams"].runtime, b.plugins["gpustreams"].runtime]
    assert rts[0] is not rts[1]  # each worker its own
    assert all(rt in live_runtimes() for rt in rts)
    await c.unregister_worker_plugin("gpustreams")
    assert all(rt.closed for rt in rts)
    assert not any(rt in live_runtimes() for rt in rts)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 2)], config=CONFIG)
async def test_closing_the_worker_closes_its_runtime(c, s, a):
    await c.register_plugin(StreamsPlugin())
    assert await c.submit(total, c.submit(inc, c.submit(produce, 100, 1.0))) == 200.0
    # The workers close with the plugin registered: teardown closes the runtime.


@gen_cluster(client=True, config={**CONFIG, "gpustreams.enabled": True, "gpustreams.streams": 5})
async def test_a_local_compute_in_a_cluster_test_leaves_no_thread(c, s, a, b):
    # distributed's test_client.py::test_aliases_2 computes with dask.get inside gen_cluster,
    # whose thread-leak check failed on the idle shared runtime's stream threads.
    dsk = {"x": (produce, 100, 1.0), "y": (inc, "x"), "z": (total, "y")}
    assert dask.get(dsk, "z") == 200.0
    assert await c.submit(total, c.submit(produce, 100, 2.0)) == 200.0


def test_no_threads_remain_after_a_local_cluster_with_the_plugin():
    before = set(threading.enumerate())
    with (
        dask.config.set(CONFIG),
        distributed.LocalCluster(
            n_workers=2, threads_per_worker=2, processes=False, dashboard_address=":0"
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        client.register_plugin(StreamsPlugin())
        x = client.submit(inc, client.submit(produce, 100, 1.0))
        assert client.submit(total, x).result() == 200.0
        del x
    assert join_all(ours() - before) == []
