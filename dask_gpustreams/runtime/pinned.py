"""A bounded pool of page-locked host buffers for staged, asynchronous copies.

A buffer handed back with :meth:`PinnedPool.release` is reused only once the
event of the copy that reads or writes it has completed, so the host side of
a copy in flight is never overwritten. When the pool is full, :meth:`acquire`
waits for the oldest copy in flight (back-pressure), never hands out a busy
buffer, and raises only for a copy larger than the whole pool.

:meth:`PinnedPool.take` hands out pinned buffers that leave the pool for good
(download results), counted in an allowance of their own until they are
garbage, so staging never waits on memory that users hold.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Any

import numpy as np
from dask.utils import format_bytes

from dask_gpustreams.backends.base import Backend
from dask_gpustreams.runtime.events import InflightQueue

logger = logging.getLogger("dask_gpustreams")

_ROUND = 1 << 16


@dataclass(frozen=True)
class PinnedStats:
    """A pinned pool's bytes, read at once (:meth:`PinnedPool.stats`)."""

    #: Staging bytes allocated (free, in use and in flight).
    staging_bytes: int
    #: Bytes handed out by :meth:`PinnedPool.take` and still alive (download results).
    results_bytes: int
    #: The pool's size (``gpustreams.pinned-pool-size``), for each of the two.
    limit_bytes: int


class PinnedPool:
    """Up to ``limit`` bytes of pinned buffers, cached by size and reused in event order.

    Apart from those, up to ``limit`` bytes of buffers taken with :meth:`take`.
    """

    def __init__(self, backend: Backend, limit: int):
        self.backend = backend
        self.limit = limit
        self._free: dict[int, list[np.ndarray]] = defaultdict(list)
        self._inflight = InflightQueue()  # (copy event, buffer)
        self._total = 0
        self._taken = 0
        # Sizes of taken buffers that died. Their finalizers run in any thread, at any
        # allocation, even inside this pool's lock: they only append, the lock's holders drain.
        self._returned: deque[int] = deque()
        self._changed = threading.Condition()

    def total_bytes(self) -> int:
        """Pinned staging bytes allocated (free, in use and in flight)."""
        return self._total

    def taken_bytes(self) -> int:
        """Pinned bytes handed out by :meth:`take` and still alive."""
        return self.stats().results_bytes

    def stats(self) -> PinnedStats:
        """:meth:`total_bytes`, :meth:`taken_bytes` and :attr:`limit`, read together under
        the pool's lock (one consistent snapshot)."""
        with self._changed:
            self._settle()
            return PinnedStats(self._total, self._taken, self.limit)

    def inflight(self) -> int:
        """Buffers whose copy may still be running."""
        return len(self._inflight)

    def acquire(self, nbytes: int) -> np.ndarray:
        """A pinned ``uint8`` buffer of at least ``nbytes`` that no copy in flight uses."""
        size = max(_ROUND, -(-nbytes // _ROUND) * _ROUND)
        if size > self.limit:
            raise ValueError(
                f"a {format_bytes(nbytes)} copy does not fit gpustreams.pinned-pool-size="
                f"{format_bytes(self.limit)}; raise it above the largest chunk copied"
            )
        with self._changed:
            while True:
                self._reclaim()
                free = self._free[size]
                if free:
                    buffer = free.pop()
                elif self._total + size <= self.limit:
                    buffer = self._allocate(size)
                    self._total += size
                elif self._inflight:
                    self.backend.synchronize_event(self._inflight[0][0])
                    continue
                elif not self._drop_other_sizes(size):
                    # Everything is held by copies being staged in other threads.
                    self._changed.wait()
                    continue
                else:
                    continue
                return buffer

    def take(self, nbytes: int) -> np.ndarray | None:
        """A pinned ``uint8`` buffer of ``nbytes`` that the caller keeps, or None at once.

        Its bytes count against an allowance of ``limit`` bytes, apart from
        staging, until the buffer and every view of it are garbage. None (no
        wait: results may be held forever) when the allowance has no room or
        the allocation fails; the caller then stages its copy instead.
        """
        with self._changed:
            self._settle()
            if self._taken + nbytes > self.limit:
                return None
            self._taken += nbytes
        try:
            buffer = self.backend.alloc_pinned(nbytes)
        except Exception as e:  # cudaErrorMemoryAllocation and friends
            logger.debug(
                "gpustreams: no pinned buffer of %s (%s); staging", format_bytes(nbytes), e
            )
            self._returned.append(nbytes)
            return None
        weakref.finalize(buffer, self._returned.append, nbytes)
        return buffer

    def trim(self) -> int:
        """Drop the cached buffers that no copy uses; return their bytes.

        They go back to the backend's pinned allocator (CuPy caches them for
        reuse), so a pool that is no longer used holds no staging memory.
        """
        with self._changed:
            self._reclaim()
            dropped = sum(b.nbytes for buffers in self._free.values() for b in buffers)
            self._free.clear()
            self._total -= dropped
            return dropped

    def release(self, buffer: np.ndarray, event: Any | None) -> None:
        """Give ``buffer`` back; it is reused once ``event`` (its copy) has completed.

        ``event`` None: no copy was enqueued, the buffer is free at once.
        """
        with self._changed:
            if event is None:
                self._free[buffer.nbytes].append(buffer)
            else:
                self._inflight.append((event, buffer))
            self._changed.notify_all()

    def _settle(self) -> None:
        returned = self._returned
        while returned:
            self._taken -= returned.popleft()

    def _reclaim(self) -> None:
        for buffer in self._inflight.pop_done(self.backend.done):
            self._free[buffer.nbytes].append(buffer)

    def _drop_other_sizes(self, size: int) -> bool:
        dropped = False
        for other, buffers in self._free.items():
            if other != size and buffers:
                self._total -= sum(b.nbytes for b in buffers)
                buffers.clear()
                dropped = True
        return dropped

    def _allocate(self, size: int) -> np.ndarray:
        try:
            return self.backend.alloc_pinned(size)
        except Exception as e:  # cudaErrorMemoryAllocation and friends
            raise MemoryError(
                f"could not allocate {format_bytes(size)} of pinned host memory for "
                f"gpustreams.pinned-pool-size={format_bytes(self.limit)} ({e}); "
                "lower gpustreams.pinned-pool-size"
            ) from e
