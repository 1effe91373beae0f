"""``cupy`` for dask.array's own CuPy tests: the simulated device under CuPy's name.

Only the pytest session that ``tests/dask_suite/run.py`` starts puts this package on
``sys.path``; nothing else imports it, and with real CuPy installed it shadows CuPy
there alone. ``cupy.ndarray`` is :class:`dask_gpustreams.sim.SimArray`; creation
functions make arrays on the current stream (NumPy's ``like=`` dispatch to the sim),
and every other NumPy name is NumPy's own, which runs on SimArray operands through
their ``__array_ufunc__``/``__array_function__`` (each op a kernel on the current
stream). What the sim does not implement raises NumPy's TypeError, as a function
missing from CuPy would fail.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import numpy as np

from dask_gpustreams import sim
from dask_gpustreams.sim import SimArray as ndarray
from dask_gpustreams.sim import asnumpy

from . import fft, linalg, random

#: The CuPy API level the shim stands for (dask's tests gate features on it), marked as the sim.
__version__ = "13.0.0+sim"

#: A prototype for ``like=``: empty, so it takes no memory from the pool.
_LIKE = sim.empty(0)

#: NumPy functions with ``like=`` that create arrays: here they create SimArrays.
_CREATION = (
    "array asarray asanyarray ascontiguousarray empty zeros ones full arange eye identity tri"
)


def _creation(func: Any) -> Any:
    @functools.wraps(func)
    def create(*args: Any, **kwargs: Any) -> ndarray:
        return func(*args, like=_LIKE, **kwargs)

    return create


globals().update({name: _creation(getattr(np, name)) for name in _CREATION.split()})


def get_array_module(*args: Any) -> Any:
    """This module if any argument is a SimArray, else NumPy (as ``cupy.get_array_module``)."""
    return sys.modules[__name__] if any(isinstance(a, ndarray) for a in args) else np


def __getattr__(name: str) -> Any:
    """NumPy's functions, ufuncs, dtypes and constants, which dispatch on SimArray operands."""
    if name.startswith("__"):
        raise AttributeError(name)
    try:
        return getattr(np, name)
    except AttributeError:
        raise AttributeError(f"module 'cupy' (the sim shim) has no attribute {name!r}") from None


__all__ = ["asnumpy", "fft", "get_array_module", "linalg", "ndarray", "random"]
