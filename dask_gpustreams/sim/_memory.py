"""The simulated device's memory pool.

Like CuPy's pool, it keeps one arena of free chunks per stream, keyed by the
stream's identifier (so the pool never keeps a stream alive): a chunk goes back
to the arena of the stream that was current when it was allocated, at once, on
the host, when its array is garbage collected. As in CuPy's pool
(``cupy/cuda/memory.pyx``), an allocation takes the smallest free chunk of its
stream's arena that is large enough and splits off what it does not need; a
chunk freed is merged with its free neighbours of the same allocation; and only
an allocation none of whose parts is in use can be freed
(:meth:`MemoryPool.free_all_blocks`): a small array carved out of a large free
chunk keeps the whole allocation. The arena of a stream that has ended is
dropped, and so are chunks freed after it ended. A chunk handed out again is
first poisoned (NaN for floats, 0xA5 bytes otherwise) by work enqueued on the
new allocation's stream, so a kernel on another stream that still reads the old
contents sees the poison, as it would see reused memory on a GPU.

A capacity (:meth:`MemoryPool.set_capacity`) stands for the device's memory: an
allocation that finds no free chunk in its stream's arena and would take the pool past
it first drops every stream's free allocations, then collects garbage and tries again,
as CuPy's pool does when ``cudaMalloc`` fails, then raises :class:`OutOfMemoryError` if
it still would. (It is not CuPy's
``set_limit``, which the sim does not model.)
"""

from __future__ import annotations

import bisect
import gc
import numbers
import threading
from collections import deque
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


class Chunk:
    """A part of one allocation (``segment``, a host buffer standing in for a ``cudaMalloc``).

    ``buffer`` is its bytes; ``prev`` and ``next`` are the neighbouring chunks of the
    same allocation, as in CuPy's pool; ``arena`` is the arena of the stream it was
    allocated on, the one it goes back to.
    """

    __slots__ = ("segment", "offset", "nbytes", "arena", "prev", "next", "in_use")

    def __init__(self, segment: np.ndarray, offset: int, nbytes: int, arena: _Arena):
        self.segment = segment
        self.offset = offset
        self.nbytes = nbytes
        self.arena = arena
        self.prev: Chunk | None = None
        self.next: Chunk | None = None
        self.in_use = False

    @property
    def buffer(self) -> np.ndarray:
        """Its bytes: a view of its part of ``segment``."""
        return self.segment[self.offset : self.offset + self.nbytes]

    @property
    def whole(self) -> bool:
        """Whether this chunk is its whole allocation (nothing split off)."""
        return self.prev is None and self.next is None


class UnownedBlock:
    """Device memory that the pool does not own, as CuPy's ``UnownedMemory``: the bytes of
    ``chunk``, which ``owner`` (kept alive as long as this) gives back when it goes.

    An allocator (:func:`~dask_gpustreams.sim.using_allocator`) may return one instead of
    a :class:`Chunk`; the array frees nothing itself.
    """

    __slots__ = ("chunk", "_owner")

    def __init__(self, chunk: Chunk, owner: object):
        self.chunk = chunk
        self._owner = owner

    @property
    def buffer(self) -> np.ndarray:
        return self.chunk.buffer


class _Arena:
    """One stream's free chunks by size, and the sizes in order (best fit by bisection).

    ``dropped``: its stream has ended; chunks freed into it are dropped instead.
    """

    __slots__ = ("by_size", "sizes", "dropped")

    def __init__(self) -> None:
        self.by_size: dict[int, list[Chunk]] = {}
        self.sizes: list[int] = []
        self.dropped = False

    def add(self, chunk: Chunk) -> None:
        chunks = self.by_size.get(chunk.nbytes)
        if chunks is None:
            chunks = self.by_size[chunk.nbytes] = []
            bisect.insort(self.sizes, chunk.nbytes)
        chunks.append(chunk)

    def remove(self, chunk: Chunk) -> None:
        chunks = self.by_size[chunk.nbytes]
        chunks.remove(chunk)
        if not chunks:
            self._drop_size(chunk.nbytes)

    def take(self, nbytes: int) -> Chunk | None:
        """The most recently freed of the smallest free chunks of at least ``nbytes``."""
        i = bisect.bisect_left(self.sizes, nbytes)
        if i == len(self.sizes):
            return None
        size = self.sizes[i]
        chunks = self.by_size[size]
        chunk = chunks.pop()
        if not chunks:
            self._drop_size(size)
        return chunk

    def chunks(self) -> list[Chunk]:
        return [c for chunks in self.by_size.values() for c in chunks]

    def _drop_size(self, size: int) -> None:
        del self.by_size[size]
        self.sizes.pop(bisect.bisect_left(self.sizes, size))


class MemoryPool:
    """Per-stream arenas of host buffers standing in for device memory.

    ``stream`` arguments are stream identifiers (any hashable, ``Stream.id``).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._arenas: dict[Hashable, _Arena] = {}
        # Streams that ended, and chunks freed. Their finalizers (a stream's, an array's
        # ``__del__``) run in any thread, even inside this pool's lock (a garbage
        # collection started by an allocation under it): they only append, the lock's
        # holders drain.
        self._ended: deque[Hashable] = deque()
        self._freed: deque[Chunk] = deque()
        self._used = 0
        self._total = 0
        self._capacity = 0

    def malloc(self, nbytes: int, stream: Hashable) -> tuple[Chunk, bool]:
        """A chunk of at least ``nbytes`` from ``stream``'s arena, and whether it was reused.

        Past the capacity, as CuPy's pool when ``cudaMalloc`` fails: every free
        allocation is dropped, then garbage is collected (arrays that only cycles
        keep), and only then is :class:`OutOfMemoryError` raised.
        """
        size = max(_ROUND, -(-nbytes // _ROUND) * _ROUND)
        got = self._take(size, stream)
        if got is None:
            gc.collect()  # outside the lock: a finalizer may allocate
            got = self._take(size, stream)
            if got is None:
                raise OutOfMemoryError(size, self.total_bytes())
        return got

    def _take(self, size: int, stream: Hashable) -> tuple[Chunk, bool] | None:
        """:meth:`malloc` of ``size`` rounded bytes; None past the capacity."""
        with self._lock:
            self._drop_ended()
            arena = self._arenas.get(stream)
            if arena is None:
                arena = self._arenas[stream] = _Arena()
            chunk = arena.take(size)
            if chunk is not None:
                if chunk.nbytes > size:  # split: the rest stays free in this arena
                    rest = Chunk(chunk.segment, chunk.offset + size, chunk.nbytes - size, arena)
                    rest.prev, rest.next = chunk, chunk.next
                    if chunk.next is not None:
                        chunk.next.prev = rest
                    chunk.next = rest
                    chunk.nbytes = size
                    arena.add(rest)
                chunk.in_use = True
                self._used += size
                return chunk, True
            if self._capacity and self._total + size > self._capacity:
                self._drop_free()
                if self._total + size > self._capacity:
                    return None
            self._used += size
            self._total += size
        chunk = Chunk(np.empty(size, dtype=np.uint8), 0, size, arena)
        chunk.in_use = True
        return chunk, False

    def set_capacity(self, nbytes: int | None = None) -> None:
        """Make the device hold ``nbytes``, free blocks included (None or 0: unbounded)."""
        if nbytes is not None and (
            isinstance(nbytes, bool) or not isinstance(nbytes, numbers.Integral) or nbytes < 0
        ):  # '1 MiB', 1.5 or True: not a number of bytes
            raise ValueError(
                f"nbytes={nbytes!r} is invalid: a capacity is None or 0 (none) or an int of bytes"
            )
        with self._lock:
            self._capacity = nbytes or 0

    def get_capacity(self) -> int:
        """The capacity in bytes; 0 if unbounded."""
        return self._capacity

    def free(self, chunk: Chunk) -> None:
        """Return ``chunk`` to the arena of its stream now, whatever is still queued on it.

        If that stream has ended (:meth:`stream_ended`), the chunk is dropped (its
        allocation once no part of it is in use). Never blocks: called inside the
        lock (by a finalizer), the holder files it.
        """
        self._freed.append(chunk)
        if self._lock.acquire(blocking=False):
            try:
                self._drop_ended()
            finally:
                self._lock.release()

    def stream_ended(self, stream: Hashable) -> None:
        """``stream`` is gone: drop its arena (safe from any thread, takes no lock)."""
        self._ended.append(stream)

    def _drop_ended(self) -> None:
        """File the chunks freed and drop the arenas of streams that ended. Locked."""
        freed = self._freed
        while freed:
            self._file(freed.popleft())
        ended = self._ended
        while ended:
            arena = self._arenas.pop(ended.popleft(), None)
            if arena is None:
                continue
            arena.dropped = True
            for chunk in arena.chunks():
                if chunk.whole:  # split chunks go with their allocation's last part
                    self._total -= chunk.nbytes

    def _file(self, chunk: Chunk) -> None:
        """``chunk`` is free: merge it with its free neighbours into its arena. Locked."""
        self._used -= chunk.nbytes
        chunk.in_use = False
        arena = chunk.arena
        for neighbour in (chunk.prev, chunk.next):
            if neighbour is not None and not neighbour.in_use:
                if not arena.dropped:
                    arena.remove(neighbour)
                chunk = _merge(chunk, neighbour)
        if not arena.dropped:
            arena.add(chunk)
        elif chunk.whole:  # its stream ended: the whole allocation goes
            self._total -= chunk.nbytes

    def used_bytes(self) -> int:
        """Bytes held by live arrays."""
        with self._lock:
            self._drop_ended()
            return self._used

    def total_bytes(self) -> int:
        """Bytes of every allocation: live arrays, free chunks, and what is split off them."""
        with self._lock:
            self._drop_ended()
            return self._total

    def free_all_blocks(self) -> None:
        """Free every allocation none of whose parts is in use (as CuPy's pool)."""
        with self._lock:
            self._drop_free()

    def _drop_free(self) -> None:
        """Free every allocation none of whose parts is in use. Locked."""
        self._drop_ended()
        for arena in self._arenas.values():
            for chunk in arena.chunks():
                if chunk.whole:
                    arena.remove(chunk)
                    self._total -= chunk.nbytes


def _merge(chunk: Chunk, neighbour: Chunk) -> Chunk:
    """One chunk of ``chunk`` and its free ``neighbour`` (adjacent, same allocation)."""
    first, second = (neighbour, chunk) if neighbour is chunk.prev else (chunk, neighbour)
    first.nbytes += second.nbytes
    first.next = second.next
    if second.next is not None:
        second.next.prev = first
    return first
