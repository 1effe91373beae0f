"""A ``host_task`` reading, off the streams, an input that the caller may still be writing.

Inside a nested compute (a task that calls ``dask.compute`` on a graph of its own), a
device array that the outer task got as its input may still be written on the outer task's
stream. The nested compute orders its streams after it on the device
(``order_after_caller``), and its host tasks now wait on the host for the event recorded
there too (``StreamRuntime.wait_caller``). Before, a host read off the streams (a GDS
write; ``copy.deepcopy(x).get()`` on the sim) saw it unwritten: NaN (helper-92's fuzzing,
2-10 of 10 runs a route).

In a top-level compute, an array made just before it on CUDA's legacy default stream, which
the device orders before the pool's streams on its own: nothing is recorded there (an event
would order the device's later work after all its earlier work), and host tasks synchronize
that stream while it was busy when the compute began (``CallerStream``). Before, they read
the array unwritten.
"""

from __future__ import annotations

import copy
import time

import dask
import dask.threaded
import numpy as np
import pytest
from dask import delayed

from dask_gpustreams import host_task, sim
from dask_gpustreams.backends.sim import SimBackend


def _fill(out, base, delay):
    time.sleep(delay)
    out[...] = base


def slow_fill(base, delay):
    out = sim.empty(base.shape)
    sim.launch(_fill, out, base, delay)
    return out


@host_task
def read_off_stream(x):
    return copy.deepcopy(x).get()


SCHEDULERS = {"launcher": "gpustreams", "threaded": dask.threaded.get, "sync": "sync"}


def nested(x, inner):
    (out,) = dask.compute(delayed(read_off_stream)(x), scheduler=SCHEDULERS[inner])
    return out


@pytest.mark.parametrize("inner", ["launcher", "threaded", "sync"])
@pytest.mark.parametrize("outer", ["launcher", "threaded", "sync"])
def test_a_host_task_of_a_nested_compute_reads_the_outer_input_whole(outer, inner, monkeypatch):
    monkeypatch.setattr(sim.get_device(), "kernel_delay", (0.0, 0.0))
    data = np.arange(8.0)
    config = {"gpustreams.enabled": True, "gpustreams.backend": "sim", "gpustreams.streams": 2}
    with dask.config.set(config):
        for _ in range(3):
            task = delayed(nested)(delayed(slow_fill)(data, 0.1), inner)
            (got,) = dask.compute(task, scheduler=SCHEDULERS[outer])
            np.testing.assert_array_equal(got, data)


@pytest.mark.parametrize("scheduler", ["launcher", "threaded", "sync"])
def test_a_host_task_reads_whole_an_input_the_caller_writes_on_a_legacy_like_stream(
    scheduler, monkeypatch
):
    """The sim's default stream stands for CUDA's legacy one here: the device orders the
    pool's streams after it (``orders_before_pool``), so no event is recorded on it. Only
    the host task reads the input, so the device's own order does not matter."""
    monkeypatch.setattr(SimBackend, "orders_before_pool", lambda self, stream: True)
    monkeypatch.setattr(sim.get_device(), "kernel_delay", (0.0, 0.0))
    data = np.arange(8.0)
    config = {"gpustreams.enabled": True, "gpustreams.backend": "sim", "gpustreams.streams": 2}
    with dask.config.set(config):
        for i in range(3):
            x = slow_fill(data + i, 0.1)  # on this thread's stream, the sim's default one
            (got,) = dask.compute(delayed(read_off_stream)(x), scheduler=SCHEDULERS[scheduler])
            np.testing.assert_array_equal(got, data + i)
