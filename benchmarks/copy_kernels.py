"""The compute kernel of bench_copy.py, in an importable module.

Dask tokenizes task functions; a function defined in ``__main__`` is pickled
by value together with the globals it uses, and pickling a compiled CuPy
kernel that way breaks it (CUDA_ERROR_INVALID_HANDLE on the next launch, seen
on the H200). A function imported from a module is tokenized by reference.
"""

_state: dict = {}


def compile_add_loop(iters: int) -> None:
    """Compile the kernel (once) and set how many times it adds 1.0 per element."""
    import cupy

    if "kernel" not in _state:
        _state["kernel"] = cupy.ElementwiseKernel(
            "float32 x, int32 iters",
            "float32 y",
            "float v = x; for (int i = 0; i < iters; ++i) { v = v + 1.0f; } y = v;",
            "gpustreams_bench_add_loop",
        )
    _state["iters"] = iters


def iters() -> int:
    return _state["iters"]


def add_loop(x):
    """``x + iters``, one 1.0 at a time (exact for integers below 2**24)."""
    return _state["kernel"](x, _state["iters"])
