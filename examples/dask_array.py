"""A dask.array computation on the stream launcher, on the GPU or on the simulated device.

Chunks are CuPy arrays where a GPU is visible, else arrays of the simulated
stream device (``dask_gpustreams.sim``), which behave like CuPy's: every
operation is a kernel on the current stream. The result is checked against
plain Dask's synchronous scheduler::

    python examples/dask_array.py
"""

import time

import dask
import dask.array as da
import numpy as np

import dask_gpustreams
from dask_gpustreams.backends import gpu_visible

if gpu_visible()[0]:
    import cupy as xp
else:
    from dask_gpustreams import sim as xp  # the simulated device: no GPU needed

host = np.random.default_rng(0).random((4096, 4096))
x = da.from_array(host, chunks=1024).map_blocks(xp.asarray).persist()
y = ((x * 2 + 1) ** 2 - x).std(axis=0) + (x + x.T).mean(axis=1)

t0 = time.perf_counter()
got = y.compute(scheduler="gpustreams")  # the stream launcher
wall = time.perf_counter() - t0
with dask.config.set({"gpustreams.enabled": False}):  # plain Dask, for the check
    plain = y.compute(scheduler="sync")
np.testing.assert_allclose(xp.asnumpy(got), xp.asnumpy(plain), rtol=1e-12)
print(f"{dask_gpustreams.get_runtime()!r}: {wall * 1e3:.0f} ms, result matches plain Dask")
