"""The simulated stream device: GPU stream semantics on the CPU.

Streams are FIFOs run by their own threads, events are markers in them,
memory comes from a per-stream pool that poisons reused blocks in stream
order, and kernel failures surface at the next dependent host sync. Ordering
or lifetime bugs therefore show up as wrong values, on a laptop or in CI.

>>> from dask_gpustreams import sim
>>> x = sim.asarray(np.arange(4.0))
>>> sim.launch(lambda v: np.multiply(v, 2, out=v), x)
>>> x.get()
array([0., 2., 4., 6.])
"""

from dask_gpustreams.sim._array import (
    SimArray,
    asarray,
    asnumpy,
    empty,
    get_default_memory_pool,
    get_device,
    launch,
)
from dask_gpustreams.sim._device import Device, Event, Stream
from dask_gpustreams.sim._memory import POISON_BYTE, MemoryPool

__all__ = [
    "POISON_BYTE",
    "Device",
    "Event",
    "MemoryPool",
    "SimArray",
    "Stream",
    "asarray",
    "asnumpy",
    "empty",
    "get_default_memory_pool",
    "get_device",
    "launch",
]
