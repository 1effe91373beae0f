"""Which kinds of task block the host, learned from how long their calls take.

A GPU task only enqueues work, so its call returns in microseconds; a task
that waits for the device (a download, ``.item()``), computes on the host or
sleeps takes as long as that work. The launcher times each call it makes and
tells :class:`HostTasks`, keyed by the task's group (its key prefix, as
distributed's task-prefix estimates are): a group whose calls took longer
than :attr:`HostTasks.threshold_s` :attr:`HostTasks.confirm` times in a row
is sent to host threads from then on, and goes back to the launcher after
:attr:`HostTasks.recover` fast calls in a row.

One slow call is not enough: a GPU task's call is slow now and then for
reasons that are not its own (a kernel compiled, the memory pool grown with a
``cudaMalloc`` that waits for the whole device, a garbage collection, a full
launch queue). On host threads such a task would first wait on the host for
its inputs, draining the device; on the H200 groups of std and stencil went
back and forth in every run. A task that does block the host runs on the
launching thread once more, noted, before it moves.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable

logger = logging.getLogger(__name__)


class HostTasks:
    """Per-group verdicts: does a call of this group block the host?"""

    #: A call longer than this (host seconds) marks its group as host work. Enqueueing a
    #: fused chain of small CuPy operations takes about a millisecond of host time and is
    #: no host task: on host threads it would only wait for its inputs and fight for the GIL.
    threshold_s = 5e-3
    #: Slow calls in a row (on the launching thread) that send a group to host threads.
    confirm = 2
    #: Fast calls in a row on a host thread that send a group back to the launcher.
    recover = 2
    #: Suspected groups kept at most (a group slow once may never run again), oldest dropped.
    max_suspects = 256

    def __init__(self) -> None:
        self._fast_runs: dict[Hashable, int] = {}  # host groups -> fast calls in a row
        self._slow_runs: dict[Hashable, int] = {}  # suspected groups -> slow calls in a row
        self._logged: set[Hashable] = set()  # groups whose verdicts were logged at INFO
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        """Whether any group is marked (the launcher skips group lookups while none is)."""
        return bool(self._fast_runs)

    def __contains__(self, group: Hashable) -> bool:
        return group in self._fast_runs

    def groups(self) -> list[Hashable]:
        """The groups marked as host work."""
        return list(self._fast_runs)

    def suspecting(self) -> bool:
        """Whether a group's last call was slow but it is not marked yet: the launcher then
        reports its fast calls too (:meth:`observe`), which clear the suspicion."""
        return bool(self._slow_runs)

    def observe(self, group: Hashable, seconds: float) -> None:
        """Note a call of ``group`` that took ``seconds`` on the host."""
        fast = seconds < self.threshold_s
        if fast and group not in self._slow_runs and group not in self._fast_runs:
            return  # nothing to note: no lock (the launcher reports every call while suspecting)
        with self._lock:
            runs = self._fast_runs.get(group)
            if runs is None:
                if fast:
                    self._slow_runs.pop(group, None)
                    return
                slow = self._slow_runs.pop(group, 0) + 1
                if slow < self.confirm:
                    self._slow_runs[group] = slow
                    if len(self._slow_runs) > self.max_suspects:
                        del self._slow_runs[next(iter(self._slow_runs))]
                    return
                self._fast_runs[group] = 0
                self._log(
                    group,
                    "gpustreams: tasks of group %r block the host (%d calls in a row, the last "
                    "took %.1f ms): they run on host threads from now on",
                    slow,
                    seconds * 1e3,
                )
            elif not fast:
                self._fast_runs[group] = 0
            elif runs + 1 >= self.recover:
                del self._fast_runs[group]
                self._log(
                    group,
                    "gpustreams: tasks of group %r no longer block the host (%d fast calls): "
                    "they launch from the launcher again",
                    self.recover,
                )
                self._logged.add(group)
            else:
                self._fast_runs[group] = runs + 1

    def _log(self, group: Hashable, message: str, *values: float) -> None:
        """A verdict on ``group``: at INFO until it first went back, then at DEBUG.

        A GPU group whose calls are slow only now and then (a cold memory pool's
        allocations) goes back and forth; that shows at DEBUG.
        """
        level = logging.DEBUG if group in self._logged else logging.INFO
        logger.log(level, message, group, *values)
