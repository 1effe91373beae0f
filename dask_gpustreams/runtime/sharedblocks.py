"""Large device blocks shared by the pool's streams, each reused in stream order.

CuPy's pool (and the simulated device's) keeps one arena per stream, and a block
freed goes back to the arena of the stream it was allocated on: spread over 8
streams, a graph's large blocks are cached 8 times over. :class:`SharedBlocks`
takes the stream launcher's large allocations (``gpustreams.shared-blocks``) from
one arena instead, that of a stream standing for all the pool's streams, which
never runs work (``Backend.shared_block_source``). A block freed on pool stream
``A`` is:

- handed out again at once to the next allocation of its size on ``A``, as CuPy's
  own arena would: in stream order;
- given back to the shared arena, for any stream, only once ``A``'s work up to the
  free is known complete: the first event ``A`` records after the free
  (:meth:`StreamPool.next_seq`) has been seen complete, or ``A`` is idle
  (:meth:`StreamPool.reached`). No event is recorded or waited for, and no query
  made, but at a graph's end and for frees outside a graph.

Readers on other streams need no event: the runtime holds a task's inputs until
its event completes, so a block's last reference never goes while another
stream may still read it; only its own stream's work, up to the free, can. A
block freed while no graph launches is given back at once if its stream is
idle; else (its stream still runs other work, as a distributed worker's tasks
outside stream blocks, or its lock is taken) it stays cached until the next
graph on the runtime ends, or the runtime closes: ``free_all_blocks`` cannot
free it meanwhile. A task that runs out of device memory runs again once the
launcher has waited for every stream and given every block back (:meth:`release`).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Hashable
from typing import Any

from dask_gpustreams.backends.base import BlockSource
from dask_gpustreams.runtime.pool import StreamPool, StreamSlot

#: CuPy's pool rounds every request to this many bytes; so do the shared blocks, so that
#: requests that CuPy would serve from one block size find each other's blocks.
ROUND = 512


class _Lease:
    """Owns a block while arrays use it; gives it to :class:`SharedBlocks` when they go."""

    __slots__ = ("_blocks", "_slot", "_size", "_base")

    def __init__(self, blocks: SharedBlocks, slot: StreamSlot, size: int, base: Any):
        self._blocks = blocks
        self._slot = slot
        self._size = size
        self._base = base

    def __del__(self) -> None:
        self._blocks._freed_on(self._slot, self._size, self._base)


class SharedBlocks:
    """The pool's allocations of at least :attr:`size` bytes, from one arena of all its
    streams (see the module's docstring). Thread-safe; one per runtime."""

    def __init__(self, size: int, pool: StreamPool, make_source: Callable[[], BlockSource]):
        #: The smallest allocation shared.
        self.size = size
        self._pool = pool
        # Made at the first allocation, as the pool's streams are: in a thread that runs
        # tasks, once the device's context is set up.
        self._make_source = make_source
        self._source: BlockSource | None = None
        self._by_key: dict[Hashable, StreamSlot] = {}
        self._lock = threading.Lock()
        # Freed by leases, in any thread, even under this lock (a collection during an
        # allocation): (slot, mark, size, base), filed by the lock's holders.
        self._freed: deque[tuple[StreamSlot, int, int, Any]] = deque()
        # Per pool stream: its freed blocks in free order ([mark, size, base] lists, the
        # base set to None once handed out again), and those still cached by size, in the
        # same order: a block is reused from the newest end, given back from the oldest.
        self._in_order: dict[StreamSlot, deque[list]] = {}
        self._by_size: dict[StreamSlot, dict[int, deque[list]]] = {}
        self._graphs = 0  # graphs launching now (their frees are filed at allocations)
        self._closed = False

    def malloc(self, nbytes: int, stream_key: Hashable, allocate: Callable) -> Any | None:
        """A block for ``nbytes`` on the pool stream of ``stream_key``, a new one taken
        through ``allocate``; None if that is no pool stream (the caller allocates)."""
        slot = self._by_key.get(stream_key)
        if slot is None:
            if self._source is not None:
                return None
            slot = self._start(stream_key)
            if slot is None:
                return None
        size = -(-nbytes // ROUND) * ROUND
        with self._lock:
            self._file()
            entry = self._same_stream(slot, size)
            if entry is not None:
                base, entry[2] = entry[2], None
                reused = True
            else:
                self._give_back(query=False)
                base, reused = self._source.take(size, allocate)
        return self._source.lend(base, size, _Lease(self, slot, size, base), reused)

    def _start(self, stream_key: Hashable) -> StreamSlot | None:
        """Make the shared arena's source and learn the pool's streams; the slot of
        ``stream_key``, if one."""
        with self._lock:
            if self._source is None:
                source = self._make_source()
                self._by_key = {source.stream_key(s.stream): s for s in self._pool.slots}
                self._source = source
        return self._by_key.get(stream_key)

    def _same_stream(self, slot: StreamSlot, size: int) -> list | None:
        """The last block of ``size`` freed on ``slot`` and not yet reused (locked)."""
        sizes = self._by_size.get(slot)
        blocks = sizes.get(size) if sizes else None
        return blocks.pop() if blocks else None

    def _freed_on(self, slot: StreamSlot, size: int, base: Any) -> None:
        """A lease's block is free on ``slot`` (from its finalizer, in any thread)."""
        if self._closed:  # the pool's streams were synchronized at its close
            self._source.give_back(base)
            return
        self._freed.append((slot, self._pool.next_seq(slot), size, base))
        if self._closed:  # closed since the check above: close() may have missed it
            self._drain_closed()
        elif not self._graphs and self._lock.acquire(blocking=False):
            try:
                self._file()
                self._give_back(query=True)
            finally:
                self._lock.release()

    def _file(self) -> None:
        """File the blocks that leases freed since (locked)."""
        freed = self._freed
        while freed:
            slot, mark, size, base = freed.popleft()
            entry = [mark, size, base]
            in_order = self._in_order.get(slot)
            if in_order is None:
                in_order = self._in_order[slot] = deque()
                self._by_size[slot] = {}
            in_order.append(entry)
            self._by_size[slot].setdefault(size, deque()).append(entry)

    def _give_back(self, query: bool) -> None:
        """Return to the shared arena each block whose stream's work up to its free is
        known complete (``query``: or whose stream is idle). Locked."""
        if self._source is None:
            return
        give_back, reached = self._source.give_back, self._pool.reached
        for slot, in_order in self._in_order.items():
            sizes = self._by_size[slot]
            while in_order:
                entry = in_order[0]
                if entry[2] is not None:
                    if not reached(slot, entry[0], query):
                        break
                    give_back(entry[2])
                    entry[2] = None
                    blocks = sizes[entry[1]]
                    blocks.popleft()  # the oldest cached of its size: this entry
                    if not blocks:
                        del sizes[entry[1]]
                in_order.popleft()

    def begin(self) -> None:
        """A graph starts launching: frees are filed at its allocations and its end."""
        with self._lock:
            self._graphs += 1

    def end(self) -> None:
        """A graph has ended: give back what its streams have done with."""
        with self._lock:
            self._graphs -= 1
            self._file()
            self._give_back(query=True)

    def release(self) -> None:
        """Give back every cached block, after waiting for the work enqueued so far on every
        stream (a graph ran out of device memory). Blocks whose stream has no later event
        to be seen complete (a stream whose task failed, one that went idle) need the wait."""
        with self._lock:
            self._file()
            bases = [e[2] for q in self._in_order.values() for e in q if e[2] is not None]
            self._in_order.clear()
            self._by_size.clear()
        self._pool.wait_all()  # after every free taken above: their work is done
        for base in bases:
            self._source.give_back(base)

    def close(self) -> None:
        """Give every cached block back and free the shared arena (after the pool's close:
        its streams are synchronized); later frees go back at once."""
        with self._lock:
            self._closed = True
            if self._source is None:
                return
            self._file()
            for in_order in self._in_order.values():
                for entry in in_order:
                    if entry[2] is not None:
                        self._source.give_back(entry[2])
            self._in_order.clear()
            self._by_size.clear()
            self._drain_closed()
            self._source.close()

    def _drain_closed(self) -> None:
        """Give back what leases freed once closed (any thread; no lock)."""
        freed = self._freed
        while True:
            try:
                base = freed.popleft()[3]
            except IndexError:
                return
            self._source.give_back(base)
