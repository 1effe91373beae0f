"""Task functions on the simulated device and a cluster config, shared by the diagnostics tests."""

from __future__ import annotations

import time

import numpy as np

from dask_gpustreams import sim

#: A sim-backed cluster of 2 streams per worker, with only the plugin deciding what waits.
SIM_CLUSTER = {
    "gpustreams.backend": "sim",
    "gpustreams.streams": 2,
    "distributed.worker.memory.spill": False,
    "distributed.worker.memory.pause": False,
    "distributed.worker.memory.terminate": False,
}


def _slow(out, a, seconds):
    time.sleep(seconds)
    out[...] = a + 1


def slow_inc(a, seconds=0.0):
    """``a + 1`` by a kernel that sleeps ``seconds`` first."""
    out = sim.empty(a.shape)
    sim.launch(_slow, out, a, seconds)
    return out


def ones(n):
    return sim.asarray(np.ones(n))


def _raises(out, a):
    raise ValueError("boom")


def fails_on_the_device(a):
    """Returns at once; its kernel fails on the device."""
    out = sim.empty(a.shape)
    sim.launch(_raises, out, a)
    return out
