"""Device arrays of the simulated device and the functions that enqueue work on them."""

from __future__ import annotations

import itertools
import math
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
from dask.sizeof import sizeof
from numpy.lib.mixins import NDArrayOperatorsMixin

from dask_gpustreams.sim import _functions, _ops, _routines
from dask_gpustreams.sim._device import Device
from dask_gpustreams.sim._memory import Chunk, MemoryPool, poison

_device: Device | None = None
_device_lock = threading.Lock()
_pool = MemoryPool()
_ids = itertools.count()
_local = threading.local()  # .allocator: this thread's, inside using_allocator
# Pinned host buffers (alloc_pinned) by id, while alive: NumPy arrays are not hashable.
_pinned: weakref.WeakValueDictionary[int, np.ndarray] = weakref.WeakValueDictionary()


def get_device() -> Device:
    """The simulated device (there is one, id 0), created on first use.

    Creating it starts no thread: each stream's thread starts with the stream (the
    default stream's at its first use) and ends once the stream is garbage.
    """
    global _device
    if _device is None:
        with _device_lock:
            if _device is None:
                _device = Device(0, on_stream_end=_pool.stream_ended)
    return _device


def get_default_memory_pool() -> MemoryPool:
    """The pool every :class:`SimArray` is allocated from."""
    return _pool


def get_allocator() -> Callable:
    """The allocator of this thread: ``malloc(nbytes, stream_id) -> (chunk, reused)``.

    The default pool's ``malloc`` unless :func:`using_allocator` set another, as
    ``cupy.cuda.get_allocator`` answers.
    """
    allocator = getattr(_local, "allocator", None)
    return _pool.malloc if allocator is None else allocator


@contextmanager
def using_allocator(allocator: Callable) -> Iterator[None]:
    """Allocate with ``allocator`` in this thread, inside (``cupy.cuda.using_allocator``)."""
    previous = getattr(_local, "allocator", None)
    _local.allocator = allocator
    try:
        yield
    finally:
        _local.allocator = previous


def _forward(func: Callable, name: str) -> Callable:
    """A method ``name(self, ...)`` that is ``func(self, ...)``."""

    def method(self: SimArray, *args: Any, **kwargs: Any) -> Any:
        return func(self, *args, **kwargs)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"``numpy.{func.__name__}(self, ...)``, enqueued on the current stream."
    return method


class SimArray(NDArrayOperatorsMixin):
    """Memory on the simulated device, used like a ``cupy.ndarray``.

    Operators, ufuncs, indexing and the NumPy functions that dask.array calls on
    chunks enqueue a kernel on the current stream and return at once a new
    array allocated on that stream (see :mod:`dask_gpustreams.sim._ops`).
    Results are new arrays, never views. Other work is written as functions of
    NumPy views and enqueued with :func:`launch`. Nothing reaches the host
    implicitly: :meth:`get` and :func:`asnumpy` copy back, after waiting for the
    current stream, and so do the ops that return host values (``bool(x)``,
    ``x.item()``) or whose output shape depends on the data (``x[mask]``,
    ``numpy.nonzero``).
    """

    __slots__ = ("shape", "dtype", "_block", "_stream_id", "_view", "_id", "__weakref__")
    __array_priority__ = 100  # as cupy.ndarray: dask dispatches on the highest
    __hash__ = object.__hash__  # by identity, as a buffer (NumPy's __eq__ would remove it)

    def __init__(self, *args: Any, **kwargs: Any):
        raise TypeError(
            "SimArray objects cannot be instantiated directly: use sim.empty or sim.asarray"
        )

    @classmethod
    def _allocate(cls, shape: tuple[int, ...], dtype: np.dtype) -> SimArray:
        if dtype.hasobject:
            raise TypeError(f"SimArray cannot hold Python objects (dtype={dtype})")
        if any(s < 0 for s in shape):
            raise ValueError(f"negative dimensions are not allowed, got shape {shape}")
        self = object.__new__(cls)
        self.shape = shape
        self.dtype = dtype
        self._id = next(_ids)
        stream = get_device().current_stream()
        self._stream_id = stream.id  # an identifier: an array does not keep its stream alive
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0:  # like CuPy, an empty array takes no memory from the pool
            self._block = None
            self._view = np.empty(shape, dtype)
            return self
        allocator = getattr(_local, "allocator", None)  # get_allocator(), inline
        chunk, reused = (_pool.malloc if allocator is None else allocator)(nbytes, stream.id)
        self._block = chunk
        self._view = chunk.buffer[:nbytes].view(dtype).reshape(shape)
        if reused:
            view = self._view
            stream.enqueue(lambda _s: poison(view))
        else:
            poison(self._view)
        return self

    def __del__(self) -> None:
        block = getattr(self, "_block", None)
        if block.__class__ is Chunk:  # an UnownedBlock goes with its owner
            _pool.free(block)

    @property
    def nbytes(self) -> int:
        return self._view.nbytes

    #: The array a view is of: always None, as results are new arrays, never views
    #: (``cupy.ndarray.base``; distributed's P2P rechunk copies a shard that has one).
    base = None
    ndim = property(lambda self: len(self.shape))
    size = property(lambda self: self._view.size)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    def __repr__(self) -> str:
        return f"<sim.SimArray shape={self.shape} dtype={self.dtype}>"

    def get(self) -> np.ndarray:
        """A NumPy copy, after waiting for the current stream (like ``cupy.ndarray.get``)."""
        get_device().current_stream().synchronize()
        return self._view.copy()

    def __reduce__(self):
        # A snapshot of the buffer as it is now, without waiting for queued work,
        # like a device-to-host copy on an unrelated stream.
        return (_rebuild, (self._view.copy(),))

    def __dask_tokenize__(self) -> object:
        # The buffer may still be written by queued kernels: its bytes cannot name it.
        return ("sim.SimArray", self._id)

    # --- NumPy protocols ---------------------------------------------------------------------

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        raise TypeError(
            "Implicit conversion of a SimArray to a NumPy array is not allowed (as for "
            "cupy.ndarray): use .get() or sim.asnumpy() to copy it to the host"
        )

    def __array_ufunc__(self, ufunc: np.ufunc, method: str, *inputs: Any, **kwargs: Any) -> Any:
        return _ops.array_ufunc(ufunc, method, inputs, kwargs)

    def __array_function__(self, func: Callable, types: tuple, args: tuple, kwargs: dict) -> Any:
        return _functions.array_function(func, types, args, kwargs)

    def __getitem__(self, key: Any) -> SimArray:
        return _ops.getitem(self, key)

    def __setitem__(self, key: Any, value: Any) -> None:
        _ops.setitem(self, key, value)

    # --- host values: these wait for the current stream ----------------------------------------

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of unsized object")
        return self.shape[0]

    def __iter__(self) -> Iterator[SimArray]:
        if not self.shape:
            raise TypeError("iteration over a 0-d array")
        return (self[i] for i in range(self.shape[0]))

    def __bool__(self) -> bool:
        return bool(self.get())

    def __int__(self) -> int:
        return int(self.get())

    def __float__(self) -> float:
        return float(self.get())

    def __complex__(self) -> complex:
        return complex(self.get())

    def __index__(self) -> int:
        return self.get().__index__()

    def item(self, *args: Any) -> Any:
        """The element as a Python scalar, after waiting for the current stream."""
        return self.get().item(*args)

    def tolist(self) -> Any:
        """Nested lists of Python scalars, after waiting for the current stream."""
        return self.get().tolist()

    # --- methods: enqueued like the NumPy functions they name --------------------------------

    @property
    def T(self) -> SimArray:
        return np.transpose(self)

    @property
    def real(self) -> SimArray:
        return np.real(self)

    @property
    def imag(self) -> SimArray:
        return np.imag(self)

    def astype(
        self, dtype: Any, order: str = "K", casting: str = "unsafe", copy: bool = True
    ) -> SimArray:
        """A converted copy (``self`` if ``copy`` is false and the dtype is the same)."""
        return _ops.astype(self, dtype, casting=casting, copy=copy)

    def copy(self, order: str = "C") -> SimArray:
        """A copy on the current stream."""
        return np.copy(self)

    def reshape(self, *shape: Any, order: str = "C") -> SimArray:
        """``numpy.reshape``; the shape may be given as one tuple or as integers."""
        return np.reshape(self, shape[0] if len(shape) == 1 else shape, order=order)

    def transpose(self, *axes: Any) -> SimArray:
        """``numpy.transpose``; the axes may be given as one tuple or as integers."""
        return np.transpose(self, (axes[0] if len(axes) == 1 else axes) or None)

    def flatten(self, order: str = "C") -> SimArray:
        return np.ravel(self, order=order)

    def view(self, dtype: Any = None) -> SimArray:
        """The bytes read as ``dtype``: a copy made by a kernel, not a view."""
        return _routines.view(self, dtype)

    def sort(self, axis: int = -1) -> None:
        """Sort in place along ``axis`` (a kernel on the current stream)."""
        _routines.sort(self, axis)

    def fill(self, value: Any) -> None:
        """Set every element to ``value`` (a kernel on the current stream)."""
        self[...] = value

    ravel = _forward(np.ravel, "ravel")
    squeeze = _forward(np.squeeze, "squeeze")
    swapaxes = _forward(np.swapaxes, "swapaxes")
    take = _forward(np.take, "take")
    repeat = _forward(np.repeat, "repeat")
    sum = _forward(np.sum, "sum")
    prod = _forward(np.prod, "prod")
    mean = _forward(np.mean, "mean")
    std = _forward(np.std, "std")
    var = _forward(np.var, "var")
    max = _forward(np.max, "max")
    min = _forward(np.min, "min")
    any = _forward(np.any, "any")
    all = _forward(np.all, "all")
    argmax = _forward(np.argmax, "argmax")
    argmin = _forward(np.argmin, "argmin")
    cumsum = _forward(np.cumsum, "cumsum")
    cumprod = _forward(np.cumprod, "cumprod")
    clip = _forward(np.clip, "clip")
    round = _forward(np.round, "round")
    conj = conjugate = _forward(np.conjugate, "conj")
    dot = _forward(np.dot, "dot")
    nonzero = _forward(np.nonzero, "nonzero")


def _rebuild(host: np.ndarray) -> SimArray:
    """Unpickled data arrives complete: the copy is enqueued, then waited for."""
    out = asarray(host)
    get_device().current_stream().synchronize()
    return out


def empty(shape: int | tuple[int, ...], dtype: Any = "float64") -> SimArray:
    """Uninitialized (poisoned) device memory allocated on the current stream."""
    shape = (int(shape),) if np.ndim(shape) == 0 else tuple(int(s) for s in shape)
    return SimArray._allocate(shape, np.dtype(dtype))


def alloc_pinned(nbytes: int) -> np.ndarray:
    """``nbytes`` of page-locked host memory, as ``uint8`` (``cupyx.empty_pinned``).

    :func:`asarray` copies from it when its stream gets to the copy, not at the call.
    """
    buffer = np.empty(nbytes, dtype=np.uint8)
    _pinned[id(buffer)] = buffer
    return buffer


def _is_pinned(obj: np.ndarray) -> bool:
    """Whether ``obj`` is a view of memory from :func:`alloc_pinned`."""
    while isinstance(obj, np.ndarray):
        if _pinned.get(id(obj)) is obj:
            return True
        obj = obj.base
    return False


def asarray(obj: Any, dtype: Any = None) -> SimArray:
    """Copy host data to the device on the current stream (a ``SimArray`` is returned as is).

    Pageable host data is staged at call time, as CuPy stages it, so the caller
    may modify ``obj`` as soon as this returns. Pinned memory (:func:`alloc_pinned`,
    contiguous, of the dtype asked for) is not staged: as in CuPy (``_array_default``),
    the copy reads it when it runs, and the caller must not modify it before.

    The copy (:meth:`Stream.launch`, run on a stream in error too) first sleeps for a
    delay drawn from :attr:`Device.kernel_delay`, as a host-to-device copy takes time on
    a GPU, so a reader on another stream that does not wait for it can see the poison.
    """
    if isinstance(obj, SimArray):
        if dtype is None or np.dtype(dtype) == obj.dtype:
            return obj
        # A device-side conversion on the current stream, like cupy.asarray(x, dtype).
        out = empty(obj.shape, dtype)
        launch(_convert, out, obj)
        return out
    if (
        isinstance(obj, np.ndarray)
        and (dtype is None or np.dtype(dtype) == obj.dtype)
        and (obj.flags.c_contiguous or obj.flags.f_contiguous)
        and _is_pinned(obj)
    ):
        staged = obj  # read when the copy runs, which holds it (CuPy's watch list does)
    else:
        staged = np.array(obj, dtype=dtype, copy=True)
    out = empty(staged.shape, staged.dtype)
    if out.size:
        device = get_device()
        stream = device.current_stream()
        stream.launch(np.copyto, (out._view, staged), {}, device.current_key(), runs_on_error=True)
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
    device = get_device()
    device.current_stream().launch(fn, args, kwargs, device.current_key())


@sizeof.register(SimArray)
def _sizeof_simarray(x: SimArray) -> int:
    return x.nbytes
