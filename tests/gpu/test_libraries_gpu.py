"""CuPy's libraries on many streams: cuFFT plans, cuRAND generators, cudaMallocAsync.

Each test runs its graph through the launcher (``scheduler="gpustreams"``) and
the threaded route (``gpustreams.enabled``), with kernels of random length in
front of the library calls so that the calls of different tasks overlap on
the device in changing orders. The ``*_control`` tests show that the hazard
the safe path avoids is real; they skip, saying so, where it did not show.
"""

import threading

import dask
import dask.threaded
import numpy as np
import pytest
from dask import delayed

cupy = pytest.importorskip("cupy")
da = pytest.importorskip("dask.array")
cupyx_fftpack = pytest.importorskip("cupyx.scipy.fftpack")

from dask_gpustreams.runtime import StreamPool  # noqa: E402

from .kernels import spin_fill, spin_scale  # noqa: E402
from .test_launcher_gpu import check_plan_caches  # noqa: E402
from .test_runtime_gpu import N as HOLD_N  # noqa: E402
from .test_runtime_gpu import _freed_input_is_reused  # noqa: E402
from .test_runtime_gpu import runtime as two_stream_runtime  # noqa: E402

STREAMS = 8
BASE = {
    "gpustreams.backend": "cupy",
    "gpustreams.streams": STREAMS,
    "gpustreams.policy": "round-robin",
    "gpustreams.launch-ahead": "4 GiB",  # every task of a round in flight at once
}
ROUTES = {
    "launcher": (BASE, "gpustreams"),
    "threaded": ({**BASE, "gpustreams.enabled": True, "num_workers": STREAMS}, dask.threaded.get),
}


def compute(route, *collections, streams=STREAMS):
    """``dask.compute`` of ``collections`` through ``route`` on ``streams`` pool streams."""
    config, scheduler = ROUTES[route]
    with dask.config.set({**config, "gpustreams.streams": streams}):
        return dask.compute(*collections, scheduler=scheduler)


def plain(*collections):
    """The same with Dask alone: no stream runtime, one thread, CuPy's default stream."""
    with dask.config.set({"gpustreams.enabled": False}):
        return dask.compute(*collections, scheduler="sync")


def delay(ms):
    """A one-block kernel that spins ``ms`` on the current stream, before what follows it."""
    if ms > 0:
        spin_fill(1, 0.0, ms)


def jitter_ms(rng, n, high=0.5):
    """``n`` kernel lengths: 0 for about a third, else uniform in (0, ``high``) ms."""
    return rng.uniform(0, high, n) * (rng.random(n) < 0.7)


# --- cuFFT: one plan cache per thread, keyed without the stream (cupy#8079) -------------------

FFT_SHAPE = (1000, 1000)  # not a power of two: cuFFT needs a work area
TILES = 48
#: Relative error above which an FFT is wrong: float64 round-off is about 1e-13 here,
#: a work area overwritten by another FFT gives errors of order 1.
RACE = 1e-6


def jittered_fft2(x, ms):
    delay(ms)
    return cupy.fft.fft2(x)


def jittered_fft2_cached(x, ms):
    """``jittered_fft2``, and where it ran (see ``test_launcher_gpu.fft_roundtrip_cached``)."""
    out = jittered_fft2(x, ms)
    used = cupy.fft._fft.get_plan_cache()
    place = (threading.get_ident(), cupy.cuda.get_current_stream().ptr)
    return out, (place, id(used), used.get_curr_size(), id(cupy.fft.config.get_plan_cache()))


def fft_tiles(seed):
    rng = np.random.default_rng(seed)
    tiles = [cupy.asarray(rng.standard_normal(FFT_SHAPE)) for _ in range(TILES)]
    alone = [cupy.fft.fft2(t) for t in tiles]  # one at a time, on the default stream
    return rng, tiles, alone


def fft_graph(tiles, rng):
    lengths = jitter_ms(rng, len(tiles))
    return [delayed(jittered_fft2)(t, ms) for t, ms in zip(tiles, lengths, strict=True)]


def fft_errors(got, alone):
    pairs = zip(got, alone, strict=True)
    return [float(cupy.abs(g - a).max() / cupy.abs(a).max()) for g, a in pairs]


def work_area_bytes(x):
    """The work area of the cuFFT plan of ``fft2(x)`` (0: none to share)."""
    plan = cupyx_fftpack.get_fft_plan(x.astype(cupy.complex128), axes=(0, 1))
    return int(getattr(getattr(plan.work_area, "mem", None), "size", 0))


@pytest.mark.parametrize("route", ROUTES)
def test_same_shape_ffts_on_pool_streams_are_exact(route):
    """48 same-shape fft2 tasks on 8 streams, each behind a kernel of random length.

    The launcher runs them all from one thread, the threaded route from 8;
    every thread that launches on several streams caches plans of its own, one
    per stream (``isolate_thread``, ``backends.cufft_plans``), so no two running
    FFTs share a work area, and plans are still reused.
    """
    rng, tiles, alone = fft_tiles(11)
    work = work_area_bytes(tiles[0])
    own = cupy.fft.config.get_plan_cache()
    before = own.get_size(), own.get_curr_size()
    runs = []
    for _ in range(4):
        lengths = jitter_ms(rng, len(tiles))
        ffts = [delayed(jittered_fft2_cached)(t, ms) for t, ms in zip(tiles, lengths, strict=True)]
        got = compute(route, *ffts)
        errors = fft_errors([g for g, _ in got], alone)
        assert max(errors) < RACE, f"work area {work} B, errors {errors}"
        runs += [info for _, info in got]
    # The launcher's host threads end when idle: its own thread only; Dask's pool threads live.
    check_plan_caches(runs, threads={threading.get_ident()} if route == "launcher" else None)
    if route == "launcher":  # this thread launched: its own cache is as it was
        assert (own.get_size(), own.get_curr_size()) == before


def test_same_shape_ffts_race_with_the_plan_cache_on_control():
    """The test above is meaningful: with the isolation removed (the launching thread's
    plan cache left on), the same launcher graph gives wrong FFTs."""
    from unittest import mock

    from dask_gpustreams.backends.cupy import CupyBackend

    rng, tiles, alone = fft_tiles(12)
    work = work_area_bytes(tiles[0])
    if not work:
        pytest.skip(f"cuFFT plans {FFT_SHAPE} without a work area: nothing to share")
    cache = cupy.fft.config.get_plan_cache()
    size = cache.get_size()
    cache.set_size(16)
    wrong, rounds = 0, 8
    try:
        with mock.patch.object(CupyBackend, "isolate_thread", lambda self: lambda: None):
            for _ in range(rounds):
                got = compute("launcher", *fft_graph(tiles, rng))
                wrong += sum(e > RACE for e in fft_errors(got, alone))
    finally:
        cache.set_size(size)
    if not wrong:
        pytest.skip(
            f"no wrong FFT in {rounds} rounds of {TILES} on {STREAMS} streams sharing one "
            f"cached plan (work area {work} B)"
        )
    assert wrong > 0


# --- cuRAND: dask.array's random chunks each make their own generator, inside the task --------

RANDOM_SHAPE = (4096, 4096)
RANDOM_CHUNKS = (512, 512)


def _jitter_block(block, block_id=None):
    """``block`` itself, copied after a kernel of a length that varies over the blocks."""
    ms = 0.25 * ((block_id[0] * 5 + block_id[1] * 3) % 4)
    return spin_scale(block, 1.0, ms) if ms else block


def random_arrays(kind, seed):
    """Three arrays from one seeded dask.array generator of CuPy chunks."""
    if kind == "RandomState":
        rs = da.random.RandomState(seed, RandomState=cupy.random.RandomState)
        a = rs.standard_normal(RANDOM_SHAPE, chunks=RANDOM_CHUNKS)
        b = rs.random_sample(RANDOM_SHAPE, chunks=RANDOM_CHUNKS)
    else:
        rng = da.random.default_rng(cupy.random.default_rng(seed))
        a = rng.standard_normal(RANDOM_SHAPE, chunks=RANDOM_CHUNKS)
        b = rng.random(RANDOM_SHAPE, chunks=RANDOM_CHUNKS)
    slow_a = a.map_blocks(_jitter_block, dtype=a.dtype, meta=a._meta)
    return slow_a, b, slow_a * 2 + b.map_blocks(_jitter_block, dtype=b.dtype, meta=b._meta)


@pytest.mark.parametrize("kind", ["RandomState", "Generator"])
@pytest.mark.parametrize("route", ROUTES)
def test_dask_random_with_cupy_generators_equals_plain_dask(route, kind):
    """``da.random`` seeds one generator per chunk (``RandomState(state_data)``, or a
    spawned ``XORWOW``) inside the chunk's task, on its stream: no generator is
    shared, so the result equals plain Dask's bit for bit."""
    want = [cupy.asnumpy(x) for x in plain(*random_arrays(kind, 1234))]
    for _ in range(2):
        got = compute(route, *random_arrays(kind, 1234))
        assert all(isinstance(g, cupy.ndarray) for g in got)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(cupy.asnumpy(g), w)


def _equal_pairs(draws):
    """How many elements two different draws have equal at the same index, over all pairs."""
    return sum(
        int(cupy.count_nonzero(draws[i] == draws[j]))
        for i in range(len(draws))
        for j in range(i + 1, len(draws))
    )


@pytest.mark.parametrize("shared", ["Generator", "cupy.random"])
def test_one_generator_shared_by_tasks_on_many_streams_control(shared):
    """Why the guide says not to share a generator between tasks: a CuPy ``Generator``
    keeps its state in device memory, which each draw's kernel reads at its start and
    writes back at its end, on the caller's stream (``cupy/random/cupy_distributions.cu``);
    ``cupy.random.*`` shares one cuRAND generator per device, re-bound to the caller's
    stream at each call. On one stream no two draws are equal; on 8 streams, two draws
    that run at once can read the same state and repeat each other's numbers."""
    n = 1 << 20
    if shared == "Generator":
        generator = cupy.random.default_rng(0)

        def draw(ms):
            delay(ms)
            return generator.random(n)
    else:
        cupy.random.seed(0)

        def draw(ms):
            delay(ms)
            return cupy.random.random_sample(n)

    rng = np.random.default_rng(13)
    lengths = jitter_ms(rng, 32, high=0.3)
    one_stream = compute("launcher", *[delayed(draw)(ms) for ms in lengths], streams=1)
    assert _equal_pairs(one_stream) == 0
    rounds, equal = 4, 0
    for _ in range(rounds):
        draws = compute("launcher", *[delayed(draw)(ms) for ms in jitter_ms(rng, 32, high=0.3)])
        equal += _equal_pairs(draws)
    if not equal:
        pytest.skip(f"{shared}: no repeated numbers in {rounds} rounds of 32 draws on 8 streams")
    assert equal > 0


# --- cudaMallocAsync as CuPy's allocator ------------------------------------------------------


@pytest.fixture
def async_pool():
    """``cupy.cuda.MemoryAsyncPool`` as CuPy's allocator for the test, then the previous one."""
    runtime_api = cupy.cuda.runtime
    device = cupy.cuda.Device().id
    if runtime_api.is_hip or not runtime_api.deviceGetAttribute(
        runtime_api.cudaDevAttrMemoryPoolsSupported, device
    ):
        pytest.skip("this device has no stream-ordered allocator (cudaMallocAsync)")
    pool = cupy.cuda.MemoryAsyncPool()
    previous = cupy.cuda.get_allocator()
    cupy.cuda.set_allocator(pool.malloc)
    try:
        yield pool
    finally:
        cupy.cuda.Device().synchronize()
        cupy.cuda.set_allocator(previous)


def test_inputs_are_held_with_memory_async_pool(async_pool):
    """cudaFreeAsync runs on the allocating stream (``MemoryAsync.__dealloc__``): freed
    there while another stream still reads it, the block is reusable on that stream at
    once. The input hold delays the free until the reader's event has completed."""
    rt = two_stream_runtime()
    for _ in range(5):
        assert _freed_input_is_reused(rt).tolist() == [6.0] * HOLD_N


def test_without_the_hold_memory_async_pool_reuses_the_block_control(async_pool, monkeypatch):
    rt = two_stream_runtime()
    original = StreamPool.record
    monkeypatch.setattr(
        StreamPool, "record", lambda self, s, e, refs, *a: original(self, s, e, None, *a)
    )
    bad = [_freed_input_is_reused(rt) for _ in range(5)]
    if not any((b == -2.0).any() for b in bad):
        pytest.skip("cudaMallocAsync gave stream 0 another block each time: no reuse race")


def add(a, b):
    return a + b


@pytest.mark.parametrize("route", ROUTES)
def test_random_dag_is_exact_with_memory_async_pool(route, async_pool):
    """Values exact under random kernel lengths: every allocation and free stream-ordered."""
    rng = np.random.default_rng(17)
    for _ in range(4):
        values = rng.integers(0, 100, 16).astype(float)
        layer = [delayed(spin_fill)(1 << 14, v, rng.uniform(0, 1)) for v in values]
        expected = list(values)
        for _ in range(6):
            picks = rng.integers(0, len(layer), (len(layer), 2))
            layer = [
                delayed(spin_scale)(delayed(add)(layer[i], layer[j]), 1.0, rng.uniform(0, 1))
                for i, j in picks
            ]
            expected = [expected[i] + expected[j] for i, j in picks]
        got = compute(route, *[delayed(cupy.asnumpy)(x) for x in layer])
        assert [g[0] for g in got] == expected
        assert all((g == g[0]).all() for g in got)


@pytest.mark.parametrize("route", ROUTES)
def test_libraries_are_exact_with_memory_async_pool(route, async_pool):
    """FFT work areas and random chunks come from cudaMallocAsync on the task's stream."""
    rng, tiles, alone = fft_tiles(19)
    want = [cupy.asnumpy(x) for x in plain(*random_arrays("RandomState", 7))]
    for _ in range(2):
        errors = fft_errors(compute(route, *fft_graph(tiles, rng)), alone)
        assert max(errors) < RACE, errors
        got = compute(route, *random_arrays("RandomState", 7))
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(cupy.asnumpy(g), w)
    assert async_pool.used_bytes() > 0
