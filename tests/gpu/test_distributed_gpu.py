"""``StreamsPlugin`` on a real GPU: dask-cuda's ``LocalCUDACluster`` with the cupy backend.

The plugin is enabled the way dask-cuda users do it, with
``LocalCUDACluster(preload=["dask_gpustreams"])`` (dask-cuda appends its own
preload and ``--create-cuda-context`` to it), once with CuPy's memory pool and
once with an RMM pool as CuPy's allocator (``rmm_pool_size``, skipped where
RMM is not installed). Results are compared with NumPy.
Run with ``-s`` to see what each worker reports.
"""

import sys

import cloudpickle
import dask
import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
dask_cuda = pytest.importorskip("dask_cuda")
da = pytest.importorskip("dask.array")

from dask import delayed  # noqa: E402
from distributed import Client  # noqa: E402

from .kernels import spin_fill, spin_scale  # noqa: E402

pytestmark = pytest.mark.gpu

# The worker process unpickles the helpers below without importing this module.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def worker_report(dask_worker):
    """What the plugin did on this worker (runs there)."""
    plugin = dask_worker.plugins.get("gpustreams")
    if plugin is None:
        return None
    runtime = plugin.runtime
    return {
        "backend": runtime.backend.name if runtime is not None else None,
        "streams": runtime.pool.n_streams if runtime is not None else None,
        "tasks_recorded": sum(s.seq for s in runtime.pool.slots) if runtime is not None else 0,
        "data": type(dask_worker.data).__name__,
        "spill_hooks": len(plugin.egress.evicting),
        "failures": len(plugin.failures),
    }


def current_stream_ptr():
    return int(cupy.cuda.get_current_stream().ptr)


def stacked_sum(*arrays):
    return cupy.stack(arrays).sum(axis=0)


def cupy_allocator():
    """CuPy's current allocator on this worker (RMM's when dask-cuda set it), as text."""
    return repr(cupy.cuda.get_allocator())


@pytest.fixture(scope="module", params=["cupy-pool", "rmm-pool"])
def client(request):
    """A dask-cuda worker with CuPy's memory pool, or with an RMM pool as CuPy's allocator."""
    rmm = {}
    if request.param == "rmm-pool":
        pytest.importorskip("rmm")
        rmm = {"rmm_pool_size": "2GB", "rmm_allocator_external_lib_list": ["cupy"]}
    with (
        dask.config.set({"gpustreams.backend": "cupy", "gpustreams.streams": 8}),
        dask_cuda.LocalCUDACluster(
            n_workers=1, preload=["dask_gpustreams"], dashboard_address=":0", **rmm
        ) as cluster,
        Client(cluster) as c,
    ):
        allocator = next(iter(c.run(cupy_allocator).values()))
        assert ("rmm" in allocator) == bool(rmm), allocator
        yield c
        print("worker report:", c.run(worker_report))


def test_plugin_installed_by_preload(client):
    assert [r is not None for r in client.run(worker_report).values()] == [True]
    ptr = client.submit(current_stream_ptr, pure=False).result()
    assert ptr not in (0, 1, 2), "the task ran on a default stream, not a pool stream"
    report = next(iter(client.run(worker_report).values()))
    assert report["backend"] == "cupy"


def test_dask_array_of_cupy_chunks_equals_numpy(client):
    rng = np.random.default_rng(0)
    host = rng.standard_normal((2048, 2048))
    x = da.from_array(host, chunks=512).map_blocks(cupy.asarray)
    y = x * 2.0 + 1.0  # elementwise
    z = y @ y.T  # matmul (cuBLAS on pool streams)
    total = z.sum(axis=0)  # reduction
    y_dev, z_sum, t = dask.compute(y, z.sum(), total)
    expected_y = host * 2.0 + 1.0
    expected_z = expected_y @ expected_y.T
    np.testing.assert_array_equal(cupy.asnumpy(y_dev), expected_y)
    np.testing.assert_allclose(float(z_sum), expected_z.sum(), rtol=1e-9)
    np.testing.assert_allclose(cupy.asnumpy(t), expected_z.sum(axis=0), rtol=1e-9)
    back = (y.map_blocks(cupy.asnumpy)).compute()
    assert isinstance(back, np.ndarray)
    np.testing.assert_array_equal(back, expected_y)


def test_delayed_pipeline_of_cupy_kernels_equals_numpy(client):
    n = 1 << 16
    leaves = [delayed(spin_fill)(n, float(i), 2.0) for i in range(16)]  # 2 ms kernels
    scaled = [delayed(spin_scale)(leaf, 3.0, 2.0) for leaf in leaves]
    summed = delayed(stacked_sum)(*scaled)
    result = delayed(cupy.asnumpy)(summed * 0.5 + delayed(cupy.ones)(n))
    for _ in range(3):
        got = result.compute()
        np.testing.assert_array_equal(got, np.full(n, 3.0 * sum(range(16)) * 0.5 + 1.0))
    report = next(iter(client.run(worker_report).values()))
    assert report["tasks_recorded"] >= 3 * 34
    assert report["failures"] == 0


def test_one_plugin_object_given_to_two_in_process_workers_runs_each_on_its_streams():
    """``LocalCluster(processes=False, plugins={plugin})`` hands one object to both workers:
    each runs its tasks on pool streams of its own runtime, and a sum across the workers of
    2 ms kernels is exact."""
    from distributed import LocalCluster

    from dask_gpustreams import StreamsPlugin

    plugin = StreamsPlugin(backend="cupy", streams=4)
    n = 1 << 16
    with (
        LocalCluster(
            n_workers=2,
            threads_per_worker=1,
            processes=False,
            dashboard_address=":0",
            plugins={plugin},
        ) as cluster,
        Client(cluster) as c,
    ):
        workers = [w.address for w in cluster.workers.values()]
        plugins = [w.plugins["gpustreams"] for w in cluster.workers.values()]
        assert plugins[0] is not plugins[1]
        for w in workers:
            ptr = c.submit(current_stream_ptr, pure=False, workers=[w]).result()
            assert ptr not in (0, 1, 2), f"a task of {w} ran on a default stream"
        xs = [
            c.submit(spin_fill, n, float(i + 1), 2.0, pure=False, workers=[w])
            for i, w in enumerate(workers)
        ]
        sums = [c.submit(stacked_sum, *xs, pure=False, workers=[w]) for w in workers]
        got = c.gather([c.submit(cupy.asnumpy, s, pure=False) for s in sums])
        for g in got:
            np.testing.assert_array_equal(g, np.full(n, 3.0))
        assert all(p.runtime is not None and p.runtime.backend.name == "cupy" for p in plugins)
