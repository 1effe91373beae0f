"""SimArray over distributed's "dask" serializer, as ``distributed/protocol/cupy.py`` does for
CuPy: copied to the host with ``asnumpy`` on the serializing thread's current stream (after
the work queued on it, without syncing the device), and back to the device on the receiver's.

Without it a SimArray falls back to pickle, a snapshot that waits for nothing (``SimArray.
__reduce__``, host code's copy on an unrelated stream): plain Dask's gathers and peer fetches
then read results whose kernels are still queued on the default stream, which on a GPU's
legacy default stream they cannot."""

from __future__ import annotations

from distributed.protocol.numpy import deserialize_numpy_ndarray, serialize_numpy_ndarray
from distributed.protocol.serialize import dask_deserialize, dask_serialize

from dask_gpustreams import sim


@dask_serialize.register(sim.SimArray)
def _serialize(x: sim.SimArray) -> tuple[dict, list]:
    return serialize_numpy_ndarray(sim.asnumpy(x))


@dask_deserialize.register(sim.SimArray)
def _deserialize(header: dict, frames: list) -> sim.SimArray:
    out = sim.asarray(deserialize_numpy_ndarray(header, frames))
    sim.get_device().current_stream().synchronize()  # arrives complete, as unpickled data
    return out
