"""On the scheduler: a corrupt result whose input has erred errs too, instead of waiting.

A worker drops a result it found corrupt (see *Failures* in :mod:`.plugin`)
so that the scheduler recomputes it. But the scheduler sends a released key
back to ``waiting`` only if none of its dependencies has erred
(``Scheduler._transition_memory_released``): when the failed kernel's own key
has already erred, the dependent stays ``released`` and whoever wants it
waits forever. The same holds for a key released because a peer found such a
result missing. :class:`ErredInputs` turns any key released while one of its
inputs has erred, and still wanted, into an error blamed on that input, as the
scheduler does for the dependents of a task that raises; so is a key sent back
to ``waiting`` for an input that has erred since (a chain of such keys errs
link by link).
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from typing import Any

from distributed import SchedulerPlugin

from dask_gpustreams.diagnostics.dashboard import add_dashboard_page

#: States in which a key whose input has erred waits forever.
_STUCK = frozenset({"released", "waiting"})

#: Prefix of the stimulus ids of the workers' releases of corrupt results.
STIMULUS_PREFIX = "gpustreams-kernel-error"


class ErredInputs(SchedulerPlugin):
    """Err the corrupt results released by workers that cannot be recomputed."""

    name = "gpustreams-erred-inputs"
    idempotent = True

    async def start(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        add_dashboard_page(scheduler)  # the plugin's page on the dashboard (no-op without bokeh)

    def transition(self, key: Hashable, start: str, finish: str, *args: Any, **kw: Any) -> None:
        # Whatever released it (the worker's drop of a corrupt result, or a fetch of that
        # result that found it missing), a key released after one of its inputs erred can
        # never run again. Transitions cannot be started from inside one: after this batch.
        if finish in _STUCK:
            self.scheduler.loop.add_callback(self._err_if_stuck, key)

    def _err_if_stuck(self, key: Hashable) -> None:
        ts = self.scheduler.tasks.get(key)
        if ts is None or ts.state not in _STUCK or not (ts.who_wants or ts.waiters):
            return
        erred = next((d for d in ts.dependencies if d.state == "erred"), None)
        if erred is None:
            return
        ts.exception_blame = erred.exception_blame
        self.scheduler.transitions(
            {key: "erred"}, stimulus_id=f"gpustreams-erred-input-{time.time()}"
        )
