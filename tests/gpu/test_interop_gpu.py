"""PyTorch and Numba inside tasks: they launch on the task's pool stream.

PyTorch: once PyTorch has started CUDA, ``CupyBackend.use_stream`` makes the
pool stream PyTorch's current stream too (a cached ``torch.cuda.ExternalStream``).
Numba has no current stream: a task passes
``cuda.external_stream(cupy.cuda.get_current_stream().ptr)`` to its launches.
Both routes, the launcher and ``gpustreams.enabled``, with kernels of random
length on both libraries' side.
"""

import time

import dask
import dask.threaded
import numpy as np
import pytest
from dask import delayed

cupy = pytest.importorskip("cupy")

from dask_gpustreams import get_runtime  # noqa: E402

from .kernels import spin_fill, spin_scale  # noqa: E402

STREAMS = 8
BASE = {
    "gpustreams.backend": "cupy",
    "gpustreams.streams": STREAMS,
    "gpustreams.policy": "round-robin",
}
ROUTES = {
    "launcher": (BASE, "gpustreams"),
    "threaded": ({**BASE, "gpustreams.enabled": True, "num_workers": STREAMS}, dask.threaded.get),
}
N = 1 << 14


def compute(route, *collections):
    config, scheduler = ROUTES[route]
    with dask.config.set(config):
        return dask.compute(*collections, scheduler=scheduler)


def add(a, b):
    return a + b


def cycles(ms):
    return int(ms * cupy.cuda.Device().attributes["ClockRate"])  # kHz


# --- PyTorch -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch without CUDA")
    torch.cuda.init()  # started before the graphs: every task then sees its pool stream
    return torch


def streams_seen(_):
    import torch

    return cupy.cuda.get_current_stream().ptr, torch.cuda.current_stream().cuda_stream


@pytest.mark.parametrize("route", ROUTES)
def test_torch_current_stream_is_the_task_stream(torch, route):
    before = torch.cuda.current_stream().cuda_stream
    seen = compute(route, *[delayed(streams_seen)(i) for i in range(4 * STREAMS)])
    assert all(cupy_ptr == torch_ptr != 0 for cupy_ptr, torch_ptr in seen), seen
    assert len({ptr for ptr, _ in seen}) > 1  # several pool streams
    assert torch.cuda.current_stream().cuda_stream == before  # restored after the tasks


def test_torch_current_stream_through_the_public_functions(torch, monkeypatch):
    """A PyTorch without the id entry points (older versions): the pool stream becomes
    PyTorch's current one through ``torch.cuda.set_stream``, and the stream before is put
    back after each task."""
    from dask_gpustreams.backends import cupy as cupy_backend

    monkeypatch.setattr(cupy_backend, "_stream_ids", lambda current: False)
    calls = []
    set_stream = torch.cuda.set_stream

    def counted(stream):
        calls.append(stream.cuda_stream)
        set_stream(stream)

    monkeypatch.setattr(torch.cuda, "set_stream", counted)
    before = torch.cuda.current_stream().cuda_stream
    streams = STREAMS - 1  # a runtime of its own, whose backend finds PyTorch's calls now
    with dask.config.set({**BASE, "gpustreams.streams": streams}):
        tasks = [delayed(streams_seen)(i) for i in range(4 * streams)]
        seen = dask.compute(*tasks, scheduler="gpustreams")
    assert all(cupy_ptr == torch_ptr != 0 for cupy_ptr, torch_ptr in seen), seen
    assert len({ptr for ptr, _ in seen}) > 1
    assert {ptr for ptr, _ in seen} <= set(calls)  # set through the public function
    assert calls.count(before) >= len(seen)  # and the stream before, put back each time
    assert torch.cuda.current_stream().cuda_stream == before


def torch_affine(x, k, ms):
    """``x * k + 1`` by PyTorch on a tensor that shares ``x``'s memory (DLPack), after a
    PyTorch kernel of ``ms``; returned as a CuPy array over PyTorch's memory."""
    import torch

    t = torch.from_dlpack(x)
    if ms > 0:
        torch.cuda._sleep(cycles(ms))
    return cupy.from_dlpack(t * k + 1)


def torch_add(a, b):
    """``a + b`` by PyTorch on CUDA-array-interface views; a PyTorch tensor out."""
    import torch

    return torch.as_tensor(a, device="cuda") + torch.as_tensor(b, device="cuda")


def cupy_scale(x, ms):
    """``x`` (a CuPy array or a PyTorch tensor) copied by a CuPy kernel after ``ms``."""
    return spin_scale(cupy.asarray(x), 1.0, ms)


@pytest.mark.parametrize("route", ROUTES)
def test_mixed_cupy_and_torch_pipeline_is_exact(torch, route):
    if not hasattr(torch.cuda, "_sleep"):
        pytest.skip("torch.cuda._sleep (a spinning kernel) is missing")
    rng = np.random.default_rng(23)
    for _ in range(4):
        values = rng.integers(0, 50, 16).astype(float)
        layer = [delayed(spin_fill)(N, v, rng.uniform(0, 1)) for v in values]
        expected = list(values)
        for step in range(6):
            picks = rng.integers(0, len(layer), (len(layer), 2))
            if step % 2:
                k = float(rng.integers(-2, 3))
                layer = [
                    delayed(cupy_scale)(
                        delayed(torch_affine)(layer[i], k, rng.uniform(0, 1)), rng.uniform(0, 1)
                    )
                    for i, _ in picks
                ]
                expected = [expected[i] * k + 1 for i, _ in picks]
            else:
                layer = [
                    delayed(cupy_scale)(delayed(torch_add)(layer[i], layer[j]), rng.uniform(0, 1))
                    for i, j in picks
                ]
                expected = [expected[i] + expected[j] for i, j in picks]
        got = compute(route, *[delayed(cupy.asnumpy)(x) for x in layer])
        assert [g[0] for g in got] == expected
        assert all((g == g[0]).all() for g in got)


def torch_sleep(ms):
    import torch

    torch.cuda._sleep(cycles(ms))
    return ms


@pytest.mark.parametrize("interop", [True, False])
def test_torch_kernels_of_tasks_run_concurrently(torch, interop, monkeypatch):
    """8 tasks of a 20 ms PyTorch kernel: concurrent on the pool streams; with
    ``torch_interop`` off they share PyTorch's default (legacy) stream, one by one."""
    if not hasattr(torch.cuda, "_sleep"):
        pytest.skip("torch.cuda._sleep (a spinning kernel) is missing")
    ms = 20
    with dask.config.set(BASE):
        monkeypatch.setattr(get_runtime().backend, "torch_interop", interop)
        tasks = [delayed(torch_sleep)(ms, dask_key_name=f"sleep-{i}") for i in range(STREAMS)]
        dask.compute(*tasks, scheduler="gpustreams")  # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dask.compute(*tasks, scheduler="gpustreams")
        torch.cuda.synchronize()  # without interop, the launcher's events miss the kernels
        wall = (time.perf_counter() - t0) * 1e3
    if interop:
        assert wall < 3 * ms, wall
    else:
        assert wall > 0.8 * STREAMS * ms, wall


def test_torch_stream_entry_cost(torch, monkeypatch):
    """What entering a pool stream costs per task with PyTorch's stream entered too."""
    with dask.config.set(BASE):
        backend = get_runtime().backend
    stream = backend.create_stream()

    def per_entry(n=20000):
        t0 = time.perf_counter()
        for _ in range(n):
            with backend.use_stream(stream):
                pass
        return (time.perf_counter() - t0) / n * 1e6

    with_torch = min(per_entry() for _ in range(3))
    monkeypatch.setattr(backend, "torch_interop", False)
    without = min(per_entry() for _ in range(3))
    print(f"use_stream: {with_torch:.2f} us with PyTorch's stream, {without:.2f} us without")
    assert with_torch - without < 20, (with_torch, without)


# --- Numba -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def numba_cuda():
    cuda = pytest.importorskip("numba.cuda")
    if not cuda.is_available():
        pytest.skip("Numba sees no CUDA device")
    try:  # numba-cuda 0.x fails to compile any kernel against NumPy 2.5 (np.row_stack is gone)
        numba_affine(cupy.zeros(4), 1.0)
    except AttributeError as e:
        pytest.skip(f"Numba cannot compile a kernel here: {e}")
    cupy.cuda.Device().synchronize()
    return cuda


_kernels = {}


def _numba_affine(cuda):
    if "affine" not in _kernels:

        @cuda.jit
        def affine(x, out, k):
            i = cuda.grid(1)
            if i < x.size:
                out[i] = x[i] * k + 1.0

        _kernels["affine"] = affine
    return _kernels["affine"]


def numba_affine(x, k):
    """``x * k + 1`` by a Numba kernel on the task's stream, into a CuPy array.

    ``sync=False``: the arrays' CUDA array interface names the pool stream, on
    which the kernel runs anyway; the default would block the host on it.
    """
    from numba import cuda

    out = cupy.empty_like(x)
    stream = cuda.external_stream(cupy.cuda.get_current_stream().ptr)
    kernel = _numba_affine(cuda)
    blocks = (x.size + 255) // 256
    kernel[blocks, 256, stream](
        cuda.as_cuda_array(x, sync=False), cuda.as_cuda_array(out, sync=False), k
    )
    return out


@pytest.mark.parametrize("route", ROUTES)
def test_numba_kernels_on_the_task_stream_are_exact(numba_cuda, route):
    # The fixture compiled the kernel outside the graph.
    rng = np.random.default_rng(29)
    for _ in range(4):
        values = rng.integers(0, 50, 16).astype(float)
        layer = [delayed(spin_fill)(N, v, rng.uniform(0, 1)) for v in values]
        expected = list(values)
        for _ in range(4):
            picks = rng.integers(0, len(layer), (len(layer), 2))
            k = float(rng.integers(-2, 3))
            layer = [
                delayed(spin_scale)(
                    delayed(numba_affine)(delayed(add)(layer[i], layer[j]), k),
                    1.0,
                    rng.uniform(0, 1),
                )
                for i, j in picks
            ]
            expected = [(expected[i] + expected[j]) * k + 1 for i, j in picks]
        got = compute(route, *[delayed(cupy.asnumpy)(x) for x in layer])
        assert [g[0] for g in got] == expected
        assert all((g == g[0]).all() for g in got)
