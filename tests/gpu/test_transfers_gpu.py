"""Staged copies on copy streams with CuPy: an existing upload/compute/download pipeline."""

import dask
import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
da = pytest.importorskip("dask.array")

from dask_gpustreams import get_runtime  # noqa: E402
from dask_gpustreams.config import auto_pinned_pool_size  # noqa: E402
from dask_gpustreams.transfers import to_device, to_host  # noqa: E402

from .kernels import spin_scale  # noqa: E402


def slow_double(x):
    return spin_scale(x.ravel(), 2.0, 1).reshape(x.shape)


@pytest.mark.parametrize("funcs", ["cupy", "helpers"])
def test_pipeline_exact_with_small_pinned_pool(funcs):
    host = np.random.default_rng(0).standard_normal((64, 1 << 15))
    up, down = (cupy.asarray, cupy.asnumpy) if funcs == "cupy" else (to_device, to_host)
    meta = np.empty((0, 0))
    x = (
        da.from_array(host, chunks=(1, 1 << 15))
        .map_blocks(up, meta=meta)
        .map_blocks(slow_double, meta=meta)
        .map_blocks(down, meta=meta)
    )
    cfg = {
        "gpustreams.enabled": True,
        "gpustreams.backend": "cupy",
        "gpustreams.pinned-pool-size": "2 MiB",  # 8 chunks of 256 KiB: reused in flight
    }
    with dask.config.set(cfg):
        for _ in range(3):
            result = x.compute()
            assert isinstance(result, np.ndarray)
            np.testing.assert_array_equal(result, host * 2.0)
        rt = get_runtime()
        assert sum(s.seq for s in rt.transfers.h2d.slots) >= 64
        assert rt.transfers.pinned.total_bytes() <= 2 << 20


def test_download_returns_pinned_memory_while_the_allowance_has_room():
    cfg = {"gpustreams.enabled": True, "gpustreams.backend": "cupy", "gpustreams.streams": 2}
    host = np.arange(1 << 16, dtype=np.float64)
    with dask.config.set(cfg):
        pinned = get_runtime().transfers.pinned
        devices = cupy.cuda.runtime.getDeviceCount()
        assert pinned.limit == auto_pinned_pool_size(devices)  # the default, 'auto'
        before = pinned.taken_bytes()
        result = to_host(slow_double(cupy.asarray(host)))
        np.testing.assert_array_equal(result, host * 2.0)
        attributes = cupy.cuda.runtime.pointerGetAttributes(result.ctypes.data)
        assert attributes.type == 1  # cudaMemoryTypeHost: page-locked
        assert pinned.taken_bytes() == before + host.nbytes
        del result
        assert pinned.taken_bytes() == before


PER_THREAD_STREAM = """
import cupy, dask, numpy as np
import dask.array as da
from tests.gpu.kernels import spin_scale

assert cupy.cuda.get_current_stream().ptr == 2, "the per-thread default stream is off"
host = np.random.default_rng(0).standard_normal((64, 1 << 15))
meta = np.empty((0, 0))
double = lambda x: spin_scale(x.ravel(), 2.0, 1).reshape(x.shape)
pipeline = (
    da.from_array(host, chunks=(1, 1 << 15))
    .map_blocks(cupy.asarray, meta=meta)
    .map_blocks(double, meta=meta)
    .map_blocks(cupy.asnumpy, meta=meta)
)
rng = np.random.default_rng(1)
a, b = rng.standard_normal((256, 512)), rng.standard_normal((512, 256))
x = da.from_array(a, chunks=(64, 128)).map_blocks(cupy.asarray)
y = da.from_array(b, chunks=(128, 128)).map_blocks(cupy.asarray)
expr = ((da.exp(x / 10) * 2 + x) @ y).sum(axis=0) + (x**2).mean()
expected = ((np.exp(a / 10) * 2 + a) @ b).sum(axis=0) + (a**2).mean()
cfg = {
    "gpustreams.enabled": True,
    "gpustreams.backend": "cupy",
    "gpustreams.pinned-pool-size": "2 MiB",
}
with dask.config.set(cfg):
    for _ in range(3):
        np.testing.assert_array_equal(pipeline.compute(), host * 2.0)
        np.testing.assert_allclose(cupy.asnumpy(expr.compute()), expected, rtol=1e-10)
print("exact")
"""


WRITTEN_LATE = """
import cupy, dask, dask.threaded, numpy as np
from dask import delayed
import dask_gpustreams  # scheduler="gpustreams"
from tests.gpu.kernels import spin_fill

assert cupy.cuda.get_current_stream().ptr == 2, "the per-thread default stream is off"
n = 1 << 20
cfg = {"gpustreams.backend": "cupy", "gpustreams.streams": 8}
for scheduler, enabled in (("gpustreams", False), (dask.threaded.get, True)):
    with dask.config.set({**cfg, "gpustreams.enabled": enabled}):
        for value in (3.0, 5.0, 7.0):
            x = spin_fill(n, value, 200)  # written 200 ms from now, on this thread's stream
            (total,) = dask.compute(delayed(lambda a: (a * 1.0).sum())(x), scheduler=scheduler)
            assert float(total) == value * n, (scheduler, float(total), value * n)
print("exact")
"""


def test_an_input_still_being_written_on_the_per_thread_stream_is_read_after(run_python):
    """An array made just before compute on the caller's per-thread default stream, which the
    pool's streams do not wait for on their own (at ca2bda0 each such task read it early;
    ``StreamRuntime.order_after_caller``)."""
    out = run_python(WRITTEN_LATE, env={"CUPY_CUDA_PER_THREAD_DEFAULT_STREAM": "1"})
    assert out.strip().splitlines()[-1] == "exact"


def test_pipelines_exact_with_the_per_thread_default_stream(run_python):
    """Users of today's workaround keep CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1 set."""
    out = run_python(PER_THREAD_STREAM, env={"CUPY_CUDA_PER_THREAD_DEFAULT_STREAM": "1"})
    assert out.strip().splitlines()[-1] == "exact"
