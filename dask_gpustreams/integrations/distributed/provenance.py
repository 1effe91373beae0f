"""What each key's value on a worker derives from on the device, and which of that work failed.

The state behind the *Failures* section of :mod:`.plugin`'s documentation:
the worker's runtime, its event registry, the taint of each key and the
records of corrupt results, with the reads that the plugin's other parts make
of them, and the release of corrupt results. Reads never block unless said
otherwise.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping
from collections.abc import Set as AbstractSet
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from distributed.core import Status
from distributed.worker_state_machine import ReleaseWorkerDataMsg, RemoveReplicasEvent

from dask_gpustreams.config import StreamsConfig
from dask_gpustreams.errors import KernelError
from dask_gpustreams.integrations.distributed.erred_inputs import STIMULUS_PREFIX
from dask_gpustreams.integrations.distributed.failures import FailureRecords
from dask_gpustreams.runtime import EventRegistry, StreamRuntime, TaskRecord, runtimes

# Worker task states of a dependent that still needs its inputs in this worker's memory.
# "cancelled" and "resumed": a task whose thread may still run (its inputs read, or not yet).
_NEEDS_INPUTS = frozenset(
    {"waiting", "ready", "constrained", "executing", "long-running", "cancelled", "resumed"}
)


def as_kernel_error(key: Hashable, exc: BaseException) -> KernelError:
    """``exc`` (a failed event sync) as the :class:`KernelError` of ``key``'s work."""
    if isinstance(exc, KernelError):
        return exc
    return KernelError(key, f"{type(exc).__name__}: {exc}")


class Taints(dict):
    """key -> the records of the work its value derives from on this worker (its taint).

    The records of its inputs, of their inputs, ..., while not known to have
    succeeded. Written by :meth:`note` (a task that starts with inputs whose work
    is pending, in its worker thread or on the event loop) and :meth:`succeeded`
    (an egress wait found all that work fine), both through :class:`Provenance`,
    which holds it, and by it as keys go. A mapping: the read made per input of
    each task (``get``) is no Python call.
    """

    def note(self, key: Hashable, pending: tuple[TaskRecord, ...]) -> None:
        """``key``'s value derives from ``pending``, work not complete when its task started."""
        self[key] = pending

    def succeeded(self, key: Hashable) -> None:
        """The work ``key``'s value derives from has completed without error."""
        self.pop(key, None)


class DistinctCount:
    """How many distinct items were added, an item counted once while among the last
    :attr:`window` added (any thread; a failure path, so a lock)."""

    window = 1000

    def __init__(self):
        self.count = 0
        self._recent: dict[Hashable, None] = {}
        self._lock = threading.Lock()

    def add(self, item: Hashable) -> None:
        with self._lock:
            if item not in self._recent:
                self.count += 1
                self._recent[item] = None
                if len(self._recent) > self.window:
                    del self._recent[next(iter(self._recent))]


class Provenance:
    """The device work behind one worker's keys: its runtime, events, taints and failures.

    The one owner of that state; the plugin's hooks, :class:`.Execution` and
    :class:`.Egress` use it through these methods, and read the runtime, the
    registry, the taints and the failure records through read-only properties.
    ``threads`` (the plugin's egress threads) clear stream errors after a
    failure (those found are reported at once, see :meth:`_report`), report
    the failures nothing read when no task does (:meth:`report_unread`), and
    close the runtime. ``failures``: the worker's records of corrupt results, which
    :meth:`drop_corrupt` writes (and :class:`.Execution` takes from).
    """

    def __init__(
        self,
        worker: Any,
        config: StreamsConfig,
        threads: ThreadPoolExecutor,
        failures: FailureRecords,
    ):
        self._worker = worker
        self._config = config
        self._threads = threads
        #: The worker's runtime, created by its first task or :meth:`note_unpooled`
        #: (:meth:`task_runtime`), its own (not shared with other workers of the process);
        #: closed by :meth:`close`.
        self._runtime: StreamRuntime | None = None
        #: The event of each key produced on this worker (its tasks record them).
        self._registry = EventRegistry()
        #: key -> (KernelError of a result found corrupt, when); raised when the key runs again.
        self._failures = failures
        #: key -> records of the work its value derives from on this worker, not yet known
        #: to have succeeded (its inputs, their inputs, ...).
        self._taint = Taints()
        #: The records and taints of forgotten keys, not yet freed (:meth:`forget`).
        self._retired: deque[Any] = deque()
        #: The taints' writers (:meth:`Taints.note`: ``key``'s value derives from ``pending``,
        #: work not complete when its task started; :meth:`Taints.succeeded`: all that work
        #: completed fine). Bound here: ``note_pending`` runs once per task, with no call added.
        self.note_pending = self._taint.note
        self.succeeded = self._taint.succeeded
        #: corrupt key -> the keys of its dependents that still need it on this worker; it is
        #: released when the last one leaves those states (:meth:`transitioned`).
        self._held: dict[Hashable, set[Hashable]] = {}
        #: dependent -> the held keys it needs (the same pairs, by dependent).
        self._needed_by: dict[Hashable, set[Hashable]] = {}
        self._clearing = False  # a clear of stream errors is queued
        #: Whether each task's record is watched for a failure nobody reads
        #: (:meth:`report_unread`): set with the runtime, where errors are not sticky.
        self._watching = False
        #: The records of the tasks launched (or keys forgotten) since the last
        #: :meth:`report_unread`, and, by stream, those whose task had not completed then:
        #: heaps of ``(seq, n, record)``, in the order their events complete (``n`` breaks
        #: the tie of a record watched twice: records do not compare).
        self._launched: deque[TaskRecord] = deque()
        self._unsettled: dict[int, list[tuple[int, int, TaskRecord]]] = {}
        self._watched = itertools.count()
        self._reporting = False  # a report_unread holds the records it took (under the lock)
        self._report_queued = False  # collect queued a report_unread, not run yet
        self._report_lock = threading.Lock()
        #: The task runs found failed (:meth:`_failed`), for :attr:`kernel_failures`.
        self._failed_runs = DistinctCount()
        #: Keys whose values were made, or are being made, while no plugin was set up on
        #: this worker (:meth:`note_unpooled`): their work has no event. Their readers wait
        #: for it on the host first (:meth:`settle_unpooled`). Iterated and changed under
        #: :attr:`_unpooled_lock`; read (truthiness, membership) with no lock.
        self._unpooled: set[Hashable] = set()
        self._unpooled_lock = threading.Lock()

    # Read-only views, for the other parts' bindings and for diagnostics.

    @property
    def runtime(self) -> StreamRuntime | None:
        """The worker's runtime; None until its first task (or :meth:`note_unpooled`)."""
        return self._runtime

    @property
    def registry(self) -> EventRegistry:
        """The event of each key produced on this worker: handed to the tasks that record them."""
        return self._registry

    @property
    def failures(self) -> FailureRecords:
        """The records of corrupt results (taken by :class:`.Execution` when a key runs again)."""
        return self._failures

    @property
    def taint(self) -> Mapping[Hashable, tuple[TaskRecord, ...]]:
        """key -> the records of the work its value derives from here, not yet known fine."""
        return self._taint

    @property
    def held(self) -> Mapping[Hashable, set[Hashable]]:
        """Corrupt keys held for their dependents: read, never written, by the plugin's hook.

        Its truthiness is the one check the hook makes per transition (no Python call).
        """
        return self._held

    @property
    def unpooled(self) -> AbstractSet[Hashable]:
        """Keys made while no plugin was set up here, their work not yet waited for: read,
        never written, by the other parts (its truthiness is their check per task)."""
        return self._unpooled

    @property
    def kernel_failures(self) -> int:
        """Task runs whose kernels this worker found failed (in a task's inputs, in a result
        asked for), each counted once however often it is found; for diagnostics."""
        return self._failed_runs.count

    def task_runtime(self) -> StreamRuntime:
        """The worker's runtime, created at its first task (or :meth:`note_unpooled`): after
        dask-cuda and RMM set up."""
        if self._runtime is None:
            self._runtime = runtimes.create(self._config)
            self._watching = not self._runtime.sticky_errors
        return self._runtime

    def sources_by_key(self, keys: Iterable[Hashable]) -> dict[Hashable, list[TaskRecord]]:
        """:meth:`sources` of each of ``keys`` that has a record on this worker, by key."""
        return {r.key: self.sources((r.key,)) for r in self._registry.records(keys)}

    def sources(self, keys: Iterable[Hashable]) -> list[TaskRecord]:
        """Records of the work the values of ``keys`` derive from on this worker.

        The keys' own records and their taint: a failure reported elsewhere
        first may not reach the events of the work that read its output.
        """
        sources = {}
        for record in self._registry.records(keys):
            sources[record] = None
            sources.update(dict.fromkeys(self._taint.get(record.key, ())))
        return list(sources)

    def pending(self, records: Iterable[TaskRecord]) -> list[TaskRecord]:
        """Those of ``records`` whose task has not completed (never blocks; errors reported)."""
        state = None  # the runtime's, asked once, with no call added per record
        pending = []
        for record in records:
            if state is None:  # bound at the first record: without any, no runtime is read
                state = self._runtime.state
            done, error = state(record)
            if error is not None:
                self._failed(record, error)
            if not done:
                pending.append(record)
        return pending

    def first_error(self, records: Iterable[TaskRecord]) -> KernelError | None:
        """The error of the first of ``records`` whose task failed (reported), or None."""
        state = None
        for record in records:
            if state is None:
                state = self._runtime.state
            error = state(record)[1]
            if error is not None:
                return self._failed(record, error)
        return None

    def any_running(self, records: Iterable[TaskRecord]) -> bool:
        """Whether the task of any of ``records`` has not completed (a query each, no wait).

        A query does not report errors; on CUDA one that finds a failure raises it.
        """
        return any(not self._runtime.done(r) for r in records)

    def wait(self, record: TaskRecord) -> KernelError | None:
        """Block until ``record``'s task completes; its error (reported, see :meth:`_report`)."""
        error = self._runtime.wait(record)
        if error is None:
            return None
        return self._failed(record, error)

    def wait_all(self, records: Iterable[TaskRecord]) -> None:
        """Block until the task of each of ``records`` completes (errors: :meth:`state`)."""
        self._runtime.wait_all(records)

    def _failed(self, record: TaskRecord, error: BaseException) -> KernelError:
        """The failure of ``record``'s completed task, reported (:meth:`_report`) and counted."""
        self._report(record)
        self._failed_runs.add((record.key, record.stream_index, record.seq))  # this run
        return as_kernel_error(record.key, error)

    def _report(self, record: TaskRecord) -> None:
        """Report the error of ``record``'s completed task to the device, now.

        :meth:`StreamRuntime.report`, before the failure goes anywhere (a task's
        error, a dropped key, the client): on the simulated device, the streams
        the failure reached skip what is launched on them until it is reported,
        and no task launched after this is skipped for it, such as those of the
        user's next graph, which would otherwise fail with this key's error. The
        task keeps its error, so corrupt results are still found.
        """
        self._runtime.report(record)

    def input_states(
        self, dep_keys: Iterable[Hashable]
    ) -> tuple[KernelError | None, tuple[TaskRecord, ...]]:
        """The error of failed work the inputs derive from, and the work still pending.

        Once per task on the event loop: the inputs' own records, and their taints
        only where they have one (a set then drops the records shared by several).
        """
        get = self._registry.get
        taint = self._taint
        state = None  # the runtime's, bound at the first record (none: no runtime yet)
        pending: list[TaskRecord] = []
        tainted = False
        for key in dep_keys:
            record = get(key)
            if record is None:
                continue
            if state is None:  # not self.state for each: no call added per input
                state = self._runtime.state
            done, error = state(record)
            if error is not None:
                return self._failed(record, error), ()
            if not done:
                pending.append(record)
            more = taint.get(key)
            if more:
                tainted = True
                for other in more:
                    done, error = state(other)
                    if error is not None:
                        return self._failed(other, error), ()
                    if not done:
                        pending.append(other)
        return None, tuple(dict.fromkeys(pending) if tainted else pending)

    def wait_inputs(self, dep_keys: tuple[Hashable, ...]) -> None:
        """Worker thread: block until the work the inputs derive from is done; raise its error."""
        if self._unpooled:
            self.settle_unpooled(dep_keys)
        for record in self.sources(dep_keys):
            error = self._runtime.wait(record)  # as :meth:`wait` does, with no call added
            if error is not None:
                raise self._failed(record, error)

    def input_failures(self, dep_keys: tuple[Hashable, ...]) -> dict[Hashable, KernelError]:
        """Worker thread: block until the work the inputs derive from is done; the error of
        each input whose work failed (a block fails only the outputs that derive from it)."""
        failures = {}
        for key, records in self.sources_by_key(dep_keys).items():
            for record in records:
                error = self._runtime.wait(record)
                if error is not None:
                    failures[key] = self._failed(record, error)
                    break
        return failures

    def note_unpooled(self, keys: Collection[Hashable]) -> None:
        """Event loop, at setup: ``keys`` were made, or are being made by tasks already
        running, while no plugin was set up here (before the first registration, or while
        a new one waited for the old one's teardown). Their work went to the device's
        default streams, with no event: their readers settle it first
        (:meth:`settle_unpooled`). Starts the runtime, which that wait uses (tasks ran: the
        worker's own setup, dask-cuda's and RMM's, is done)."""
        if keys:
            self.task_runtime()
            with self._unpooled_lock:
                self._unpooled.update(keys)

    def settle_unpooled(self, keys: Collection[Hashable]) -> None:
        """Block until the work of those of ``keys`` that :meth:`note_unpooled` noted is done.

        Any thread but the event loop's (a reader's, an egress thread), except for a spill.
        One wait for an event recorded on the backend's unpooled stream, after which
        every noted key in memory before it (the readers' keys among them) is settled for
        all its readers: its task had returned, so its work was launched before the event.
        That work's failure is not raised: it stays with that work, as in plain Dask (a
        later sync reports it).
        """
        unpooled = self._unpooled
        if not unpooled or unpooled.isdisjoint(keys):
            return
        tasks = self._worker.state.tasks
        with self._unpooled_lock:
            made = [k for k in unpooled if getattr(tasks.get(k), "state", None) == "memory"]
        backend = self._runtime.backend
        with backend.on_device():
            event = backend.create_event()
            backend.record(event, backend.unpooled_stream())
        backend.event_error(event)  # waits; returns the error, reports nothing
        with self._unpooled_lock:
            unpooled.difference_update(made)

    def forget(self, key: Hashable) -> None:
        """Drop the entries of ``key``, which is no longer this worker's to serve.

        On the event loop: its record and its taint (records, each with its event)
        are freed later, in a task thread (:meth:`free_retired`) or at the next
        :meth:`collect`; where errors are not sticky (the sim), it is also watched
        (:meth:`watch`: a key forgotten between its launch and its task's watch).
        Deque appends and clears are atomic: no lock.
        """
        record = self._registry.discard(key)
        if record is not None:
            self._retired.append(record)
            if self._watching:  # an attribute: no call
                self._launched.append(record)
        if self._taint:
            taint = self._taint.pop(key, None)
            if taint:
                self._retired.append(taint)
        if self._unpooled:
            with self._unpooled_lock:
                self._unpooled.discard(key)

    def free_retired(self) -> None:
        """Worker thread: free the records of the keys forgotten since the last call."""
        self._retired.clear()

    def watch(self, key: Hashable) -> None:
        """Worker thread, after ``key``'s task launched: watch its record for a failure
        nobody reads (:meth:`report_unread`), where errors are not sticky (the sim)."""
        if self._watching:
            record = self._registry.get(key)
            if record is not None:
                self._launched.append(record)

    def report_unread(self) -> None:
        """Worker thread, before a launch (or egress thread): report failures nobody read.

        A failed key is found, hence reported (:meth:`_report`), only when
        something reads it: a ``get_data``, a dependent, a spill. One that nothing
        reads (released unread, or held by a future never gathered) would leave its
        stream in error on the simulated device, and the next task launched there
        would be skipped and fail with this key's error. So each watched record
        (:meth:`watch`) is asked here once its task has completed, and reported if
        it failed; one not completed yet is asked again at each call (per stream,
        oldest first: they complete in that order). A task calls this before it
        launches, so a failure complete by then is reported before its work is
        enqueued (a task launched on that stream while the failing kernel still
        runs is skipped with it, as any work queued after a failure is). A report
        leaves the key's error with its record: its readers still find it. Only
        where errors are not sticky (:meth:`watch` collects no record otherwise);
        with nothing to do, three reads. Another thread's call holds the records
        it took under the lock with ``_reporting`` set, read last here: then this
        waits for it.
        """
        if not (self._launched or self._unsettled or self._reporting):
            return
        with self._report_lock:
            self._reporting = True
            try:
                self._report_unread()
            finally:
                self._reporting = False

    def _report_from_egress(self) -> None:
        """Egress thread: :meth:`report_unread` for :meth:`collect`, which may queue another."""
        try:
            self.report_unread()
        finally:
            self._report_queued = False

    def _report_unread(self) -> None:
        """:meth:`report_unread`'s work, under its lock."""
        runtime = self._runtime
        if runtime is None:
            return
        state = runtime.state
        launched = self._launched
        unsettled = self._unsettled
        while True:  # not ``while launched``: a teardown's clear may empty it in between
            try:
                record = launched.popleft()
            except IndexError:
                break
            entry = (record.seq, next(self._watched), record)
            heapq.heappush(unsettled.setdefault(record.stream_index, []), entry)
        for index, heap in list(unsettled.items()):
            while heap:
                record = heap[0][2]
                done, error = state(record)
                if not done:
                    break
                heapq.heappop(heap)
                if error is not None:
                    self._report(record)
            if not heap:
                unsettled.pop(index, None)  # (a teardown's clear may have emptied it)

    def collect(self) -> None:
        """Release the inputs held for completed tasks; free the records of forgotten keys
        in an egress thread (none ran a task since), and there report the failures
        nobody read (:meth:`report_unread`; tasks do before they launch); drop the
        expired failure records."""
        if self._runtime is not None:
            self._runtime.collect()
        self._failures.expire()
        if (self._launched or self._unsettled) and not self._report_queued:
            self._report_queued = True  # one at a time: a kernel that never ends keeps them
            try:
                self._threads.submit(self._report_from_egress)
            except RuntimeError:  # shut down: the runtime closes anyway
                self._report_queued = False
        if self._retired:  # the loop alone appends, and this runs on the loop: no race
            retired, self._retired = self._retired, deque()
            try:
                self._threads.submit(retired.clear)
            except RuntimeError:  # the threads are shut down (the interpreter exits): here
                retired.clear()

    def clear(self, keep_held: bool = False) -> None:
        """Forget every key (the plugin is removed, or the worker closes).

        ``keep_held``: but the corrupt keys held for their dependents, and their
        failure records, and the keys noted as made while no plugin was set up (the
        teardown guard's tasks still wait for them: :meth:`settle_unpooled` needs no
        stream of the runtime).
        """
        self._registry.clear()
        self._taint.clear()
        self._retired.clear()
        self._launched.clear()
        self._unsettled.clear()
        if not keep_held:
            with self._unpooled_lock:
                self._unpooled.clear()
            self._failures.clear()
            self._held.clear()
            self._needed_by.clear()
            return
        failures = self._failures
        for key in [k for k in failures if k not in self._held]:
            del failures[key]

    async def close(self, timeout: float) -> None:
        """Forget every key, then close the runtime in an egress thread, waiting ``timeout`` s.

        The close ends the runtime's streams and threads once the work left on the
        device is done; a kernel that never ends leaves it going on in its thread.
        The corrupt keys still held for their dependents, and their failure
        records, stay: :class:`.WithheldKeys` sees them go.

        Raises ``TimeoutError``, naming the runtime and what holds it, where it did
        not close within ``timeout``: the caller logs it once, with what else its
        teardown left undone.
        """
        self.clear(keep_held=True)  # before the close: the records refer to the streams
        runtime = self._runtime
        if runtime is None:
            return
        try:
            submitted = self._threads.submit(runtime.close)
        except RuntimeError:
            # The interpreter is exiting (a cluster left open at the end of a script): the
            # executor takes no new work, so the runtime closes here, on the event loop
            # (its TimeoutError says which computes still hold it).
            runtime.close(timeout)
            return
        closing = asyncio.wrap_future(submitted)
        closing.add_done_callback(lambda f: f.cancelled() or f.exception())  # read: no log
        try:  # shielded: a close not started yet (busy threads) still runs after the timeout
            await asyncio.wait_for(asyncio.shield(closing), timeout)
        except TimeoutError:
            raise TimeoutError(
                f"{runtime!r} did not close within {timeout:.3g} s: work still runs on its "
                "streams or threads; its close goes on in an egress thread until that ends"
            ) from None

    def fail_if_reads_held(
        self, key: Hashable, fail: Callable[[Hashable, BaseException], None]
    ) -> None:
        """``key``'s task starts executing: if an input is a held corrupt key, it raises its error.

        For a removed plugin (:class:`.WithheldKeys`), whose check of inputs no
        longer runs. ``fail(key, error)`` replaces the task's run_spec.
        """
        held = self._held
        ts = self._worker.state.tasks.get(key)
        if ts is None or not held:
            return
        for dep in ts.dependencies:
            if dep.key in held:
                recorded = self._failures.get(dep.key)
                fail(key, recorded[0] if recorded else KernelError(dep.key, "result corrupt"))
                return

    def drop_corrupt(self, failed: dict[Hashable, KernelError]) -> None:
        """Record the errors of corrupt results and release them, so they are recomputed.

        Runs on the event loop, outside the state machine. A key with dependents that
        still need it on this worker is held until they have left (they fail on their
        own when they start, see :meth:`input_states`): :meth:`transitioned`.
        """
        self._failures.record(failed)
        self._release(failed)

    def _release(self, keys: Iterable[Hashable]) -> None:
        """Release those of the corrupt ``keys`` still in memory; hold those still needed."""
        worker = self._worker
        # A retiring worker (closing_gracefully) releases them too: the scheduler copies its
        # results to other workers before it closes, and would try to copy these forever.
        if worker.status not in (Status.running, Status.paused, Status.closing_gracefully):
            if worker.status == Status.closing:  # it still serves get_data: keep them held
                for key in keys:  # (and withheld) until it has closed
                    ts = worker.state.tasks.get(key)
                    if ts is not None and ts.state == "memory":
                        self._held.setdefault(key, set())
            return
        tasks = worker.state.tasks
        now = []
        held = []
        for key in keys:
            ts = tasks.get(key)
            if ts is None or ts.state != "memory":
                continue
            needing = {dep.key for dep in ts.dependents if dep.state in _NEEDS_INPUTS}
            if needing:
                self._held[key] = needing
                held.append(key)
                for dependent in needing:
                    self._needed_by.setdefault(dependent, set()).add(key)
            else:
                now.append(key)
        stimulus_id = f"{STIMULUS_PREFIX}-{time.time()}"
        if held and worker.status == Status.closing_gracefully:
            # A retiring worker is paused: its dependents queued here never run, so the key
            # would stay held, and the retirement copy it, forever. The scheduler forgets
            # this replica instead, and releases those dependents here, which releases it.
            for key in held:
                msg = ReleaseWorkerDataMsg(key=key, stimulus_id=stimulus_id)
                worker.batched_send(msg.to_dict())
        if now:
            worker.handle_stimulus(RemoveReplicasEvent(keys=now, stimulus_id=stimulus_id))

    def transitioned(self, key: Hashable, finish: str) -> None:
        """The plugin's hook, while a corrupt key is held: ``key`` went to state ``finish``.

        A held key that leaves memory on its own is no longer held. One whose last
        dependent that needed it has left is released on the loop's next turn (the
        hook runs inside the worker's state machine, which must not be re-entered),
        unless another dependent needs it by then. A key that is neither costs two
        lookups, however many keys are held.
        """
        held = self._held
        if finish != "memory" and key in held:
            needed_by = self._needed_by
            for dependent in held.pop(key):
                corrupts = needed_by.get(dependent)
                if corrupts is not None:
                    corrupts.discard(key)
                    if not corrupts:
                        del needed_by[dependent]
        if finish in _NEEDS_INPUTS:
            return
        needs = self._needed_by.pop(key, None)
        if not needs:
            return
        free = []
        for corrupt in needs:
            needing = held.get(corrupt)
            if needing is None:
                continue
            needing.discard(key)
            if not needing:
                del held[corrupt]
                free.append(corrupt)
        if free:
            self._worker.loop.add_callback(self._release, free)

    def clear_stream_errors_soon(self) -> None:
        """Queue one :meth:`_clear_stream_errors` on the egress threads, if none is queued."""
        if not self._clearing and self._runtime is not None:
            self._clearing = True
            try:
                self._threads.submit(self._clear_stream_errors)
            except RuntimeError:  # the threads are shut down (torn down): its close synced all
                self._clearing = False

    def _clear_stream_errors(self) -> None:
        """Egress thread: synchronize every stream of the runtime, ignoring its errors.

        A failure reaches every stream that waited for the failed work, and a
        stream in error skips what is launched on it later, until a host sync
        reports the error. The errors found are reported where they are found
        (:meth:`_report`); this reports those nobody has found yet, so that
        tasks unrelated to them run again. (Their events keep any error they
        recorded: corrupt results are still found.) Runs only after failures,
        and waits for all queued work.
        """
        self._clearing = False
        self._runtime.clear_errors()
