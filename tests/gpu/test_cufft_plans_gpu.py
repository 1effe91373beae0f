"""The per-(thread, stream) cuFFT plan caches (``backends.cufft_plans``) on a real GPU."""

import contextlib
import gc
import threading

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from cupy.fft import _cache  # noqa: E402

from dask_gpustreams.backends import cufft_plans  # noqa: E402

#: Not a power of two: each plan has a work area.
SHAPE = (1000, 1000)


def roundtrip(x):
    return cupy.fft.ifft2(cupy.fft.fft2(x)).real


@contextlib.contextmanager
def full_collections():
    """Count the full (generation 2) collections started while open; automatic ones off."""
    started = []

    def callback(phase, info):
        if phase == "start" and info["generation"] == 2:
            started.append(threading.current_thread().name)

    enabled = gc.isenabled()
    gc.disable()
    gc.callbacks.append(callback)
    try:
        yield started
    finally:
        gc.callbacks.remove(callback)
        if enabled:
            gc.enable()


def in_a_thread(fn):
    """Run ``fn`` in a new thread and join it (its thread-local state ends before the join)."""
    errors = []

    def run():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            errors.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]


def test_a_thread_ends_its_plan_caches_without_a_full_collection():
    """A thread that ran FFTs on 8 streams through its own caches ends with at most one
    ``gc.collect()``: that of its CuPy cache, made to read its limits, as any thread running
    a CuPy FFT makes one. Each stream's FFT came out exact and left its plans cached there."""
    x = cupy.asarray(np.random.default_rng(5).standard_normal(SHAPE))
    want = cupy.asnumpy(roundtrip(x))
    streams = [cupy.cuda.Stream() for _ in range(8)]
    got, cached = [], []

    def launch():
        stop = cufft_plans.use()
        try:
            for stream in streams:
                with stream:
                    got.append(roundtrip(x))
                    cached.append(cupy.fft._fft.get_plan_cache().get_curr_size())
        finally:
            stop()

    with full_collections() as started:
        in_a_thread(launch)
    cupy.cuda.Device().synchronize()
    assert len(started) <= 1, started
    assert cached[0] >= 1 and cached == cached[:1] * 8  # the same plans on each stream
    for g in got:
        np.testing.assert_allclose(cupy.asnumpy(g), want, rtol=0, atol=1e-12)


def test_cupy_plan_caches_end_with_a_full_collection_control():
    """The test above is meaningful: CuPy's own ``PlanCache``, one per stream as before,
    runs a full collection each when the thread that held them ends (8 streams: 8)."""
    from cupyx.scipy import fftpack

    x = cupy.asarray(np.random.default_rng(6).standard_normal(SHAPE), dtype=cupy.complex128)
    held = threading.local()

    def launch():
        held.caches = []
        for i in range(8):
            cache = _cache.PlanCache(16, -1, cupy.cuda.runtime.getDevice())
            cache[("plan", i)] = fftpack.get_fft_plan(x, axes=(0, 1))
            held.caches.append(cache)

    with full_collections() as started:
        in_a_thread(launch)
    assert len(started) > 1, started


def test_a_stream_keeps_at_most_the_cache_size_of_plans():
    """The thread's CuPy cache size (2 here) bounds each stream's cache: three shapes,
    then the first again, keep two plans, and the FFTs stay exact."""
    rng = np.random.default_rng(7)
    xs = [cupy.asarray(rng.standard_normal((n, n))) for n in (96, 100, 104)]
    xs.append(xs[0])
    wants = [np.fft.fft2(cupy.asnumpy(x)) for x in xs]
    sizes = []

    def launch():
        own = cupy.fft.config.get_plan_cache()
        own.set_size(2)
        stop = cufft_plans.use()
        try:
            with cupy.cuda.Stream():
                for x, want in zip(xs, wants, strict=True):
                    np.testing.assert_allclose(cupy.asnumpy(cupy.fft.fft2(x)), want, atol=1e-9)
                    sizes.append(cupy.fft._fft.get_plan_cache().get_curr_size())
        finally:
            stop()

    in_a_thread(launch)
    assert sizes == [1, 2, 2, 2]
