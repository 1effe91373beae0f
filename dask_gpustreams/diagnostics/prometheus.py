"""``dask_worker_gpustreams_*`` series on the workers' ``/metrics`` (Prometheus).

:class:`StreamsMetricCollector` is built as distributed's
``WorkerMetricCollector`` (``distributed/http/worker/prometheus/core.py``): a
``PrometheusCollector`` of subsystem ``worker`` in prometheus_client's global
registry, whose names follow ``distributed.dashboard.prometheus.namespace``.
distributed registers one collector per process and points it at the worker
whose ``/metrics`` is being served; this one does the same, so that several
workers in one process each report their own plugin. ``StreamsPlugin.setup``
adds the worker (:func:`register`), its teardown removes it (:func:`unregister`),
and the collector leaves the registry with the last worker. Without
``prometheus_client`` installed (``pip install 'dask-gpustreams[prometheus]'``)
nothing is registered, as distributed serves no metrics then either.

Series (``dask_worker_`` prefix by default):

- ``gpustreams_tasks_total``: tasks launched on the compute streams;
- ``gpustreams_tasks_in_flight``: tasks whose event has not completed;
- ``gpustreams_stream_waits_total``: event waits enqueued between streams;
- ``gpustreams_egress_waits_total``, ``gpustreams_egress_wait_seconds_total``:
  get_data and spill requests that waited for events, and the time;
- ``gpustreams_failures_total``: corrupt results found (kernel failures);
- ``gpustreams_held_bytes``: arrays held for tasks in flight;
- ``gpustreams_pinned_bytes{type="staging"|"results"|"limit"}``;
- ``gpustreams_streams``: compute streams;
- ``gpustreams_device_busy_seconds_total{stream}``: device time of the tasks
  completed on each stream, only with ``gpustreams.timeline`` on (it needs the
  timing events; tasks dropped from the timeline before a scrape are not counted).

The runtime's series are those of the worker's plugin's runtime; workers of one
process that share a runtime report the same values.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from distributed.http.prometheus import PrometheusCollector

from dask_gpustreams.diagnostics.status import egress_counts, runtime_counts
from dask_gpustreams.diagnostics.timeline import RecordCursor


class DeviceBusy:
    """Seconds of device time per stream of one runtime, from its timeline (cumulative).

    Each :meth:`update` adds the tasks completed since the last one
    (:class:`~dask_gpustreams.diagnostics.timeline.RecordCursor`); records of
    tasks still running are kept for the next.
    """

    def __init__(self, runtime: Any):
        self.runtime = runtime
        self.seconds: dict[int, float] = {}
        self._cursor = RecordCursor(runtime)

    def update(self) -> dict[int, float]:
        """``stream index -> busy seconds`` so far."""
        runtime = self.runtime
        if not runtime.timeline_enabled:
            return self.seconds
        elapsed = runtime.elapsed_ms
        for record in self._cursor.take():
            index = record.stream_index
            self.seconds[index] = self.seconds.get(index, 0.0) + elapsed(record) / 1e3
        return self.seconds


#: ``(type, name, help, key, unit)`` of the series of one value each: of the plugin's
#: :func:`~dask_gpustreams.diagnostics.status.egress_counts`, and of its runtime's
#: :func:`~dask_gpustreams.diagnostics.status.runtime_counts`.
EGRESS_SERIES = (
    (
        "counter",
        "gpustreams_egress_waits",
        "get_data and spill requests that waited for their results' events",
        "egress_waits",
        "",
    ),
    (
        "counter",
        "gpustreams_egress_wait",
        "Time get_data and spill requests waited for their results' events",
        "egress_wait_seconds",
        "seconds",
    ),
    (
        "counter",
        "gpustreams_failures",
        "Corrupt results found (kernel failures), released for recomputation",
        "failures",
        "",
    ),
)
RUNTIME_SERIES = (
    ("gauge", "gpustreams_streams", "Compute streams of the worker's pool", "streams", ""),
    ("counter", "gpustreams_tasks", "Tasks launched on the compute streams", "tasks_run", ""),
    (
        "gauge",
        "gpustreams_tasks_in_flight",
        "Tasks launched whose completion event has not fired",
        "tasks_in_flight",
        "",
    ),
    (
        "counter",
        "gpustreams_stream_waits",
        "Event waits enqueued on a stream for other streams' work",
        "stream_waits",
        "",
    ),
    (
        "gauge",
        "gpustreams_held",
        "Bytes of arrays held until the tasks that read them complete",
        "held_bytes",
        "bytes",
    ),
)


class StreamsMetricCollector(PrometheusCollector):
    """The ``gpustreams`` series of the worker being scraped (one collector per process)."""

    def __init__(self) -> None:
        super().__init__(None)
        self.subsystem = "worker"
        #: worker -> its StreamsPlugin
        self.plugins: dict[Any, Any] = {}
        self._busy: dict[int, DeviceBusy] = {}  # id(runtime) -> its busy seconds

    def describe(self) -> list:
        return []  # no names checked at registration: they depend on the worker

    def scraped_plugin(self) -> Any:
        """The plugin of the worker whose ``/metrics`` is being served, or None."""
        plugins = self.plugins
        try:
            from distributed.http.worker.prometheus.core import PrometheusHandler

            served = getattr(PrometheusHandler._collector, "server", None)
        except ImportError:
            served = None
        if served in plugins:
            return plugins[served]
        if served is None and len(plugins) == 1:
            return next(iter(plugins.values()))
        return None

    def _series(self, series: tuple, values: dict) -> Iterator[Any]:
        """A metric family of each row of ``series`` (as :data:`EGRESS_SERIES`), from ``values``."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        families = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily}
        for kind, name, documentation, key, unit in series:
            yield families[kind](self.build_name(name), documentation, value=values[key], unit=unit)

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        plugin = self.scraped_plugin()
        if plugin is None:
            return
        name = self.build_name
        yield from self._series(EGRESS_SERIES, egress_counts(plugin))
        runtime = plugin.runtime
        if runtime is None:  # no task yet
            return
        counts = runtime_counts(runtime)
        yield from self._series(RUNTIME_SERIES, counts)
        pinned = GaugeMetricFamily(
            name("gpustreams_pinned"),
            "Pinned host memory: staging buffers, download results alive, pool size",
            labels=["type"],
            unit="bytes",
        )
        pinned.add_metric(["staging"], counts["pinned_staging_bytes"])
        pinned.add_metric(["results"], counts["pinned_results_bytes"])
        pinned.add_metric(["limit"], counts["pinned_limit_bytes"])
        yield pinned
        if runtime.timeline_enabled:
            busy = self._busy.get(id(runtime))
            if busy is None or busy.runtime is not runtime:
                busy = self._busy[id(runtime)] = DeviceBusy(runtime)
            family = CounterMetricFamily(
                name("gpustreams_device_busy"),
                "Device time of the tasks completed on each stream (gpustreams.timeline)",
                labels=["stream"],
                unit="seconds",
            )
            for index, seconds in sorted(busy.update().items()):
                family.add_metric([str(index)], seconds)
            yield family


_lock = threading.Lock()
_collector: StreamsMetricCollector | None = None


def register(worker: Any, plugin: Any) -> bool:
    """Report ``plugin``'s series on ``worker``'s ``/metrics``; False without prometheus_client."""
    global _collector
    try:
        import prometheus_client
    except ImportError:
        return False
    with _lock:
        if _collector is None:
            _collector = StreamsMetricCollector()
            prometheus_client.REGISTRY.register(_collector)
        _collector.plugins[worker] = plugin
    return True


def unregister(worker: Any) -> None:
    """Stop reporting ``worker``'s series; the collector leaves the registry with the last."""
    global _collector
    with _lock:
        if _collector is None:
            return
        _collector.plugins.pop(worker, None)
        if not _collector.plugins:
            import prometheus_client

            prometheus_client.REGISTRY.unregister(_collector)
            _collector = None
