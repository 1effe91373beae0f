"""Slow CuPy kernels for GPU tests: spin a set time on one block, then write a known result."""

import cupy

_SOURCE = r"""
extern "C" __global__ void spin_scale(const double* x, double* out, double scale, double add,
                                      long long cycles, long long n) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
    for (long long i = threadIdx.x; i < n; i += blockDim.x) {
        out[i] = (x ? x[i] : 0.0) * scale + add;
    }
}
"""
_kernel = cupy.RawKernel(_SOURCE, "spin_scale")


def _cycles(ms: float) -> int:
    khz = cupy.cuda.Device().attributes["ClockRate"]
    return int(ms * khz)


def spin_fill(n: int, value: float, ms: float) -> cupy.ndarray:
    """A new array of ``n`` times ``value``, written after spinning ``ms`` on the current stream."""
    out = cupy.empty(n, dtype=cupy.float64)
    _kernel((1,), (256,), (None, out, 0.0, value, _cycles(ms), n))
    return out


def spin_scale(x: cupy.ndarray, scale: float, ms: float) -> cupy.ndarray:
    """``x * scale``, read only after spinning ``ms`` on the current stream (float64 only)."""
    if x.dtype != cupy.float64:
        raise TypeError(f"spin_scale takes float64 arrays, not {x.dtype}")
    out = cupy.empty_like(x)
    _kernel((1,), (256,), (x, out, scale, 0.0, _cycles(ms), x.size))
    return out
