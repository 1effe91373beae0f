"""The plugin's cost on the worker's event loop, counted in Python function calls per task.

Every transition of every key calls ``StreamsPlugin.transition`` on the event
loop, which also serves the scheduler's messages and the peers' fetches. The
count of Python-level calls made inside it is a stable stand-in for its time
(about 0.1-0.3 us a call on a current CPU): it does not depend on the
machine's load, and it rises with any per-task work added to the hook.
"""

from __future__ import annotations

import collections
import sys

import dask
import numpy as np
import pytest
from distributed import Client, LocalCluster

from dask_gpustreams import StreamsPlugin, sim
from dask_gpustreams.integrations.distributed.plugin import StreamsPlugin as PluginClass

# A task per key: stream blocks would make each chain one task.
CONFIG = {"gpustreams.backend": "sim", "gpustreams.streams": 4, "gpustreams.blocks": "off"}
#: Python calls of the hook per task, all its transitions together: 22 when this was set,
#: 8 of them ``Task.is_coro``, which ``Worker.execute`` would make otherwise (it is cached on
#: the task), and 1 per transition for the hook itself; the checks of the inputs' events run
#: in the worker thread. The hook made 41 before it was made cheap.
MAX_CALLS_PER_TASK = 25


def _inc(x):
    return x + 1


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

            sys.setprofile(profile)
            try:
                return transition(plugin, key, start, finish, **kwargs)
            finally:
                sys.setprofile(None)
                counter.calls[finish] += n
                counter.transitions[finish] += 1

        return counted


def _chains(width: int, depth: int, tag: str):
    """``width`` chains of ``depth`` dependent tasks on one sim array (its record is an input)."""
    x = dask.delayed(sim.asarray, name=f"hook-source-{tag}")(np.zeros(4))
    outs = []
    for j in range(width):
        y = x
        for i in range(depth):
            y = dask.delayed(_inc, name=f"hook-{tag}-{j}-{i}")(y)
        outs.append(y)
    return outs


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


def test_hook_makes_few_python_calls_per_task(counted):
    client, counter = counted
    dask.compute(*_chains(4, 10, "warm"))  # the runtime and the caches exist from here
    counter.calls.clear()
    counter.transitions.clear()
    results = dask.compute(*_chains(4, 50, "timed"))
    del results
    client.run(lambda: None)  # the releases of the dropped results have reached the worker
    tasks = counter.transitions["executing"]
    assert tasks >= 4 * 50 + 1, dict(counter.transitions)
    per_task = sum(counter.calls.values()) / tasks
    assert per_task <= MAX_CALLS_PER_TASK, dict(counter.calls)
    # Transitions that need nothing make no call beyond the hook's own.
    for finish in ("waiting", "ready", "memory", "forgotten"):
        assert counter.calls[finish] == counter.transitions[finish], (finish, dict(counter.calls))


def test_results_are_exact_with_the_cheap_hook(counted):
    client, _ = counted
    results = dask.compute(*_chains(3, 20, "exact"))
    assert [float(sim.asnumpy(r)[0]) for r in results] == [20.0] * 3
