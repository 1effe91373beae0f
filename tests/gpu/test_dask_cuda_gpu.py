"""dask-cuda deployments on real GPUs: spilling, fetches between GPUs, ``dask cuda worker``.

Spilling: dask-cuda's ``DeviceHostFile`` serializes a result to host memory
as soon as the device limit is exceeded, on the worker's event loop, with the
loop thread's default stream. The producers here spin 30 ms before writing
their result, so a copy that does not wait for the key's event reads memory
the kernel has not written yet (the tests check that some spills did start
while their kernel ran). With the legacy default stream the copy is ordered
behind the (blocking) pool streams anyway; with a per-thread default stream
(``CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1``, how Dask users get concurrency
today) only the plugin's per-key wait orders it, which the control test
shows by removing that wait. Consumers read their unspilled input at once.

Fetches between two GPUs' workers (where two are visible) go through the
producer's ``get_data`` on its event loop, in the same way: with the
per-thread default stream only the plugin's per-key wait orders them.
``GPUSTREAMS_TEST_PROTOCOL=ucx`` runs these two over UCX (``distributed-ucxx``):
there its ``write`` synchronizes the whole device before sending (ucxx#589), so
the control test without the wait is expected to find every fetch exact.
"""

import os
import sys

import cloudpickle
import dask
import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
dask_cuda = pytest.importorskip("dask_cuda")

from distributed import Client, wait  # noqa: E402

from .kernels import spin_fill, spin_scale  # noqa: E402

pytestmark = pytest.mark.gpu

cloudpickle.register_pickle_by_value(sys.modules[__name__])

N = 1 << 20  # float64: 8 MiB per result
PROTOCOL = os.environ.get("GPUSTREAMS_TEST_PROTOCOL") or None  # fetches across GPUs only
PRODUCERS = 8
DEVICE_LIMIT = 20 * 2**20  # two results fit on the device; the others are spilled


def current_stream_ptr():
    """CuPy's stream on the calling thread: without one set, 0 (legacy) or 2 (per-thread)."""
    return int(cupy.cuda.get_current_stream().ptr)


def spilled_keys(dask_worker):
    return len(dask_worker.data.host)


def remove_spill_wait(dask_worker):
    plugin = dask_worker.plugins["gpustreams"]
    for lru in plugin.egress.evicting:
        lru.on_evict.remove(plugin.egress.before_spill)


def count_early_spills(dask_worker):
    """Put a counter before the spill wait: spills of keys whose work was still running."""
    plugin = dask_worker.plugins["gpustreams"]
    wait_then_spill = plugin.egress.before_spill
    dask_worker.early_spills = 0

    def counted(key, value):
        records = plugin.provenance.sources((key,))
        if any(not plugin.runtime.backend.done(r.event) for r in records):
            dask_worker.early_spills += 1
        wait_then_spill(key, value)

    for lru in plugin.egress.evicting:
        lru.on_evict[lru.on_evict.index(wait_then_spill)] = counted


def early_spills(dask_worker):
    return dask_worker.early_spills


def has_plugin(dask_worker):
    return "gpustreams" in dask_worker.plugins


def spill_round_trip(monkeypatch, ptds: str, spill_wait: bool) -> tuple[list, list]:
    """Producers spilled while their kernels run, then read back: (produced, scaled by 2)."""
    monkeypatch.setenv("CUPY_CUDA_PER_THREAD_DEFAULT_STREAM", ptds)  # the worker inherits it
    with (
        dask.config.set({"gpustreams.backend": "cupy", "gpustreams.streams": 4}),
        dask_cuda.LocalCUDACluster(
            n_workers=1,
            device_memory_limit=DEVICE_LIMIT,
            preload=["dask_gpustreams"],
            dashboard_address=":0",
        ) as cluster,
        Client(cluster) as client,
    ):
        assert list(client.run(current_stream_ptr).values()) == [2 if ptds == "1" else 0]
        client.run(count_early_spills if spill_wait else remove_spill_wait)
        xs = [client.submit(spin_fill, N, 100.0 + i, 30.0, pure=False) for i in range(PRODUCERS)]
        wait(xs)
        assert list(client.run(spilled_keys).values())[0] >= PRODUCERS - 2
        if spill_wait:  # the test shows something only if spills raced running kernels
            assert list(client.run(early_spills).values())[0] >= 1
        # Read at once (no spin): the unspill copy must be ordered before the kernel too.
        ys = [client.submit(spin_scale, x, 2.0, 0.0, pure=False) for x in xs]
        return [cupy.asnumpy(x) for x in client.gather(xs)], [
            cupy.asnumpy(y) for y in client.gather(ys)
        ]


@pytest.mark.parametrize("ptds", ["0", "1"], ids=["legacy-stream", "per-thread-stream"])
def test_device_host_file_spills_are_exact(monkeypatch, ptds):
    produced, scaled = spill_round_trip(monkeypatch, ptds, spill_wait=True)
    for i in range(PRODUCERS):
        np.testing.assert_array_equal(produced[i], np.full(N, 100.0 + i))
        np.testing.assert_array_equal(scaled[i], np.full(N, 2 * (100.0 + i)))


def test_per_thread_stream_spills_need_the_spill_wait(monkeypatch):
    produced, _ = spill_round_trip(monkeypatch, "1", spill_wait=False)
    wrong = [i for i in range(PRODUCERS) if not np.array_equal(produced[i], np.full(N, 100.0 + i))]
    assert wrong, "every spill was exact without the per-key wait: the test shows nothing"


def remove_egress_wait(dask_worker):
    dask_worker.plugins["gpustreams"].egress.uninstall()


def fetched_across_gpus(monkeypatch, egress_wait: bool) -> list:
    """Producers on one GPU's worker, consumers on the other's: what the consumers read."""
    monkeypatch.setenv("CUPY_CUDA_PER_THREAD_DEFAULT_STREAM", "1")
    with (
        dask.config.set({"gpustreams.backend": "cupy", "gpustreams.streams": 4}),
        dask_cuda.LocalCUDACluster(
            n_workers=2, preload=["dask_gpustreams"], dashboard_address=":0", protocol=PROTOCOL
        ) as cluster,
        Client(cluster) as client,
    ):
        a, b = sorted(client.scheduler_info()["workers"])
        assert set(client.run(current_stream_ptr).values()) == {2}  # per-thread streams
        if not egress_wait:
            client.run(remove_egress_wait, workers=[a])
        xs = [
            client.submit(spin_fill, N, 100.0 + i, 30.0, workers=[a], pure=False)
            for i in range(PRODUCERS)
        ]
        ys = [client.submit(spin_scale, x, 2.0, 0.0, workers=[b], pure=False) for x in xs]
        return [cupy.asnumpy(y) for y in client.gather(ys)]


def gpu_count() -> int:
    try:
        return cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError:  # no driver or no device: skipped anyway
        return 0


two_gpus = pytest.mark.skipif(gpu_count() < 2, reason="needs two GPUs (one worker each)")


@two_gpus
def test_fetches_across_gpus_are_exact(monkeypatch):
    scaled = fetched_across_gpus(monkeypatch, egress_wait=True)
    for i in range(PRODUCERS):
        np.testing.assert_array_equal(scaled[i], np.full(N, 2 * (100.0 + i)))


@two_gpus
def test_fetches_across_gpus_need_the_egress_wait(monkeypatch):
    scaled = fetched_across_gpus(monkeypatch, egress_wait=False)
    wrong = [i for i in range(PRODUCERS) if not np.array_equal(scaled[i], 2 * (100.0 + i))]
    assert wrong, "every fetch was exact without the per-key wait: the test shows nothing"


@pytest.fixture
def cli_env():
    """Workers started from the CLI use the cupy backend."""
    from tests.conftest import CHILD_PATH

    return {
        "PYTHONPATH": CHILD_PATH,
        "DASK_GPUSTREAMS__BACKEND": "cupy",
        "DASK_GPUSTREAMS__STREAMS": "8",
    }


def test_dask_cuda_worker_preload(dask_cli):
    dask_cli("scheduler", "--no-dashboard", "--port", "0")
    scheduler_file = dask_cli("cuda", "worker", "--no-dashboard", "--preload", "dask_gpustreams")
    with Client(scheduler_file=scheduler_file, timeout=30) as client:
        client.wait_for_workers(1, timeout=60)
        installed = list(client.run(has_plugin).values())  # one worker per visible GPU
        assert installed and all(installed)
        assert client.submit(current_stream_ptr, pure=False).result() not in (0, 1, 2)
        n = 1 << 16
        leaves = [client.submit(spin_fill, n, float(i), 5.0, pure=False) for i in range(8)]
        scaled = [client.submit(spin_scale, x, 3.0, 5.0, pure=False) for x in leaves]
        for i, y in enumerate(client.gather(scaled)):
            np.testing.assert_array_equal(cupy.asnumpy(y), np.full(n, 3.0 * i))


def forget_unpooled(dask_worker):
    """The control: the plugin forgets the keys made before its setup (no reader waits)."""
    plugin = dask_worker.plugins["gpustreams"]
    plugin.provenance.clear()  # nothing else is held yet, right after the setup


def read_after_registration(monkeypatch, settle: bool) -> tuple[list, list]:
    """Producers run with no plugin set up, on the worker thread's per-thread default stream;
    the plugin is registered while their kernels spin, and consumers on its pool streams,
    and a gather, read the results at once: (produced, scaled by 2)."""
    from dask_gpustreams import StreamsPlugin

    monkeypatch.setenv("CUPY_CUDA_PER_THREAD_DEFAULT_STREAM", "1")
    with (
        dask.config.set({"gpustreams.enabled": False}),
        dask_cuda.LocalCUDACluster(n_workers=1, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        assert list(client.run(has_plugin).values()) == [False]
        assert list(client.run(current_stream_ptr).values()) == [2]
        xs = [client.submit(spin_fill, N, 100.0 + i, 100.0, pure=False) for i in range(PRODUCERS)]
        wait(xs)  # returned: their kernels spin for 0.8 s in all, one after the other
        client.register_plugin(StreamsPlugin(backend="cupy", streams=4))
        if not settle:
            client.run(forget_unpooled)
        ys = [client.submit(spin_scale, x, 2.0, 0.0, pure=False) for x in xs]
        scaled = [cupy.asnumpy(y) for y in client.gather(ys)]
        return [cupy.asnumpy(x) for x in client.gather(xs)], scaled


def test_results_made_before_the_plugin_is_registered_are_read_whole(monkeypatch):
    produced, scaled = read_after_registration(monkeypatch, settle=True)
    for i in range(PRODUCERS):
        np.testing.assert_array_equal(produced[i], np.full(N, 100.0 + i))
        np.testing.assert_array_equal(scaled[i], np.full(N, 2 * (100.0 + i)))


def test_results_made_before_the_plugin_is_registered_need_its_wait(monkeypatch):
    produced, scaled = read_after_registration(monkeypatch, settle=False)
    wrong = [
        i
        for i in range(PRODUCERS)
        if not np.array_equal(produced[i], np.full(N, 100.0 + i))
        or not np.array_equal(scaled[i], np.full(N, 2 * (100.0 + i)))
    ]
    assert wrong, "every read was exact without the wait: the test shows nothing"
