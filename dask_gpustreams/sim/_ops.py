"""How a NumPy operation on :class:`SimArray` operands becomes a kernel on the current stream.

An op allocates its outputs on the current stream (from the pool, as every
array is) and enqueues a kernel that computes into them, then returns at once,
as CuPy does. The kernel holds its operands' buffers, not the arrays: lifetime
stays the caller's business, as on a GPU. Output shapes and dtypes are found at
launch, on the host, without waiting for the device:

- shapes from the operands' shapes, by a rule per op, or for ops that move
  elements without computing (concatenate, transpose, indexing...) by running
  NumPy on *shape dummies*: arrays of a zero-itemsize dtype, which hold no
  memory whatever their shape;
- dtypes by running NumPy on *tiny dummies*: ones of the operands' dtypes and
  numbers of dimensions, every dimension 1.

Python scalars and host arrays may be operands: scalars go to the kernel by
value, host arrays as copies taken at launch, so the caller may modify them
afterwards. An op whose device operands are all empty is run on the host at once
(their values cannot matter), which makes dask's meta computations exact,
errors included. Ops whose output shape depends on the data, or that return
host values, first wait for the current stream (a host sync, as in CuPy).
"""

from __future__ import annotations

import numbers
import operator
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from dask_gpustreams.sim import _array

try:
    from numpy.lib.array_utils import normalize_axis_index, normalize_axis_tuple
except ImportError:  # NumPy < 2
    from numpy.core.numeric import normalize_axis_index, normalize_axis_tuple

Shape = tuple[int, ...]

#: Zero itemsize: an array of it takes no memory, whatever its shape.
_SHAPE_ONLY = np.dtype([])


# --- operands --------------------------------------------------------------------------------


def is_operand(obj: Any) -> bool:
    """What a kernel can take: a device or host array, a scalar, None."""
    return obj is None or isinstance(obj, (_array.SimArray, np.ndarray, numbers.Number, np.generic))


def _is_index(obj: Any) -> bool:
    return is_operand(obj) or isinstance(obj, (slice, type(Ellipsis)))


def _nested(obj: Any) -> bool:
    return type(obj) in (list, tuple)


def sim_operands(obj: Any) -> Iterator[_array.SimArray]:
    """The device arrays in ``obj``, looking into lists, tuples and dicts."""
    if isinstance(obj, _array.SimArray):
        yield obj
    elif _nested(obj):
        for item in obj:
            yield from sim_operands(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from sim_operands(item)


def has_sim_operand(obj: Any) -> bool:
    """Whether ``obj`` holds a device array (not ``any(sim_operands(obj))``: that syncs)."""
    return next(sim_operands(obj), None) is not None


def map_arrays(obj: Any, on_sim: Callable, on_host: Callable | None = None) -> Any:
    """``obj`` with its device arrays replaced by ``on_sim(x)``, host arrays by ``on_host(x)``."""
    if isinstance(obj, _array.SimArray):
        return on_sim(obj)
    if on_host is not None and isinstance(obj, np.ndarray):
        return on_host(obj)
    if _nested(obj):
        return type(obj)(map_arrays(item, on_sim, on_host) for item in obj)
    if isinstance(obj, dict):
        return {k: map_arrays(v, on_sim, on_host) for k, v in obj.items()}
    return obj


def stage(obj: Any) -> Any:
    """What a kernel receives: device buffers as views, host arrays as copies taken now."""
    return map_arrays(obj, lambda x: x._view, np.copy)


def tiny(obj: Any) -> Any:
    """``obj`` with its arrays replaced by ones of their dtype and ndim, every dimension 1."""

    def ones(x: Any) -> np.ndarray:
        return np.ones((1,) * x.ndim, x.dtype)

    return map_arrays(obj, ones, ones)


def shape_dummy(x: Any) -> np.ndarray:
    """An array of ``x``'s shape that holds no memory, for NumPy to work out shapes."""
    return np.empty(np.shape(x) if not isinstance(x, _array.SimArray) else x.shape, _SHAPE_ONLY)


def zeros_dummy(x: _array.SimArray) -> np.ndarray:
    """Zeros of ``x``'s shape and dtype that take no memory (zero strides): for indices."""
    return np.broadcast_to(np.zeros((), x.dtype), x.shape)


def dtypes_of(result: Any) -> list[np.dtype]:
    """The dtype of each output of a NumPy call on tiny dummies."""
    results = result if isinstance(result, (tuple, list)) else (result,)
    return [np.asarray(r).dtype for r in results]


def evaluate(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """``fn`` on dummies: floating-point errors of dummy values mean nothing."""
    with np.errstate(all="ignore"):
        return fn(*args, **kwargs)


# --- launching -------------------------------------------------------------------------------


def check_dtype(dtype: np.dtype) -> np.dtype:
    dtype = np.dtype(dtype)
    if dtype.fields is not None:
        raise TypeError(
            f"SimArray does not support structured dtypes (got {dtype}), as cupy.ndarray does not"
        )
    return dtype


def allocate(shape: Shape, dtype: Any) -> _array.SimArray:
    """An output array on the current stream."""
    return _array.empty(shape, check_dtype(dtype))


def upload(host: Any) -> _array.SimArray:
    """A host result (array or NumPy scalar) copied to the device on the current stream."""
    check_dtype(np.asarray(host).dtype)
    return _array.asarray(host)


def launch(fn: Callable, *args: Any) -> None:
    """Enqueue ``fn(*args)`` on the current stream, labelled with the current task's key."""
    device = _array.get_device()
    device.current_stream().launch(fn, args, {}, device.current_key())


def _store(fn: Callable, outs: tuple, multi: bool, args: tuple, kwargs: dict) -> None:
    """The kernel of :func:`run`: compute, check the prediction, write the outputs."""
    result = fn(*args, **kwargs)
    results = result if multi else (result,)
    for out, r in zip(outs, results, strict=True):
        r = np.asarray(r)
        if r.shape != out.shape or r.dtype != out.dtype:
            name = getattr(fn, "__name__", fn)
            raise RuntimeError(
                f"{name} gave {r.dtype}{r.shape}, predicted at launch {out.dtype}{out.shape}"
            )
        out[...] = r


def run(
    fn: Callable,
    outputs: Sequence[tuple[Shape, Any]],
    args: tuple,
    kwargs: dict | None = None,
    multi: bool | None = None,
) -> list[_array.SimArray]:
    """Allocate ``outputs`` (shape, dtype) and enqueue ``fn(*args, **kwargs)`` to fill them.

    ``fn`` returns one array, or a sequence of them if ``multi`` (default: if
    there are several outputs). The kernel fails if it differs from the prediction.
    """
    outs = [allocate(shape, dtype) for shape, dtype in outputs]
    if any(out.size for out in outs):
        multi = len(outs) > 1 if multi is None else multi
        views = tuple(out._view for out in outs)
        launch(_store, fn, views, multi, stage(args), stage(kwargs or {}))
    return outs


def _results(result: Any, originals: dict[int, _array.SimArray]) -> Any:
    """Host results on the device: arrays and NumPy scalars uploaded, the rest as is.

    A result that is one of the call's operands (``originals``, by id) is that device array.
    """
    if isinstance(result, np.ndarray) and id(result) in originals:
        return originals[id(result)]
    if isinstance(result, (np.ndarray, np.generic)):
        return upload(result)
    if isinstance(result, tuple) and hasattr(result, "_fields"):  # QRResult, SVDResult...
        return type(result)(*(_results(r, originals) for r in result))
    if _nested(result):
        return type(result)(_results(r, originals) for r in result)
    return result


def _on_host(fn: Callable, args: tuple, kwargs: dict, host: Callable) -> Any:
    originals: dict[int, tuple] = {}  # id -> (device array, its host stand-in, kept alive)

    def to_host(x: _array.SimArray) -> np.ndarray:
        h = host(x)
        originals[id(h)] = (x, h)
        return h

    result = fn(*map_arrays(args, to_host), **map_arrays(kwargs, to_host))
    return _results(result, {i: x for i, (x, _) in originals.items()})


def all_empty(args: Any) -> bool:
    """True if ``args`` hold device arrays and all of them are empty."""
    sims = list(sim_operands(args))
    return bool(sims) and all(x.size == 0 for x in sims)


def on_empty(fn: Callable, args: tuple, kwargs: dict) -> Any:
    """``fn`` run at once on host stand-ins of empty device operands, its results uploaded."""
    return _on_host(fn, args, kwargs, lambda x: np.empty(x.shape, x.dtype))


def synced(fn: Callable, args: tuple, kwargs: dict) -> Any:
    """``fn`` on the host after the current stream's work: a host sync, as in CuPy.

    For outputs whose shape depends on the data (``nonzero``, boolean masks) and
    for host values; array results are uploaded on the current stream.
    """
    _array.get_device().current_stream().synchronize()
    return _on_host(fn, args, kwargs, lambda x: x._view)


# --- shape rules -----------------------------------------------------------------------------


def reduced_shape(shape: Shape, axis: Any, keepdims: bool) -> Shape:
    """The shape of a reduction of ``shape`` over ``axis`` (None: all axes)."""
    axes = range(len(shape)) if axis is None else normalize_axis_tuple(axis, len(shape))
    if keepdims:
        return tuple(1 if i in axes else n for i, n in enumerate(shape))
    return tuple(n for i, n in enumerate(shape) if i not in axes)


def matmul_shape(a: Shape, b: Shape) -> Shape:
    """``numpy.matmul``'s output shape, with its errors."""
    for i, s in enumerate((a, b)):
        if not s:
            raise ValueError(f"matmul: Input operand {i} does not have enough dimensions")
    a2 = (1, *a) if len(a) == 1 else a
    b2 = (*b, 1) if len(b) == 1 else b
    if a2[-1] != b2[-2]:
        raise ValueError(
            f"matmul: Input operand 1 has a mismatch in its core dimension 0 "
            f"(size {b2[-2]} is different from {a2[-1]})"
        )
    batch = np.broadcast_shapes(a2[:-2], b2[:-2])
    return batch + (a2[-2:-1] if len(a) > 1 else ()) + (b2[-1:] if len(b) > 1 else ())


# --- ufuncs ----------------------------------------------------------------------------------


def _ufunc_kernel(ufunc: np.ufunc, method: str, inputs: tuple, out: tuple, kwargs: dict) -> None:
    getattr(ufunc, method)(*inputs, out=out if len(out) > 1 else out[0], **kwargs)


def _out_dummies(result: Any, outs: tuple) -> tuple:
    """Tiny outputs of the given arrays' dtypes, for NumPy to check casting to them."""
    results = result if isinstance(result, tuple) else (result,)
    return tuple(
        None if o is None else np.empty(np.shape(r), o.dtype)
        for r, o in zip(results, outs, strict=True)
    )


def array_ufunc(ufunc: np.ufunc, method: str, inputs: tuple, kwargs: dict) -> Any:
    """``SimArray.__array_ufunc__``: ``__call__``, ``reduce``, ``accumulate``, ``outer``, ``at``."""
    if method == "at":  # in place; NumPy checks the indices when the kernel runs
        target, indices, *values = inputs
        if not isinstance(target, _array.SimArray) or not all(map(is_operand, values)):
            return NotImplemented
        launch(call, ufunc.at, stage(inputs), {})
        return None
    out = kwargs.pop("out", None)
    outs = tuple(out) if out is not None else (None,) * ufunc.nout
    if not all(map(is_operand, (*inputs, kwargs.get("where")))) or not all(
        o is None or isinstance(o, _array.SimArray) for o in outs
    ):
        return NotImplemented
    if method not in ("__call__", "reduce", "accumulate", "outer"):
        return NotImplemented
    if all_empty((inputs, outs, kwargs)):
        call_kwargs = dict(kwargs, out=outs) if out is not None else kwargs
        return on_empty(getattr(ufunc, method), inputs, call_kwargs)
    shape = _ufunc_shape(ufunc, method, inputs, kwargs)
    if shape is None:
        return NotImplemented
    given = [o.shape for o in outs if o is not None]
    if method == "__call__":  # outputs may broadcast the inputs further
        shape = np.broadcast_shapes(shape, *given)
    if any(s != shape for s in given):
        raise ValueError(
            f"output operand of shape {given} does not match {ufunc.__name__}.{method}'s "
            f"output shape {shape}"
        )
    tiny_kwargs = {k: v for k, v in kwargs.items() if k != "where"}
    result = evaluate(getattr(ufunc, method), *tiny(inputs), **tiny_kwargs)
    if out is not None:  # NumPy's casting errors for these outputs
        evaluate(
            getattr(ufunc, method), *tiny(inputs), out=_out_dummies(result, outs), **tiny_kwargs
        )
    outs = tuple(
        allocate(shape, dtype) if o is None else o
        for o, dtype in zip(outs, dtypes_of(result), strict=True)
    )
    if any(o.size for o in outs):
        views = tuple(o._view for o in outs)
        launch(_ufunc_kernel, ufunc, method, stage(inputs), views, stage(kwargs))
    return outs[0] if len(outs) == 1 else outs


def _ufunc_shape(ufunc: np.ufunc, method: str, inputs: tuple, kwargs: dict) -> Shape | None:
    """The output shape of a ufunc method, or None where the sim does not implement it."""
    shapes = [np.shape(x) if not isinstance(x, _array.SimArray) else x.shape for x in inputs]
    if method == "__call__":
        if ufunc is np.matmul:
            if {"axes", "axis", "keepdims"} & kwargs.keys():
                return None
            return matmul_shape(*shapes)
        if ufunc.signature is not None:
            return None
        where = kwargs.get("where")
        extra = [where.shape] if isinstance(where, (_array.SimArray, np.ndarray)) else []
        return np.broadcast_shapes(*shapes, *extra)
    if method == "outer":
        return shapes[0] + shapes[1]
    if not isinstance(inputs[0], _array.SimArray):
        return None
    if method == "reduce":
        return reduced_shape(shapes[0], kwargs.get("axis", 0), kwargs.get("keepdims", False))
    normalize_axis_index(kwargs.get("axis", 0), max(len(shapes[0]), 1))  # accumulate
    return shapes[0]


def call(fn: Callable, args: tuple, kwargs: dict) -> None:
    """A kernel for functions that write into their arguments."""
    fn(*args, **kwargs)


# --- indexing --------------------------------------------------------------------------------


def _index(key: Any) -> tuple:
    """``key`` as a tuple of index parts, lists as host arrays (NumPy's reading)."""
    parts = key if isinstance(key, tuple) else (key,)
    parts = tuple(np.asarray(k) if isinstance(k, list) else k for k in parts)
    if not all(map(_is_index, parts)):
        raise TypeError(f"SimArray indices must be ints, slices, arrays or None, got {key!r}")
    return parts


def _device_mask(parts: tuple) -> bool:
    return any(isinstance(k, _array.SimArray) and k.dtype == np.bool_ for k in parts)


def getitem(x: _array.SimArray, key: Any) -> _array.SimArray:
    """``x[key]`` as a copy made by a kernel; a device boolean mask waits for the stream."""
    parts = _index(key)
    if _device_mask(parts):  # how many elements it selects is on the device
        return synced(operator.getitem, (x, parts), {})
    shape = shape_dummy(x)[map_arrays(parts, zeros_dummy)].shape
    (out,) = run(operator.getitem, [(shape, x.dtype)], (x, parts))
    return out


def setitem(x: _array.SimArray, key: Any, value: Any) -> None:
    """``x[key] = value`` as a kernel writing into ``x``'s buffer."""
    parts = _index(key)
    if _nested(value):  # a sequence of numbers, as NumPy reads it (not device arrays in it)
        value = np.asarray(value)
    if not is_operand(value):
        raise TypeError(f"cannot assign a {type(value).__name__} to a SimArray")
    if not _device_mask(parts):  # a device mask's selection is only known on the device
        target = shape_dummy(x)
        target[map_arrays(parts, zeros_dummy)] = shape_dummy(value)
    # NumPy's casting errors: an int too large for the dtype, a complex into reals...
    is_array = isinstance(value, (_array.SimArray, np.ndarray))
    np.empty((), x.dtype)[()] = np.ones((), value.dtype) if is_array else value
    if x.size:
        launch(operator.setitem, x._view, stage(parts), stage(value))


def astype(x: _array.SimArray, dtype: Any, casting: str = "unsafe", copy: bool = True) -> Any:
    """``x`` converted to ``dtype`` by a kernel; ``x`` itself if no copy is needed."""
    dtype = check_dtype(dtype)
    if not np.can_cast(x.dtype, dtype, casting):
        raise TypeError(
            f"Cannot cast array data from {x.dtype!r} to {dtype!r} according to the rule "
            f"{casting!r}"
        )
    if dtype == x.dtype and not copy:
        return x
    out = allocate(x.shape, dtype)
    if out.size:
        launch(_array._convert, out._view, x._view)
    return out
