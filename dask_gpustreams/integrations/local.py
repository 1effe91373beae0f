"""The local (threaded or synchronous) scheduler: a dask callback that wraps each graph.

Registered at import of :mod:`dask_gpustreams`; it does nothing unless
``gpustreams.enabled`` is true when ``compute``/``persist`` starts. Then every
task runs through the stream runtime in the pool thread that executes it,
and before ``compute`` returns the events of the results handed back are
waited for (one host sync at the end, none per task).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from dask.callbacks import Callback

from dask_gpustreams.config import enabled
from dask_gpustreams.integrations.tasks import wrap_task
from dask_gpustreams.runtime import EventRegistry, StreamRuntime, get_runtime
from dask_gpustreams.runtime.policies import critical_keys

logger = logging.getLogger("dask_gpustreams")


class LocalSchedulerHook(Callback):
    """Runs local-scheduler graphs through the stream runtime while enabled."""

    def __init__(self) -> None:
        super().__init__()
        self._runs: dict[int, tuple[StreamRuntime, EventRegistry]] = {}
        self._lock = threading.Lock()
        self._advised = False

    def _start(self, dsk: dict) -> None:
        if not enabled():
            return
        runtime = get_runtime()
        if not self._advised:
            self._advised = True
            logger.info(
                "gpustreams: running this graph's tasks through the stream runtime from "
                "Dask's scheduler threads; compute(scheduler='gpustreams') launches the whole "
                "graph from one thread and is faster on GPU graphs"
            )
        registry = EventRegistry()
        critical: set | None = None
        if runtime.policy.needs_critical_path:
            critical = critical_keys({k: v.dependencies for k, v in dsk.items()})
        for key, node in dsk.items():
            dsk[key] = wrap_task(
                node, runtime, registry, None if critical is None else key in critical
            )
        with self._lock:
            self._runs[id(dsk)] = (runtime, registry)

    def _finish(self, dsk: dict, state: dict[str, Any], errored: bool) -> None:
        with self._lock:
            run = self._runs.pop(id(dsk), None)
        if run is None:
            return
        runtime, registry = run
        if errored:
            # The exception being raised wins; wait for this graph's work so that a
            # kernel failure it left behind is reported here, not by the next compute.
            runtime.drain(registry)
        else:
            runtime.synchronize(state.get("cache", ()), registry)
        runtime.collect()
        runtime.release_events(registry)


hook = LocalSchedulerHook()
