"""Fine performance metrics of workers, through ``distributed.metrics.context_meter``.

Two activities, added to what distributed records (``Worker.digests_total``,
the scheduler's ``fine_performance_metrics`` and the dashboard's "Fine
Performance Metrics" page):

- :data:`LAUNCH`: the time a task spends launching its work onto its stream
  in the worker thread (stream choice, event waits enqueued, the task's
  function, recording its event, back-pressure), metered by the plugin's
  :class:`~dask_gpustreams.integrations.distributed.execution.WorkerStreamTask`. Digested as
  ``("execute", <span>, <prefix>, "gpustreams-launch", "seconds")``; like any
  metered time it is taken out of the task's ``thread-cpu`` and
  ``thread-noncpu``. The device time of the task is not in it: see
  :func:`dask_gpustreams.diagnostics.timeline`.
- :data:`WAIT`: time spent waiting for a result's events before it leaves
  the device. ``("get-data", "gpustreams-wait", "seconds")`` for peer fetches
  and gathers; for a spill, the activity that caused the eviction gets it
  (e.g. ``execute``), and the ``SpillBuffer`` counts it too (Prometheus
  ``dask_worker_spill_time_seconds_total{activity="gpustreams-wait"}``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from distributed.metrics import context_meter

#: Label of the launch time of tasks on worker threads.
LAUNCH = "gpustreams-launch"
#: Label of the waits for events before results leave the device (get_data, spilling).
WAIT = "gpustreams-wait"


def server_digest(server: Any, activity: str) -> Callable[[Hashable, float, str], None]:
    """A ``context_meter`` callback digesting ``(activity, label, unit)`` on ``server``.

    What ``distributed.core.context_meter_to_server_digest`` does for a method
    of the server, for code that runs before it (the wrapped ``get_data``).
    """

    def digest(label: Hashable, value: float, unit: str) -> None:
        labels = label if isinstance(label, tuple) else (label,)
        server.digest_metric((activity, *labels, unit), value)

    return digest


def launch_meter() -> Any:
    """``context_meter.meter(LAUNCH)``: meter a task's launch on a worker thread."""
    return context_meter.meter(LAUNCH)


def wait_meter() -> Any:
    """``context_meter.meter(WAIT)``: meter a wait for events at egress."""
    return context_meter.meter(WAIT)
