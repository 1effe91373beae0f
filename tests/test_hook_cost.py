"""The plugin's cost on the worker's event loop, counted in Python function calls per task.

Every transition of every key calls ``StreamsPlugin.transition`` on the event
loop, which also serves the scheduler's messages and the peers' fetches. The
count of Python-level calls made inside it is a stable stand-in for its time
(about 0.1-0.3 us a call on a current CPU): it does not depend on the
machine's load, and it rises with any per-task work added to the hook.
"""

from __future__ import annotations

import collections
import functools
import gc
import sys
import time
from dataclasses import dataclass

import dask
import numpy as np
import pytest
from distributed import Client, LocalCluster

from dask_gpustreams import StreamsPlugin, sim
from dask_gpustreams.integrations.distributed.plugin import StreamsPlugin as PluginClass

# A task per key: stream blocks would make each chain one task.
CONFIG = {"gpustreams.backend": "sim", "gpustreams.streams": 4, "gpustreams.blocks": "off"}
#: Python calls of the hook per task, all its transitions together: 10.07 when this was set,
#: 1 per transition for the hook itself; the checks of the inputs' events run in the worker
#: thread. The hook made 41 before it was first made cheap, then 22 (8 of them
#: ``Task.is_coro``), then 12.0 (before the wrapping decision was kept per function); with a
#: dataclass as the task function, 12.0 until the function of the last task was found by
#: identity (not by its ``__hash__`` and ``__eq__``, 2 calls per task). With a new object per
#: task, as a worker process gets them: a dataclass 12.0 and a partial 22.0 until they were
#: found by class and by the function wrapped, 10.03 since.
MAX_CALLS_PER_TASK = 10.5
#: Python calls per transition, the hook's own included, by finish state. ``executing``: the
#: hook, ``Execution.prepare`` and ``StreamTask.__init__``, and the rare task with a transfer
#: or a task in its arguments ``rewrite_transfers`` (3.07 here; the module, coroutine and
#: transfer checks are made at a function's first task only); ``released``: the hook,
#: ``Provenance.forget`` and ``EventRegistry.discard`` (the record is freed in a task thread:
#: no finalizer runs here); the others only the hook.
CALLS_PER_TRANSITION = {
    "executing": 3.1,
    "released": 3,
    "waiting": 1,
    "ready": 1,
    "memory": 1,
    "forgotten": 1,
}


def _inc(x):
    return x + 1


@dataclass(frozen=True)
class _Add:
    """A task function whose ``__hash__`` and ``__eq__`` are Python calls; each graph brings
    a new, equal object (pickled with it), which its tasks share."""

    k: int

    def __call__(self, x):
        return x + self.k


class CallCounter:
    """Counts the Python function calls made inside each ``transition`` call, by finish state."""

    def __init__(self):
        self.calls: collections.Counter = collections.Counter()
        self.transitions: collections.Counter = collections.Counter()

    def wrap(self, transition):
        counter = self

        def counted(plugin, key, start, finish, **kwargs):
            n = 0

            def profile(frame, event, arg):
                nonlocal n
                if event == "call":
                    n += 1  # the first is the hook itself

            collecting = gc.isenabled()
            gc.disable()  # a collection's finalizers would count as the hook's calls
            sys.setprofile(profile)
            try:
                return transition(plugin, key, start, finish, **kwargs)
            finally:
                sys.setprofile(None)
                if collecting:
                    gc.enable()
                counter.calls[finish] += n
                counter.transitions[finish] += 1

        return counted


def _chains(width: int, depth: int, tag: str, func=_inc):
    """``width`` chains of ``depth`` dependent ``func`` tasks on one sim array (its record is
    an input). ``func`` may be a ``_New`` factory: each task then has its own object, as a
    worker process unpickles each task's function from its own message."""
    x = dask.delayed(sim.asarray, name=f"hook-source-{tag}")(np.zeros(4))
    outs = []
    for j in range(width):
        y = x
        for i in range(depth):
            f = func.make() if isinstance(func, _New) else func
            y = dask.delayed(f, name=f"hook-{tag}-{j}-{i}")(y)
        outs.append(y)
    return outs


@dataclass(frozen=True)
class _New:
    """Each task's function made anew by ``make`` (``_chains``)."""

    make: object


def _wait_until_idle(client, timeout=10.0):
    """Until the worker holds no task (the releases of dropped results have reached it)."""
    deadline = time.monotonic() + timeout
    while any(client.run(lambda dask_worker: len(dask_worker.state.tasks)).values()):
        assert time.monotonic() < deadline, "the worker still holds tasks"
        time.sleep(0.01)


@pytest.fixture
def counted(monkeypatch):
    counter = CallCounter()
    monkeypatch.setattr(PluginClass, "transition", counter.wrap(PluginClass.transition))
    with (
        dask.config.set(CONFIG),
        LocalCluster(
            n_workers=1, threads_per_worker=2, processes=False, dashboard_address=":0"
        ) as cluster,
        Client(cluster) as client,
    ):
        client.register_plugin(StreamsPlugin())
        yield client, counter


@pytest.mark.parametrize(
    "func",
    [_inc, _Add(1), _New(lambda: _Add(1)), _New(lambda: functools.partial(_inc))],
    ids=["function", "dataclass", "dataclass-per-task", "partial-per-task"],
)
def test_hook_makes_few_python_calls_per_task(counted, func):
    client, counter = counted
    dask.compute(*_chains(4, 10, "warm", func))  # the runtime and the caches exist from here
    _wait_until_idle(client)  # the warm-up's keys released and forgotten: not counted below
    counter.calls.clear()
    counter.transitions.clear()
    results = dask.compute(*_chains(4, 50, "timed", func))
    del results
    _wait_until_idle(client)
    tasks = counter.transitions["executing"]
    assert tasks >= 4 * 50 + 1, dict(counter.transitions)
    per_task = sum(counter.calls.values()) / tasks
    assert per_task <= MAX_CALLS_PER_TASK, dict(counter.calls)
    # Transitions that need nothing make no call beyond the hook's own.
    for finish in ("waiting", "ready", "memory", "forgotten"):
        assert counter.calls[finish] == counter.transitions[finish], (finish, dict(counter.calls))
    for finish, bound in CALLS_PER_TRANSITION.items():
        assert counter.calls[finish] <= bound * counter.transitions[finish], (
            finish,
            dict(counter.calls),
            dict(counter.transitions),
        )


def test_results_are_exact_with_the_cheap_hook(counted):
    client, _ = counted
    results = dask.compute(*_chains(3, 20, "exact"))
    assert [float(sim.asnumpy(r)[0]) for r in results] == [20.0] * 3
