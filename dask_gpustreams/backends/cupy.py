"""The backend over CuPy: CUDA, or ROCm through CuPy's HIP build.

Pool streams are blocking (``non_blocking=False``), so they stay ordered with
the legacy default stream that serializers and spilling use; events are
created without timing unless asked for, as CUDA recommends for waits.

Inside a task, CuPy's current stream is the task's pool stream; so is
PyTorch's, once PyTorch has initialized CUDA in the process (see
:meth:`CupyBackend.use_stream`). Numba has no current stream: a task passes
``numba.cuda.external_stream(cupy.cuda.get_current_stream().ptr)`` to each
launch (docs/guide.md, "Other libraries inside a task").
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import sys
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

import cupy
import cupyx
import numpy as np

from dask_gpustreams.backends import cufft_plans
from dask_gpustreams.backends.base import AllocationMeter, SharedAllocator, StandingStreams
from dask_gpustreams.backends.nvidia import cuda_connections

logger = logging.getLogger("dask_gpustreams")

# HIP's default GPU_MAX_HW_QUEUES.
HIP_DEFAULT_QUEUES = 4


class CupyBackend:
    """Streams, events and arrays of the device current when it is created."""

    name = "cupy"
    # Not cupy.array: it always copies, a device array too, where to_device would not.
    upload_functions = (cupy.asarray,)
    download_functions = (cupy.asnumpy, cupy.ndarray.get)
    # CuPy's pool raises it once cudaMalloc fails after it freed every arena's free blocks.
    out_of_memory_errors = (cupy.cuda.memory.OutOfMemoryError,)
    # A kernel fault is sticky for the CUDA (HIP) context: no sync reports it away.
    sticky_errors = True

    #: Make each pool stream PyTorch's current stream too, inside tasks (see use_stream).
    torch_interop = True

    def __init__(self) -> None:
        self.device_id = cupy.cuda.Device().id
        self.is_hip = bool(cupy.cuda.runtime.is_hip)
        self._torch_calls: _TorchStreamCalls | None = None  # once PyTorch has started CUDA
        # Each stream as PyTorch's current stream (_TorchStreamCalls.target), dropped with it.
        self._torch_streams: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._fft_warned = False
        # Pool stream (by handle) -> the stream whose arena holds its small blocks.
        self._small_streams = StandingStreams()

    def create_stream(self, priority: int = 0) -> cupy.cuda.Stream:
        with cupy.cuda.Device(self.device_id):
            return cupy.cuda.Stream(non_blocking=False, priority=priority)

    def high_priority(self) -> int:
        with cupy.cuda.Device(self.device_id):
            get_range = getattr(cupy.cuda.runtime, "deviceGetStreamPriorityRange", None)
            return get_range()[1] if get_range is not None else -1

    def create_event(self, timing: bool = False) -> cupy.cuda.Event:
        return cupy.cuda.Event(block=False, disable_timing=not timing)

    def record(self, event: cupy.cuda.Event, stream: cupy.cuda.Stream) -> None:
        event.record(stream)

    def wait_event(self, stream: cupy.cuda.Stream, event: cupy.cuda.Event) -> None:
        stream.wait_event(event)

    def done(self, event: cupy.cuda.Event) -> bool:
        return event.done

    def synchronize_event(self, event: cupy.cuda.Event) -> None:
        event.synchronize()

    def event_error(self, event: cupy.cuda.Event) -> BaseException | None:
        try:
            event.synchronize()  # CUDA reports a failed kernel's (sticky) error on every sync
        except Exception as e:  # cupy_backends.cuda.api.runtime.CUDARuntimeError
            return e
        return None

    def event_state(self, event: cupy.cuda.Event) -> tuple[bool, BaseException | None]:
        # One query: cudaEventQuery returns a failed kernel's error (sticky: on every call
        # after it), which CuPy raises; a query that says done saw no error.
        try:
            return event.done, None
        except Exception as e:  # cupy_backends.cuda.api.runtime.CUDARuntimeError
            return True, e

    def synchronize_stream(self, stream: cupy.cuda.Stream) -> None:
        stream.synchronize()

    def destroy_stream(self, stream: cupy.cuda.Stream, timeout: float | None = None) -> None:
        """Free the blocks CuPy's pool caches for ``stream``; CuPy destroys the stream itself.

        CuPy's pool keeps one arena of free blocks per stream and reuses a block
        only on the stream it was allocated on: a closed pool stream's arena would
        stay held, never reused, until an allocation fails (a runtime closed and
        made again, as by a plugin registered twice, grew the pool each time).
        Its blocks still in use (results alive at the close) go back to that arena
        when freed, and stay there. So does the arena of the stream that stood for
        its small blocks (:meth:`launch_allocator`). Each block freed is a
        ``cudaFree``, which waits for the device. Never raises: after a sticky CUDA
        error the pool's close still ends its other streams.
        """
        small = self._small_streams.pop(stream.ptr)
        with contextlib.suppress(Exception), cupy.cuda.Device(self.device_id):
            pool = cupy.get_default_memory_pool()
            pool.free_all_blocks(stream=stream)
            if small is not None:
                pool.free_all_blocks(stream=small)

    def elapsed_ms(self, start: cupy.cuda.Event, end: cupy.cuda.Event) -> float:
        return cupy.cuda.get_elapsed_time(start, end)

    def isolate_thread(self) -> Callable[[], None]:
        # A cached cuFFT plan owns one work area and is keyed without the stream, so two
        # same-shape FFTs launched from this thread on two streams would share it while both
        # run (cupy#8079). This thread gets plan caches of its own, one per stream, instead
        # (cufft_plans: nor may two threads run one plan at once). Where CuPy's FFT modules
        # are not as expected, no cache: each call then makes its plan, whose work area
        # comes from the pool on the task's stream.
        problem = cufft_plans.installable()
        if problem is None:
            return cufft_plans.use()
        with cupy.cuda.Device(self.device_id):
            cache = cupy.fft.config.get_plan_cache()
            size = cache.get_size()
            cache.set_size(0)
        if not self._fft_warned:
            self._fft_warned = True
            logger.warning("gpustreams: cuFFT plan cache off while launching: %s", problem)

        def restore() -> None:
            with cupy.cuda.Device(self.device_id):
                cache.set_size(size)

        return restore

    def use_stream(self, stream: cupy.cuda.Stream, key: Any = None) -> AbstractContextManager:
        """``stream`` current for CuPy and, once PyTorch has started CUDA, for PyTorch.

        Until then (or with :attr:`torch_interop` off) this is ``stream`` itself,
        after a ``sys.modules`` lookup (and ``torch.cuda.is_initialized()`` once
        PyTorch is imported); PyTorch is never imported here, and each stream's
        ``torch.cuda.ExternalStream`` is made once, on first use (entered as
        :class:`_TorchStreamCalls` says). A task that starts PyTorch's CUDA itself
        runs its first PyTorch work on PyTorch's default stream, the legacy one, which
        CUDA orders with the blocking pool streams: correct, only not concurrent.
        """
        calls = self._torch_calls
        if calls is None:
            if "torch" not in sys.modules or not self.torch_interop:
                return stream
            calls = self._find_torch_calls()
            if calls is None:
                return stream
        elif not self.torch_interop:
            return stream
        target = self._torch_streams.get(stream)
        if target is None:
            target = self._torch_streams.setdefault(stream, calls.target(stream.ptr))
        return _TorchAndCupyStream(stream, target, calls)

    def _find_torch_calls(self) -> _TorchStreamCalls | None:
        """PyTorch's stream calls if it is imported and its CUDA started, else None (not cached)."""
        torch = sys.modules.get("torch")
        cuda = getattr(torch, "cuda", None)  # None while torch is still being imported
        is_initialized = getattr(cuda, "is_initialized", None)
        if is_initialized is None or not is_initialized():
            return None
        self._torch_calls = _TorchStreamCalls(torch, self.device_id)
        return self._torch_calls

    def current_stream(self) -> cupy.cuda.Stream:
        return cupy.cuda.get_current_stream()

    def orders_before_pool(self, stream: cupy.cuda.Stream) -> bool:
        # The legacy default stream (handle 0): the pool's streams are blocking ones.
        return stream.ptr == 0

    def unpooled_stream(self) -> cupy.cuda.Stream:
        # Handle 0, the legacy default stream: its work follows all earlier work of the
        # blocking streams, per-thread default ones included (CUDA's stream sync behavior).
        return cupy.cuda.Stream.null

    def stream_idle(self, stream: cupy.cuda.Stream) -> bool:
        return stream.done  # cudaStreamQuery

    def is_device_array(self, obj: Any) -> bool:
        return isinstance(obj, cupy.ndarray)

    def free_cached_memory(self) -> None:
        """Free CuPy's default pool's cached blocks (``cudaFree``, which waits for the device).

        CuPy frees them itself when ``cudaMalloc`` fails; a limit of its own
        (``set_limit``, ``CUPY_GPU_MEMORY_LIMIT``) may be reached with blocks still
        cached in other streams' arenas.
        """
        with cupy.cuda.Device(self.device_id):
            cupy.get_default_memory_pool().free_all_blocks()

    @contextlib.contextmanager
    def launch_allocator(
        self,
        streams: Sequence[cupy.cuda.Stream],
        small_blocks: int,
        large_tasks: int,
        shared: SharedAllocator | None = None,
    ) -> Iterator[AllocationMeter | None]:
        """A small request is allocated while a stream of its own, standing for the
        current pool stream, is current (CuPy's pool keys its arenas by the stream
        current then); the others are metered.

        A thread-local allocator (``cupy.cuda.using_allocator``), installed only where
        the current one is the default pool's ``malloc`` (or wraps it,
        ``functools.wraps``) and ``small_blocks`` or ``large_tasks`` is set; inside, a
        task's ``cupy.cuda.set_allocator`` raises (CuPy refuses it there), and one made
        by another thread is not seen. The
        standing stream never runs work: a block in its arena is reused only by later
        allocations on the pool stream it stands for, so CuPy's stream-order reuse,
        and the inputs held for other streams, stay as they are. It lives as long as
        that stream (:meth:`destroy_stream`). Allocations of at least ``shared.size``
        on a pool stream come from ``shared`` (keyed by the stream's handle). Allocations
        on other streams (the default, other devices', a task's own) are left as they
        are; so are those of a nested compute, whose allocator is this one already.
        """
        allocator = cupy.cuda.get_allocator()
        pool = cupy.get_default_memory_pool()
        shared_size = shared.size if shared is not None else 0
        if (
            not (small_blocks or large_tasks or shared_size)
            or inspect.unwrap(allocator) != pool.malloc
        ):
            yield None
            return
        if small_blocks:
            self._small_streams.ensure([s.ptr for s in streams], self._standing_stream)
        standing_for, current = self._small_streams.get, cupy.cuda.get_current_stream
        meter = _CupyMeter()
        made = meter.made

        def malloc(size: int) -> cupy.cuda.MemoryPointer:
            stream = current().ptr
            memory = None
            if size < small_blocks:
                small = standing_for(stream)
                if small is not None:
                    with small:
                        memory = allocator(size)
            elif size > meter.largest:
                meter.largest = size
            if memory is None and shared_size and size >= shared_size:
                memory = shared.malloc(size, stream, allocator)
            if memory is None:
                memory = allocator(size)
            made[memory.ptr] = stream
            return memory

        with cupy.cuda.using_allocator(malloc):
            yield meter

    def shared_block_source(self) -> _SharedArena:
        return _SharedArena(self._standing_stream(), self.device_id)

    def _standing_stream(self) -> cupy.cuda.Stream:
        """A stream of this device that never runs work (see :meth:`launch_allocator`)."""
        with cupy.cuda.Device(self.device_id):
            return cupy.cuda.Stream(non_blocking=True)

    def hardware_queues(self) -> int | None:
        if self.is_hip:
            return int(os.environ.get("GPU_MAX_HW_QUEUES", HIP_DEFAULT_QUEUES))
        return cuda_connections()

    def hardware_queues_variable(self) -> str:
        return "GPU_MAX_HW_QUEUES" if self.is_hip else "CUDA_DEVICE_MAX_CONNECTIONS"

    def on_device(self) -> cupy.cuda.Device:
        return cupy.cuda.Device(self.device_id)

    def alloc_pinned(self, nbytes: int) -> np.ndarray:
        return cupyx.empty_pinned((nbytes,), dtype=np.uint8)

    def empty(self, shape: tuple[int, ...], dtype: Any) -> cupy.ndarray:
        return cupy.empty(shape, dtype)

    def copy_to_device(self, dst: cupy.ndarray, src: np.ndarray, stream: cupy.cuda.Stream) -> None:
        dst.set(src, stream=stream)

    def copy_to_host(self, dst: np.ndarray, src: cupy.ndarray, stream: cupy.cuda.Stream) -> None:
        src.get(stream=stream, out=dst, blocking=False)


class _CupyMeter(AllocationMeter):
    """:class:`AllocationMeter` of CuPy's launch allocator: addresses are device pointers
    (an array's allocation's, ``data.mem.ptr``), stream keys the streams' handles."""

    __slots__ = ()

    def made_on(self, value: Any, stream: cupy.cuda.Stream) -> bool:
        if not isinstance(value, cupy.ndarray):
            return False
        memory = value.data.mem
        return memory is not None and self.made.get(memory.ptr) == stream.ptr


class _SharedArena:
    """The blocks of CuPy's pool allocated while ``stream``, which never runs work, is
    current: one arena for all the pool's streams (``Backend.shared_block_source``)."""

    def __init__(self, stream: cupy.cuda.Stream, device_id: int):
        self._stream = stream
        self._device_id = device_id

    def stream_key(self, stream: cupy.cuda.Stream) -> int:
        return stream.ptr

    def take(self, nbytes: int, allocate: Callable) -> tuple[cupy.cuda.MemoryPointer, bool]:
        with self._stream:
            return allocate(nbytes), False

    def lend(
        self, base: cupy.cuda.MemoryPointer, nbytes: int, owner: Any, reused: bool
    ) -> cupy.cuda.MemoryPointer:
        memory = cupy.cuda.UnownedMemory(base.ptr, nbytes, owner, self._device_id)
        return cupy.cuda.MemoryPointer(memory, 0)

    def give_back(self, base: cupy.cuda.MemoryPointer) -> None:
        """Nothing to do: the caller drops ``base``, and CuPy's pool files it in the arena
        of the stream current when it was allocated, this one's."""

    def close(self) -> None:
        with contextlib.suppress(Exception), cupy.cuda.Device(self._device_id):
            cupy.get_default_memory_pool().free_all_blocks(stream=self._stream)


#: ``torch._C``'s current device and its setter, a device's current stream and the stream
#: setter (what ``torch.cuda`` calls).
_ENTRIES = ("_cuda_getDevice", "_cuda_setDevice", "_cuda_getCurrentStream", "_cuda_setStream")


def _stream_ids(current: Any) -> bool:
    """Whether ``current`` (from ``_cuda_getCurrentStream``) is ``(stream_id, device_index,
    device_type)``, what ``_cuda_setStream`` takes since PyTorch 1.13 (before: one packed int)."""
    return isinstance(current, tuple) and len(current) == 3


class _TorchStreamCalls:
    """How PyTorch's current stream is read and set, once PyTorch has started CUDA.

    ``get(device_id)`` gives what ``set(*...)`` takes to make it ``device_id``'s current
    stream again; setting a stream also makes its device PyTorch's current one, which
    ``device()`` and ``set_device`` read and restore. Through ``torch._C``'s entry points
    where they take and give the stream's ids ``(stream_id, device_index, device_type)``,
    as ``torch.cuda.current_stream`` and ``set_stream`` call them, without making a
    ``torch.cuda.Stream`` at each call (entering a stream that way cost 14.5 us a task on
    the H200, against 1.1 us without PyTorch); else through the public functions.
    """

    __slots__ = ("_cuda", "_ids", "device", "device_id", "get", "set", "set_device")

    def __init__(self, torch: Any, device_id: int) -> None:
        cuda = torch.cuda
        self._cuda = cuda
        self.device_id = device_id
        entries = [getattr(torch._C, name, None) for name in _ENTRIES]
        self._ids = None not in entries and _stream_ids(entries[2](device_id))
        if self._ids:
            self.device, self.set_device, self.get, self.set = entries
        else:  # older PyTorch: a packed stream, or no such entry points
            self.device, self.set_device = cuda.current_device, cuda.set_device
            self.get = lambda index: (cuda.current_stream(index),)
            self.set = cuda.set_stream

    def target(self, ptr: int) -> tuple:
        """The arguments of :attr:`set` that make the CUDA stream ``ptr`` PyTorch's current."""
        stream = self._cuda.ExternalStream(ptr, device=self.device_id)
        if self._ids:
            return stream.stream_id, stream.device_index, stream.device_type
        return (stream,)


class _TorchAndCupyStream:
    """Enters a CuPy stream, then makes it PyTorch's current stream too (``target``,
    set through ``calls``).

    On exit PyTorch's previous current stream is restored, then CuPy's. Both
    libraries keep the current stream per thread and device.
    """

    __slots__ = ("_calls", "_device", "_previous", "_stream", "_target")

    def __init__(self, stream: cupy.cuda.Stream, target: tuple, calls: _TorchStreamCalls) -> None:
        self._stream = stream
        self._target = target
        self._calls = calls
        self._previous: tuple = ()
        self._device = calls.device_id

    def __enter__(self) -> cupy.cuda.Stream:
        stream = self._stream
        stream.__enter__()
        try:
            calls = self._calls
            self._device = calls.device()
            self._previous = calls.get(calls.device_id)
            calls.set(*self._target)
        except BaseException:
            stream.__exit__(None, None, None)
            raise
        return stream

    def __exit__(self, *exc: object) -> None:
        calls = self._calls
        try:
            calls.set(*self._previous)  # the backend's device's stream, as it was
            if self._device != calls.device_id:
                calls.set_device(self._device)  # and PyTorch's current device
        finally:
            self._previous = ()
            self._stream.__exit__(*exc)
