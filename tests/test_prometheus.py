"""The ``dask_worker_gpustreams_*`` series on a worker's ``/metrics`` (Prometheus)."""

from __future__ import annotations

import urllib.request

import dask
import pytest
from distributed import Client, LocalCluster, wait

from dask_gpustreams import StreamsPlugin
from dask_gpustreams.diagnostics import prometheus
from tests.sim_tasks import SIM_CLUSTER, ones, slow_inc

parser = pytest.importorskip("prometheus_client.parser")

CONFIG = SIM_CLUSTER
PREFIX = "dask_worker_gpustreams_"


def scrape(port: int) -> dict[str, dict[tuple, float]]:
    """``family -> {labels: value}`` of the ``gpustreams`` series on a worker's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    out: dict[str, dict[tuple, float]] = {}
    for family in parser.text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith(PREFIX):
                labels = tuple(sorted(sample.labels.items()))
                out.setdefault(sample.name, {})[labels] = sample.value
    return out


def ports(client) -> dict[str, int]:
    return client.run(lambda dask_worker: dask_worker.http_server.port)


@pytest.fixture
def cluster():
    def start(n_workers=1, **config):
        return (
            dask.config.set({**CONFIG, **{f"gpustreams.{k}": v for k, v in config.items()}}),
            LocalCluster(
                n_workers=n_workers, threads_per_worker=2, processes=False, dashboard_address=":0"
            ),
        )

    return start


def test_metrics_hold_the_gpustreams_series_with_the_task_count(cluster):
    conf, lc = cluster(timeline=True)
    with conf, lc, Client(lc) as client:
        (port,) = ports(client).values()
        assert not any(k.startswith(PREFIX) for k in scrape(port))  # no plugin yet
        client.register_plugin(StreamsPlugin())
        x = client.submit(ones, 64, pure=False)
        ys = client.map(slow_inc, [x] * 9, [0.02] * 9, pure=False)
        wait(ys)
        client.gather(ys)  # waits for the events
        m = scrape(port)
        assert m[PREFIX + "tasks_total"][()] == 10
        assert m[PREFIX + "streams"][()] == 2
        assert m[PREFIX + "tasks_in_flight"][()] == 0
        assert m[PREFIX + "failures_total"][()] == 0
        assert m[PREFIX + "egress_waits_total"][()] >= 1
        assert m[PREFIX + "egress_wait_seconds_total"][()] > 0
        assert PREFIX + "stream_waits_total" in m
        assert PREFIX + "held_bytes" in m
        pinned = m[PREFIX + "pinned_bytes"]
        assert pinned[(("type", "limit"),)] > 0
        assert set(pinned) == {(("type", t),) for t in ("staging", "results", "limit")}
        busy = m[PREFIX + "device_busy_seconds_total"]
        assert 9 * 0.02 * 0.9 <= sum(busy.values()) < 5
        again = scrape(port)[PREFIX + "device_busy_seconds_total"]
        assert again == busy  # counted once
        client.unregister_worker_plugin("gpustreams")
        assert not any(k.startswith(PREFIX) for k in scrape(port))
    assert prometheus._collector is None


def test_device_busy_is_left_out_without_the_timeline(cluster):
    conf, lc = cluster()
    with conf, lc, Client(lc) as client:
        client.register_plugin(StreamsPlugin())
        client.submit(ones, 8).result()
        (port,) = ports(client).values()
        m = scrape(port)
        assert m[PREFIX + "tasks_total"][()] == 1
        assert PREFIX + "device_busy_seconds_total" not in m


def test_each_worker_reports_its_own_plugin(cluster):
    conf, lc = cluster(n_workers=2)
    with conf, lc, Client(lc) as client:
        client.register_plugin(StreamsPlugin())
        a, b = sorted(client.scheduler_info()["workers"])
        x = client.submit(ones, 8, workers=[a], pure=False)
        y = client.submit(slow_inc, x, 0.2, workers=[a], pure=False)
        y.result()
        by_worker = {w: scrape(p) for w, p in ports(client).items()}
        assert by_worker[a][PREFIX + "egress_waits_total"][()] >= 1
        assert by_worker[b][PREFIX + "egress_waits_total"][()] == 0
