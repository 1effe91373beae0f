"""The ``distributed`` integration: a worker plugin that runs every task on a stream pool.

:class:`StreamsPlugin` is a :class:`distributed.WorkerPlugin`. Install it with
``client.register_plugin(StreamsPlugin())``, by preloading ``dask_gpustreams``
on the workers or the scheduler, or by setting ``gpustreams.enabled`` before a
client is created (:mod:`dask_gpustreams.integrations.preload` lists the routes).
All its hooks run on the worker's event loop unless said otherwise.

Execution
    When a task goes ``ready -> executing``, :meth:`StreamsPlugin.transition`
    replaces its ``run_spec`` by :func:`~dask_gpustreams.integrations.tasks.wrap_task`
    of it (the worker reads the spec only after that transition), so the task
    runs in its worker thread on a pool stream of the worker's
    :class:`~dask_gpustreams.runtime.StreamRuntime`, waiting on the device for
    the events of inputs this worker produced, and records its own event in
    the worker's :class:`~dask_gpustreams.runtime.EventRegistry`. Inputs fetched
    from other workers arrive complete (see *Egress*) and have no event. The
    runtime is created at the first task, so the streams appear after whatever
    dask-cuda and RMM set up at worker start. Not wrapped: coroutine tasks, data
    and tasks annotated to run on an executor that is not a thread pool (their
    spec would have to be pickled), and actors. Functions of
    ``distributed.shuffle`` (P2P transfer, barrier, unpack) hand their inputs to
    the comm layer, which serializes them outside the task: such a task waits
    on the host, in its worker thread, for its inputs' events and then runs as
    in plain Dask.

Egress
    A task's result may still be being written on the device when the worker
    declares it in memory; that is what lets dependents be queued without a
    host sync. Everything that copies a result off the device on the host
    therefore waits for that key's event first:

    - ``get_data`` (peer fetch, client gather, scheduler gather, AMM): the
      handler is wrapped. Keys whose events have completed are served at
      once; the events of the others (and of the work in their taint, see
      *Failures*; normally already complete) are waited for in a small thread
      pool (``gpustreams-egress``), so the event loop keeps running meanwhile.
      The wait is per key, never a device or stream sync (an event completes
      when the work enqueued before it on its stream has, as always).
    - spilling: a callback put first in the ``on_evict`` list of every
      ``zict.Buffer`` of ``worker.data`` (distributed's ``SpillBuffer``;
      dask-cuda's ``DeviceHostFile``, whose ``device_buffer`` and
      ``host_buffer`` are such buffers, found by type without importing
      dask-cuda) waits for the evicted key's event before it is serialized.
      Spilling runs on the event loop, so this one wait is blocking, for that
      key only, like the disk write that follows it.

Failures
    A task that raises fails as in plain Dask: the exception and traceback
    reach the client and dependents are not run. A kernel that fails
    asynchronously (``KernelError`` on the simulated device, a CUDA error on
    a GPU) is only seen after it, when its key is already in memory, and a
    scheduler has no ``memory -> erred`` transition for tasks. The plugin
    turns it into the failure of a task run.

    What failed: a key's value is corrupt if its own event completed with an
    error, or the event of any work it derives from on this worker did (its
    *taint*: the records of its inputs, of their inputs, ..., kept while not
    known to have succeeded). The plugin reads errors with
    ``Backend.event_error``, which returns an event's error every time
    without reporting it: a sync elsewhere (inside a task, say) may report a
    failure first, after which the device no longer passes it on to work
    that waits for it, and that work's own event says nothing.

    - A task whose inputs derive from work that has completed with an error
      fails with that :class:`~dask_gpustreams.KernelError` before it runs
      (a non-blocking check of completed events when it starts executing).
    - When an egress wait (``get_data``, spilling) finds a corrupt key, the
      key is not served; the worker records the error, drops the key and
      tells the scheduler (``release-worker-data``, as if the data were lost),
      which recomputes it for whoever wants it. When the recomputation runs
      on a worker that recorded the failure, the task raises the recorded
      ``KernelError`` instead of running again, so the client gets that
      error for that key, and dependents become erred as usual. A key with
      dependents queued or running on the worker is dropped once they have
      left (they fail through the first rule).

    A ``get_data`` request is thus never failed (a failed request makes a
    peer's fetch and a client's gather retry forever), and no corrupt data is
    sent. After a failure, and after any task error, the egress threads
    synchronize every stream of the runtime once, ignoring errors: a stream
    in error skips what is launched on it until a sync reports the error, so
    this keeps one failure from spilling over into unrelated tasks (on a GPU,
    a sticky CUDA error makes the worker unusable anyway; restart it). A
    worker that dies is handled by Dask as usual.

Lifetime
    The runtime holds each task's inputs, fetched ones included, until the
    task's event completes. Registry and taint entries are dropped when their
    keys are released, forgotten or erred (taints also once their work is
    known to have succeeded); failure records when they are used (at most
    :attr:`StreamsPlugin.max_failures` are kept, each for at most
    :attr:`StreamsPlugin.failure_ttl` seconds).

Known limits
    - A recomputation that lands on a worker that did not see the failure
      runs the task again; a deterministic failure is then detected there
      too, so a key is recomputed at most once per worker before it errs. A
      transient failure may succeed on recomputation; its record then stays
      on the first worker and fails a run of the same key there within
      :attr:`StreamsPlugin.failure_ttl` seconds.
    - Data read without ``get_data``: a client running inside a worker
      (``get_client()`` in a task) reads that worker's own ``data`` directly;
      unwrapped coroutine or process-pool tasks read their inputs without
      waiting; dask-cuda's JIT-unspill ``ProxifyHostFile`` spills without the
      per-key wait. With CuPy these paths stay ordered only through the
      legacy default stream (blocking pool streams, no per-thread default
      stream).
    - Removing the plugin waits for the tasks it wrapped and for their
      events; with a new plugin of the same name this happens before the new
      one is set up.
    - A worker does not see the graph: with ``policy="critical-path"`` every
      task counts as not critical.
    - A taint lists the still-running work a key derives from: a chain that
      runs far ahead of the device keeps lists as long as its queued depth.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Collection, Hashable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from dask._task_spec import GraphNode, Task, TaskRef
from distributed import WorkerPlugin
from distributed.core import Status
from distributed.worker_state_machine import RemoveReplicasEvent
from tornado.ioloop import PeriodicCallback

from dask_gpustreams.config import StreamsConfig
from dask_gpustreams.errors import KernelError
from dask_gpustreams.integrations.tasks import wrap_task
from dask_gpustreams.runtime import EventRegistry, StreamRuntime, TaskRecord, get_runtime

logger = logging.getLogger("dask_gpustreams")

# Worker task states of a dependent that still needs its inputs in this worker's memory.
_NEEDS_INPUTS = frozenset({"waiting", "ready", "constrained", "executing", "long-running"})
# Transitions after which a key's result is no longer this worker's to serve.
_GONE = frozenset({"released", "forgotten", "error"})
_RUNNING = frozenset({"executing", "long-running"})


def _as_kernel_error(key: Hashable, exc: BaseException) -> KernelError:
    """``exc`` (a failed event sync) as the :class:`KernelError` of ``key``'s work."""
    if isinstance(exc, KernelError):
        return exc
    return KernelError(key, f"{type(exc).__name__}: {exc}")


class _Raise:
    """Task function that raises ``exc``: a task failed before it ran."""

    __slots__ = ("exc",)

    def __init__(self, exc: BaseException):
        self.exc = exc

    def __call__(self, *args: Any) -> Any:
        raise self.exc.with_traceback(None)  # not the frames of the sync that found it

    def __repr__(self) -> str:
        return f"_Raise({self.exc!r})"


class _AfterInputs:
    """Task function of a host-side task: wait for the inputs' work, then run the node."""

    __slots__ = ("wait_inputs", "node", "dep_keys")

    def __init__(self, wait_inputs: Any, node: GraphNode, dep_keys: tuple[Hashable, ...]):
        self.wait_inputs = wait_inputs
        self.node = node
        self.dep_keys = dep_keys

    def __call__(self, *values: Any) -> Any:
        self.wait_inputs(self.dep_keys)
        return self.node(dict(zip(self.dep_keys, values, strict=True)))

    def __repr__(self) -> str:
        return f"_AfterInputs({self.node!r})"


def _replace(node: GraphNode, func: Any, dep_keys: tuple[Hashable, ...]) -> Task:
    """A task of ``node``'s key and dependencies calling ``func(*values of dep_keys)``."""
    return Task(node.key, func, *(TaskRef(d) for d in dep_keys), _data_producer=node.data_producer)


def _zict_buffers(data: Any) -> list:
    """``data`` and its attributes that are ``zict.Buffer`` s (SpillBuffer, DeviceHostFile)."""
    import zict

    found = []
    for candidate in (data, *getattr(data, "__dict__", {}).values()):
        if isinstance(candidate, zict.Buffer) and all(candidate is not b for b in found):
            found.append(candidate)
    return found


class StreamsPlugin(WorkerPlugin):
    """Run the tasks of every worker on a pool of GPU streams, ordered by device events.

    Keyword arguments override ``gpustreams.*`` for the workers that get this
    plugin (``streams``, ``policy``, ``backend``, ``timeline``, ...: the fields
    of :class:`~dask_gpustreams.StreamsConfig`); the other keys come from each
    worker's dask config. They are validated here, on the client, and again
    against the worker's config in :meth:`setup`.

    The plugin is idempotent under a stable name: registering it again is a
    no-op, so to change its settings unregister it first
    (``client.unregister_worker_plugin("gpustreams")``).

    Examples
    --------
    >>> client.register_plugin(StreamsPlugin(streams=4))  # doctest: +SKIP
    >>> dask.config.set({"gpustreams.enabled": True})  # doctest: +SKIP
    >>> client = Client(LocalCluster())  # same effect, every client  # doctest: +SKIP
    """

    name = "gpustreams"
    idempotent = True
    #: Modules whose task functions give their inputs to host-side machinery (P2P).
    host_modules: tuple[str, ...] = ("distributed.shuffle",)
    #: How many kernel-failure records a worker keeps for keys not yet recomputed,
    #: and for how many seconds (a recomputation normally follows within milliseconds).
    max_failures = 1000
    failure_ttl = 60.0
    #: Seconds between releases of the inputs held for completed tasks.
    collect_interval = 0.5
    _active = False  # True between setup and teardown

    def __init__(self, **overrides: Any):
        fields = StreamsConfig.__dataclass_fields__
        for name in overrides:
            if name not in fields:
                raise TypeError(
                    f"StreamsPlugin() got an unexpected keyword argument {name!r}; "
                    f"allowed: {', '.join(fields)}"
                )
        StreamsConfig.from_dask_config(**overrides)  # fail here, before pickling
        self.overrides = overrides

    def __getstate__(self) -> dict:
        return {"overrides": self.overrides}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.overrides.items())
        return f"StreamsPlugin({args})"

    # ------------------------------------------------------------------ lifecycle

    def setup(self, worker: Any) -> None:
        """Read the worker's config, wrap ``get_data`` and hook spilling (event loop)."""
        self.config = StreamsConfig.from_dask_config(**self.overrides)
        self.runtime: StreamRuntime | None = None
        self.registry = EventRegistry()
        #: key -> (KernelError of a result found corrupt, when); raised when the key runs again.
        self.failures: OrderedDict[Hashable, tuple[BaseException, float]] = OrderedDict()
        #: key -> records of the work its value derives from on this worker, not yet known
        #: to have succeeded (its inputs, their inputs, ...).
        self._taint: dict[Hashable, tuple[TaskRecord, ...]] = {}
        self._wrapped: set[Hashable] = set()
        self._egress = ThreadPoolExecutor(4, thread_name_prefix="gpustreams-egress")
        self._clearing = False
        self._get_data = worker.handlers["get_data"]
        worker.handlers["get_data"] = self.get_data
        self._evicting = [b.fast for b in _zict_buffers(worker.data)]
        for lru in self._evicting:
            lru.on_evict.insert(0, self._before_spill)
        self._collector = PeriodicCallback(self._collect, self.collect_interval * 1000)
        self._collector.start()
        self.worker = worker
        self._active = True

    async def teardown(self, worker: Any) -> None:
        """Stop wrapping; wait for the work already wrapped; restore the worker."""
        self._active = False
        if worker.status not in (Status.closing, Status.closed, Status.failed):
            while self._wrapped & set(worker.active_keys):
                await asyncio.sleep(0.01)
            failed = await self._wait_for(list(worker.data))
            if failed:
                self._drop(worker, failed)
        self._collector.stop()
        for lru in self._evicting:
            if self._before_spill in lru.on_evict:
                lru.on_evict.remove(self._before_spill)
        if worker.handlers.get("get_data") == self.get_data:
            worker.handlers["get_data"] = self._get_data
        self._egress.shutdown(wait=False)
        self.registry = EventRegistry()
        self._taint.clear()
        self.failures.clear()

    # ------------------------------------------------------------------ execution

    def transition(self, key: Hashable, start: str, finish: str, **kwargs: Any) -> None:
        """Wrap a task that starts executing; drop the entries of keys that go away."""
        if not self._active:
            return
        if finish == "executing":
            try:
                self._prepare(key)
            except Exception as e:  # distributed only logs this: fail the task instead
                ts = self.worker.state.tasks.get(key)
                if ts is not None and ts.run_spec is not None:
                    node = ts.run_spec
                    ts.run_spec = _replace(node, _Raise(e), tuple(node.dependencies))
            return
        if start in _RUNNING or finish in _GONE:
            self._wrapped.discard(key)
            if finish == "error":  # maybe a KernelError seen by a sync inside the task
                self._clear_stream_errors_soon()
        if finish in _GONE:
            self.registry.forget((key,))
            self._taint.pop(key, None)

    def _prepare(self, key: Hashable) -> None:
        ts = self.worker.state.tasks.get(key)
        if ts is None or ts.run_spec is None:
            return
        node = ts.run_spec
        dep_keys = tuple(node.dependencies)
        error, _ = self.failures.pop(key, (None, None))
        if error is None:
            error, pending = self._input_states(dep_keys)
            if error is not None:
                self._clear_stream_errors_soon()
            elif pending:
                self._taint[key] = pending
        if error is not None:
            ts.run_spec = _replace(node, _Raise(error), dep_keys)
            return
        if key in self.worker.state.actors or not self._thread_pool(ts):
            return
        try:
            runtime = self._get_runtime()
        except Exception as e:  # a bad backend: fail the task, not the worker
            ts.run_spec = _replace(node, _Raise(e), dep_keys)
            return
        if self._is_host_task(node):
            if pending:
                host = _AfterInputs(self._wait_inputs, node, dep_keys)
                ts.run_spec = _replace(node, host, dep_keys)
            return
        ts.run_spec = wrap_task(node, runtime, self.registry)
        self._wrapped.add(key)

    def _get_runtime(self) -> StreamRuntime:
        if self.runtime is None:
            self.runtime = get_runtime(self.config)
        return self.runtime

    def _thread_pool(self, ts: Any) -> bool:
        """Whether ``ts`` runs in a worker thread (as ``Worker.execute`` decides)."""
        name = (ts.annotations or {}).get("executor", "default")
        executor = self.worker.executors.get(name)
        return executor is not None and "ThreadPoolExecutor" in str(type(executor))

    def _is_host_task(self, node: GraphNode) -> bool:
        module = getattr(getattr(node, "func", None), "__module__", None) or ""
        return module.startswith(self.host_modules)

    def _sources(self, keys: Iterable[Hashable]) -> list[TaskRecord]:
        """Records of the work the values of ``keys`` derive from on this worker.

        The keys' own records and their taint: a failure reported elsewhere
        first may not reach the events of the work that read its output.
        """
        sources = {}
        for record in self.registry.records(keys):
            sources[record] = None
            sources.update(dict.fromkeys(self._taint.get(record.key, ())))
        return list(sources)

    def _state(self, record: TaskRecord) -> tuple[bool, KernelError | None]:
        """Whether ``record``'s event has completed, and its error if so (never blocks)."""
        backend = self.runtime.backend
        try:
            if not backend.done(record.event):
                return False, None
            error = backend.event_error(record.event)  # completed: returns at once
        except Exception as e:  # a CUDA error from the query itself
            error = e
        return True, None if error is None else _as_kernel_error(record.key, error)

    def _input_states(
        self, dep_keys: Iterable[Hashable]
    ) -> tuple[KernelError | None, tuple[TaskRecord, ...]]:
        """The error of failed work the inputs derive from, and the work still pending."""
        pending = []
        for record in self._sources(dep_keys):
            done, error = self._state(record)
            if error is not None:
                return error, ()
            if not done:
                pending.append(record)
        return None, tuple(pending)

    def _wait_inputs(self, dep_keys: tuple[Hashable, ...]) -> None:
        """Worker thread: block until the work the inputs derive from is done; raise its error."""
        for record in self._sources(dep_keys):
            error = self.runtime.backend.event_error(record.event)
            if error is not None:
                raise _as_kernel_error(record.key, error)

    def _collect(self) -> None:
        """Periodically: release the inputs of completed tasks, expire old failure records."""
        if self.runtime is not None:
            self.runtime.collect()
        expired = time.monotonic() - self.failure_ttl
        while self.failures and next(iter(self.failures.values()))[1] < expired:
            self.failures.popitem(last=False)

    # ------------------------------------------------------------------ egress

    async def get_data(
        self,
        comm: Any,
        keys: Collection[Hashable],
        who: str | None = None,
        serializers: list[str] | None = None,
    ) -> Any:
        """``Worker.get_data`` once the events of ``keys`` have completed; failed keys left out."""
        if len(self.registry):
            failed = await self._wait_for(keys)
            if failed:
                self._drop(self.worker, failed)
                keys = [k for k in keys if k not in failed]
                self._clear_stream_errors_soon()
        return await self._get_data(comm, keys=keys, who=who, serializers=serializers)

    async def _wait_for(self, keys: Collection[Hashable]) -> dict[Hashable, KernelError]:
        """Wait, off the event loop, for the work of ``keys``; return the keys whose work failed."""
        loop = asyncio.get_running_loop()
        while True:
            sources = {r.key: self._sources((r.key,)) for r in self.registry.records(keys)}
            pending = [r for rs in sources.values() for r in rs if not self._state(r)[0]]
            if not pending:
                break
            await loop.run_in_executor(self._egress, self._wait_events, pending)
        failed = {}
        for key, records in sources.items():
            error = next(filter(None, (self._state(r)[1] for r in records)), None)
            if error is not None:
                failed[key] = error
            else:
                self._taint.pop(key, None)  # all done and fine
        return failed

    def _wait_events(self, records: list[TaskRecord]) -> None:
        """Egress thread: block until each record's event has completed (errors read later)."""
        for record in records:
            with contextlib.suppress(Exception):
                self.runtime.backend.event_error(record.event)

    def _before_spill(self, key: Hashable, value: Any) -> None:
        """First ``on_evict`` callback: the key's work must be complete before it is serialized."""
        if self.runtime is None:
            return
        for record in self._sources((key,)):
            try:
                error = self.runtime.backend.event_error(record.event)  # blocks the loop
            except Exception as e:
                error = e
            if error is not None:
                # Spilled anyway (the value is garbage either way); the key is dropped next.
                failed = {key: _as_kernel_error(record.key, error)}
                self.worker.loop.add_callback(self._drop, self.worker, failed)
                self._clear_stream_errors_soon()
                return
        self._taint.pop(key, None)

    # ------------------------------------------------------------------ failures

    def _drop(self, worker: Any, failed: dict[Hashable, KernelError]) -> None:
        """Record the errors of corrupt results and release them, so they are recomputed.

        Runs on the event loop, outside the state machine. A key with dependents that
        still need it on this worker is released once they have left (they fail on
        their own when they start, see :meth:`_input_states`).
        """
        for key, error in failed.items():
            if key not in self.failures:
                logger.error("gpustreams: result of %r is corrupt (%s); recomputing it", key, error)
            self.failures[key] = (error, time.monotonic())
            self.failures.move_to_end(key)
        while len(self.failures) > self.max_failures:
            self.failures.popitem(last=False)
        self._release(worker, list(failed))

    def _clear_stream_errors_soon(self) -> None:
        if not self._clearing and self.runtime is not None:
            self._clearing = True
            self._egress.submit(self._clear_stream_errors)

    def _clear_stream_errors(self) -> None:
        """Egress thread: synchronize every stream of the runtime, ignoring its errors.

        A failure reaches every stream that waited for the failed work, and a
        stream in error skips what is launched on it later, until a host sync
        reports the error. Once one sync has reported it, this reports it on
        every stream, so that tasks unrelated to the failure run again. (Their
        events keep any error they recorded: corrupt results are still found.)
        Runs only after failures, and waits for all queued work.
        """
        self._clearing = False
        runtime = self.runtime
        transfers = getattr(runtime, "transfers", None)
        pools = (runtime.pool, getattr(transfers, "h2d", None), getattr(transfers, "d2h", None))
        for pool in pools:
            if pool is None or not pool.started():
                continue
            for slot in pool.slots:
                # The error is the one being cleared, or one that an event recorded.
                with contextlib.suppress(Exception):
                    runtime.backend.synchronize_stream(slot.stream)

    def _release(self, worker: Any, keys: list[Hashable]) -> None:
        if worker.status not in (Status.running, Status.paused):
            return
        now, later = [], []
        for key in keys:
            ts = worker.state.tasks.get(key)
            if ts is None or ts.state != "memory":
                continue
            if any(dep.state in _NEEDS_INPUTS for dep in ts.dependents):
                later.append(key)
            else:
                now.append(key)
        if now:
            stimulus_id = f"gpustreams-kernel-error-{time.time()}"
            worker.handle_stimulus(RemoveReplicasEvent(keys=now, stimulus_id=stimulus_id))
        if later:
            worker.loop.call_later(0.05, self._release, worker, later)
