"""``cupy.random``: NumPy's generators, their draws copied to the device on the current stream.

Draws are made on the host, when the method is called, from NumPy's bit generators,
and staged to a new SimArray (``sim.asarray``), so values are NumPy's for the same
seed, not CuPy's. SimArray parameters (``p=`` of ``choice``...) are read back first,
a host sync.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from dask_gpustreams import sim


def _host(obj: Any) -> Any:
    return obj.get() if isinstance(obj, sim.SimArray) else obj


def _drawing(method: Callable) -> Callable:
    def draw(*args: Any, **kwargs: Any) -> sim.SimArray:
        args = tuple(_host(a) for a in args)
        kwargs = {k: _host(v) for k, v in kwargs.items()}
        return sim.asarray(np.asarray(method(*args, **kwargs)))

    draw.__name__ = draw.__qualname__ = method.__name__
    return draw


class XORWOW:
    """The bit generator that dask asks the ``cupy`` backend for: NumPy's PCG64 here.

    Dask spawns one per chunk from ``_seed_seq`` and rebuilds each by its type, as
    it does for NumPy's bit generators.
    """

    def __init__(self, seed: Any = None):
        self._seed_seq = seed if isinstance(seed, np.random.SeedSequence) else None
        if self._seed_seq is None:
            self._seed_seq = np.random.SeedSequence(seed)
        self._numpy = np.random.PCG64(self._seed_seq)


class Generator:
    """``cupy.random.Generator``: each distribution method returns a SimArray."""

    def __init__(self, bit_generator: XORWOW):
        self.bit_generator = bit_generator
        self._numpy = np.random.Generator(bit_generator._numpy)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return _drawing(getattr(self._numpy, name))


class RandomState:
    """``cupy.random.RandomState`` over ``numpy.random.RandomState``; draws are SimArrays."""

    def __init__(self, seed: Any = None):
        self._numpy = np.random.RandomState(_host(seed))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return _drawing(getattr(self._numpy, name))


def default_rng(seed: Any = None) -> Generator:
    """A :class:`Generator`; a bit generator given as ``seed`` is used as is."""
    return Generator(seed if isinstance(seed, XORWOW) else XORWOW(seed))
