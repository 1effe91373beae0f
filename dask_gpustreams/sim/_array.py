"""Device arrays of the simulated device and the functions that enqueue work on them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from dask.sizeof import sizeof

from dask_gpustreams.sim._device import Device
from dask_gpustreams.sim._memory import MemoryPool, poison

_device = Device(0)
_pool = MemoryPool()


def get_device() -> Device:
    """The simulated device (there is one, id 0)."""
    return _device


def get_default_memory_pool() -> MemoryPool:
    """The pool every :class:`SimArray` is allocated from."""
    return _pool


class SimArray:
    """Memory on the simulated device, like a ``cupy.ndarray`` without operators.

    Work on it is written as functions of NumPy views and enqueued with
    :func:`launch`; :meth:`get` copies it back to the host.
    """

    __slots__ = ("shape", "dtype", "_block", "_stream", "_view", "__weakref__")

    def __init__(self, *args: Any, **kwargs: Any):
        raise TypeError(
            "SimArray objects cannot be instantiated directly: use sim.empty or sim.asarray"
        )

    @classmethod
    def _allocate(cls, shape: tuple[int, ...], dtype: np.dtype) -> SimArray:
        self = object.__new__(cls)
        self.shape = shape
        self.dtype = dtype
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        stream = _device.current_stream()
        block, reused = _pool.malloc(nbytes, stream)
        self._block = block
        self._stream = stream
        self._view = block[:nbytes].view(dtype).reshape(shape)
        if reused:
            view = self._view
            stream.enqueue(lambda _s: poison(view))
        else:
            poison(self._view)
        return self

    def __del__(self) -> None:
        block = getattr(self, "_block", None)
        if block is not None:
            _pool.free(block, self._stream)

    @property
    def nbytes(self) -> int:
        return self._view.nbytes

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return self._view.size

    def __repr__(self) -> str:
        return f"<sim.SimArray shape={self.shape} dtype={self.dtype}>"

    def get(self) -> np.ndarray:
        """A NumPy copy, after waiting for the current stream (like ``cupy.ndarray.get``)."""
        _device.current_stream().synchronize()
        return self._view.copy()

    def __reduce__(self):
        # A snapshot of the buffer as it is now, without waiting for queued work,
        # like a device-to-host copy on an unrelated stream.
        return (_rebuild, (self._view.copy(),))


def _rebuild(host: np.ndarray) -> SimArray:
    """Unpickled data arrives complete: the copy is enqueued, then waited for."""
    out = asarray(host)
    _device.current_stream().synchronize()
    return out


def empty(shape: int | tuple[int, ...], dtype: Any = "float64") -> SimArray:
    """Uninitialized (poisoned) device memory allocated on the current stream."""
    shape = (shape,) if isinstance(shape, int) else tuple(int(s) for s in shape)
    return SimArray._allocate(shape, np.dtype(dtype))


def asarray(obj: Any, dtype: Any = None) -> SimArray:
    """Copy host data to the device on the current stream (a ``SimArray`` is returned as is).

    The host data is staged at call time, as CuPy stages pageable memory, so the
    caller may modify ``obj`` as soon as this returns.
    """
    if isinstance(obj, SimArray):
        if dtype is None or np.dtype(dtype) == obj.dtype:
            return obj
        # A device-side conversion on the current stream, like cupy.asarray(x, dtype).
        out = empty(obj.shape, dtype)
        launch(_convert, out, obj)
        return out
    staged = np.array(obj, dtype=dtype, copy=True)
    out = empty(staged.shape, staged.dtype)
    view = out._view
    _device.current_stream().enqueue(lambda _s: np.copyto(view, staged))
    return out


def _convert(out: np.ndarray, src: np.ndarray) -> None:
    np.copyto(out, src, casting="unsafe")


def asnumpy(obj: Any) -> np.ndarray:
    """``obj.get()`` for a :class:`SimArray`, ``numpy.asarray(obj)`` otherwise."""
    if isinstance(obj, SimArray):
        return obj.get()
    return np.asarray(obj)


def _as_view(obj: Any) -> Any:
    return obj._view if isinstance(obj, SimArray) else obj


def launch(fn: Callable, *args: Any, **kwargs: Any) -> None:
    """Enqueue ``fn(*args, **kwargs)`` on the current stream and return at once.

    Every :class:`SimArray` argument is passed as a NumPy view of its device
    buffer. The launch holds the buffers, not the arrays: an array dropped
    while the kernel is queued goes back to the pool, as on a GPU. An exception
    raised by ``fn`` surfaces at the next host sync that depends on it, as
    :class:`dask_gpustreams.KernelError`.
    """
    args = tuple(_as_view(a) for a in args)
    kwargs = {k: _as_view(v) for k, v in kwargs.items()}
    _device.current_stream().launch(fn, args, kwargs, _device.current_key())


@sizeof.register(SimArray)
def _sizeof_simarray(x: SimArray) -> int:
    return x.nbytes
