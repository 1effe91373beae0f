"""``SimArray.__array_function__``: the NumPy functions the sim implements, by kind of op.

Each kind finds its outputs' shapes and dtypes at launch (see
:mod:`dask_gpustreams.sim._ops`) and enqueues NumPy's own function as the
kernel. Functions missing here raise NumPy's ``TypeError`` ("no implementation
found ..."), as they would for a CuPy array without a CuPy equivalent.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import numpy as np

from dask_gpustreams.sim import _array, _ops
from dask_gpustreams.sim._ops import normalize_axis_index

#: NumPy function -> its implementation, called with the function's own arguments.
FUNCTIONS: dict[Callable, Callable] = {}


def array_function(func: Callable, types: tuple, args: tuple, kwargs: dict) -> Any:
    """Run ``func`` on the sim, or NotImplemented for functions and types it does not know."""
    impl = FUNCTIONS.get(func)
    if impl is None or not all(t is np.ndarray or issubclass(t, _array.SimArray) for t in types):
        return NotImplemented
    if _ops.all_empty((args, kwargs)):
        return _ops.on_empty(func, args, kwargs)
    return impl(*args, **kwargs)


def _numpy(names: str, module: Any = np) -> tuple:
    """The functions of these names in ``module`` (None for those this NumPy lacks)."""
    return tuple(getattr(module, name, None) for name in names.split())


def _register(impl: Callable, funcs: tuple, *options: Any) -> None:
    for func in funcs:
        if func is not None:
            FUNCTIONS[func] = functools.partial(impl, func, *options)


@functools.cache
def _signature(func: Callable) -> inspect.Signature:
    return inspect.signature(func)


def _bind(func: Callable, args: tuple, kwargs: dict) -> inspect.BoundArguments:
    return _signature(func).bind(*args, **kwargs)


def _on_tiny(func: Callable, bound: inspect.BoundArguments, **replace: Any) -> Any:
    """``func`` called as bound, on tiny dummies, with arguments replaced (None: dropped)."""
    arguments = {k: _ops.tiny(v) for k, v in bound.arguments.items()}
    for name, value in replace.items():
        arguments.pop(name, None)
        if value is not None:
            arguments[name] = value
    tiny = inspect.BoundArguments(bound.signature, arguments)
    return _ops.evaluate(func, *tiny.args, **tiny.kwargs)


def _no_out(func: Callable, params: dict) -> None:
    if params.get("out") is not None:
        raise TypeError(f"SimArray: out= is not supported by {func.__name__} (only by ufuncs)")


def _on_array(impl: Callable, *options: Any) -> Callable:
    """The handler of ``func(*args, **kwargs)``, a function of an array ``a``, through ``impl``.

    It calls ``impl(func, bound, a, *options)`` with the call bound; NotImplemented
    where ``a`` is no SimArray. Refuses ``out=`` (:func:`_no_out`).
    """

    def handler(func: Callable, *args: Any, **kwargs: Any) -> Any:
        bound = _bind(func, args, kwargs)
        a = bound.arguments["a"]
        if not isinstance(a, _array.SimArray):
            return NotImplemented
        _no_out(func, bound.arguments)
        return impl(func, bound, a, *options)

    return handler


def _shape(x: Any) -> tuple[int, ...]:
    return x.shape if isinstance(x, _array.SimArray) else np.shape(x)


def _default(bound: inspect.BoundArguments, name: str) -> Any:
    if name in bound.arguments:
        return bound.arguments[name]
    return bound.signature.parameters[name].default


def _compute(func: Callable, shapes: list, bound: inspect.BoundArguments, **replace: Any) -> list:
    """Outputs of ``shapes``, dtypes from ``func`` on tiny dummies, filled by ``func``."""
    dtypes = _ops.dtypes_of(_on_tiny(func, bound, **replace))
    return _ops.run(func, list(zip(shapes, dtypes, strict=True)), bound.args, bound.kwargs)


# --- elementwise -----------------------------------------------------------------------------


def _elementwise(func: Callable, *args: Any, **kwargs: Any) -> _array.SimArray:
    """Broadcasting functions that are not ufuncs: ``where``, ``clip``, ``round``..."""
    bound = _bind(func, args, kwargs)
    _no_out(func, bound.arguments)
    arrays = [v for v in bound.arguments.values() if isinstance(v, (_array.SimArray, np.ndarray))]
    shape = np.broadcast_shapes(*(_shape(a) for a in arrays))
    (out,) = _compute(func, [shape], bound, out=None)
    return out


def _where(func: Callable, condition: Any, x: Any = None, y: Any = None) -> Any:
    if x is None and y is None:  # nonzero: how many is on the device
        return _ops.synced(func, (condition,), {})
    return _elementwise(func, condition, x, y)


def _astype(func: Callable, x: Any, dtype: Any, /, *, copy: bool = True, device: Any = None) -> Any:
    if not isinstance(x, _array.SimArray):
        return NotImplemented
    return _ops.astype(x, dtype, copy=copy)


_register(_elementwise, _numpy("clip round around real imag isclose copy angle"))
_register(_where, (np.where,))
_register(_astype, _numpy("astype"))


# --- reductions and scans --------------------------------------------------------------------


def _reduction(func: Callable, bound: inspect.BoundArguments, a: _array.SimArray) -> Any:
    """``sum``, ``mean``, ``std``, ``argmax``...: the reduced shape; dtypes from tiny dummies."""
    params = bound.arguments
    # ddof only changes values; on a tiny dummy it would warn of too few degrees of freedom.
    dtypes = _ops.dtypes_of(_on_tiny(func, bound, out=None, ddof=None, correction=None))
    keepdims = params.get("keepdims", False)
    keepdims = keepdims is not np._NoValue and bool(keepdims)
    shape = _ops.reduced_shape(a.shape, params.get("axis"), keepdims)
    (out,) = _ops.run(func, [(shape, dtypes[0])], bound.args, bound.kwargs)
    return out


def _along_axis(func: Callable, bound: inspect.BoundArguments, a: _array.SimArray) -> Any:
    """``cumsum``, ``sort``...: the input's shape, or its size flattened for ``axis=None``."""
    axis = _default(bound, "axis")
    if axis is None:
        shape = (a.size,)
    else:
        normalize_axis_index(axis, a.ndim)
        shape = a.shape
    (out,) = _compute(func, [shape], bound, out=None)
    return out


_register(
    _on_array(_reduction),
    _numpy(
        "sum prod mean std var max min amax amin any all argmax argmin nansum nanprod nanmean "
        "nanstd nanvar nanmax nanmin nanargmax nanargmin median nanmedian ptp count_nonzero"
    ),
)
_register(_on_array(_along_axis), _numpy("cumsum cumprod nancumsum nancumprod sort argsort"))


# --- moving elements: shapes from NumPy on shape dummies -------------------------------------

#: dtype rules of the ops that move elements (see _structural)
PROMOTE, SAME, EACH = "promote", "same", "each"


def _structural(func: Callable, rule: str, *args: Any, **kwargs: Any) -> Any:
    """``concatenate``, ``transpose``, ``take``, ``split``...: NumPy works out the shapes itself.

    ``rule``: the outputs take the promoted dtype of the arrays in the first
    argument, or ``dtype=`` (PROMOTE); the first argument's dtype (SAME); each
    the dtype of the matching argument (EACH, for ``broadcast_arrays(*arrays)``).
    """
    _no_out(func, kwargs)
    data, params = (args, ()) if rule == EACH else (args[:1], args[1:])
    if rule == SAME and not isinstance(data[0], (_array.SimArray, np.ndarray)):
        return NotImplemented
    if func is not np.take and _ops.has_sim_operand((params, kwargs)):
        return NotImplemented  # a device array as a parameter (repeats...) would set shapes
    meta_kwargs = {k: v for k, v in kwargs.items() if k not in ("dtype", "casting")}
    meta = func(
        *_ops.map_arrays(data, _ops.shape_dummy, _ops.shape_dummy),
        *_ops.map_arrays(params, _ops.zeros_dummy),
        **_ops.map_arrays(meta_kwargs, _ops.zeros_dummy),
    )
    multi = isinstance(meta, (list, tuple))
    shapes = [m.shape for m in meta] if multi else [meta.shape]
    if rule == EACH:
        dtypes = [np.asarray(x).dtype if np.isscalar(x) else x.dtype for x in data]
    elif rule == PROMOTE:
        dtype = kwargs.get("dtype")
        if dtype is None:
            dtype = np.result_type(*(getattr(x, "dtype", x) for x in data[0]))
        dtypes = [np.dtype(dtype)]
    else:
        dtypes = [data[0].dtype] * len(shapes)
    outs = _ops.run(func, list(zip(shapes, dtypes, strict=True)), args, kwargs, multi)
    return type(meta)(outs) if multi else outs[0]


_register(_structural, _numpy("concatenate stack hstack vstack"), PROMOTE)
_register(
    _structural,
    _numpy(
        "transpose reshape ravel squeeze expand_dims broadcast_to moveaxis swapaxes flip roll "
        "tile repeat take split array_split diagonal diag"
    ),
    SAME,
)
_register(_structural, _numpy("broadcast_arrays atleast_1d atleast_2d atleast_3d"), EACH)


# --- linear algebra and FFTs: shapes by rule -------------------------------------------------


def _dot_shape(a: tuple, b: tuple) -> tuple:
    if not a or not b:  # a scalar factor: a product
        return a or b
    k_b = b[-2] if len(b) > 1 else b[0]
    if a[-1] != k_b:
        raise ValueError(
            f"shapes {a} and {b} not aligned: {a[-1]} (dim {len(a) - 1}) != "
            f"{k_b} (dim {max(len(b) - 2, 0)})"
        )
    return a[:-1] + b[:-2] + b[-1:] if len(b) > 1 else a[:-1]


def _tensordot_shape(a: tuple, b: tuple, axes: Any) -> tuple:
    """``numpy.tensordot``'s output shape, with its error."""
    if np.ndim(axes) == 0:
        axes_a, axes_b = list(range(-axes, 0)), list(range(axes))
    else:
        axes_a, axes_b = ([x] if np.ndim(x) == 0 else list(x) for x in axes)
    if len(axes_a) != len(axes_b) or any(a[i] != b[j] for i, j in zip(axes_a, axes_b, strict=True)):
        raise ValueError("shape-mismatch for sum")
    sum_a = {normalize_axis_index(i, len(a)) for i in axes_a}
    sum_b = {normalize_axis_index(j, len(b)) for j in axes_b}
    return tuple(n for i, n in enumerate(a) if i not in sum_a) + tuple(
        n for j, n in enumerate(b) if j not in sum_b
    )


def _products(func: Callable, *args: Any, **kwargs: Any) -> _array.SimArray:
    """``dot``, ``tensordot``, ``outer``."""
    bound = _bind(func, args, kwargs)
    _no_out(func, bound.arguments)
    a, b = _shape(bound.arguments["a"]), _shape(bound.arguments["b"])
    if func is np.dot:
        shape = _dot_shape(a, b)
    elif func is np.tensordot:
        shape = _tensordot_shape(a, b, _default(bound, "axes"))
    else:  # outer
        shape = (int(np.prod(a)), int(np.prod(b)))
    (out,) = _compute(func, [shape], bound, out=None)
    return out


def _qr(func: Callable, a: Any, mode: str = "reduced") -> Any:
    if not isinstance(a, _array.SimArray) or mode not in ("reduced", "complete", "r"):
        return NotImplemented
    tiny = _ops.evaluate(func, _ops.tiny(a), mode=mode)
    *batch, m, n = a.shape
    k = min(m, n)
    shapes = {"reduced": [(m, k), (k, n)], "complete": [(m, m), (m, n)], "r": [(k, n)]}[mode]
    outputs = [((*batch, *s), dtype) for s, dtype in zip(shapes, _ops.dtypes_of(tiny), strict=True)]
    outs = _ops.run(func, outputs, (a,), {"mode": mode}, multi=mode != "r")
    return outs[0] if mode == "r" else type(tiny)(*outs)


def _svd(
    func: Callable,
    a: Any,
    full_matrices: bool = True,
    compute_uv: bool = True,
    hermitian: bool = False,
) -> Any:
    if not isinstance(a, _array.SimArray):
        return NotImplemented
    options = {"full_matrices": full_matrices, "compute_uv": compute_uv, "hermitian": hermitian}
    tiny = _ops.evaluate(func, _ops.tiny(a), **options)
    *batch, m, n = a.shape
    k = min(m, n)
    shapes = [(k,)]
    if compute_uv:
        shapes = [(m, m if full_matrices else k), (k,), (n if full_matrices else k, n)]
    outputs = [((*batch, *s), dtype) for s, dtype in zip(shapes, _ops.dtypes_of(tiny), strict=True)]
    outs = _ops.run(func, outputs, (a,), options, multi=compute_uv)
    return type(tiny)(*outs) if compute_uv else outs[0]


def _fft(
    func: Callable, bound: inspect.BoundArguments, a: _array.SimArray, kind: str
) -> _array.SimArray:
    """The FFTs: ``kind`` is "c2c", "r2c" (``rfft*``, half the last axis) or "c2r" (``irfft*``)."""
    if "n" in bound.signature.parameters:  # one axis
        n = bound.arguments.get("n")
        axes, sizes = [_default(bound, "axis")], None if n is None else [n]
    else:
        sizes, axes = bound.arguments.get("s"), _default(bound, "axes")
        if axes is None:
            axes = range(a.ndim) if sizes is None else range(-len(sizes), 0)
    axes = [normalize_axis_index(ax, a.ndim) for ax in axes]
    if sizes is None:
        sizes = [a.shape[ax] for ax in axes]
        if kind == "c2r":
            sizes[-1] = 2 * (sizes[-1] - 1)
    elif len(sizes) != len(axes):
        raise ValueError("Shape and axes have different lengths.")
    else:
        sizes = [a.shape[ax] if s == -1 else s for ax, s in zip(axes, sizes, strict=True)]
    shape = list(a.shape)
    for ax, size in zip(axes, sizes, strict=True):
        shape[ax] = size
    if kind == "r2c":
        shape[axes[-1]] = sizes[-1] // 2 + 1
    # On tiny dummies two points per axis: enough for every kind.
    replace = {"n": 2} if "n" in bound.signature.parameters else {"s": (2,) * len(axes)}
    if "axes" in bound.signature.parameters:
        replace["axes"] = axes
    (out,) = _compute(func, [tuple(shape)], bound, out=None, **replace)
    return out


_register(_products, (np.dot, np.tensordot, np.outer))
_register(_qr, (np.linalg.qr,))
_register(_svd, (np.linalg.svd,))
_register(_on_array(_fft, "c2c"), _numpy("fft ifft fft2 ifft2 fftn ifftn", np.fft))
_register(_on_array(_fft, "r2c"), _numpy("rfft rfft2 rfftn", np.fft))
_register(_on_array(_fft, "c2r"), _numpy("irfft irfft2 irfftn", np.fft))


# --- indices ---------------------------------------------------------------------------------


def _check_int(func: Callable, x: Any) -> None:
    dtype = x.dtype if isinstance(x, (_array.SimArray, np.ndarray)) else np.asarray(x).dtype
    if dtype.kind not in "iu":
        raise TypeError(f"{func.__name__}: only int indices permitted, got {dtype}")


def _unravel_index(func: Callable, indices: Any, shape: Any, order: str = "C") -> Any:
    if not isinstance(indices, _array.SimArray):
        return NotImplemented
    _check_int(func, indices)
    dims = tuple(shape) if np.ndim(shape) else (shape,)
    outputs = [(indices.shape, np.intp)] * len(dims)
    return tuple(_ops.run(func, outputs, (indices, dims), {"order": order}, multi=True))


def _ravel_multi_index(
    func: Callable, multi_index: Any, dims: Any, mode: str = "raise", order: str = "C"
) -> Any:
    for x in multi_index:
        _check_int(func, x)
    shape = np.broadcast_shapes(*(_shape(x) for x in multi_index))
    kwargs = {"mode": mode, "order": order}
    (out,) = _ops.run(func, [(shape, np.intp)], (tuple(multi_index), dims), kwargs)
    return out


_register(_unravel_index, (np.unravel_index,))
_register(_ravel_multi_index, (np.ravel_multi_index,))


# --- writing into an array -------------------------------------------------------------------


def _copyto(
    func: Callable, dst: Any, src: Any, casting: str = "same_kind", where: Any = True
) -> Any:
    """``copyto`` into a device array, checked at launch as NumPy would check it."""
    if not isinstance(dst, _array.SimArray):
        return NotImplemented
    where_dummy = _ops.map_arrays(where, _ops.zeros_dummy, _ops.zeros_dummy)
    func(_ops.shape_dummy(dst), _ops.shape_dummy(src), where=where_dummy)  # NumPy's shape errors
    is_array = isinstance(src, (_array.SimArray, np.ndarray))
    func(np.empty((), dst.dtype), np.ones((), src.dtype) if is_array else src, casting=casting)
    if dst.size:
        kwargs = {"casting": casting, "where": _ops.stage(where)}
        _ops.launch(_ops.call, func, (dst._view, _ops.stage(src)), kwargs)


_register(_copyto, (np.copyto,))


# --- creation --------------------------------------------------------------------------------


def _shape_arg(shape: Any) -> tuple[int, ...]:
    return tuple(int(n) for n in shape) if np.ndim(shape) else (int(shape),)


def _filled(shape: Any, dtype: Any, value: Any) -> _array.SimArray:
    """A new array of ``value``, written by a kernel (NumPy's ``full`` casts unsafely)."""
    out = _ops.allocate(_shape_arg(shape), dtype)
    if out.size:
        _ops.launch(_ops.call, np.copyto, (out._view, _ops.stage(value)), {"casting": "unsafe"})
    return out


def _filled_like(func: Callable, value: Any, *args: Any, **kwargs: Any) -> Any:
    """``empty_like``, ``zeros_like``, ``ones_like`` (``value``), ``full_like``."""
    bound = _bind(func, args, kwargs)
    params = bound.arguments
    prototype = next(iter(params.values()))
    if not isinstance(prototype, _array.SimArray):
        return NotImplemented
    shape = params.get("shape")
    shape = prototype.shape if shape is None else shape
    dtype = params.get("dtype")
    dtype = prototype.dtype if dtype is None else dtype
    if func is np.empty_like:
        return _ops.allocate(_shape_arg(shape), dtype)
    return _filled(shape, dtype, params["fill_value"] if func is np.full_like else value)


def _created(func: Callable, *args: Any, **kwargs: Any) -> Any:
    """``numpy.<creation>(..., like=a_sim_array)``: NumPy passes the call on without ``like``."""
    bound = _bind(func, args, kwargs)
    params = bound.arguments
    dtype = params.get("dtype")
    if func in (np.empty, np.zeros, np.ones):
        dtype = np.float64 if dtype is None else dtype
        if func is np.empty:
            return _ops.allocate(_shape_arg(params["shape"]), dtype)
        return _filled(params["shape"], dtype, 0 if func is np.zeros else 1)
    if func is np.full:
        value = params["fill_value"]
        if dtype is None:
            dtype = value.dtype if isinstance(value, _array.SimArray) else np.asarray(value).dtype
        return _filled(params["shape"], dtype, value)
    obj = next(iter(params.values()))
    if _ops._nested(obj) and _ops.has_sim_operand(obj):  # array([x, y]), as CuPy takes it
        obj = _stacked(obj)
    if isinstance(obj, _array.SimArray):  # array(x), asarray(x): a device copy or conversion
        copy = params.get("copy", func is np.array)
        return _ops.astype(obj, obj.dtype if dtype is None else dtype, copy=bool(copy))
    return _ops.upload(func(*bound.args, **bound.kwargs))


def _stacked(obj: Any) -> Any:
    """Nested lists of device arrays (and numbers) as one array, stacked on the device."""
    return np.stack([_stacked(item) for item in obj]) if _ops._nested(obj) else obj


_register(_filled_like, (np.empty_like,), None)
_register(_filled_like, (np.zeros_like,), 0)
_register(_filled_like, (np.ones_like,), 1)
_register(_filled_like, (np.full_like,), None)
_register(
    _created,
    _numpy(
        "array asarray asanyarray ascontiguousarray empty zeros ones full arange eye identity tri"
    ),
)


# --- host values and data-dependent shapes: after a host sync --------------------------------


def _synced(func: Callable, *args: Any, **kwargs: Any) -> Any:
    return _ops.synced(func, args, kwargs)


def _metadata(func: Callable, *args: Any, **kwargs: Any) -> Any:
    """``shape``, ``result_type``...: answered from shapes and dtypes, without the device."""
    return func(
        *_ops.map_arrays(args, _ops.zeros_dummy), **_ops.map_arrays(kwargs, _ops.zeros_dummy)
    )


_register(_synced, _numpy("nonzero argwhere flatnonzero unique allclose array_equal array_equiv"))
_register(_metadata, _numpy("shape ndim size result_type can_cast iscomplexobj isrealobj"))
