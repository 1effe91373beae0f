"""The stream launcher: one thread enqueues a whole graph onto the pool, most urgent first.

A task is launched as soon as its inputs have been *launched*: the device,
not the host, waits for them (event waits). Ready tasks go in rounds of as
many as the pool has streams, most urgent first (the caller's priority:
:mod:`.ordering`'s or ``dask.order``'s, computed only once more tasks are
ready than a round takes), so independent chains
start together rather than one after another; of large tasks, at most as many as
the policy runs them on (``StreamPolicy.large_streams``), so that memory holds
that many large paths, not one per stream. The launching thread never waits
for the device except for back-pressure: at most ``config.launch_ahead``
bytes of device outputs whose kernels have not completed (an input returned,
updated in place as Dagger's gemm tiles are, is no new output), and
``pool.max_inflight`` tasks per stream. Tasks that block the host (marked,
or learned by :class:`~dask_gpustreams.runtime.hosttasks.HostTasks`) run on
the runtime's host threads after a host wait for their inputs' events, so
they never stall launches that do not depend on them, unless more of them are
in flight than there are threads (so some wait for one) and either the device
inputs of those in flight add up to over ``config.launch_ahead`` or a round's
width of them wait: then the launcher waits for one to end before its next round
(a round may pass either bound by its width), since each keeps its inputs alive
meanwhile, and the threads take them in the order they came, not by priority. An intermediate is
dropped once all its consumers are launched; the pool holds it until their
events complete, but for consumers on the stream that its task allocated it on
(``AllocationMeter.made_on``): once freed, its block is reused only in that
stream's order, after them, as by Dask's own schedulers on one stream, so a path
of large tasks on one stream holds its live values, not every output launched
ahead. A task that runs out of device memory
(``Backend.out_of_memory_errors``) runs once more (tasks are pure, as Dask
assumes) after the launcher has waited for all launched work and released the
inputs it held and the allocator's cached blocks, with the launch-ahead from
then on at most what was in flight: running ahead must not fail a graph whose
live values fit. Rounds may still have left more values alive than Dask's
order would (on three streams, ``(a + b) + c``'s round of three leaves holds
them all when ``a + b`` needs a fourth block; Dask's order needs three at most):
if the task runs out of memory again, the
graph runs again from its start as Dask's synchronous scheduler runs it: one
task at a time in its order (``dask.order``'s ranks, the tasks the last one made
ready first), on one stream, host tasks on the launching thread, the
launch-ahead at its least (the first run's values are dropped and their blocks
given back to the device; the hooks hear each key once). Only a task whose retry
runs out of memory there fails the graph.
The retry's error is raised instead where a run again would be wrong: a host task
of the first run failed (its error is the compute's), or a task returned the device
value of a key known before the run (updated in place: it would be updated twice).
A device array carried in a task's arguments and changed in place is not seen:
that breaks Dask's rule that tasks leave their inputs as they are.
"""

from __future__ import annotations

import contextlib
import contextvars
import heapq
import logging
import threading
from collections import deque
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping, MutableMapping
from time import perf_counter
from typing import TYPE_CHECKING, Any, Protocol

from dask.utils import format_bytes

from dask_gpustreams.backends.base import AllocationMeter
from dask_gpustreams.config import MIN_SIZE
from dask_gpustreams.runtime.context import task_state
from dask_gpustreams.runtime.policies import TaskInfo, critical_keys
from dask_gpustreams.runtime.registry import EventRegistry, TaskRecord

if TYPE_CHECKING:
    from dask_gpustreams.runtime.runtime import StreamRuntime

logger = logging.getLogger("dask_gpustreams")

#: Launches between two releases of the finished work of every stream.
COLLECT_EVERY = 64


class LaunchHooks(Protocol):
    """What an integration hears of each task (e.g. dask's local callbacks)."""

    def pretask(self, key: Hashable) -> None: ...

    def posttask(self, key: Hashable, result: Any, worker: int) -> None: ...


class ReadyTasks:
    """Tasks whose inputs are all launched, handed out in rounds, the most urgent first.

    ``priority`` maps each task to its rank (lower first), or is a callable that
    returns that mapping. A mapping ranks the tasks at once. A callable is called
    only once more tasks are ready than a round takes: until then every ready
    task goes in the next round whatever its rank, in the order it became ready.
    Once ranked, rounds go by rank to the end. A graph that never has more ready
    tasks than the pool has streams (chains side by side) is so launched without
    its order, which the launcher would compute before its first launch
    (:func:`~.ordering.depth_first`, the default, at under 5 us a key;
    ``dask.order`` at 6-22 us).
    """

    __slots__ = ("_priority", "_unranked", "_heap")

    def __init__(
        self,
        priority: Mapping[Hashable, int] | Callable[[], Mapping[Hashable, int]],
        keys: Iterable[Hashable],
    ):
        self._priority = priority
        #: The ready keys in arrival order while no rank was needed; then None.
        self._unranked: list[Hashable] | None = list(keys)
        self._heap: list[tuple[int, Hashable]] = []
        if isinstance(priority, Mapping):
            self._rank(priority)

    def __len__(self) -> int:
        unranked = self._unranked
        return len(self._heap) if unranked is None else len(unranked)

    def push(self, key: Hashable) -> None:
        """``key``'s inputs are all launched."""
        unranked = self._unranked
        if unranked is None:
            heapq.heappush(self._heap, (self._priority[key], key))
        else:
            unranked.append(key)

    def pop_round(self, n: int) -> list[Hashable]:
        """The ``n`` most urgent ready tasks (all of them if fewer), taken out."""
        unranked = self._unranked
        if unranked is not None:
            if len(unranked) <= n:
                self._unranked = []
                return unranked
            self._rank(self._priority())
        heap = self._heap
        return [heapq.heappop(heap)[1] for _ in range(min(n, len(heap)))]

    def keys(self) -> list[Hashable]:
        """The ready keys not yet handed out, in no particular order."""
        unranked = self._unranked
        return [k for _, k in self._heap] if unranked is None else list(unranked)

    def _rank(self, priority: Mapping[Hashable, int]) -> None:
        self._priority = priority
        self._heap = [(priority[k], k) for k in self._unranked]
        heapq.heapify(self._heap)
        self._unranked = None


class LastReadyFirst:
    """Ready tasks in the order Dask's synchronous scheduler takes them (``dask.local``): a
    stack, onto which the tasks that the last one made ready go, the most urgent on top.

    The launcher's run one task at a time (:meth:`GraphLauncher._launch`) takes them so:
    a task made ready by the one just run, such as the last reader of its input, runs
    before older ready tasks of higher rank, and lets that input go. ``priority`` as
    :class:`ReadyTasks`'s, called at the first round that needs it.
    """

    __slots__ = ("_priority", "_stack", "_new")

    def __init__(
        self,
        priority: Mapping[Hashable, int] | Callable[[], Mapping[Hashable, int]],
        keys: Iterable[Hashable],
    ):
        self._priority = priority
        self._stack: list[Hashable] = []
        #: Keys made ready since the last round, not yet on the stack.
        self._new: list[Hashable] = list(keys)

    def __len__(self) -> int:
        return len(self._stack) + len(self._new)

    def push(self, key: Hashable) -> None:
        self._new.append(key)

    def pop_round(self, n: int) -> list[Hashable]:
        if self._new:
            if not isinstance(self._priority, Mapping):
                self._priority = self._priority()
            self._stack.extend(sorted(self._new, key=self._priority.__getitem__, reverse=True))
            self._new = []
        stack = self._stack
        return [stack.pop() for _ in range(min(n, len(stack)))]

    def keys(self) -> list[Hashable]:
        return [*self._stack, *self._new]


def _cycle_message(
    dependencies: Mapping[Hashable, Collection[Hashable]], missing: Mapping[Hashable, int]
) -> str:
    """Dask's error for a graph whose tasks ``missing`` inputs never became ready: a cycle.

    Each such task waits for another such task, so following those inputs from one
    of them comes back to a task already on the path.
    """
    key = next(k for k, n in missing.items() if n)
    path: list[Hashable] = []
    seen: dict[Hashable, int] = {}
    while key not in seen:
        seen[key] = len(path)
        path.append(key)
        key = next(d for d in dependencies[key] if missing.get(d))
    cycle = [*path[seen[key] :], key]
    return "Cycle detected between the following keys:\n  -> " + "\n  -> ".join(map(str, cycle))


class _RunAgain(Exception):
    """Internal: ``key``'s retry ran out of device memory too; the graph runs again from its
    start one task at a time (:meth:`GraphLauncher._launch`). ``told``: the keys whose
    ``pretask`` the hooks heard."""

    def __init__(self, key: Hashable, told: set) -> None:
        super().__init__(key)
        self.key = key
        self.told = told


class _TellOnce:
    """Launch hooks that pass on only what ``hooks`` did not hear yet: a ``pretask`` of a
    key not in ``started``, a ``posttask`` of one not in ``finished``."""

    __slots__ = ("hooks", "started", "finished")

    def __init__(self, hooks: LaunchHooks, started: set, finished: set) -> None:
        self.hooks = hooks
        self.started = started
        self.finished = finished

    def pretask(self, key: Hashable) -> None:
        if key not in self.started:
            self.hooks.pretask(key)

    def posttask(self, key: Hashable, result: Any, worker: int) -> None:
        if key not in self.finished:
            self.hooks.posttask(key, result, worker)


class _HostDone:
    """A host task's outcome, handed from its host thread to the launcher."""

    __slots__ = ("key", "result", "record", "error", "seconds", "worker", "inputs")

    def __init__(self, key, result, record, error, seconds, worker, inputs):
        self.key = key
        self.result = result
        self.record = record
        self.error = error
        self.seconds = seconds
        self.worker = worker
        self.inputs = inputs  # bytes of its device inputs, as counted at its submission


class _HostOutcomes:
    """Host tasks in flight, and the outcomes their threads hand back to the launcher."""

    __slots__ = ("running", "inputs", "_done", "_wake")

    def __init__(self) -> None:
        #: Host tasks submitted and not yet taken (read and written by the launching thread).
        self.running = 0
        #: Bytes of those tasks' device inputs (an input read by two counts twice): what
        #: they keep alive until they are taken, however long they wait for a thread.
        self.inputs = 0
        self._done: deque[_HostDone] = deque()
        self._wake = threading.Event()

    def __len__(self) -> int:
        """Outcomes handed back and not yet taken."""
        return len(self._done)

    def put(self, done: _HostDone) -> None:
        """On a host thread: hand ``done`` back and wake the launcher."""
        self._done.append(done)
        self._wake.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until an outcome is handed back and not yet taken (at once if one is), or
        until a wake-up's wait passes ``timeout`` seconds; False if it returns on a timeout.

        It checks the outcomes, not only the wake-up: two handed back before one
        wait share one wake-up, and the launcher may leave the loop that takes them
        (an exception in a callback) before it took the second.
        """
        while not self._done:
            if not self._wake.wait(timeout):
                return False
            self._wake.clear()
        return True

    def submitted(self, inputs: int) -> None:
        """On the launching thread: a host task with ``inputs`` bytes of device inputs is
        on its way."""
        self.running += 1
        self.inputs += inputs

    def take(self) -> _HostDone | None:
        """The oldest outcome handed back, or None."""
        if not self._done:
            return None
        self.running -= 1
        done = self._done.popleft()
        self.inputs -= done.inputs
        return done


class GraphLauncher:
    """Runs one graph through ``runtime`` from the calling thread; see :meth:`run`.

    ``tasks[key](values)`` computes ``key`` from the values of
    ``dependencies[key]``; ``priority[key]`` orders ready tasks (lower first,
    e.g. ``dask.order``), or ``priority()`` returns that mapping when the order
    first matters (:class:`ReadyTasks`); ``cache`` holds values known before the run and
    becomes the results (intermediates are removed from it as they go);
    ``host`` names tasks that block the host; ``group_of(key)`` names a key's
    group for learning which tasks block the host. ``host_threads``: False runs
    every task on the calling thread, host tasks too (each where it comes, as Dask's
    synchronous scheduler does, ``host`` ones after a host wait for their inputs), and
    learns nothing of them. ``check``: before
    returning, read every event of the graph with ``Backend.event_error``
    and raise the first error (see :meth:`run`). ``sync_priority``: the ranks
    that the graph's run one task at a time takes, or a callable that returns
    them (``dask.order``'s, as Dask's synchronous scheduler; ``priority`` if None):
    see :meth:`_launch`. ``rerun_locally``: a host task that raised on a host thread runs
    again on the calling thread before the graph's error is raised (Dask's
    ``rerun_exceptions_locally``): see :meth:`_rerun_locally`.
    """

    #: Seconds :meth:`_join_host` waits for host tasks still running before it says so.
    warn_after = 10.0

    def __init__(
        self,
        runtime: StreamRuntime,
        tasks: Mapping[Hashable, Callable[[Mapping], Any]],
        dependencies: Mapping[Hashable, Collection[Hashable]],
        priority: Mapping[Hashable, int] | Callable[[], Mapping[Hashable, int]],
        wanted: Collection[Hashable],
        cache: MutableMapping[Hashable, Any] | None = None,
        host: Collection[Hashable] = (),
        group_of: Callable[[Hashable], Hashable] = lambda key: key,
        hooks: LaunchHooks | None = None,
        check: bool = False,
        host_threads: bool = True,
        sync_priority: Mapping[Hashable, int] | Callable[[], Mapping[Hashable, int]] | None = None,
        rerun_locally: bool = False,
    ):
        self.runtime = runtime
        self.tasks = tasks
        self.dependencies = dependencies
        self._priority = priority
        self.wanted = set(wanted)
        self.results: MutableMapping[Hashable, Any] = {} if cache is None else cache
        self.host = host
        self.group_of = group_of
        self.hooks = hooks
        self.check = check
        self.host_threads = host_threads
        self._sync_priority = priority if sync_priority is None else sync_priority
        self.rerun_locally = rerun_locally
        #: The error raised is that of the task :attr:`failed` on a host thread, to run again
        #: on this one first (``rerun_locally``).
        self._rerun = False
        self.registry = EventRegistry()
        self._outcomes = _HostOutcomes()
        self._error: BaseException | None = None
        #: The key of the task whose exception :meth:`run` raised (None: no task's).
        self.failed: Hashable | None = None
        self._launched: list[Any] = []
        #: Whether a host task got timing events (the timeline was turned on during the
        #: graph): the timeline keeps its record, so the graph's events stay out of the pool.
        self._timed = False
        self._streams: list[Any] = []  # the pool's, while run() runs
        #: What the caller's work left to wait for (``order_after_caller``), while run()
        #: runs: host tasks wait for it, as a literal input may still be written there.
        self._caller: Any = None
        #: Keys whose value's memory their task allocated on its own stream (the meter's
        #: ``made_on``), while they are results: see :meth:`_launch_all`'s holds.
        self._own: set[Hashable] = set()
        #: One task at a time, on one stream, no host threads, the launch-ahead at its
        #: least: the graph's second run after a retry ran out of memory (:meth:`_launch`).
        self._one_by_one = False
        #: ``id`` of each device value known before the run (the first run's, else empty):
        #: a task that returns one of them updated it in place (or passed it on).
        self._given_ids: set[int] = set()
        #: A task of the first run returned a value known before the run: running the graph
        #: again would update it twice, so a retry that runs out of memory raises then.
        self._given_returned = False

    # --- the launch loop ----------------------------------------------------------------------

    def run(self) -> MutableMapping[Hashable, Any]:
        """Launch every task, wait for the wanted keys' events; return ``key -> value``.

        The first exception a task raises is raised here, after the work
        already launched has drained; a kernel failure surfaces as the error
        of the wanted key whose event reports it. A sync elsewhere (another
        graph's, a task's) may report a failure first, after which the device
        neither raises it again nor passes it on to the work that waits for
        it: that work's results are garbage, and the wanted keys' syncs say
        nothing. So with ``check``, or where a sync reported a failure while the
        graph ran (:meth:`StreamRuntime.reported_failures`, never on CUDA), the
        first error that any event of the graph carries is raised then too
        (``event_error`` returns it every time).

        Meanwhile this thread allocates through ``Backend.launch_allocator``:
        allocations below ``config.small_blocks`` bytes come from arenas of their
        own (running ``streams`` paths at once, each stream would otherwise pin a
        large cached block under its small results), those of at least
        ``config.shared_blocks`` from one arena of all the streams
        (:class:`~dask_gpustreams.runtime.sharedblocks.SharedBlocks`), and the largest block each
        task allocates goes to the runtime's ``large_tasks``, which makes the
        later tasks of its group large (:attr:`TaskInfo.large`).
        """
        runtime = self.runtime
        self._streams = streams = [slot.stream for slot in runtime.pool.slots]
        config = runtime.config
        shared = runtime.shared_blocks
        allocator = runtime.backend.launch_allocator(
            streams, config.small_blocks, config.large_tasks, shared
        )
        if shared is None:
            with allocator as meter:
                return self._launch(meter)
        shared.begin()
        try:
            with allocator as meter:
                return self._launch(meter)
        finally:
            # After the launch's own end (its streams may be drained); a device error here
            # (a sticky CUDA error's query) must not hide the graph's own.
            with contextlib.suppress(Exception):
                shared.end()

    def _launch(self, meter: AllocationMeter | None) -> MutableMapping[Hashable, Any]:
        """:meth:`_launch_all`; if a task's retry runs out of device memory too, the graph
        runs again from its start as Dask's synchronous scheduler runs it: one task at a time
        in its order (:class:`LastReadyFirst` of ``sync_priority``), on one stream, host tasks
        on this thread, the launch-ahead at its least (rounds of every stream may have left
        more values alive than fit, where Dask's order needs fewer). The values known before
        the run are its inputs again, the hooks hear each key once, and a task that runs out
        of memory there runs once more after a wait for the device, and then raises."""
        results = self.results
        given = dict(results)  # the values known before the run: consumed ones are popped
        is_device = self.runtime.backend.is_device_array
        self._given_ids = {id(v) for v in given.values() if is_device(v)}
        try:
            return self._launch_all(meter)
        except _RunAgain as again:
            key, started = again.key, again.told
        # Out of the handler: its traceback holds the first run's values.
        finished = started - {key}  # a host task's failure is raised instead (_absorb)
        logger.warning(
            "gpustreams: task %r ran out of device memory again after the launched work was "
            "done; the graph runs again from its start, one task at a time on one stream",
            key,
        )
        results.clear()
        results.update(given)
        given = None
        # The first run's values are free now: give their blocks back, so that the run
        # again starts as plain sync does, not in cached blocks it would split (a block of
        # the first run, half of it holding a value, cannot be freed for a larger one).
        self._free_device()
        self.failed = None
        self._own.clear()
        self._launched = []  # the first run's events went back to the runtime
        self._one_by_one = True
        self._given_ids = set()
        self._priority = self._sync_priority
        hooks = self.hooks
        if hooks is not None:
            self.hooks = _TellOnce(hooks, started, finished)
        try:
            return self._launch_all(meter)
        finally:
            self.hooks = hooks
            self._one_by_one = False

    def _launch_all(self, meter: AllocationMeter | None) -> MutableMapping[Hashable, Any]:
        """:meth:`run`, inside its allocator, whose ``meter`` tells large tasks (one task at
        a time if ``_one_by_one``: see :meth:`_launch`)."""
        runtime, registry = self.runtime, self.registry
        results, tasks, dependencies = self.results, self.tasks, self.dependencies
        wanted, hooks = self.wanted, self.hooks
        host, offload = self.host, self.host_threads
        backend, pool = runtime.backend, runtime.pool
        reports = runtime.reported_failures()  # before the first launch: see run
        self._caller = runtime.order_after_caller()  # creates the streams first, too
        runtime.isolate_thread()
        # Bound once: the loop below runs once per task.
        get_record, add_record = registry.get, registry.add
        select, assign_lock = runtime.policy.select, pool.assign_lock
        wait, record_on, acquire = pool.wait, pool.record, runtime.events.acquire
        use_stream, is_device = backend.use_stream, backend.is_device_array
        out_of_memory = backend.out_of_memory_errors
        learned, timeline, width = runtime.host_tasks, runtime.timeline, pool.n_streams
        one_by_one = self._one_by_one
        if one_by_one:
            width, offload = 1, False
            first_slot = pool.slots[0]
            select = lambda info, pool: first_slot  # noqa: E731
        threshold = learned.threshold_s
        large_tasks = runtime.large_tasks
        large_size = large_tasks.size if meter is not None else 0
        large_per_round = runtime.policy.large_streams or width
        # Once per graph, for policies that place the longest path apart (critical-path).
        critical = critical_keys(dependencies) if runtime.policy.needs_critical_path else None

        dependents: dict[Hashable, list[Hashable]] = {k: [] for k in tasks}
        missing: dict[Hashable, int] = {}
        consumers: dict[Hashable, int] = {}
        for key, deps in dependencies.items():
            n = 0
            for d in deps:
                if d in dependents:
                    dependents[d].append(key)
                    n += 1
                consumers[d] = consumers.get(d, 0) + 1
            missing[key] = n
        roots = [k for k, n in missing.items() if n == 0]
        ready = (LastReadyFirst if one_by_one else ReadyTasks)(self._priority, roots)

        launched = self._launched  # every event recorded, in order
        own = self._own
        given_ids = self._given_ids
        ahead: deque[tuple[Any, int]] = deque()
        ahead_bytes = 0
        limit = MIN_SIZE if one_by_one else runtime.config.launch_ahead
        threads = runtime.config.host_threads
        held: list = []
        state = task_state.__dict__
        previous = state.get("runtime"), state.get("stream"), state.get("holds")
        nested = state.get("launching", False)
        state["runtime"], state["holds"], state["launching"] = runtime, held, True
        outcomes = self._outcomes
        try:
            while ready or outcomes.running:
                if outcomes:
                    self._absorb(ready, dependents, missing, consumers)
                    if self._error is not None:
                        break
                    continue  # the last host task may have finished the graph
                waiting = outcomes.running - threads  # host tasks waiting for a thread
                if not ready or (waiting > 0 and (outcomes.inputs > limit or waiting >= width)):
                    # Host tasks waiting for a thread hold their inputs: launching on would
                    # run ahead of them without the launch-ahead's bound; and a round's worth
                    # of them waiting is enough (their host thread's queue runs in the order
                    # they came: more would run ahead of urgent tasks ready later, as a tree's
                    # leaves ahead of the sums that would free them).
                    outcomes.wait()
                    continue
                # The `width` most urgent ready tasks, then those they made ready: independent
                # work reaches every stream at once, and memory stays that of `width` paths;
                # of large tasks, as many as the policy runs them on (the others wait a round).
                batch = ready.pop_round(width)
                large_room = large_per_round
                for key in batch:
                    large = bool(large_size and large_tasks) and self.group_of(key) in large_tasks
                    if large:
                        if not large_room:  # the next round's: memory of that many paths
                            ready.push(key)
                            continue
                        large_room -= 1
                    deps = dependencies[key]
                    values = {d: results[d] for d in deps}
                    if hooks is not None:
                        hooks.pretask(key)
                    if offload and (key in host or (learned and self.group_of(key) in learned)):
                        self._submit_host(key, values, large)
                        continue
                    producers = [r for d in deps if (r := get_record(d)) is not None]
                    if not offload and key in host:
                        # A marked host task reads its inputs on the host, maybe not through
                        # its stream (host_task's promise): complete first, as on host threads.
                        self._wait_on_host(producers)
                    with assign_lock:
                        on_path = None if critical is None else key in critical
                        info = TaskInfo(key, producers, registry, on_path, large)
                        slot = select(info, pool)
                        pool.assign(slot)
                    stream = slot.stream
                    start = None
                    event = None
                    called = False
                    try:
                        for r in producers:
                            if r.slot is not slot:
                                wait(slot, r.slot, r.event, r.seq)
                        if timeline is not None:
                            start = backend.create_event(timing=True)
                            backend.record(start, stream)
                            event = backend.create_event(timing=True)
                        else:
                            event = acquire()
                        state["stream"] = stream
                        if meter is not None:
                            meter.made.clear()
                        t0 = perf_counter()
                        with use_stream(stream, key):
                            called = True
                            retry = False
                            try:
                                result = tasks[key](values)
                            except out_of_memory:
                                retry = True  # outside the handler: its traceback holds
                                # the failed attempt's arrays
                            if retry:
                                limit = self._make_room(key, limit, ahead_bytes)
                                ahead.clear()
                                ahead_bytes = 0
                                held.clear()  # the failed attempt's uploads (done by now)
                                t0 = perf_counter()  # the wait is no host work of the task
                                if meter is not None:
                                    meter.made.clear()
                                if one_by_one:
                                    result = tasks[key](values)
                                else:
                                    result = self._retry(key, values, batch, ready, missing)
                        seconds = perf_counter() - t0
                        # Not with holds: a nested compute's results are among them, which
                        # its host threads may have allocated, on their streams, at an
                        # address this task freed (``made`` would name this stream).
                        if meter is not None and not held and meter.made_on(result, stream):
                            own.add(key)
                        if large_size:
                            # Only news is told: a large block, or none from a large task.
                            if (meter.largest >= large_size) is not large:
                                large_tasks.observe(self.group_of(key), meter.largest)
                            meter.largest = 0
                    except BaseException as e:
                        if called:
                            self.failed = key
                        state["stream"] = None
                        if event is None:
                            pool.unassign(slot)
                        else:
                            # Kernels it enqueued may still read the inputs: hold them.
                            record_on(slot, event, (values, held[:]), True)
                            launched.append(event)
                        held.clear()
                        self._error = e
                        break
                    state["stream"] = None
                    refs = values
                    if own:
                        # An input whose memory its producer allocated on this stream needs
                        # no hold: once freed, its block is reused in this stream's order
                        # (as by Dask's own schedulers on one stream), after these kernels.
                        mine = {r.key for r in producers if r.slot is slot and r.key in own}
                        if mine:
                            refs = {d: v for d, v in values.items() if d not in mine}
                    if held:
                        seq = record_on(slot, event, (refs, held[:]), True)
                        held.clear()
                    else:
                        seq = record_on(slot, event, refs, True)
                    # Else this task's inputs would live through the next task's call (until
                    # ``refs`` is bound again): the record alone holds them now.
                    refs = None
                    record = TaskRecord(key, slot, event, seq, start)
                    add_record(record)
                    launched.append(event)
                    if start is not None:
                        timeline.append(record)
                    results[key] = result
                    if offload and (seconds > threshold or learned.suspecting()):
                        learned.observe(self.group_of(key), seconds)
                    if not len(launched) % COLLECT_EVERY:
                        pool.collect_all()  # streams not used lately hold finished inputs
                    # An input updated in place is no new memory (a loop's variable would
                    # hold an input past its consumers: a generator's does not).
                    if is_device(result):
                        if not any(v is result for v in values.values()):
                            nbytes = result.nbytes
                            ahead.append((event, nbytes))
                            ahead_bytes += nbytes
                            while ahead_bytes > limit:
                                done_event, done_bytes = ahead.popleft()
                                backend.synchronize_event(done_event)
                                ahead_bytes -= done_bytes
                        elif id(result) in given_ids:
                            self._given_returned = True  # see _retry
                    self._finish(key, deps, ready, dependents, missing, consumers)
                    if hooks is not None:
                        hooks.posttask(key, result, 0)
                if self._error is not None:
                    break
            self._join_host(dependents, missing, consumers)
            if self._error is not None:
                if self._rerun:
                    self._rerun_locally(self.failed)
                raise self._error
            if any(missing.values()):
                raise RuntimeError(_cycle_message(dependencies, missing))
            runtime.synchronize(wanted, registry)
            if self.check or runtime.reported_failures() != reports:
                self._check_events()
            outer_holds = previous[2]
            if outer_holds is not None:
                # A nested compute: the calling task's kernels, on its own stream, may read
                # these after it returns; held as its inputs are, until its event completes.
                outer_holds.extend(results[k] for k in wanted if k in results)
            return results
        except BaseException:
            # The exception raised wins; this graph's work drains first, so that a kernel
            # failure it left behind is reported here, not by the next compute.
            self._join_host(dependents, missing, consumers)
            sync = backend.synchronize_event
            for event in launched:
                with contextlib.suppress(Exception):  # reported here, so no later sync sees it
                    sync(event)
            raise
        finally:
            # The error's traceback holds this frame, and so this launcher and its values:
            # no cycle through self, so they go once the caller has handled it.
            self._error = None
            state["runtime"], state["stream"], state["holds"] = previous
            state["launching"] = nested
            registry.clear()
            drained = not runtime.collect()  # then every event it recorded has completed
            if timeline is None and not self._timed:
                runtime.events.release(launched, done=drained)

    def _retry(self, key, values, batch, ready, missing) -> Any:
        """Run ``key`` again after :meth:`_make_room`; raise :class:`_RunAgain` if it runs out
        of device memory again: what stays allocated is values that rounds launched before
        a depth-first order would have."""
        again = False
        try:
            return self.tasks[key](values)
        except self.runtime.backend.out_of_memory_errors:
            if self._given_returned:
                # A task returned a value known before the run, updated in place (as a
                # tiled gemm accumulates): running again would update it twice.
                raise
            again = True  # outside the handler: its traceback holds the attempt's arrays
        if again:
            # Told: each task launched (its inputs were, it is no longer ready, nor waiting
            # in this round after ``key``) and submitted to a host thread.
            waiting = {*ready.keys(), *batch[batch.index(key) + 1 :]}
            told = {k for k, n in missing.items() if not n and k not in waiting}
            raise _RunAgain(key, told)

    def _make_room(self, key: Hashable, limit: int, in_flight: int) -> int:
        """``key`` ran out of device memory: wait for every stream's work (its errors stay
        with their events), release the inputs held for it and the blocks the allocator
        caches, and return the launch-ahead from now on: half of ``limit``, and at most
        the ``in_flight`` bytes that ran ahead when it failed (if any). What stays
        allocated is the graph's live values."""
        self._free_device()
        ahead = max(min(limit // 2, in_flight or limit), MIN_SIZE)
        logger.warning(
            "gpustreams: task %r ran out of device memory; it runs again now that the work "
            "launched before it is done (launch-ahead for the rest of this graph: %s)",
            key,
            format_bytes(ahead),
        )
        return ahead

    def _free_device(self) -> None:
        """Wait for every stream's work (its errors stay with their events), release the
        inputs held for it, and the blocks the allocator caches."""
        runtime = self.runtime
        runtime.pool.wait_all()
        runtime.pool.collect_all()
        if runtime.shared_blocks is not None:  # the inputs released just now, too
            runtime.shared_blocks.release()
        runtime.backend.free_cached_memory()

    def _check_events(self) -> None:
        """Raise the error of any of the graph's work, reported elsewhere or not (blocking)."""
        event_error = self.runtime.backend.event_error
        for event in self._launched:
            error = event_error(event)
            if error is not None:
                raise error.with_traceback(None)  # shared: not the frames of an earlier raise

    def _finish(self, key, deps, ready, dependents, missing, consumers) -> None:
        """``key`` is launched: ready its dependents, drop inputs nobody else will read."""
        push = ready.push
        for c in dependents[key]:
            n = missing[c] - 1
            missing[c] = n
            if n == 0:
                push(c)
        results = self.results
        wanted = self.wanted
        discard = self.registry.discard
        own = self._own
        for d in deps:
            n = consumers[d] - 1
            consumers[d] = n
            if n == 0 and d not in wanted:
                results.pop(d, None)
                discard(d)
                own.discard(d)

    # --- host tasks ---------------------------------------------------------------------------

    def _submit_host(self, key: Hashable, values: dict, large: bool) -> None:
        """Run ``key`` on a host thread, in a copy of this thread's context variables (a
        distributed worker's, which ``get_worker`` reads); inline if this thread is one (a
        nested compute in a host task), since all host threads may be taken by tasks that
        wait for this one. ``large``: on the large tasks' streams, as on the launcher (a
        large group learned to block the host would otherwise spread its blocks over every
        stream, several at once)."""
        producers = self.registry.records(self.dependencies[key])
        is_device = self.runtime.backend.is_device_array
        inputs = sum(v.nbytes for v in values.values() if is_device(v))
        if task_state.__dict__.get("host_thread"):
            self._outcomes.submitted(inputs)
            self._run_host(key, values, producers, large, inputs)
        else:
            run = contextvars.copy_context().run
            submit = self.runtime.host_executor().submit
            submit(run, self._run_host, key, values, producers, large, inputs)
            # Not before: a refused submit must not be waited for.
            self._outcomes.submitted(inputs)

    def _wait_on_host(self, producers: list[TaskRecord]) -> None:
        """Block until a host task's inputs are complete: the caller's work (a literal input)
        and its producers'; raise a failure, also one another compute's sync reported first."""
        runtime = self.runtime
        if self._caller is not None:
            runtime.wait_caller(self._caller)
        for r in producers:
            runtime.check(r.event)

    def _run_host(
        self, key: Hashable, values: dict, producers: list[TaskRecord], large: bool, inputs: int
    ) -> None:
        """On a host thread: wait for the inputs on the host, then run ``key`` on a stream
        (``inputs``: the bytes :meth:`_submit_host` counted, handed back with the outcome)."""
        runtime = self.runtime
        result = record = error = None
        seconds = 0.0
        state = task_state.__dict__
        previous = state.get("launching", False), state.get("host_thread", False)
        state["launching"] = state["host_thread"] = True
        registry = EventRegistry()
        try:
            backend = runtime.backend
            self._wait_on_host(producers)
            # Small blocks apart and large ones shared here too (the meter is the launching
            # thread's business).
            config = runtime.config
            shared = runtime.shared_blocks
            with backend.launch_allocator(self._streams, config.small_blocks, 0, shared):
                t0 = perf_counter()
                result = runtime.run(key, self.tasks[key], values, registry, large=large)
                seconds = perf_counter() - t0
            # Release what completed tasks hold (this task's producers among them): a stream's
            # finished work is otherwise collected only when it records again, so the uploads
            # of host tasks spread over the streams, and their shared blocks, stayed meanwhile.
            runtime.pool.collect_all()
        except BaseException as e:
            error = e
        finally:
            state["launching"], state["host_thread"] = previous
        record = registry.get(key)  # also after a failure: its kernels are drained
        worker = threading.get_ident()
        self._outcomes.put(_HostDone(key, result, record, error, seconds, worker, inputs))
        # The error's traceback holds this frame: without this, a cycle through it kept the
        # inputs, and the launcher's results, until a garbage collection.
        error = None

    def _absorb(self, ready, dependents, missing, consumers) -> None:
        """Take the outcomes of host tasks that finished (on the launching thread)."""
        learned = self.runtime.host_tasks
        while (done := self._outcomes.take()) is not None:
            record = done.record
            if record is not None:
                self._launched.append(record.event)
                if record.start is not None:
                    self._timed = True
            if done.error is not None:
                # A task's error wins over running the graph again (which might not raise it).
                if self._error is None or isinstance(self._error, _RunAgain):
                    self._error = done.error
                    self.failed = done.key
                    # Not a task run inline (a nested compute's, on its host thread).
                    self._rerun = self.rerun_locally and done.worker != threading.get_ident()
                continue
            key = done.key
            if key not in self.host:
                learned.observe(self.group_of(key), done.seconds)
            if id(done.result) in self._given_ids:
                self._given_returned = True  # see _retry
            self.results[key] = done.result
            if record is not None:
                self.registry.add(record)
            self._finish(key, self.dependencies[key], ready, dependents, missing, consumers)
            if self.hooks is not None:
                self.hooks.posttask(key, done.result, done.worker)

    def _rerun_locally(self, key: Hashable) -> None:
        """Run host task ``key``, which raised on a host thread, again on this thread (Dask's
        ``rerun_exceptions_locally``: a debugger's post-mortem then stops here), on a stream
        after a host wait for its inputs, as there; its exception propagates. The inputs
        are still results: a failed task's are never released (:meth:`_finish`). Its
        record's event joins the graph's, for the drain. A rerun that returns leaves the
        first run's error to be raised (Dask's threads would hand that exception object on
        as the task's value)."""
        registry = EventRegistry()
        deps = self.dependencies[key]
        try:
            self._wait_on_host(self.registry.records(deps))
            self.runtime.run(key, self.tasks[key], {d: self.results[d] for d in deps}, registry)
        finally:
            record = registry.get(key)
            if record is not None:
                self._launched.append(record.event)
                if record.start is not None:
                    self._timed = True

    def _join_host(self, dependents, missing, consumers) -> None:
        """Wait for every host task still running (their dependents are not launched); log
        a warning if that takes :attr:`warn_after` seconds (a host task that waits for the
        caller, after the compute, would hang it)."""
        ready = ReadyTasks(self._priority, ())  # launches nothing more
        warn_at: float | None = perf_counter() + self.warn_after
        while self._outcomes.running:
            if warn_at is None:
                self._outcomes.wait()
            elif not self._outcomes.wait(max(warn_at - perf_counter(), 0.0)):
                warn_at = None
                logger.warning(
                    "gpustreams: the compute ends once the %d host task(s) still running on "
                    "the launcher's host threads return. A host task that waits for something "
                    "the caller does after the compute would hang it",
                    self._outcomes.running,
                )
                continue
            self._absorb(ready, dependents, missing, consumers)
