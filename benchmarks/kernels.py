"""Task kernels of the benchmarks on the ``cupy`` backend (GPU) and the ``sim`` device (CPU).

- :class:`Spin`: an occupancy-limited busy kernel of set duration whose result
  is a deterministic hash of its inputs and salt (:func:`mix`), so every run is
  checkable exactly. On a GPU, a ``RawKernel`` of ``blocks`` blocks of 256
  threads (default ``max(1, ceil(SMs / 32))``, about 1/32 of the GPU, as in
  Dagger.jl's ``:spin``) runs a dependent FMA loop whose length is calibrated to
  the requested time; on the sim device, a sleep then the NumPy hash.
- :class:`TileGemm`: one tile of a tiled gemm, ``C = A @ B`` or, given the
  partial sum ``C``, ``C += A @ B`` in place (cuBLAS ``gemm`` with beta 1, as
  Dagger's ``InOut(C)``; each partial sum has exactly one consumer).
- :class:`SyncAfter`: today's way to get concurrency from Dask without this
  package: each thread launches on its own per-thread default stream
  (``CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1``; a per-thread stream on sim) and
  synchronizes it at the end of every task.

Kernels are picklable callables that launch on the calling thread's current
stream and return at once.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

BACKENDS = ("cupy", "sim")
BLOCK = 256
_PRIME = np.uint32(16777619)


def mix(salt: int, *inputs: np.ndarray) -> np.ndarray:
    """The result of a :class:`Spin` node, in NumPy (the reference; uint32 arithmetic wraps)."""
    h = np.full(inputs[0].shape, salt, dtype=np.uint32)
    for j, x in enumerate(inputs):
        h = (h ^ x) * _PRIME + np.uint32(j)
    return h


def source(seed: int, size: int) -> np.ndarray:
    """The host data of busy-kernel source ``seed``."""
    return (np.arange(size, dtype=np.uint32) * np.uint32(2654435761)) ^ np.uint32(seed * 97 + 1)


def default_blocks(backend: str) -> int:
    """``max(1, ceil(SMs / 32))``: the blocks of 256 threads filling about 1/32 of the GPU."""
    if backend != "cupy":
        return 1
    import cupy

    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    return max(1, math.ceil(sms / 32))


# --- the busy kernel --------------------------------------------------------------------------

_SPIN_SOURCE = r"""
extern "C" __global__ void spin{n}({params}unsigned int* out, long long iters,
                                    unsigned int salt, int size) {{
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    float acc = 1.0f + 1e-7f * (float)t;
    for (long long i = 0; i < iters; ++i) acc = fmaf(acc, 0.999999f, 1e-6f);
    if (t < size) {{
        unsigned int h = salt;
{mix}        out[t] = h + (acc < 0.0f ? 1u : 0u);  // never true; keeps the loop alive
    }}
}}
"""
_kernels: dict[tuple[int, int], Any] = {}
_kernels_lock = threading.Lock()


def _spin_kernel(n: int) -> Any:
    """The compiled busy kernel taking ``n`` inputs, on the current device."""
    import cupy

    key = (n, cupy.cuda.Device().id)
    kernel = _kernels.get(key)
    if kernel is None:
        with _kernels_lock:
            kernel = _kernels.get(key)
            if kernel is None:
                params = "".join(f"const unsigned int* in{j}, " for j in range(n))
                body = "".join(
                    f"        h = (h ^ in{j}[t]) * 16777619u + {j}u;\n" for j in range(n)
                )
                code = _SPIN_SOURCE.format(n=n, params=params, mix=body)
                kernel = cupy.RawKernel(code, f"spin{n}")
                kernel.compile()
                _kernels[key] = kernel
    return kernel


def _sim_spin(out: np.ndarray, *inputs: np.ndarray, seconds: float, salt: int) -> None:
    time.sleep(seconds)
    out[...] = mix(salt, *inputs)


@dataclass(frozen=True)
class Spin:
    """``Spin(...)(salt, *inputs)`` launches one busy kernel; returns its output array.

    ``size`` elements (= threads launched, ``blocks * 256`` on a GPU), ``iters``
    FMA iterations per thread (cupy) or ``seconds`` of sleep (sim).
    """

    backend: str
    blocks: int = 1
    iters: int = 0
    seconds: float = 0.0

    @property
    def size(self) -> int:
        return self.blocks * BLOCK

    def __call__(self, salt: int, *inputs: Any) -> Any:
        if self.backend == "cupy":
            import cupy

            out = cupy.empty(self.size, dtype=cupy.uint32)
            args = (*inputs, out, np.int64(self.iters), np.uint32(salt), np.int32(self.size))
            _spin_kernel(len(inputs))((self.blocks,), (BLOCK,), args)
            return out
        from dask_gpustreams import sim

        out = sim.empty(self.size, "uint32")
        sim.launch(_sim_spin, out, *inputs, seconds=self.seconds, salt=salt)
        return out


# --- gemm tiles -------------------------------------------------------------------------------


def _sim_matmul(out: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
    np.matmul(a, b, out=out)


def _sim_gemm_acc(c: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
    c += a @ b


@dataclass(frozen=True)
class TileGemm:
    """``TileGemm(backend)(a, b)`` returns ``a @ b``; ``(a, b, c)`` adds ``a @ b`` into ``c``."""

    backend: str

    def __call__(self, a: Any, b: Any, c: Any = None) -> Any:
        if self.backend == "cupy":
            import cupy
            import cupy.cublas

            if c is None:
                return cupy.matmul(a, b)
            cupy.cublas.gemm("N", "N", a, b, out=c, alpha=1.0, beta=1.0)
            return c
        from dask_gpustreams import sim

        if c is None:
            c = sim.empty(a.shape, a.dtype)
            sim.launch(_sim_matmul, c, a, b)
        else:
            sim.launch(_sim_gemm_acc, c, a, b)
        return c


# --- the ptds-sync wrapper --------------------------------------------------------------------

_thread = threading.local()


@dataclass(frozen=True)
class SyncAfter:
    """``fn`` on the thread's own default stream, synchronized before the task returns."""

    fn: Any
    backend: str

    def __call__(self, *args: Any) -> Any:
        if self.backend == "cupy":
            import cupy

            result = self.fn(*args)
            cupy.cuda.get_current_stream().synchronize()
            return result
        from dask_gpustreams import sim

        stream = getattr(_thread, "stream", None)
        if stream is None:
            stream = _thread.stream = sim.get_device().create_stream()
        with stream:
            result = self.fn(*args)
        stream.synchronize()
        return result


# --- device helpers ---------------------------------------------------------------------------


def to_device(backend: str, host: np.ndarray) -> Any:
    """Copy ``host`` to the device on the current stream and wait for it."""
    if backend == "cupy":
        import cupy

        out = cupy.asarray(host)
        cupy.cuda.get_current_stream().synchronize()
        return out
    from dask_gpustreams import sim

    out = sim.asarray(host)
    sim.get_device().current_stream().synchronize()
    return out


def to_host(backend: str, x: Any) -> np.ndarray:
    """A host copy of device array ``x`` (synchronizing the current stream first)."""
    if backend == "cupy":
        import cupy

        return cupy.asnumpy(x)
    return x.get()


def device_synchronize(backend: str) -> None:
    """Wait for all work on the device (sim: its default stream; pools sync their own)."""
    if backend == "cupy":
        import cupy

        cupy.cuda.runtime.deviceSynchronize()
    else:
        from dask_gpustreams import sim

        sim.get_device().synchronize()


def matmul(backend: str, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Untiled reference product of host matrices (cuBLAS on a GPU, NumPy on sim)."""
    if backend == "cupy":
        import cupy

        return cupy.asnumpy(cupy.matmul(cupy.asarray(a), cupy.asarray(b)))
    return a @ b


def time_isolated(backend: Any, launch: Any, repeats: int = 5) -> float:
    """Min over ``repeats`` of the device time (ms) of ``launch()`` alone on a fresh stream.

    ``backend`` is a :mod:`dask_gpustreams.backends` instance.
    """
    stream = _timing_stream(backend)
    best = math.inf
    with backend.use_stream(stream):
        launch()  # warm: compile, allocate
        backend.synchronize_stream(stream)
        for _ in range(repeats):
            start = backend.create_event(timing=True)
            end = backend.create_event(timing=True)
            backend.record(start, stream)
            launch()
            backend.record(end, stream)
            backend.synchronize_event(end)
            best = min(best, backend.elapsed_ms(start, end))
    return best


_timing_streams: dict[int, Any] = {}


def _timing_stream(backend: Any) -> Any:
    stream = _timing_streams.get(id(backend))
    if stream is None:
        stream = _timing_streams[id(backend)] = backend.create_stream()
    return stream


def calibrate_spin(backend: Any, target_ms: float, blocks: int) -> tuple[Spin, float]:
    """A :class:`Spin` lasting about ``target_ms`` alone, and its measured time (ms)."""
    name = backend.name
    if name == "sim":
        spin = Spin("sim", blocks, seconds=target_ms / 1e3)
        return spin, _time_spin(backend, spin)
    iters = 20_000
    spin = Spin("cupy", blocks, iters=iters)
    for _ in range(3):  # the loop is linear in iters past a few microseconds of launch
        ms = _time_spin(backend, spin)
        iters = max(1, round(iters * target_ms / ms))
        spin = Spin("cupy", blocks, iters=iters)
    return spin, _time_spin(backend, spin)


def _time_spin(backend: Any, spin: Spin) -> float:
    x = to_device(backend.name, source(0, spin.size))
    return time_isolated(backend, lambda: spin(1, x))
