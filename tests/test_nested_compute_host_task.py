"""A ``host_task`` inside a nested compute (a task that calls ``dask.compute`` on a graph
of its own) reading a device array that the outer task got as its input: that array may
still be written on the outer task's stream. The nested compute orders its streams after
it on the device (``order_after_caller``), and its host tasks now wait on the host for the
event recorded there too (``StreamRuntime.check``). Before, a host read off the streams (a
GDS write; ``copy.deepcopy(x).get()`` on the sim) saw it unwritten: NaN (helper-92's
fuzzing, 2-10 of 10 runs a route).
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
