"""On the scheduler: a corrupt result whose input has erred errs too, instead of waiting.

A worker drops a result it found corrupt (see *Failures* in :mod:`.plugin`)
so that the scheduler recomputes it. But the scheduler sends a released key
back to ``waiting`` only if none of its dependencies has erred
(``Scheduler._transition_memory_released``): when the failed kernel's own key
has already erred, the dependent stays ``released`` and whoever wants it
waits forever. :class:`ErredInputs` turns such a key into an error blamed on
the erred input, as the scheduler does for dependents of a task that raised.
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from typing import Any

from distributed import SchedulerPlugin

#: Prefix of the stimulus ids of the workers' releases of corrupt results.
STIMULUS_PREFIX = "gpustreams-kernel-error"


class ErredInputs(SchedulerPlugin):
    """Err the corrupt results released by workers that cannot be recomputed."""

    name = "gpustreams-erred-inputs"
    idempotent = True

    async def start(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def transition(
        self, key: Hashable, start: str, finish: str, *args: Any, stimulus_id: str = "", **kw: Any
    ) -> None:
        if start == "memory" and finish == "released" and stimulus_id.startswith(STIMULUS_PREFIX):
            # Transitions cannot be started from inside one: after this batch.
            self.scheduler.loop.add_callback(self._err_if_stuck, key)

    def _err_if_stuck(self, key: Hashable) -> None:
        ts = self.scheduler.tasks.get(key)
        if ts is None or ts.state != "released" or not (ts.who_wants or ts.waiters):
            return
        erred = next((d for d in ts.dependencies if d.state == "erred"), None)
        if erred is None:
            return
        ts.exception_blame = erred.exception_blame
        self.scheduler.transitions(
            {key: "erred"}, stimulus_id=f"gpustreams-erred-input-{time.time()}"
        )
