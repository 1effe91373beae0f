"""The simulated stream device: GPU stream semantics on the CPU.

Streams are FIFOs run by their own threads, events are markers in them,
memory comes from a per-stream pool that poisons reused blocks in stream
order, and kernel failures surface at the next dependent host sync. Ordering
or lifetime bugs therefore show up as wrong values, on a laptop or in CI.

:class:`SimArray` implements NumPy's array protocols as ``cupy.ndarray`` does:
operators, ufuncs, indexing and the NumPy functions dask.array calls on chunks
enqueue kernels on the current stream, so dask.array expressions run over
SimArray chunks (``da.from_array(a).map_blocks(sim.asarray)``). Other kernels
are functions of NumPy views, enqueued with :func:`launch`.

>>> from dask_gpustreams import sim
>>> x = sim.asarray(np.arange(4.0))
>>> sim.launch(lambda v: np.multiply(v, 2, out=v), x)
>>> (x + 1).get()
array([1., 3., 5., 7.])
"""

from dask_gpustreams.sim._array import (
    SimArray,
    alloc_pinned,
    asarray,
    asnumpy,
    empty,
    get_allocator,
    get_default_memory_pool,
    get_device,
    launch,
    using_allocator,
)
from dask_gpustreams.sim._device import Device, Event, Stream
from dask_gpustreams.sim._memory import POISON_BYTE, MemoryPool, OutOfMemoryError, UnownedBlock

__all__ = [
    "POISON_BYTE",
    "Device",
    "Event",
    "MemoryPool",
    "OutOfMemoryError",
    "SimArray",
    "Stream",
    "UnownedBlock",
    "alloc_pinned",
    "asarray",
    "asnumpy",
    "empty",
    "get_allocator",
    "get_default_memory_pool",
    "get_device",
    "launch",
    "using_allocator",
]
