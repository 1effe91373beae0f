"""Copy streams and pinned staging on the simulated device: exact results, no reuse in flight."""

import gc
import logging
import re
import threading
import time
import weakref

import dask
import dask.array as da
import numpy as np
import pytest
from dask import delayed

from dask_gpustreams import StreamsConfig, get_runtime, sim
from dask_gpustreams import config as config_module
from dask_gpustreams.backends.sim import SimBackend
from dask_gpustreams.runtime.pinned import PinnedPool
from dask_gpustreams.transfers import to_device, to_host


def slow_kernel(seed: int, scale: float):
    """A kernel that sleeps a random few ms, then writes ``x * scale``."""
    rng = np.random.default_rng(seed)

    def kernel(x):
        out = sim.empty(x.shape, x.dtype)
        delay = rng.uniform(0, 0.004)

        def body(o, v):
            time.sleep(delay)
            np.multiply(v, scale, out=o)

        sim.launch(body, out, x)
        return out

    return kernel


def config(**extra):
    return {
        "gpustreams.enabled": True,
        "gpustreams.backend": "sim",
        "gpustreams.streams": 4,
        **extra,
    }


@pytest.mark.parametrize("upload, download", [("sim", "sim"), ("helpers", "helpers")])
def test_pipeline_of_many_chunks_is_exact_with_a_small_pinned_pool(upload, download):
    host = np.random.default_rng(1).standard_normal((48, 4096))
    up = sim.asarray if upload == "sim" else to_device
    down = sim.asnumpy if download == "sim" else to_host
    meta = np.empty((0, 0))
    x = (
        da.from_array(host, chunks=(1, 4096))
        .map_blocks(up, meta=meta)
        .map_blocks(slow_kernel(2, 3.0), meta=meta)
        .map_blocks(down, meta=meta)
    )
    # 128 KiB of staging for 48 chunks of 32 KiB: buffers are reused while copies are in flight.
    with dask.config.set(config(**{"gpustreams.pinned-pool-size": 1 << 20})):
        for _ in range(5):
            np.testing.assert_array_equal(x.compute(), host * 3.0)
        pinned = get_runtime().transfers.pinned
        assert pinned.total_bytes() <= 1 << 20


def test_existing_transfer_calls_are_rewritten_onto_copy_streams():
    host = np.arange(8 * 1000, dtype=np.float64).reshape(8, 1000)
    meta = np.empty((0, 0))
    x = (
        da.from_array(host, chunks=(1, 1000))
        .map_blocks(sim.asarray, meta=meta)
        .map_blocks(slow_kernel(3, 2.0), meta=meta)
        .map_blocks(sim.asnumpy, meta=meta)
    )
    with dask.config.set(config()):
        runtime = get_runtime()
        before = [s.seq for s in (*runtime.transfers.h2d.slots, *runtime.transfers.d2h.slots)]
        result = x.compute()
        after = [s.seq for s in (*runtime.transfers.h2d.slots, *runtime.transfers.d2h.slots)]
    np.testing.assert_array_equal(result, host * 2.0)
    assert [b - a for a, b in zip(before, after, strict=True)] == [8, 8]


def test_helpers_outside_a_task_order_with_the_current_stream():
    with dask.config.set({"gpustreams.backend": "sim"}):
        for i in range(20):
            x = to_device(np.full(1000, float(i)))
            y = sim.empty(1000)
            sim.launch(lambda o, v: np.add(v, 1, out=o), y, x)
            del x  # freed to the current stream's pool while the kernel may still read it
            np.testing.assert_array_equal(to_host(y), np.full(1000, i + 1.0))


def test_upload_is_staged_so_the_caller_may_reuse_its_host_buffer():
    with dask.config.set({"gpustreams.backend": "sim"}):
        gate = threading.Event()
        stream = sim.get_device().current_stream()
        stream.launch(lambda: gate.wait(), (), {}, None)  # hold the device back
        host = np.ones(1000)
        x = to_device(host)
        host[:] = -1
        gate.set()
        np.testing.assert_array_equal(to_host(x), np.ones(1000))


def test_pinned_buffer_is_not_reused_while_its_copy_is_in_flight():
    backend = SimBackend()
    pool = PinnedPool(backend, limit=1 << 16)
    stream = backend.create_stream()
    gate = threading.Event()
    stream.launch(lambda: gate.wait(), (), {}, None)
    buffer = pool.acquire(1000)
    copied = backend.create_event()
    backend.record(copied, stream)
    pool.release(buffer, copied)

    got = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire(1000)))
    waiter.start()
    waiter.join(timeout=0.2)
    assert waiter.is_alive() and not got  # the only buffer is still in flight: acquire waits
    gate.set()
    waiter.join()
    assert got[0] is buffer and copied.done


def test_copy_larger_than_the_pinned_pool_is_a_clear_error():
    cfg = {"gpustreams.backend": "sim", "gpustreams.pinned-pool-size": "1 MiB"}
    message = r"does not fit gpustreams.pinned-pool-size=1.00 MiB"
    with dask.config.set(cfg), pytest.raises(ValueError, match=message):
        to_device(np.zeros(2**18))  # 2 MiB


def test_failed_pinned_allocation_is_a_clear_error(monkeypatch):
    def refuse(self, nbytes):
        raise RuntimeError("cudaErrorMemoryAllocation: out of memory")

    monkeypatch.setattr(SimBackend, "alloc_pinned", refuse)
    rt = get_runtime(StreamsConfig(backend="sim", pinned_pool_size=3 << 20))
    with pytest.raises(MemoryError, match=r"could not allocate .* pinned host memory .* lower"):
        rt.transfers.to_device(np.zeros(1000), rt.backend.current_stream())


@pytest.mark.parametrize(
    "value, message",
    [
        (0, r"gpustreams.copy-streams=0 is invalid: allowed values are an int >= 1"),
        ("2", r"gpustreams.copy-streams='2' is invalid"),
    ],
)
def test_invalid_copy_streams(value, message):
    with (
        dask.config.set({"gpustreams.copy-streams": value}),
        pytest.raises(ValueError, match=message),
    ):
        StreamsConfig.from_dask_config()


def test_pinned_pool_size_auto_is_a_share_of_host_memory_per_device(monkeypatch):
    monkeypatch.setattr(config_module, "host_memory", lambda: 64 << 30)
    assert dask.config.get("gpustreams.pinned-pool-size") == "auto"
    assert StreamsConfig.from_dask_config(backend="sim").pinned_pool_size is None
    assert config_module.auto_pinned_pool_size(1) == 4 << 30  # 1/16 of 64 GiB
    assert config_module.auto_pinned_pool_size(8) == 512 << 20  # split among a node's 8 GPUs
    rt = get_runtime(StreamsConfig(backend="sim", streams=2))
    assert rt.transfers.pinned.limit == 4 << 30  # the simulated device counts as one
    with dask.config.set({"gpustreams.pinned-pool-size": "256 MiB"}):
        rt = get_runtime(StreamsConfig.from_dask_config(backend="sim"))
    assert rt.transfers.pinned.limit == 256 << 20


@pytest.mark.parametrize("value, expected", [(" AUTO ", None), ("1 GiB", 1 << 30), (None, None)])
def test_pinned_pool_size_strings_are_parsed_by_the_dataclass(value, expected):
    assert StreamsConfig(pinned_pool_size=value).pinned_pool_size == expected
    assert StreamsConfig(pinned_pool_size=value) == StreamsConfig(pinned_pool_size=expected)


def test_host_memory_is_within_the_machine():
    import psutil

    assert 0 < config_module.host_memory() <= psutil.virtual_memory().total


@pytest.mark.parametrize("value", ["lots", 1000, True, None, "", "-2 GiB", "1 KiB"])
def test_invalid_pinned_pool_size(value):
    message = (
        rf"gpustreams.pinned-pool-size={re.escape(repr(value))} is invalid: "
        "allowed values are 'auto' or a byte"
    )
    with (
        dask.config.set({"gpustreams.pinned-pool-size": value}),
        pytest.raises(ValueError, match=message),
    ):
        StreamsConfig.from_dask_config()


def test_new_settings_free_the_idle_staging_of_the_old_ones():
    old = get_runtime(StreamsConfig(backend="sim", streams=2, pinned_pool_size=8 << 20))
    host = np.arange(1 << 16, dtype=np.float64)
    stream = old.backend.current_stream()
    old.transfers.to_device(host, stream)
    stream.synchronize()
    assert old.transfers.pinned.total_bytes() == host.nbytes  # cached for the next copy
    get_runtime(StreamsConfig(backend="sim", streams=3, pinned_pool_size=8 << 20))
    assert old.transfers.pinned.total_bytes() == 0
    again = old.transfers.to_device(host, stream)  # the old runtime still works
    np.testing.assert_array_equal(again.get(), host)


def test_pinned_pool_is_usable_after_a_failed_upload(monkeypatch):
    rt = get_runtime(StreamsConfig(backend="sim", pinned_pool_size=1 << 20))
    stream = rt.backend.current_stream()
    real_empty = SimBackend.empty
    failures = iter(range(20))

    def flaky_empty(self, shape, dtype):
        if next(failures, None) is not None:
            raise MemoryError("out of device memory")
        return real_empty(self, shape, dtype)

    monkeypatch.setattr(SimBackend, "empty", flaky_empty)
    for _ in range(20):  # more failures than the pool has buffers of this size
        with pytest.raises(MemoryError, match="out of device memory"):
            rt.transfers.to_device(np.ones(2**16), stream)
    x = rt.transfers.to_device(np.ones(2**16), stream)
    np.testing.assert_array_equal(rt.transfers.to_host(x, stream), np.ones(2**16))


def test_calls_with_more_arguments_keep_their_meaning(gpustreams):
    host = np.arange(6, dtype=np.float64)
    with gpustreams(streams=2):
        x = dask.delayed(sim.asarray)(host, "float32")
        y = dask.delayed(sim.asnumpy)(x)
        result = y.compute()
    assert result.dtype == np.float32
    np.testing.assert_array_equal(result, host.astype(np.float32))


def test_to_device_converts_device_arrays_between_dtypes():
    with dask.config.set({"gpustreams.backend": "sim"}):  # also where a GPU is visible
        x = to_device(np.arange(4, dtype=np.int64))
        y = to_device(x, "float32")
        assert to_device(x) is x
        host = to_host(y)
    assert y.dtype == np.float32
    np.testing.assert_array_equal(host, np.arange(4, dtype=np.float32))


def test_several_copy_streams_are_all_used():
    rt = get_runtime(StreamsConfig(backend="sim", copy_streams=2))
    stream = rt.backend.current_stream()
    for i in range(8):
        x = rt.transfers.to_device(np.full(10, float(i)), stream)
        assert rt.transfers.to_host(x, stream)[0] == i
    assert [s.seq for s in rt.transfers.h2d.slots] == [4, 4]
    assert [s.seq for s in rt.transfers.d2h.slots] == [4, 4]


def test_download_is_counted_as_taken_pinned_memory_while_alive():
    rt = get_runtime(StreamsConfig(backend="sim", pinned_pool_size=1 << 20))
    stream = rt.backend.current_stream()
    pinned = rt.transfers.pinned
    result = rt.transfers.to_host(rt.transfers.to_device(np.arange(1000.0), stream), stream)
    np.testing.assert_array_equal(result, np.arange(1000.0))
    assert pinned.taken_bytes() == 8000
    view = result[::2]
    del result
    gc.collect()
    assert pinned.taken_bytes() == 8000  # a view keeps the buffer alive
    del view
    gc.collect()
    assert pinned.taken_bytes() == 0


def test_results_held_beyond_the_allowance_are_staged_exactly():
    host = np.random.default_rng(4).standard_normal((16, 2**16))  # chunks of 512 KiB
    meta = np.empty((0, 0))
    x = (
        da.from_array(host, chunks=(1, 2**16))
        .map_blocks(sim.asarray, meta=meta)
        .map_blocks(slow_kernel(5, 3.0), meta=meta)
        .map_blocks(sim.asnumpy, meta=meta)
    )
    with dask.config.set(config(**{"gpustreams.pinned-pool-size": 1 << 20})):
        held = x.persist()  # holds all 16 results: 2 pinned, 14 staged
        rt = get_runtime()
        pinned = rt.transfers.pinned
        assert pinned.taken_bytes() == 1 << 20
        stream = rt.backend.current_stream()
        up = rt.transfers.to_device(np.ones(2**17), stream)  # a chunk as large as the pool
        np.testing.assert_array_equal(rt.transfers.to_host(up, stream), np.ones(2**17))
        np.testing.assert_array_equal(held.compute(), host * 3.0)
    del held
    gc.collect()
    assert pinned.taken_bytes() == 0


def test_results_are_never_overwritten_by_later_downloads():
    rt = get_runtime(StreamsConfig(backend="sim", pinned_pool_size=1 << 20))
    stream = rt.backend.current_stream()
    pinned = rt.transfers.pinned
    n = 2**15  # 256 KiB of float64: four results fill the allowance

    def download(value):
        return rt.transfers.to_host(rt.transfers.to_device(np.full(n, value), stream), stream)

    first = [download(i) for i in range(2)]
    later = [download(i) for i in range(2, 40)]  # two more pinned, then staged
    assert pinned.taken_bytes() == 4 * n * 8
    for i, result in enumerate(later, start=2):
        np.testing.assert_array_equal(result, np.full(n, float(i)))
    del later
    gc.collect()
    for i in range(40, 80):  # pinned, and freed at once
        np.testing.assert_array_equal(download(i), np.full(n, float(i)))
    for i, result in enumerate(first):
        np.testing.assert_array_equal(result, np.full(n, float(i)))
    assert pinned.taken_bytes() == 2 * n * 8


def test_failed_pinned_result_allocation_falls_back_to_staging(monkeypatch, caplog):
    rt = get_runtime(StreamsConfig(backend="sim", pinned_pool_size=1 << 20))
    stream = rt.backend.current_stream()
    x = rt.transfers.to_device(np.arange(1000.0), stream)
    real_alloc = SimBackend.alloc_pinned
    refusals = iter([RuntimeError("cudaErrorMemoryAllocation: out of memory")])

    def refuse_once(self, nbytes):
        error = next(refusals, None)
        if error is not None:
            raise error
        return real_alloc(self, nbytes)

    monkeypatch.setattr(SimBackend, "alloc_pinned", refuse_once)
    with caplog.at_level(logging.DEBUG, logger="dask_gpustreams"):
        result = rt.transfers.to_host(x, stream)
    np.testing.assert_array_equal(result, np.arange(1000.0))
    assert rt.transfers.pinned.taken_bytes() == 0
    assert "no pinned buffer of 7.81 kiB" in caplog.text


@pytest.mark.parametrize("shape, dtype", [((0,), np.float64), ((3, 0), np.complex64)])
def test_zero_size_download(shape, dtype):
    rt = get_runtime(StreamsConfig(backend="sim"))
    stream = rt.backend.current_stream()
    result = rt.transfers.to_host(rt.transfers.to_device(np.empty(shape, dtype), stream), stream)
    assert result.shape == shape and result.dtype == dtype


def test_downloaded_device_array_is_not_kept_after_the_compute(gpustreams):
    """A download's copy stream does not keep the device array once the copy is done."""
    refs = []

    def make():
        x = sim.asarray(np.arange(1000.0))
        refs.append(weakref.ref(x))
        return x

    with gpustreams(streams=2):
        got = delayed(to_host)(delayed(make)()).compute()
        got_launcher = dask.compute(delayed(to_host)(delayed(make)()), scheduler="gpustreams")[0]
    np.testing.assert_array_equal(got, np.arange(1000.0))
    np.testing.assert_array_equal(got_launcher, np.arange(1000.0))
    assert [r() for r in refs] == [None, None]


def _boom(out):
    raise ValueError("boom")


@pytest.mark.parametrize("pinned_results", [True, False])
def test_download_skipped_after_a_failure_reported_elsewhere_raises(monkeypatch, pinned_results):
    """A copy stream that a failure reached skips its copies until a sync reports the error.

    When another sync reports it first (the fuzzer's distributed route: the plugin clears
    stream errors after a failure), the download's own sync must still raise, not return
    the staging or result buffer's stale contents as data.
    """
    from dask_gpustreams.errors import KernelError
    from dask_gpustreams.runtime.transfers import Transfers

    backend = SimBackend()
    transfers = Transfers(backend, 1, 2**20)
    if not pinned_results:
        monkeypatch.setattr(transfers.pinned, "take", lambda nbytes: None)
    compute = backend.create_stream()
    with compute:
        x = sim.asarray(np.arange(8.0))
        compute.synchronize()
        sim.launch(_boom, sim.empty((1,)))  # the compute stream is in error from here
    reached, report = threading.Event(), threading.Event()
    copy_to_host = backend.copy_to_host

    def gated_copy(dst, src, stream):
        copy_to_host(dst, src, stream)  # skipped: the copy stream waited on the failure
        stream.enqueue(lambda _s: (reached.set(), report.wait(10)))

    monkeypatch.setattr(backend, "copy_to_host", gated_copy)
    outcome = {}

    def download():
        try:
            outcome["value"] = transfers.to_host(x, compute)
        except KernelError as e:
            outcome["error"] = e

    thread = threading.Thread(target=download)
    thread.start()
    assert reached.wait(10)
    with pytest.raises(KernelError):
        compute.synchronize()  # reported here, before the download's own sync
    report.set()
    thread.join(10)
    assert "value" not in outcome, f"a skipped copy returned {outcome.get('value')}"
    assert "boom" in str(outcome["error"])


def test_a_download_result_is_pinned_so_an_upload_of_it_reads_it_late():
    """A download that fits the allowance returns pinned memory (``PinnedPool.take``); CuPy
    uploads pinned memory without staging it, so the caller must not modify it until the
    upload's copy has run. The sim's backend pins it too, to show this as on a GPU."""
    rt = get_runtime(StreamsConfig(backend="sim", pinned_pool_size=1 << 20))
    stream = rt.backend.current_stream()
    result = rt.transfers.to_host(rt.transfers.to_device(np.ones(1000), stream), stream)
    other = sim.get_device().create_stream()
    gate = threading.Event()
    with other:
        sim.launch(lambda: gate.wait(5.0))
        again = sim.asarray(result)
    result[:] = 2.0
    gate.set()
    with other:
        np.testing.assert_array_equal(again.get(), np.full(1000, 2.0))
