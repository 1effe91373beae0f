"""The simulated device's memory pool.

Like CuPy's pool, it keeps one free list per stream: a block goes back to the
list of the stream that was current when it was allocated, at once, on the
host, when its array is garbage collected. A block handed out again is first
poisoned (NaN for floats, 0xA5 bytes otherwise) by work enqueued on the new
allocation's stream, so a kernel on another stream that still reads the old
contents sees the poison, as it would see reused memory on a GPU.
"""

from __future__ import annotations

import threading
from collections import defaultdict

import numpy as np

_ROUND = 512
POISON_BYTE = 0xA5


def poison(view: np.ndarray) -> None:
    """Fill ``view`` with the poison value of its dtype."""
    if view.dtype.kind in "fc":
        view.fill(np.nan)
    else:
        view.reshape(-1).view(np.uint8).fill(POISON_BYTE)  # 1-d: a 0-d view cannot change itemsize


class MemoryPool:
    """Per-stream free lists of host buffers standing in for device blocks."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[object, dict[int, list[np.ndarray]]] = defaultdict(
            lambda: defaultdict(list)
        )
        self._used = 0
        self._total = 0

    def malloc(self, nbytes: int, stream: object) -> tuple[np.ndarray, bool]:
        """A block of at least ``nbytes`` from ``stream``'s free list, and whether it was reused."""
        size = max(_ROUND, -(-nbytes // _ROUND) * _ROUND)
        with self._lock:
            free = self._free[stream][size]
            self._used += size
            if free:
                return free.pop(), True
            self._total += size
        return np.empty(size, dtype=np.uint8), False

    def free(self, block: np.ndarray, stream: object) -> None:
        """Return ``block`` to ``stream``'s free list now, whatever is still queued on it."""
        with self._lock:
            self._used -= block.nbytes
            self._free[stream][block.nbytes].append(block)

    def used_bytes(self) -> int:
        """Bytes held by live arrays."""
        return self._used

    def total_bytes(self) -> int:
        """Bytes held by live arrays and free lists."""
        return self._total

    def free_all_blocks(self) -> None:
        """Drop every cached free block."""
        with self._lock:
            for lists in self._free.values():
                for blocks in lists.values():
                    self._total -= sum(b.nbytes for b in blocks)
                    blocks.clear()
