"""The simulated device's memory pool.

Like CuPy's pool, it keeps one free list per stream, keyed by the stream's
identifier (so the pool never keeps a stream alive): a block goes back to the
list of the stream that was current when it was allocated, at once, on the
host, when its array is garbage collected. The list of a stream that has
ended is dropped, and so are blocks freed after it ended. A block handed out again is first
poisoned (NaN for floats, 0xA5 bytes otherwise) by work enqueued on the new
allocation's stream, so a kernel on another stream that still reads the old
contents sees the poison, as it would see reused memory on a GPU.

A capacity (:meth:`MemoryPool.set_capacity`) stands for the device's memory: an
allocation that finds no free block of its stream and would take the pool past
it first drops every stream's free blocks, as CuPy's pool does when ``cudaMalloc``
fails, then raises :class:`OutOfMemoryError` if it still would. (It is not CuPy's
``set_limit``, which the sim does not model.)
"""

from __future__ import annotations

import threading
from collections import defaultdict, deque
from collections.abc import Hashable

import numpy as np

_ROUND = 512
POISON_BYTE = 0xA5


class OutOfMemoryError(MemoryError):
    """An allocation beyond the device's capacity, with CuPy's message."""

    def __init__(self, size: int, total: int):
        super().__init__(
            f"Out of memory allocating {size:,} bytes (allocated so far: {total:,} bytes)."
        )


def poison(view: np.ndarray) -> None:
    """Fill ``view`` with the poison value of its dtype."""
    if view.dtype.kind in "fc":
        view.fill(np.nan)
    else:
        view.reshape(-1).view(np.uint8).fill(POISON_BYTE)  # 1-d: a 0-d view cannot change itemsize


class MemoryPool:
    """Per-stream free lists of host buffers standing in for device blocks.

    ``stream`` arguments are stream identifiers (any hashable, ``Stream.id``).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[Hashable, defaultdict[int, list[np.ndarray]]] = {}
        # Streams that ended, and blocks freed. Their finalizers (a stream's, an array's
        # ``__del__``) run in any thread, even inside this pool's lock (a garbage
        # collection started by an allocation under it): they only append, the lock's
        # holders drain.
        self._ended: deque[Hashable] = deque()
        self._freed: deque[tuple[np.ndarray, Hashable]] = deque()
        self._used = 0
        self._total = 0
        self._capacity = 0

    def malloc(self, nbytes: int, stream: Hashable) -> tuple[np.ndarray, bool]:
        """A block of at least ``nbytes`` from ``stream``'s free list, and whether it was reused."""
        size = max(_ROUND, -(-nbytes // _ROUND) * _ROUND)
        with self._lock:
            self._drop_ended()
            lists = self._free.get(stream)
            if lists is None:
                lists = self._free[stream] = defaultdict(list)
            free = lists[size]
            if free:
                self._used += size
                return free.pop(), True
            if self._capacity and self._total + size > self._capacity:
                self._drop_free()
                if self._total + size > self._capacity:
                    raise OutOfMemoryError(size, self._total)
            self._used += size
            self._total += size
        return np.empty(size, dtype=np.uint8), False

    def set_capacity(self, nbytes: int | None = None) -> None:
        """Make the device hold ``nbytes``, free blocks included (None or 0: unbounded)."""
        if nbytes is not None and nbytes < 0:
            raise ValueError(f"nbytes={nbytes} is invalid: a capacity is 0 (none) or more bytes")
        with self._lock:
            self._capacity = nbytes or 0

    def get_capacity(self) -> int:
        """The capacity in bytes; 0 if unbounded."""
        return self._capacity

    def free(self, block: np.ndarray, stream: Hashable) -> None:
        """Return ``block`` to ``stream``'s free list now, whatever is still queued on it.

        If ``stream`` has ended (:meth:`stream_ended`), the block is dropped. Never
        blocks: called inside the lock (by a finalizer), the holder files it.
        """
        self._freed.append((block, stream))
        if self._lock.acquire(blocking=False):
            try:
                self._drop_ended()
            finally:
                self._lock.release()

    def stream_ended(self, stream: Hashable) -> None:
        """``stream`` is gone: drop its free list (safe from any thread, takes no lock)."""
        self._ended.append(stream)

    def _drop_ended(self) -> None:
        """File the blocks freed and drop the lists of streams that ended. Locked."""
        freed = self._freed
        while freed:
            block, stream = freed.popleft()
            self._used -= block.nbytes
            lists = self._free.get(stream)
            if lists is None:
                self._total -= block.nbytes
            else:
                lists[block.nbytes].append(block)
        ended = self._ended
        while ended:
            lists = self._free.pop(ended.popleft(), None)
            if lists:
                self._total -= sum(b.nbytes for blocks in lists.values() for b in blocks)

    def used_bytes(self) -> int:
        """Bytes held by live arrays."""
        with self._lock:
            self._drop_ended()
            return self._used

    def total_bytes(self) -> int:
        """Bytes held by live arrays and free lists."""
        with self._lock:
            self._drop_ended()
            return self._total

    def free_all_blocks(self) -> None:
        """Drop every cached free block."""
        with self._lock:
            self._drop_free()

    def _drop_free(self) -> None:
        """Drop every cached free block. Locked."""
        self._drop_ended()
        for lists in self._free.values():
            for blocks in lists.values():
                self._total -= sum(b.nbytes for b in blocks)
                blocks.clear()
