"""``dask_gpustreams.status()``: this process and a cluster's workers, with no side effect."""

from __future__ import annotations

import dask
import dask.threaded
import numpy as np
import pytest
from dask import delayed
from distributed import Client, LocalCluster

import dask_gpustreams
from dask_gpustreams import KernelError, StreamsPlugin, sim
from dask_gpustreams.diagnostics.status import STATUS_FIELDS, StreamsStatus
from dask_gpustreams.runtime import EventRegistry, get_runtime
from dask_gpustreams.runtime.runtime import live_runtimes
from tests.sim_tasks import SIM_CLUSTER, fails_on_the_device, ones, slow_inc

CLUSTER_CONFIG = SIM_CLUSTER


def test_without_a_runtime_it_reports_the_settings_and_creates_none(gpustreams):
    with gpustreams(streams=3, policy="least-loaded"):
        report = dask_gpustreams.status()
    assert live_runtimes() == []
    (row,) = report.rows
    assert set(row) == set(STATUS_FIELDS)
    assert row["enabled"] is True and row["started"] is False
    assert (row["backend"], row["streams"], row["policy"]) == ("sim", 3, "least-loaded")
    assert row["settings"]["copy-streams"] == 1
    assert row["tasks_run"] is None and row["egress_waits"] is None
    text = str(report)
    assert "sim (not started)" in text and "least-loaded" in text
    assert "settings: timeline=False" in text


def test_settings_line_shows_byte_sizes_as_bytes_and_block_size_as_a_count():
    settings = {
        "gpustreams.block-size": 1000,
        "gpustreams.small-blocks": "4 MiB",
        "gpustreams.large-tasks": 0,
        "gpustreams.launch-ahead": "64 MiB",
    }
    with dask.config.set(settings):
        text = str(dask_gpustreams.status())
    assert "block-size=1000" in text.split()
    assert "small-blocks=4.00 MiB" in text and "large-tasks=0 B" in text
    assert "shared-blocks=16.00 MiB" in text and "launch-ahead=64.00 MiB" in text


def test_counts_of_a_local_graph(gpustreams, by_key):
    # a on stream 0, b on stream 1, c on stream 0 reads both: one cross-stream wait.
    by_key.update({"a": 0, "b": 1, "c": 0})
    dsk = {"a": (ones, 8), "b": (ones, 8), "c": (np.add, "a", "b")}
    with gpustreams(streams=2, policy="test-placement"):
        result = dask.threaded.get(dsk, "c")
        (row,) = dask_gpustreams.status().rows
    assert sim.asnumpy(result).tolist() == [2.0] * 8
    assert row["started"] and row["enabled"]
    assert (row["backend"], row["streams"], row["policy"]) == ("sim", 2, "test-placement")
    assert row["tasks_run"] == 3
    assert row["stream_waits"] == 1
    assert row["tasks_in_flight"] == 0 and row["held_bytes"] == 0
    assert row["pinned_limit_bytes"] > 0


def test_in_flight_and_held_bytes_of_a_running_task():
    runtime = get_runtime(dask_gpustreams.StreamsConfig(backend="sim", streams=2))
    registry = EventRegistry()
    x = runtime.run("x", lambda _: ones(1000), {}, registry)
    runtime.synchronize(["x"], registry)
    runtime.run("y", lambda v: slow_inc(v["x"], 0.5), {"x": x}, registry)
    (row,) = dask_gpustreams.status().rows  # off: no row of what a compute would get
    assert row["tasks_run"] == 2
    assert row["tasks_in_flight"] == 1
    assert row["held_bytes"] == x.nbytes == 8000
    runtime.synchronize(["y"], registry)
    runtime.collect()
    (row,) = dask_gpustreams.status().rows
    assert (row["tasks_in_flight"], row["held_bytes"]) == (0, 0)


def test_after_a_compute_a_bad_setting_and_new_settings_are_shown_beside_the_runtime(gpustreams):
    """Rows of runtimes that ran do not hide what the config gives now: an invalid value
    (the next compute raises it), or the settings of the runtime the next compute makes."""
    with gpustreams(streams=2):
        assert sim.asnumpy(delayed(ones)(4).sum().compute()).tolist() == 4.0
        (ran,) = dask_gpustreams.status().rows
        with dask.config.set({"gpustreams.streams": 1000}):
            report = dask_gpustreams.status()
        assert report.rows[0] == ran
        assert "gpustreams.streams=1000 is invalid" in report.rows[1]["error"]
        assert "error (pid" in str(report)
        with dask.config.set({"gpustreams.streams": 3}):
            ran_before, next_one = dask_gpustreams.status().rows
            assert ran_before == ran and ran["streams"] == 2
            assert (next_one["started"], next_one["streams"]) == (False, 3)


def test_an_invalid_setting_is_reported_not_raised():
    with dask.config.set({"gpustreams.streams": 0}):
        report = dask_gpustreams.status()
    (row,) = report.rows
    assert "gpustreams.streams=0 is invalid" in row["error"]
    assert "error (pid" in str(report)


def test_table_and_data_agree():
    report = StreamsStatus(
        (
            dict.fromkeys(STATUS_FIELDS)
            | {"worker": "tcp://a:1", "pid": 1, "enabled": True, "started": False},
        )
    )
    assert len(report) == 1 and list(report)[0]["worker"] == "tcp://a:1"
    assert str(report).splitlines()[0].split()[:3] == ["worker", "enabled", "backend"]
    assert repr(report) == str(report)


def test_workers_with_different_settings_are_named_on_each_settings_line():
    """The table shows backend, streams and policy; the other settings are lines below it.
    Where the workers differ (one's own preload or environment says ``blocks=off``), each
    line names the workers it is of. Before, the lines came unnamed and sorted."""

    def row(worker, **settings):
        base = dict.fromkeys(STATUS_FIELDS) | {"worker": worker, "pid": 1, "started": False}
        config = dask_gpustreams.StreamsConfig(backend="sim", **settings)
        return base | {"settings": {k.replace("_", "-"): v for k, v in vars(config).items()}}

    same = str(StreamsStatus((row("tcp://a:1"), row("tcp://b:2"))))
    assert [line for line in same.splitlines() if line.startswith("settings")] == [
        next(line for line in same.splitlines() if line.startswith("settings: "))
    ]
    text = str(StreamsStatus((row("tcp://a:1"), row("tcp://b:2", blocks="off"), row("tcp://c:3"))))
    lines = [line for line in text.splitlines() if line.startswith("settings")]
    assert len(lines) == 2
    (off,) = [line for line in lines if "blocks=off" in line]
    (auto,) = [line for line in lines if "blocks=auto" in line]
    assert off.startswith("settings (tcp://b:2): ")
    assert auto.startswith("settings (tcp://a:1, tcp://c:3): ")


@pytest.fixture(scope="module")
def cluster_client():
    with (
        dask.config.set(CLUSTER_CONFIG),
        LocalCluster(
            n_workers=2, threads_per_worker=2, processes=False, dashboard_address=":0"
        ) as lc,
        Client(lc) as client,
    ):
        yield client


def test_status_of_every_worker(cluster_client):
    client = cluster_client
    client.register_plugin(StreamsPlugin())
    a, b = sorted(client.scheduler_info()["workers"])
    before = dask_gpustreams.status(client)
    assert [r["worker"] for r in before] == [a, b]
    assert all(r["enabled"] and not r["started"] for r in before)
    x = client.submit(ones, 100, workers=[a], pure=False)
    y = client.submit(slow_inc, x, 0.3, workers=[a], pure=False)
    assert sim.asnumpy(y.result()).tolist() == [2.0] * 100  # gather waited for y's event
    rows = {r["worker"]: r for r in dask_gpustreams.status(client)}
    assert rows[a]["started"] and rows[a]["tasks_run"] >= 2
    assert rows[a]["egress_waits"] >= 1 and rows[a]["egress_wait_seconds"] > 0.05
    assert rows[a]["failures"] == 0
    assert rows[a]["backend"] == "sim" and rows[a]["streams"] == 2
    text = str(dask_gpustreams.status(client))
    assert a in text and b in text


def test_failures_count_each_failed_task_that_a_dependent_found(cluster_client):
    """A dependent on the same worker finds the failure before it runs and raises it: the
    failed result is never asked for, yet the worker's row counts it, once however many
    readers find it."""
    client = cluster_client
    client.register_plugin(StreamsPlugin())
    a = sorted(client.scheduler_info()["workers"])[0]
    x = client.submit(ones, 10, workers=[a], pure=False)
    for n in (1, 2):
        bad = client.submit(fails_on_the_device, x, workers=[a], key=f"bad-{n}")
        readers = [client.submit(slow_inc, bad, i / 1000, workers=[a], pure=False) for i in (0, 1)]
        for reader in readers:
            with pytest.raises(KernelError) as caught:
                reader.result(timeout=30)
            assert caught.value.key == f"bad-{n}"
        rows = {r["worker"]: r for r in dask_gpustreams.status(client)}
        assert rows[a]["failures"] == n


def test_workers_without_the_plugin_say_so(cluster_client):
    client = cluster_client
    client.register_plugin(StreamsPlugin())  # (also when this test runs alone)
    client.unregister_worker_plugin("gpustreams")
    try:
        rows = dask_gpustreams.status(client).rows
        assert len(rows) == 2
        assert not any(r["enabled"] for r in rows)
        # No counts where nothing counts: "-", not a 0 that reads as "nothing happened".
        assert all(r["egress_waits"] is None and r["failures"] is None for r in rows)
        table = str(dask_gpustreams.status(client)).splitlines()
        assert all(line.split()[-3:] == ["-", "-", "-"] for line in table[2:4])
    finally:
        client.register_plugin(StreamsPlugin())


def test_status_of_a_process_worker():
    with (
        dask.config.set(CLUSTER_CONFIG),
        LocalCluster(
            n_workers=1, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as lc,
        Client(lc) as client,
    ):
        client.register_plugin(StreamsPlugin())
        assert delayed(ones)(10).compute().shape == (10,)
        (row,) = dask_gpustreams.status(client).rows
        assert row["enabled"] and row["started"] and row["tasks_run"] == 1
        assert row["pid"] != dask_gpustreams.status().rows[0]["pid"]
