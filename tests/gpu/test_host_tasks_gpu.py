"""A ``host_task`` waits on the host for its inputs' work on every route, on a real GPU.

Its host code reads the input on a non-blocking stream of its own, which waits for no other
stream (as a library with a stream of its own, or a file write through GDS, would): without
the host wait, the copy runs while the producer's 20 ms kernel still writes, and reads what
the memory held before. Values are new at each run, so stale memory cannot pass.
"""

import functools

import dask
import dask.local
import dask.threaded
import numpy as np
import pytest
from dask import delayed

cupy = pytest.importorskip("cupy")

import dask_gpustreams  # noqa: E402

from .kernels import spin_fill  # noqa: E402

pytestmark = pytest.mark.gpu

N = 1 << 14


@dask_gpustreams.host_task
def read_off_stream(x, scale=1.0):
    """The input (times ``scale``), copied on a non-blocking stream that waits for nothing."""
    stream = cupy.cuda.Stream(non_blocking=True)
    out = x.get(stream=stream)  # (synchronizes that stream only)
    return float(out[0]) * scale, float(out[-1]) * scale


ROUTES = [
    pytest.param("gpustreams", id="launcher"),
    pytest.param(dask.local.get_sync, id="get_sync"),
    pytest.param(dask.threaded.get, id="threaded"),
]


@pytest.mark.parametrize("scale", [None, 2.0], ids=["marked", "partial"])
@pytest.mark.parametrize("scheduler", ROUTES)
def test_a_host_task_reads_its_input_whole_on_every_local_route(scheduler, scale):
    """Called as marked, or through a ``functools.partial`` of it (found through it)."""
    reader = read_off_stream if scale is None else functools.partial(read_off_stream, scale=scale)
    config = {"gpustreams.enabled": True, "gpustreams.backend": "cupy"}
    rng = np.random.default_rng()
    with dask.config.set(config):
        for _ in range(4):
            value = float(rng.integers(1, 1 << 30))
            got = dask.compute(
                delayed(reader)(delayed(spin_fill)(N, value, 20.0)), scheduler=scheduler
            )[0]
            assert got == (value * (scale or 1.0),) * 2


@pytest.mark.parametrize("scheduler", ROUTES)
def test_a_host_task_reads_whole_an_input_the_caller_writes_on_the_legacy_stream(scheduler):
    """An array made just before a top-level compute on CUDA's legacy default stream, which
    the pool's streams follow on the device with nothing recorded: the host task synchronizes
    that stream first (``CallerStream``). Without that host wait the read overtakes the kernel,
    as in :func:`test_race_control_without_a_host_wait` (6bad72e waited for nothing here)."""
    if cupy.cuda.get_current_stream().ptr != 0:
        pytest.skip("this thread's current stream is not CUDA's legacy default stream")
    config = {"gpustreams.enabled": True, "gpustreams.backend": "cupy"}
    rng = np.random.default_rng()
    with dask.config.set(config):
        for _ in range(4):
            value = float(rng.integers(1, 1 << 30))
            x = spin_fill(N, value, 20.0)  # written 20 ms from now, on the legacy stream
            got = dask.compute(delayed(read_off_stream)(x), scheduler=scheduler)[0]
            assert got == (value, value)


def test_a_host_task_reads_its_input_whole_on_a_worker_task_per_key():
    from distributed import Client, LocalCluster

    rng = np.random.default_rng()
    with (
        LocalCluster(n_workers=1, threads_per_worker=1, processes=False) as cluster,
        Client(cluster) as client,
    ):
        client.register_plugin(dask_gpustreams.StreamsPlugin(backend="cupy", blocks="off"))
        for _ in range(4):
            value = float(rng.integers(1, 1 << 30))
            x = client.submit(spin_fill, N, value, 20.0, pure=False)
            assert client.submit(read_off_stream, x, pure=False).result() == (value, value)


def test_race_control_without_a_host_wait():
    """The same read after the same kernel, with no host wait (no plugin): the copy on the
    non-blocking stream overtakes the kernel, which shows that the tests above can fail."""
    rng = np.random.default_rng()
    stale = 0
    for _ in range(4):
        value = float(rng.integers(1, 1 << 30))
        stale += read_off_stream(spin_fill(N, value, 20.0)) != (value, value)
    cupy.cuda.Device().synchronize()
    if not stale:
        pytest.skip("the non-blocking stream's copy never overtook the 20 ms kernel")
