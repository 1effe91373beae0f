"""A ``host_task`` inside a nested compute (a task that calls ``dask.compute`` on a graph
of its own) reading a device array that the outer task got as its input: that array may
still be written on the outer task's stream, which the nested compute orders after on the
device only (``order_after_caller``), and the host task's host wait covers only its own
graph's producers (``GraphLauncher._run_host``). A host read off the streams (a GDS
write; ``copy.deepcopy(x).get()`` on the sim) then sees it unwritten: NaN.

Failing at d9f1d88 (helper fuzz; scratch/repro_nested_host_task.py: 2-10 of 10 runs per
route and inner scheduler; a read with ``.get()`` on the task's stream is exact).
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


def nested(x):
    (out,) = dask.compute(delayed(read_off_stream)(x), scheduler="gpustreams")
    return out


@pytest.mark.parametrize("route", ["launcher", "threaded", "sync"])
def test_a_host_task_of_a_nested_compute_reads_the_outer_input_whole(route, monkeypatch):
    monkeypatch.setattr(sim.get_device(), "kernel_delay", (0.0, 0.0))
    scheduler = {"launcher": "gpustreams", "threaded": dask.threaded.get, "sync": "sync"}[route]
    data = np.arange(8.0)
    config = {"gpustreams.enabled": True, "gpustreams.backend": "sim", "gpustreams.streams": 2}
    with dask.config.set(config):
        for _ in range(3):
            got = dask.compute(delayed(nested)(delayed(slow_fill)(data, 0.1)), scheduler=scheduler)[0]
            np.testing.assert_array_equal(got, data)
