"""More NumPy functions on :class:`SimArray`: the routines dask.array's CuPy tests call on chunks.

Registered in :data:`dask_gpustreams.sim._functions.FUNCTIONS` like the others:
each predicts its outputs' shapes (by a rule per function) and dtypes (NumPy on
tiny dummies) at launch and enqueues NumPy's function as the kernel; the kernel
fails if NumPy's result differs from the prediction. Functions whose output
shape depends on the data (``bincount``, ``compress``, ``lstsq``'s residuals)
run after a host sync, as in CuPy.
"""

from __future__ import annotations

import inspect
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np

from dask_gpustreams.sim import _array, _ops
from dask_gpustreams.sim._functions import (
    _bind,
    _compute,
    _elementwise,
    _no_out,
    _numpy,
    _on_array,
    _on_tiny,
    _register,
    _shape,
    _synced,
)
from dask_gpustreams.sim._ops import normalize_axis_index, normalize_axis_tuple

_register(_elementwise, _numpy("isreal iscomplex fix i0 sinc nan_to_num"))
_register(_synced, _numpy("bincount compress", np))
_register(_synced, (np.linalg.lstsq,))


def _shaped_as(func: Callable, name: str | None, *args: Any, **kwargs: Any) -> Any:
    """Outputs of the shape of argument ``name`` (None: the first); dtypes from tiny dummies.

    ``tril``, ``triu``, ``digitize`` (the first), ``searchsorted`` (``v``), ``interp`` (``x``).
    """
    bound = _bind(func, args, kwargs)
    _no_out(func, bound.arguments)
    params = bound.arguments
    (out,) = _compute(func, [_shape(params[name] if name else next(iter(params.values())))], bound)
    return out


_register(_shaped_as, _numpy("tril triu digitize"), None)
_register(_shaped_as, (np.searchsorted,), "v")
_register(_shaped_as, (np.interp,), "x")


def _diff(
    func: Callable,
    a: Any,
    n: int = 1,
    axis: int = -1,
    prepend: Any = np._NoValue,
    append: Any = np._NoValue,
) -> Any:
    """``numpy.diff``: the axis grows by what is prepended and appended, then shrinks by ``n``."""
    if not isinstance(a, _array.SimArray):
        return NotImplemented
    if n == 0:
        return a  # as NumPy: the input itself
    if n < 0:
        raise ValueError(f"order must be non-negative but got {n!r}")
    if a.ndim == 0:
        raise ValueError("diff requires input that is at least one dimensional")
    axis = normalize_axis_index(axis, a.ndim)
    size = a.shape[axis]
    kwargs = {"n": n, "axis": axis}
    for name, extra in (("prepend", prepend), ("append", append)):
        if extra is not np._NoValue:
            if _ops._nested(extra):  # nested lists of numbers, as NumPy reads them
                extra = np.asarray(extra)
            kwargs[name] = extra
            size += _shape(extra)[axis] if np.ndim(extra) else 1
    shape = (*a.shape[:axis], max(size - n, 0), *a.shape[axis + 1 :])
    dtypes = _ops.dtypes_of(_ops.evaluate(func, _ops.tiny(a), **_ops.tiny(kwargs)))
    (out,) = _ops.run(func, [(shape, dtypes[0])], (a,), kwargs)
    return out


_register(_diff, (np.diff,))


def _einsum_shape(subscripts: str, shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    """The output shape of ``numpy.einsum(subscripts, *operands)`` (explicit or implicit form)."""
    inputs, arrow, output = subscripts.replace(" ", "").partition("->")
    terms = inputs.split(",")
    if len(terms) != len(shapes):
        raise ValueError(
            f"einsum: {len(terms)} operands in the subscripts string, {len(shapes)} given"
        )
    sizes: dict[str, int] = {}
    ellipses = []
    for term, shape in zip(terms, shapes, strict=True):
        term = term.replace("...", ".")  # '.' stands for the ellipsis' dimensions
        if "." in term:
            i, n = term.index("."), len(shape) - len(term) + 1
            ellipses.append(shape[i : i + n])
            term, shape = term[:i] + term[i + 1 :], shape[:i] + shape[i + n :]
        if len(term) != len(shape):
            raise ValueError(
                f"einsum: operand of shape {shape} has {len(shape)} dimensions, "
                f"subscripts {term!r} name {len(term)}"
            )
        for label, n in zip(term, shape, strict=True):
            known = sizes.get(label, 1)
            if n != known and 1 not in (n, known):
                raise ValueError(
                    f"einsum: operands could not be broadcast together: dimension {label!r} "
                    f"is {known} and {n}"
                )
            sizes[label] = max(n, known) if 1 in (n, known) else n
    ellipsis = np.broadcast_shapes(*ellipses) if ellipses else ()
    if arrow:
        out = output.replace("...", ".")
    else:  # implicit: the labels seen once, in alphabetical order, after the ellipsis
        counts = Counter(label for term in terms for label in term.replace("...", ""))
        out = ("." if ellipses else "") + "".join(sorted(k for k, c in counts.items() if c == 1))
    shape: tuple[int, ...] = ()
    for label in out:
        shape += ellipsis if label == "." else (sizes[label],)
    return shape


def _einsum(func: Callable, *operands: Any, out: Any = None, **kwargs: Any) -> Any:
    """``numpy.einsum`` in its subscripts-string form."""
    if out is not None:
        raise TypeError("SimArray: out= is not supported by einsum (only by ufuncs)")
    if not operands or not isinstance(operands[0], str):
        return NotImplemented  # the interleaved form einsum(a, [0, 1], b, [1, 2])
    subscripts, arrays = operands[0], operands[1:]
    shape = _einsum_shape(subscripts, [_shape(x) for x in arrays])
    dtypes = _ops.dtypes_of(_ops.evaluate(func, subscripts, *_ops.tiny(arrays), **kwargs))
    (result,) = _ops.run(func, [(shape, dtypes[0])], operands, kwargs)
    return result


_register(_einsum, (np.einsum,))


def _linspace(
    func: Callable,
    start: Any,
    stop: Any,
    num: int = 50,
    endpoint: bool = True,
    retstep: bool = False,
    dtype: Any = None,
    axis: int = 0,
    **kwargs: Any,
) -> Any:
    """``numpy.linspace`` with array ends: ``num`` samples inserted at ``axis``."""
    if retstep or kwargs:
        return NotImplemented
    if num < 0:
        raise ValueError(f"Number of samples, {num}, must be non-negative.")
    ends = np.broadcast_shapes(_shape(start), _shape(stop))
    axis = normalize_axis_index(axis, len(ends) + 1)
    shape = (*ends[:axis], int(num), *ends[axis:])
    options = {"num": int(num), "endpoint": endpoint, "dtype": dtype, "axis": axis}
    tiny = _ops.evaluate(func, *_ops.tiny((start, stop)), **dict(options, num=2))
    (out,) = _ops.run(func, [(shape, tiny.dtype)], (start, stop), options)
    return out


_register(_linspace, (np.linspace,))


def _percentile(func: Callable, bound: inspect.BoundArguments, a: _array.SimArray) -> Any:
    """``percentile``, ``quantile`` and their nan forms: ``q``'s shape, then the reduced shape."""
    params = bound.arguments
    if params.get("weights") is not None or params.get("overwrite_input"):
        return NotImplemented
    axis = params.get("axis")
    if axis is not None:
        normalize_axis_tuple(axis, a.ndim)
    reduced = _ops.reduced_shape(a.shape, axis, bool(params.get("keepdims", False)))
    # q of ones: a valid quantile (1) and percentile (1 %) on tiny dummies.
    dtypes = _ops.dtypes_of(_on_tiny(func, bound))
    shape = _shape(params["q"]) + reduced
    (out,) = _ops.run(func, [(shape, dtypes[0])], bound.args, bound.kwargs)
    return out


_register(_on_array(_percentile), _numpy("percentile quantile nanpercentile nanquantile"))


def _host_created(func: Callable, *args: Any, **kwargs: Any) -> Any:
    """``numpy.arange(..., like=a_sim_array)``: made on the host, copied on the current stream.

    ``arange``'s ``dtype`` may be positional, which its signature does not say.
    """
    if _ops.has_sim_operand((args, kwargs)):
        return NotImplemented
    return _ops.upload(func(*args, **kwargs))


_register(_host_created, (np.arange,))


def view(x: _array.SimArray, dtype: Any = None) -> _array.SimArray:
    """``x``'s bytes read as ``dtype``: a copy made by a kernel (SimArray results are never views).

    As NumPy's ``view``, the last axis is rescaled by the ratio of item sizes,
    which must divide its bytes.
    """
    dtype = x.dtype if dtype is None else _ops.check_dtype(dtype)
    shape = x.shape
    if dtype.itemsize != x.dtype.itemsize:
        if not shape:
            raise ValueError(
                "Changing the dtype of a 0d array is only supported if the itemsize is unchanged"
            )
        nbytes = shape[-1] * x.dtype.itemsize
        if nbytes % dtype.itemsize:
            raise ValueError(
                "When changing to a larger dtype, its size must be a divisor of the total size "
                "in bytes of the last axis of the array."
            )
        shape = (*shape[:-1], nbytes // dtype.itemsize)
    out = _ops.allocate(shape, dtype)
    if out.size:
        _ops.launch(_copy_bytes, out._view, x._view)
    return out


def sort(x: _array.SimArray, axis: int = -1) -> None:
    """``x`` sorted in place along ``axis`` by a kernel on the current stream."""
    if x.ndim == 0:
        raise np.exceptions.AxisError(axis, 0)
    axis = normalize_axis_index(axis, x.ndim)
    if x.size:
        _ops.launch(_sort_kernel, x._view, axis)


def _sort_kernel(view: np.ndarray, axis: int) -> None:
    view.sort(axis=axis)


def _copy_bytes(out: np.ndarray, src: np.ndarray) -> None:
    out.reshape(-1).view(np.uint8)[:] = src.reshape(-1).view(np.uint8)
