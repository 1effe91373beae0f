"""Host-device copies on dedicated copy streams, staged through pinned memory.

Uploads run on host-to-device streams and downloads on device-to-host streams,
beside the compute streams, so copies of one chunk overlap kernels of others.
Both are ordered with compute by events: the compute stream that uses an
upload waits for its copy event, a download's copy stream waits for the
compute stream's work so far. A download returns a complete NumPy array: it
waits (on the host) for its own copy only. While the pinned pool's allowance
for results has room, the device copies straight into the pinned array that
is returned; beyond it, into a staging buffer that is copied to pageable memory.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np

from dask_gpustreams.backends.base import Backend
from dask_gpustreams.runtime.pinned import PinnedPool
from dask_gpustreams.runtime.policies import RoundRobin, TaskInfo
from dask_gpustreams.runtime.pool import StreamPool
from dask_gpustreams.runtime.registry import EventRegistry


class Transfers:
    """One device's copy streams and pinned staging pool."""

    def __init__(self, backend: Backend, copy_streams: int, pinned_limit: int):
        self.backend = backend
        self.h2d = StreamPool(backend, copy_streams)
        self.d2h = StreamPool(backend, copy_streams)
        self.pinned = PinnedPool(backend, pinned_limit)
        # Copies take each pool's streams in turn: a task with no producers, to the policy.
        self._copy = TaskInfo("gpustreams-copy", (), EventRegistry())
        self._h2d_turns = RoundRobin()
        self._d2h_turns = RoundRobin()

    def to_device(self, host: Any, stream: Any, holds: list | None = None) -> Any:
        """Upload ``host`` on a copy stream; ``stream`` waits for the copy, the host does not.

        The data is staged into pinned memory before this returns, so the
        caller may reuse ``host`` at once. Inside a task, pass the task's
        ``holds``: the array is then allocated on the copy stream and held
        until the task's event completes, since ``stream`` reads it. Without
        ``holds`` it is allocated on ``stream`` and the copy waits for the
        work already on ``stream`` (whose freed blocks it may reuse).
        """
        backend = self.backend
        host = np.asarray(host)
        if host.dtype.hasobject:
            raise TypeError(f"cannot copy an array of dtype {host.dtype} to the device")
        if host.nbytes == 0:
            with backend.use_stream(stream):
                return backend.empty(host.shape, host.dtype)
        slot = self._h2d_turns.select(self._copy, self.h2d)
        buffer = self.pinned.acquire(host.nbytes)
        copied = None
        try:
            staged = buffer[: host.nbytes].view(host.dtype).reshape(host.shape)
            np.copyto(staged, host)
            if holds is not None:
                with backend.use_stream(slot.stream):
                    out = backend.empty(host.shape, host.dtype)
                holds.append(out)
            else:
                with backend.use_stream(stream):
                    out = backend.empty(host.shape, host.dtype)
                allocated = backend.create_event()
                backend.record(allocated, stream)
                backend.wait_event(slot.stream, allocated)
            copied = backend.create_event()
            backend.copy_to_device(out, staged, slot.stream)
            self.h2d.record(slot, copied, None)
        finally:
            # Reused once the copy is done; at once if it was never enqueued.
            self.pinned.release(buffer, copied)
        backend.wait_event(stream, copied)
        return out

    def to_host(self, device: Any, stream: Any) -> np.ndarray:
        """Download ``device`` (ordered after the work enqueued so far on ``stream``).

        Returns pinned memory of its own while :meth:`PinnedPool.take` has
        room (no host memcpy), else a pageable copy of a staging buffer.
        """
        backend = self.backend
        slot = self._d2h_turns.select(self._copy, self.d2h)
        ready = backend.create_event()
        backend.record(ready, stream)
        backend.wait_event(slot.stream, ready)
        taken = self.pinned.take(device.nbytes)
        if taken is not None:
            out = taken.view(device.dtype).reshape(device.shape)
            copied = backend.create_event()
            backend.copy_to_host(out, device, slot.stream)
            self.d2h.record(slot, copied, device)
            _raise_if_failed(backend, copied)
            self.d2h.collect(slot)  # the copy is done: let the device array go
            return out
        buffer = self.pinned.acquire(device.nbytes)
        copied = None
        try:
            staged = buffer[: device.nbytes].view(device.dtype).reshape(device.shape)
            copied = backend.create_event()
            backend.copy_to_host(staged, device, slot.stream)
            self.d2h.record(slot, copied, device)
            _raise_if_failed(backend, copied)
            self.d2h.collect(slot)
            return staged.copy()
        finally:
            self.pinned.release(buffer, copied)

    def collect(self) -> int:
        """Release what finished copies held; return the copies still in flight."""
        return self.h2d.collect_all() + self.d2h.collect_all()

    def close(self) -> None:
        """Wait for the copies in flight, drop the copy streams and the idle staging buffers."""
        self.h2d.close()
        self.d2h.close()
        self.pinned.trim()

    def synchronize(self) -> None:
        """Block until every copy stream is idle."""
        self.h2d.synchronize()
        self.d2h.synchronize()


def _raise_if_failed(backend: Backend, copied: Any) -> None:
    """Block until the download ``copied`` is done; raise the error of failed work before it.

    ``event_error``, not a sync: a sync raises an error only once, and a copy stream
    is shared by every download. After a failure reached it (its ``ready`` wait),
    copies on it are skipped until a sync reports that error; one reported
    elsewhere first would let a skipped copy return stale memory as data. The
    error found is then reported (a sync of the completed event), so that the
    downloads launched after this raise, a later graph's too, are not skipped
    and do not raise it as theirs.
    """
    error = backend.event_error(copied)
    if error is not None:
        with contextlib.suppress(Exception):  # this error, or a sticky CUDA one
            backend.synchronize_event(copied)
        raise error
