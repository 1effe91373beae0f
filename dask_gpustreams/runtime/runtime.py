"""The stream runtime: runs tasks on a pool of streams ordered by events, not host syncs.

It knows nothing of any scheduler: integrations call :meth:`StreamRuntime.run`
for each task with the task's inputs and an :class:`EventRegistry`, and
:meth:`StreamRuntime.synchronize` before data leaves the process. Which
runtimes exist, and when they close, is :mod:`.lifetime`'s business.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from typing import Any, NamedTuple

from dask.utils import format_bytes

from dask_gpustreams.backends import Backend, host_device_count
from dask_gpustreams.config import StreamsConfig, auto_pinned_pool_size
from dask_gpustreams.runtime.context import task_state
from dask_gpustreams.runtime.events import EventPool
from dask_gpustreams.runtime.hosttasks import HostTasks
from dask_gpustreams.runtime.hostthreads import HostThreads
from dask_gpustreams.runtime.largetasks import LargeTasks
from dask_gpustreams.runtime.lifetime import Runtimes
from dask_gpustreams.runtime.pinned import PinnedStats
from dask_gpustreams.runtime.policies import TaskInfo, make_policy
from dask_gpustreams.runtime.pool import StreamPool, StreamSlot, StreamStats
from dask_gpustreams.runtime.registry import EventRegistry, TaskRecord
from dask_gpustreams.runtime.sharedblocks import SharedBlocks
from dask_gpustreams.runtime.transfers import Transfers

logger = logging.getLogger("dask_gpustreams")


class CallerStream(NamedTuple):
    """The caller's stream, still busy when a compute began, that the device orders before
    the pool's streams on its own (CUDA's legacy default stream): nothing is recorded there,
    and host tasks wait for it on the host (:meth:`StreamRuntime.wait_caller`)."""

    stream: Any


class StreamRuntime:
    """One device's stream pool, policy and (optional) timeline.

    With ``config.timeline`` the records of the last :attr:`timeline_maxlen`
    tasks are kept in :attr:`timeline` (:mod:`dask_gpustreams.diagnostics` reads them
    with :meth:`timeline_snapshot`).

    Lifetime: a compute holds the runtime with :meth:`acquire` until
    :meth:`release`; :meth:`close` waits for those, then frees the streams,
    threads and memory. Made by :func:`get_runtime` (shared, closed when no
    longer used) or :meth:`Runtimes.create` (closed by its owner).
    """

    #: How many task records the timeline keeps (oldest dropped first).
    timeline_maxlen = 100_000

    def __init__(self, backend: Backend, config: StreamsConfig):
        self.backend = backend
        #: The backend's name (``"cupy"``, ``"sim"``) and the device the streams belong to.
        self.backend_name, self.device_id = backend.name, backend.device_id
        self.config = config
        self.policy = make_policy(config.policy)
        n_streams = fit_hardware_queues(backend, config.streams, 2 * config.copy_streams)
        #: The compute streams of the pool (``gpustreams.streams``, capped by the device).
        self.n_streams = n_streams
        self.pool = StreamPool(backend, n_streams, self.policy.high_priority_streams(n_streams))
        if config.nvtx:  # a range per task for Nsight; off, tasks run exactly as without
            from dask_gpustreams.diagnostics.nvtx import annotate

            annotate(backend, self.pool)
        pinned = config.pinned_pool_size
        if pinned is None:  # 'auto'; counting the host's devices may start NVML
            pinned = auto_pinned_pool_size(host_device_count(backend.name))
        self.transfers = Transfers(backend, config.copy_streams, pinned)
        self.timeline: deque[TaskRecord] | None = (
            deque(maxlen=self.timeline_maxlen) if config.timeline else None
        )
        #: Completion events the launcher reuses across graphs.
        self.events = EventPool(backend)
        #: Which task groups block the host (learned by the launcher).
        self.host_tasks = HostTasks()
        #: Which task groups allocate large blocks (learned by the launcher).
        self.large_tasks = LargeTasks(config.large_tasks)
        #: The launcher's large allocations, shared by the pool's streams (None: off).
        self.shared_blocks = (
            SharedBlocks(config.shared_blocks, self.pool, backend.shared_block_source)
            if config.shared_blocks
            else None
        )
        # The thread-local flag of threads whose library state is isolated for this device.
        self._isolation = ("isolated", backend.name, backend.device_id)
        self._host_executor: HostThreads | None = None
        self._host_lock = threading.Lock()
        self._host_closed = False
        # Lifetime: "open", "closing" (waiting for its users), "closed"; users counted.
        self._life = threading.Condition()
        self._state = "open"
        self._users = 0
        logger.info(
            "gpustreams: %s backend, device %s, %d streams, policy %r, pinned pool %s",
            backend.name,
            backend.device_id,
            n_streams,
            config.policy,
            format_bytes(pinned),
        )

    def __repr__(self) -> str:
        return (
            f"<StreamRuntime backend={self.backend.name} device={self.backend.device_id} "
            f"streams={self.pool.n_streams} policy={self.config.policy!r}>"
        )

    def run(
        self,
        key: Hashable,
        fn: Callable[[Mapping], Any],
        inputs: Mapping[Hashable, Any],
        registry: EventRegistry,
        critical: bool | None = None,
        large: bool = False,
    ) -> Any:
        """Run ``fn(inputs)`` for task ``key`` on a pool stream and record its event.

        The stream (chosen with ``critical`` and ``large`` as :class:`TaskInfo` has them)
        first waits (on the device) for the events of the inputs produced on other
        streams; the inputs are held until the task's own event completes. Returns as
        soon as the task's work is enqueued, unless more than ``pool.max_inflight`` tasks
        are queued on the stream: then it first waits for the oldest (back-pressure
        bounds the inputs held).
        """
        backend = self.backend
        pool = self.pool
        self.isolate_thread()
        get = registry.get
        producers = [r for k in inputs if (r := get(k)) is not None]
        with pool.assign_lock:
            slot = self.policy.select(TaskInfo(key, producers, registry, critical, large), pool)
            pool.assign(slot)
        event = start = None
        holds: list = []
        active = task_state.__dict__
        previous = active.get("runtime"), active.get("stream"), active.get("holds")
        try:
            if producers:
                self._wait_for(slot, producers)
            if self.timeline is not None:
                start = backend.create_event(timing=True)
                backend.record(start, slot.stream)
            event = self.events.acquire() if start is None else backend.create_event(timing=True)
            active["runtime"], active["stream"], active["holds"] = self, slot.stream, holds
            with backend.use_stream(slot.stream, key):
                result = fn(inputs)
        finally:
            active["runtime"], active["stream"], active["holds"] = previous
            if event is None:
                pool.unassign(slot)
            else:
                # Recorded even if fn raised: kernels it enqueued may still read the inputs,
                # and a drain of the registry waits for them.
                seq = pool.record(slot, event, (inputs, holds) if holds else inputs, True)
                record = TaskRecord(key, slot, event, seq, start)
                registry.add(record)
                if self.timeline is not None:
                    self.timeline.append(record)
        return result

    def isolate_thread(self) -> None:
        """Before this thread's first task: library state safe for several streams (once).

        For the threads that run tasks (worker and pool threads); a user's thread
        that launches a graph is isolated only while it does (:meth:`isolated`).
        """
        state = task_state.__dict__
        if self._isolation not in state and self.pool.n_streams > 1:
            state[self._isolation] = self.backend.isolate_thread()

    @contextlib.contextmanager
    def isolated(self) -> Iterator[None]:
        """This thread isolated (:meth:`isolate_thread`) inside, and as it was after.

        The launcher runs in the caller's thread: its library state (CuPy's FFT plan
        cache, disabled while isolated) must not stay changed for the caller's own
        CuPy calls after the compute.
        """
        state = task_state.__dict__
        if self._isolation in state or self.pool.n_streams <= 1:
            yield
            return
        restore = self.backend.isolate_thread()
        state[self._isolation] = restore
        try:
            yield
        finally:
            del state[self._isolation]
            restore()

    def host_executor(self) -> HostThreads:
        """The threads that run host tasks for the launcher (each ends when idle)."""
        executor = self._host_executor
        if executor is None:
            with self._host_lock:
                if self._host_executor is None:
                    if self._host_closed:
                        raise RuntimeError(f"{self!r} is closed")
                    threads = self.config.host_threads
                    self._host_executor = HostThreads(threads, "gpustreams-host")
                executor = self._host_executor
        return executor

    def _wait_for(self, slot: StreamSlot, producers: list[TaskRecord]) -> None:
        """Make ``slot`` wait for the latest event of each other stream among ``producers``."""
        latest: dict[int, TaskRecord] = {}
        for r in producers:
            if r.slot is not slot:
                seen = latest.get(r.slot.index)
                if seen is None or r.seq > seen.seq:
                    latest[r.slot.index] = r
        for r in latest.values():
            self.pool.wait(slot, r.slot, r.event, r.seq)

    def synchronize(self, keys: Iterable[Hashable], registry: EventRegistry) -> None:
        """Block until the work producing ``keys`` is done; raise if it failed (:meth:`check`).

        Only the events of these keys are waited for, not the whole device.
        """
        check = self.check
        for record in registry.records(keys):
            check(record.event)

    def check(self, event: Any) -> None:
        """Block until ``event``'s work is done; raise its failure, also one that another
        thread's sync reported first (a concurrent compute's, whose work queued behind
        it), which a sync would not raise again on the sim. A failure not reported yet is
        reported here, so the streams it reached run again (:meth:`report`)."""
        backend = self.backend
        error = backend.event_error(event)
        if error is not None:
            with contextlib.suppress(Exception):
                backend.synchronize_event(event)
            raise error.with_traceback(None)  # shared: not the frames of an earlier raise

    def release_events(self, registry: EventRegistry) -> None:
        """Give the events of ``registry``, a finished graph's, back for reuse; forget them."""
        records = registry.records(registry)
        registry.clear()
        self.events.release(r.event for r in records if r.start is None)

    def drain(self, registry: EventRegistry) -> None:
        """Wait for the work of every key of ``registry``; failures are consumed, not raised."""
        for record in registry.records(registry):
            with contextlib.suppress(Exception):
                self.backend.synchronize_event(record.event)

    def collect(self) -> int:
        """Release what completed tasks and copies held; return the work still in flight."""
        return self.pool.collect_all() + self.transfers.collect()

    # ------------------------------------------------------------------ records

    # What integrations and diagnostics ask of the tasks run here: they hand in the
    # records that run() registered and never touch events, streams or slots.

    def state(self, record: TaskRecord) -> tuple[bool, BaseException | None]:
        """``(completed, error of failed work before it)`` of ``record``'s task; never blocks.

        The error, None while not completed, is returned every time it is asked
        for, never raised; a query that fails itself (a CUDA error) counts as
        completed with that error.
        """
        try:
            return self.backend.event_state(record.event)
        except Exception as e:  # a CUDA error from the query itself
            return True, e

    def done(self, record: TaskRecord) -> bool:
        """Whether ``record``'s task has completed (a query, never blocks; may raise its error)."""
        return self.backend.done(record.event)

    def wait(self, record: TaskRecord) -> BaseException | None:
        """Block until ``record``'s task completes; the error of failed work before it, or None.

        Never raises it: a failed wait is returned as the error.
        """
        try:
            return self.backend.event_error(record.event)
        except Exception as e:
            return e

    def wait_stream(self, stream: Any) -> BaseException | None:
        """Block until the work enqueued so far on ``stream`` completes (a running task's
        stream, from ``active_task``); the error of failed work before it, or None.

        Never raises it, as :meth:`wait`: an event recorded now carries the error even
        when another thread's sync reported it meanwhile. The event comes from the pool
        and goes back to it done.
        """
        backend = self.backend
        events = self.events
        try:
            event = events.acquire()
            backend.record(event, stream)
            error = backend.event_error(event)
        except Exception as e:
            return e
        events.release((event,), done=True)
        return error

    def wait_current_stream(self) -> BaseException | None:
        """:meth:`wait_stream` for this thread's current stream (a task run off the pool)."""
        return self.wait_stream(self.backend.current_stream())

    def wait_all(self, records: Iterable[TaskRecord]) -> None:
        """Block until the task of each of ``records`` completes; errors: see :meth:`state`."""
        event_error = self.backend.event_error
        for record in records:
            with contextlib.suppress(Exception):
                event_error(record.event)

    def report(self, record: TaskRecord) -> None:
        """Report the error of ``record``'s completed task to the device, now; raise nothing.

        A sync of its event, which returns at once. On the simulated device the
        streams a failure reached skip what is launched on them until a sync
        reports it; the event keeps its error (:meth:`state` still gives it).
        A CUDA error is sticky: nothing to report, the sync raises it again.
        """
        with contextlib.suppress(Exception):
            self.backend.synchronize_event(record.event)

    def order_after_caller(self) -> Any:
        """Make every stream wait (on the device) for what this thread has enqueued so far;
        return what host tasks wait for on the host (:meth:`wait_caller`): an event, a
        :class:`CallerStream`, or None where that work is done.

        A graph's inputs may still be being written on the calling thread's current
        stream (a CuPy array made just before ``compute``, or a nested compute's caller,
        a task whose own pool stream writes them). CUDA orders the legacy default stream
        with the pool's blocking streams, but not a per-thread default stream
        (``CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1``), a stream the caller made, a pool
        stream, or the sim's default stream while busy: then one event is recorded
        there, and every stream, compute and copy (created now if need be), waits for it.
        On the legacy default stream nothing is recorded (an event there would order the
        device's later work after all its earlier work); while it is busy, host tasks
        synchronize it instead. Host tasks read their inputs off the streams (a GDS
        write), so they wait on the host either way. Once per compute.
        """
        backend = self.backend
        stream = backend.current_stream()
        if backend.orders_before_pool(stream):
            return None if backend.stream_idle(stream) else CallerStream(stream)
        event = backend.create_event()
        backend.record(event, stream)
        transfers = self.transfers
        for pool in (self.pool, transfers.h2d, transfers.d2h):
            pool.wait_event_all(event)
        return event

    def wait_caller(self, caller: Any) -> None:
        """Block until the caller's work that :meth:`order_after_caller` returned is done
        (a host task's wait for its literal inputs); raise its failure (:meth:`check`)."""
        if type(caller) is CallerStream:
            self.backend.synchronize_stream(caller.stream)
        else:
            self.check(caller)

    def clear_errors(self) -> None:
        """Block until every stream, compute and copy, is idle, ignoring their errors.

        Reports to the device the failures no sync has reported yet (see
        :meth:`report`), so that work launched later on the streams they reached
        runs again. Streams not created yet are left alone.
        """
        transfers = self.transfers
        for pool in (self.pool, transfers.h2d, transfers.d2h):
            pool.synchronize_quietly()

    def stream_stats(self) -> list[StreamStats]:
        """What each stream, compute and copy, is doing: a snapshot, no lock, nothing released.

        The compute streams' ``in_flight`` is asked of the device; the copy
        streams' is None. Empty for the streams not created yet.
        """
        transfers = self.transfers
        return [
            *self.pool.stats("compute"),
            *transfers.h2d.stats("h2d", query=False),
            *transfers.d2h.stats("d2h", query=False),
        ]

    @property
    def transfer_functions(self) -> tuple[tuple[Callable, ...], tuple[Callable, ...]]:
        """The backend's upload and download functions (``cupy.asarray``, ``cupy.asnumpy``...).

        The integrations rewrite calls of them in tasks onto the copy streams.
        """
        backend = self.backend
        return tuple(backend.upload_functions), tuple(backend.download_functions)

    @property
    def sticky_errors(self) -> bool:
        """Whether a kernel failure is sticky for the device's whole context (CUDA's).

        Then :meth:`report` clears nothing. False on the simulated device, where a
        failure stays with the streams it reached only until a sync reports it. A
        backend registered without the attribute is taken as CUDA's.
        """
        return getattr(self.backend, "sticky_errors", True)

    def reported_failures(self) -> int:
        """How many kernel failures host syncs have reported so far; always 0 where
        failures are sticky.

        On the simulated device a report clears a failure from the streams it
        reached, so work queued behind it may then run on output that was never
        written, its own event clean; a compute whose results' events are all
        clean could return such values. A compute that finds this count moved
        while it ran checks every event of its work instead (one comparison in
        the common case). On CUDA every later sync sees a sticky failure.
        """
        return 0 if self.sticky_errors else self.backend.reported_failures()

    @property
    def needs_critical_path(self) -> bool:
        """Whether the policy places tasks by the graph's longest path (give it the flags)."""
        return self.policy.needs_critical_path

    @property
    def timeline_enabled(self) -> bool:
        """Whether the tasks run from now on get timing events and a place in the timeline."""
        return self.timeline is not None

    def enable_timeline(self) -> bool:
        """Keep a timeline from now on; True if this call turned it on (off before, and open).

        For a runtime created with ``gpustreams.timeline`` off (the dashboard turns
        it on while a page is open); the tasks run before have no timing events.
        """
        if self.timeline is not None or self.closed:
            return False
        self.timeline = deque(maxlen=self.timeline_maxlen)
        return True

    def disable_timeline(self) -> None:
        """Keep no timeline from now on; the records it held go with it."""
        self.timeline = None

    def clear_timeline(self) -> None:
        """Drop the records the timeline holds so far; it stays on (or off)."""
        timeline = self.timeline
        if timeline is not None:
            timeline.clear()

    def timeline_snapshot(self) -> list[TaskRecord]:
        """The records of :attr:`timeline`, oldest first, as they are now.

        Empty while it is off or before the streams exist (or once they are closed).
        """
        timeline = self.timeline
        return list(timeline) if timeline is not None and self.pool.started() else []

    def elapsed_ms(self, record: TaskRecord) -> float:
        """Device milliseconds of ``record``'s task; it has timing events, and it completed."""
        return self.backend.elapsed_ms(record.start, record.event)

    def task_times(
        self, records: Iterable[TaskRecord], timeout: float
    ) -> list[tuple[TaskRecord, float, float]]:
        """``(record, start, end)`` of those of ``records`` timed and completed, on the host clock.

        ``start`` and ``end`` are ``time.time()`` seconds. The device clock is
        anchored to the host's by an event recorded now on a stream of its own,
        which completes when the host sees it done (to a few microseconds) and
        never waits behind the pool's work. Raises ``TimeoutError`` if the
        anchor has not completed after ``timeout`` seconds.
        """
        backend = self.backend
        done = backend.done
        finished = [r for r in records if r.timed and done(r.event)]
        if not finished:
            return []
        with backend.on_device():  # CuPy creates events on the current device
            stream = backend.create_stream()  # dropped after
            anchor = backend.create_event(timing=True)
            backend.record(anchor, stream)
        deadline = time.monotonic() + timeout
        while not done(anchor):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the clock anchor of {self!r} did not complete within "
                    f"timeout={timeout} s; its {len(finished)} records are left out"
                )
            time.sleep(0)
        now = time.time()
        elapsed = backend.elapsed_ms
        return [
            (r, now - elapsed(r.start, anchor) / 1e3, now - elapsed(r.event, anchor) / 1e3)
            for r in finished
        ]

    # ------------------------------------------------------------------ settings

    def pinned_stats(self) -> PinnedStats:
        """The pinned host memory of the copies: staging, results alive, and the limit."""
        return self.transfers.pinned.stats()

    # ------------------------------------------------------------------ lifetime

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has started: the runtime takes no new computes."""
        return self._state != "open"

    def acquire(self) -> StreamRuntime:
        """Count a compute as using the runtime until :meth:`release`; returns the runtime.

        Once per compute, not per task. Raises ``RuntimeError`` once closed.
        """
        with self._life:
            if self._state != "open":
                raise RuntimeError(f"{self!r} is closed; get_runtime() gives an open one")
            self._users += 1
        return self

    def release(self) -> None:
        """End an :meth:`acquire`; a :meth:`close` waiting for the last one then proceeds."""
        with self._life:
            self._users -= 1
            if not self._users:
                self._life.notify_all()

    def close(self, timeout: float | None = None) -> None:
        """Free the streams, host threads, pinned staging and events; idempotent.

        New computes are refused at once (:meth:`acquire` raises). The computes
        that acquired the runtime are waited for, up to ``timeout`` seconds:
        if some still run then, the runtime stays open and ``TimeoutError`` is
        raised. Then the work already enqueued on the streams runs to its end
        (its errors are not raised here: the computes that wanted its results
        have seen them) and everything is released. The streams are destroyed:
        simulated streams' threads have ended when it returns (each joined up to
        ``pool.STREAM_END_TIMEOUT`` s), whoever still refers to the streams. Do
        not call it from a task of a compute that holds the runtime (it would
        wait for itself).
        """
        with self._life:
            while self._state == "closing":  # another thread is closing it
                self._life.wait()
            if self._state == "closed":
                return
            self._state = "closing"
            if not self._life.wait_for(lambda: not self._users, timeout):
                self._state = "open"
                self._life.notify_all()
                raise TimeoutError(
                    f"{self._users} computes still use {self!r} after timeout={timeout} s; "
                    "it stays open"
                )
        try:
            self._free()
        finally:
            with self._life:
                self._state = "closed"
                self._life.notify_all()

    def _free(self) -> None:
        with self._host_lock:
            self._host_closed = True
            executor, self._host_executor = self._host_executor, None
        if executor is not None:
            # Idle: its computes have ended (unless close() runs on one of its threads).
            executor.shutdown(
                wait=not threading.current_thread().name.startswith("gpustreams-host")
            )
        self.pool.close()
        if self.shared_blocks is not None:
            self.shared_blocks.close()  # after the pool's: its streams are synchronized
        self.transfers.close()
        self.events.clear()
        if self.timeline is not None:
            self.timeline.clear()  # its records refer to the streams
        logger.info("gpustreams: closed %r", self)


def fit_hardware_queues(backend: Backend, n_streams: int, copies: int) -> int:
    """How many of ``n_streams`` compute streams to create, beside ``copies`` copy streams.

    Where the device has fewer hardware queues than compute streams, more
    streams would serialize falsely: warn and cap them. Copy streams beyond
    the queues only log, since they are created at the first copy and many
    graphs have none.
    """
    queues = backend.hardware_queues()
    if queues is None or n_streams + copies <= queues:
        return n_streams
    variable = backend.hardware_queues_variable()
    if n_streams > queues:
        warnings.warn(
            f"gpustreams.streams={n_streams} exceeds the device's {queues} hardware "
            f"queues ({variable}); capping the pool at {queues} streams, since more "
            f"would serialize falsely. Set {variable}={n_streams} in the environment "
            "before the process first uses the GPU to use more.",
            RuntimeWarning,
            stacklevel=4,
        )
        return queues
    logger.info(
        "gpustreams: %d compute and %d copy streams share the device's %d hardware queues "
        "(%s), so copies may wait for unrelated kernels; set %s=%d in the environment "
        "before the process first uses the GPU to avoid it",
        n_streams,
        copies,
        queues,
        variable,
        variable,
        n_streams + copies,
    )
    return n_streams


#: The process's runtimes: shared ones per device and setting, and owned ones.
runtimes = Runtimes(StreamRuntime)


def get_runtime(config: StreamsConfig | None = None) -> StreamRuntime:
    """The shared runtime of this process and the calling thread's device for ``config``.

    Created on first call (``config`` defaults to dask's ``gpustreams.*``), so
    configuration errors surface here, when a computation starts. A compute
    that runs on it should hold it with :func:`acquire_runtime` instead: the
    least recently used runtimes that no compute holds are closed once more
    than :attr:`Runtimes.max_idle` are kept.
    """
    return runtimes.get(config)


def acquire_runtime(config: StreamsConfig | None = None) -> StreamRuntime:
    """:func:`get_runtime`, held (:meth:`StreamRuntime.acquire`) until ``release()``."""
    return runtimes.acquire(config)


def live_runtimes() -> list[StreamRuntime]:
    """The open runtimes of this process, shared and owned, a snapshot (for diagnostics)."""
    return runtimes.live()
