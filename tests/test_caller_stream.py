"""Inputs the caller is still writing on its own stream when it computes are read after.

On a GPU with ``CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1``, an array made just before
``compute`` may still be being written on the caller's per-thread stream, which the
pool's streams do not wait for (on the H200 at ca2bda0 a delayed task read such an
array before it was written, on plain Dask's threads too). The sim's default stream
is ordered with no other stream either, like that per-thread stream.
"""

from __future__ import annotations

import time

import dask
import dask.threaded
import numpy as np
import pytest
from dask import delayed

from dask_gpustreams import sim

N = 64


def _slow_fill(out: np.ndarray, value: float) -> None:
    time.sleep(0.05)  # the kernel's run time on its stream, not a host wait
    out[...] = value


def _written_late(value: float) -> sim.SimArray:
    """An array whose values a kernel on this thread's current stream writes 50 ms from now."""
    out = sim.empty(N)
    sim.launch(_slow_fill, out, value)
    return out


def _double(x: sim.SimArray) -> sim.SimArray:
    return x * 2.0


@pytest.mark.parametrize("scheduler", ["gpustreams", pytest.param(dask.threaded.get, id="threads")])
def test_an_input_written_late_on_the_caller_s_stream_is_read_after(gpustreams, scheduler):
    with gpustreams(streams=4):
        for value in (1.0, 2.0, 3.0):
            x = _written_late(value)
            (got,) = dask.compute(delayed(_double)(x), scheduler=scheduler)
            np.testing.assert_array_equal(sim.asnumpy(got), np.full(N, 2.0 * value))
