"""The task timeline on the simulated device: records, Chrome trace, Gantt PNG, saturation."""

from __future__ import annotations

import gc
import json
import time
import warnings

import dask
import dask.threaded
import numpy as np
import pytest
from dask._task_spec import Task, TaskRef

import dask_gpustreams
from dask_gpustreams import sim
from dask_gpustreams.diagnostics import (
    clear_timeline,
    plot_gantt,
    saturation,
    timeline,
    to_chrome_trace,
    to_rectangles,
)
from dask_gpustreams.diagnostics.timeline import RECORD_FIELDS


def sleep_kernel(seconds: float):
    """A task launching one sim kernel that sleeps, then writes 1 + the sum of its inputs."""

    def task(*inputs):
        out = sim.empty(4, "float64")

        def body(o, *views):
            time.sleep(seconds)
            o[:] = 1 + sum(v[0] for v in views)

        sim.launch(body, out, *inputs)
        return out

    return task


def run(dsk: dict, keys: list, streams: int = 8, policy: str = "auto") -> list:
    config = {
        "gpustreams.enabled": True,
        "gpustreams.backend": "sim",
        "gpustreams.timeline": True,
        "gpustreams.streams": streams,
        "gpustreams.policy": policy,
    }
    with dask.config.set(config):
        return dask.threaded.get(dsk, keys, num_workers=8)


@pytest.fixture
def source():
    x = sim.asarray(np.zeros(4))
    sim.get_device().synchronize()
    return x


@pytest.fixture(autouse=True)
def empty_timeline():
    clear_timeline()
    yield
    clear_timeline()


def test_reexported():
    assert dask_gpustreams.timeline is timeline


def test_one_record_per_task(source):
    k = sleep_kernel(0.005)
    dsk = {"src": source, ("a", 0): (k, "src")}
    for d in range(1, 5):
        dsk[("a", d)] = (k, ("a", d - 1))
        dsk[("b", d)] = (k, ("a", d - 1))
    keys = [("a", 4)] + [("b", d) for d in range(1, 5)]
    results = run(dsk, keys)
    assert results[0].get()[0] == 5

    records = timeline()
    assert sorted(r["key"] for r in records) == sorted(k for k in dsk if k != "src")
    for r in records:
        assert set(r) == set(RECORD_FIELDS)
        assert r["name"] in ("a", "b")
        assert r["worker"] is None
        assert r["pool"] == "auto/8"
        assert 0 <= r["stream"] < 8
        assert 0 <= r["start_ms"] <= r["end_ms"]
        assert r["end_ms"] - r["start_ms"] >= 4  # the 5 ms kernel
    assert min(r["start_ms"] for r in records) == 0
    by_key = {r["key"]: r for r in records}
    for d in range(1, 5):  # a dependent starts after its producer ended, on the device
        assert by_key[("a", d)]["start_ms"] >= by_key[("a", d - 1)]["end_ms"] - 0.5

    clear_timeline()
    assert timeline() == []


def test_nothing_recorded_when_off_and_a_warning_says_how_to_turn_it_on(source):
    k = sleep_kernel(0)
    with dask.config.set({"gpustreams.enabled": True, "gpustreams.backend": "sim"}):
        dask.threaded.get({"src": source, "x": (k, "src")}, ["x"])
    with pytest.warns(UserWarning) as warned:
        assert timeline() == []
    assert [str(w.message) for w in warned] == [
        "timeline() is empty: gpustreams.timeline is off (the default), so no stream runtime "
        "of this process records one; turn it on before computing: "
        "dask.config.set({'gpustreams.timeline': True})"
    ]


def test_an_empty_timeline_that_is_on_does_not_warn(source):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with dask.config.set({"gpustreams.timeline": True}):
            assert timeline() == []  # no runtime yet: the next compute records
        run({"src": source, "x": (sleep_kernel(0), "src")}, ["x"])
        clear_timeline()
        assert timeline() == []  # the runtime records; nothing since the clear


def test_chrome_trace_has_one_track_per_stream(source, tmp_path):
    k = sleep_kernel(0.02)
    dsk = {"src": source, **{("n", i): (k, "src") for i in range(4)}}
    run(dsk, [("n", i) for i in range(4)], streams=4, policy="round-robin")
    records = timeline()
    streams = {r["stream"] for r in records}
    assert streams == {0, 1, 2, 3}

    path = tmp_path / "trace.json"
    to_chrome_trace(records, path)
    trace = json.loads(path.read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    names = {
        e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"
    }
    assert len(events) == 4
    assert sorted(names.values()) == [f"stream {s}" for s in range(4)]
    assert {e["tid"] for e in events} == set(names)
    for e in events:
        assert names[e["tid"]] == f"stream {e['args']['stream']}"
        assert e["dur"] >= 15_000  # microseconds
        assert e["name"] == "n"

    rects = to_rectangles(records)
    assert rects["tracks"] == [f"dev 0 stream {s}" for s in range(4)]


def test_gantt_png(source, tmp_path):
    pytest.importorskip("matplotlib")
    k = sleep_kernel(0.01)
    dsk = {"src": source, **{("n", i): (k, "src") for i in range(6)}}
    run(dsk, [("n", i) for i in range(6)], streams=3)
    ax = plot_gantt(timeline(), title="six tasks")
    assert len(ax.get_yticks()) == 3
    path = tmp_path / "gantt.png"
    ax.figure.savefig(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_saturation_of_independent_kernels(source):
    """8 kernels of 100 ms on 8 streams overlap. The collector stays off while they run: a
    collection of the heap that earlier tests leave holds the GIL, and the streams' threads
    start their kernels late (the suspected cause of saturation 1.37, and of one more
    failure, in two full-suite runs of about twenty; never alone)."""
    k = sleep_kernel(0.1)
    dsk = {"src": source, **{("n", i): (k, "src") for i in range(8)}}
    gc.collect()
    gc.disable()
    try:
        run(dsk, [("n", i) for i in range(8)], streams=8)
    finally:
        gc.enable()
    records = timeline()
    assert len({r["stream"] for r in records}) == 8
    assert saturation(records, kernel_ms=100) > 4
    assert saturation(records) > 4


def test_saturation_needs_records():
    with pytest.raises(ValueError, match="at least one record"):
        saturation([], 1.0)


def test_gantt_needs_records():
    with pytest.raises(ValueError, match="^plot_gantt needs at least one record; got none$"):
        plot_gantt([])


def test_gathered_through_a_client(source):
    distributed = pytest.importorskip("distributed")
    k = sleep_kernel(0.001)
    dsk = {"src": source, **{("n", i): (k, "src") for i in range(3)}}
    run(dsk, [("n", i) for i in range(3)])
    # Two in-process workers share this process's runtimes: each record comes back once.
    with (
        distributed.LocalCluster(
            n_workers=2, threads_per_worker=1, processes=False, dashboard_address=":0"
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        records = timeline(client)
        assert sorted(r["key"] for r in records) == [("n", i) for i in range(3)]
        assert all(r["worker"].startswith("inproc://") for r in records)
        clear_timeline(client)
        assert timeline(client) == []


def test_an_empty_cluster_timeline_warns_until_the_workers_plugin_records_one():
    """The workers' plugin read its config at setup: a client's dask.config.set comes too late
    (here, in-process, the workers' config is this process's), a plugin with the setting not."""
    distributed = pytest.importorskip("distributed")
    from tests.sim_tasks import SIM_CLUSTER, ones

    off = (
        "timeline(client) is empty: gpustreams.timeline is off on every worker (the default), "
        "so none records one; a worker reads its own config when its plugin starts, so a "
        "dask.config.set here does not reach it: turn it on with "
        "client.register_plugin(StreamsPlugin(timeline=True))"
    )
    with (
        dask.config.set(SIM_CLUSTER),
        distributed.LocalCluster(
            n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0"
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        client.register_plugin(dask_gpustreams.StreamsPlugin())
        client.submit(ones, 4, key="off").result()
        with dask.config.set({"gpustreams.timeline": True}), pytest.warns(UserWarning) as warned:
            assert timeline(client) == []
        assert [str(w.message) for w in warned] == [off]

        client.register_plugin(dask_gpustreams.StreamsPlugin(timeline=True))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert timeline(client) == []  # no runtime yet: the plugin's first task records
            client.submit(ones, 4, key="on").result()
            assert [r["key"] for r in timeline(client)] == ["on"]


def _same_host_and_pid() -> None:
    """On a worker: report the host name and pid of another worker's process (containers
    that share a host name, each its workers' pid 1)."""
    import os
    import socket

    socket.gethostname = lambda: "node"
    os.getpid = lambda: 1


@pytest.mark.parametrize(
    "processes",
    [False, pytest.param(True, marks=pytest.mark.slow)],
    ids=["in-process", "processes-of-one-host-name-and-pid"],
)
def test_each_workers_records_name_the_worker_that_ran_them(processes):
    """In-process workers each own a runtime, in the one process; worker processes are told
    apart even where their host name and pid repeat."""
    distributed = pytest.importorskip("distributed")
    from tests.sim_tasks import SIM_CLUSTER, ones

    with (
        dask.config.set(SIM_CLUSTER),
        distributed.LocalCluster(
            n_workers=2, threads_per_worker=1, processes=processes, dashboard_address=":0"
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        client.register_plugin(dask_gpustreams.StreamsPlugin(timeline=True))
        if processes:
            client.run(_same_host_and_pid)
        a, b = sorted(client.scheduler_info()["workers"])
        on_a = client.submit(ones, 4, key="on-a", workers=[a])
        on_b = client.submit(ones, 4, key="on-b", workers=[b])
        client.gather([on_a, on_b])
        records = timeline(client)
        assert {r["key"]: r["worker"] for r in records} == {"on-a": a, "on-b": b}
        tracks = to_rectangles(records)["tracks"]
        assert len(tracks) == 2 and tracks[0].startswith(a) and tracks[1].startswith(b)


@dask_gpustreams.host_task
def _host_pass(x):
    return x


def test_a_record_keeps_its_events_when_the_timeline_is_turned_on_during_a_graph(
    on_the_launcher,
):
    """The dashboard turns the timeline on (``enable_timeline``) while a graph runs on the
    launcher: its host tasks from then on get timing events and a place in the timeline,
    and their durations stay theirs. Before, the launcher, which had started with the
    timeline off, gave those events back to the runtime's event pool with its other ones:
    a host wait of the next graph (``wait_stream`` takes its event from the pool) recorded
    one again after its own kernel, and the record's duration grew by that kernel's."""
    config = {"gpustreams.enabled": True, "gpustreams.backend": "sim", "gpustreams.streams": 2}
    with dask.config.set(config):
        runtime = dask_gpustreams.get_runtime()
        runtime.disable_timeline()
        launch = dask.base.get_scheduler(scheduler="gpustreams")
        try:

            def turn_on(x):
                runtime.enable_timeline()  # as the dashboard does, from another thread
                return x

            first = {"on": Task("on", turn_on, 1), "read": Task("read", _host_pass, TaskRef("on"))}
            assert launch(first, "read") == 1
            (record,) = [r for r in runtime.timeline_snapshot() if r.key == "read"]
            duration = runtime.elapsed_ms(record)
            # A host task on a task nested in its arguments waits for its stream (a host wait).
            nested = Task(None, sleep_kernel(0.05))
            second = {"out": Task("out", _host_pass, nested)}
            launch(second, "out")
            assert runtime.elapsed_ms(record) == duration
        finally:
            runtime.disable_timeline()
