"""The backend over the simulated device (:mod:`dask_gpustreams.sim`)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import numpy as np

from dask_gpustreams import sim
from dask_gpustreams.backends.base import AllocationMeter, SharedAllocator, StandingStreams


class SimBackend:
    """Streams, events and arrays of :func:`dask_gpustreams.sim.get_device`."""

    name = "sim"
    is_hip = False
    sticky_errors = False  # a failure stays with its streams until a host sync reports it
    upload_functions = (sim.asarray,)
    download_functions = (sim.asnumpy,)
    out_of_memory_errors = (sim.OutOfMemoryError,)

    def __init__(self) -> None:
        self.device = sim.get_device()
        self.device_id = self.device.id
        # Pool stream (by id) -> the stream whose arena holds its small blocks.
        self._small_streams = StandingStreams()

    def reported_failures(self) -> int:
        return self.device.reported_failures

    def create_stream(self, priority: int = 0) -> sim.Stream:
        return self.device.create_stream(priority)

    def high_priority(self) -> int:
        return -1

    def create_event(self, timing: bool = False) -> sim.Event:
        return sim.Event(timing=timing)

    def record(self, event: sim.Event, stream: sim.Stream) -> None:
        stream.record(event)

    def wait_event(self, stream: sim.Stream, event: sim.Event) -> None:
        stream.wait_event(event)

    def done(self, event: sim.Event) -> bool:
        return event.done

    def synchronize_event(self, event: sim.Event) -> None:
        event.synchronize()

    def event_error(self, event: sim.Event) -> BaseException | None:
        return event.wait()

    def event_state(self, event: sim.Event) -> tuple[bool, BaseException | None]:
        return (True, event.wait()) if event.done else (False, None)

    def synchronize_stream(self, stream: sim.Stream) -> None:
        stream.synchronize()

    def destroy_stream(self, stream: sim.Stream, timeout: float | None = None) -> None:
        small = self._small_streams.pop(stream.id)
        if small is not None:
            small.close()  # its arena goes with it
        stream.close(timeout)

    def elapsed_ms(self, start: sim.Event, end: sim.Event) -> float:
        # As cudaEventElapsedTime, which fails (cudaErrorInvalidResourceHandle) for an
        # event created without timing, as CupyBackend.create_event makes them by default.
        if not (start.timing and end.timing):
            raise RuntimeError("elapsed time of an event created without timing")
        return (end.time - start.time) * 1e3

    def isolate_thread(self) -> Callable[[], None]:
        """Nothing to isolate: the simulated device has no library state."""
        return _nothing

    @contextmanager
    def use_stream(self, stream: sim.Stream, key: Any = None) -> Iterator[None]:
        with stream, self.device.task(key):
            yield

    def current_stream(self) -> sim.Stream:
        return self.device.current_stream()

    def orders_before_pool(self, stream: sim.Stream) -> bool:
        """Only when ``stream`` is idle: the sim orders its streams by events alone."""
        return not stream.busy

    def unpooled_stream(self) -> sim.Stream:
        """The default stream: every thread's launches with no stream current go there."""
        return self.device.default_stream

    def stream_idle(self, stream: sim.Stream) -> bool:
        return not stream.busy

    def is_device_array(self, obj: Any) -> bool:
        return isinstance(obj, sim.SimArray)

    def free_cached_memory(self) -> None:
        sim.get_default_memory_pool().free_all_blocks()

    @contextmanager
    def launch_allocator(
        self,
        streams: Sequence[sim.Stream],
        small_blocks: int,
        large_tasks: int,
        shared: SharedAllocator | None = None,
    ) -> Iterator[AllocationMeter | None]:
        """A small request on a pool stream from the arena of a stream standing for it,
        through a thread-local allocator (``sim.using_allocator``), the others metered,
        as the CuPy backend does, where the current one is the default pool's
        ``malloc`` (or wraps it, also as the pool's own attribute: a benchmark's peak
        tracker) and ``small_blocks`` or ``large_tasks`` is set.

        The sim's pool keys its arenas by the stream identifier it is given; the
        standing stream never runs work (nor starts a thread), and a reused block is
        still poisoned on the stream current at allocation. Allocations of at least
        ``shared.size`` on a pool stream come from ``shared`` (keyed by stream id).
        """
        allocator = sim.get_allocator()
        pool = sim.get_default_memory_pool()
        shared_size = shared.size if shared is not None else 0
        the_pools = inspect.unwrap(allocator) == inspect.unwrap(pool.malloc)
        if not (small_blocks or large_tasks or shared_size) or not the_pools:
            yield None
            return
        if small_blocks:
            self._small_streams.ensure([s.id for s in streams], self.device.create_stream)
        standing_for = self._small_streams.get
        meter = _SimMeter()
        made = meter.made

        def malloc(nbytes: int, stream_id: int) -> tuple[Any, bool]:
            got = None
            if nbytes < small_blocks:
                small = standing_for(stream_id)
                if small is not None:
                    got = allocator(nbytes, small.id)
            elif nbytes > meter.largest:
                meter.largest = nbytes
            if got is None and shared_size and nbytes >= shared_size:
                got = shared.malloc(nbytes, stream_id, allocator)
            if got is None:
                got = allocator(nbytes, stream_id)
            made[_address(got[0])] = stream_id
            return got

        with sim.using_allocator(malloc):
            yield meter

    def shared_block_source(self) -> _SharedArena:
        return _SharedArena(self.device.create_stream())

    def hardware_queues(self) -> int | None:
        return None

    def hardware_queues_variable(self) -> str:
        """CUDA's: the simulated device stands for a CUDA one (its queues are unbounded)."""
        return "CUDA_DEVICE_MAX_CONNECTIONS"

    def on_device(self) -> AbstractContextManager:
        """Nothing to make current: the simulated device is the only one."""
        return nullcontext()

    def alloc_pinned(self, nbytes: int) -> np.ndarray:
        return sim.alloc_pinned(nbytes)

    def empty(self, shape: tuple[int, ...], dtype: Any) -> sim.SimArray:
        return sim.empty(shape, dtype)

    def copy_to_device(self, dst: sim.SimArray, src: np.ndarray, stream: sim.Stream) -> None:
        # Reads ``src`` when the stream gets there, as a DMA from pinned memory does.
        stream.launch(np.copyto, (dst._view, src), {}, self.device.current_key())

    def copy_to_host(self, dst: np.ndarray, src: sim.SimArray, stream: sim.Stream) -> None:
        stream.launch(np.copyto, (dst, src._view), {}, self.device.current_key())


def _address(block: Any) -> tuple[int, int]:
    """Where a block of the sim's pool starts (a :class:`sim.UnownedBlock` lends a chunk's
    bytes): its allocation's identity and its offset in it, as a device address."""
    chunk = getattr(block, "chunk", block)
    return id(chunk.segment), chunk.offset


class _SimMeter(AllocationMeter):
    """:class:`AllocationMeter` of the sim's launch allocator: addresses are
    :func:`_address`, stream keys the streams' ids."""

    __slots__ = ()

    def made_on(self, value: Any, stream: sim.Stream) -> bool:
        block = getattr(value, "_block", None) if isinstance(value, sim.SimArray) else None
        return block is not None and self.made.get(_address(block)) == stream.id


def _nothing() -> None:
    """What :meth:`SimBackend.isolate_thread` has to put back: nothing."""


class _SharedArena:
    """The blocks of the sim's pool allocated for ``stream``, which never runs work: one
    arena for all the pool's streams (``Backend.shared_block_source``)."""

    def __init__(self, stream: sim.Stream):
        self._stream = stream

    def stream_key(self, stream: sim.Stream) -> int:
        return stream.id

    def take(self, nbytes: int, allocate: Callable) -> tuple[Any, bool]:
        return allocate(nbytes, self._stream.id)

    def lend(self, base: Any, nbytes: int, owner: Any, reused: bool) -> tuple[Any, bool]:
        return sim.UnownedBlock(base, owner), reused

    def give_back(self, base: Any) -> None:
        sim.get_default_memory_pool().free(base)

    def close(self) -> None:
        self._stream.close()
