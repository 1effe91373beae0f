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
      once; the events of the others are waited for in a small thread pool
      (``gpustreams-egress``), so the event loop keeps running meanwhile.
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
    a GPU) is only seen at a host synchronization after it, when its key is
    already in memory, and a scheduler has no ``memory -> erred`` transition
    for tasks. The plugin turns it into the failure of a task run:

    - a task whose input's event has completed with an error fails with that
      :class:`~dask_gpustreams.KernelError` before it runs (a non-blocking
      check of completed events when it starts executing);
    - when an egress wait (``get_data``, spilling) finds a failed event, the
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
    that waited for failed work is in error and skips later launches until a
    host sync reports it, so this keeps the failure from spilling over into
    unrelated tasks (on a GPU, a sticky CUDA error makes the worker unusable
    anyway; restart it). A worker that dies is handled by Dask as usual.

Lifetime
    The runtime holds each task's inputs, fetched ones included, until the
    task's event completes. Registry entries are dropped when their keys are
    released, forgotten or erred; failure records when they are used (at most
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
    """Task function of a host-side task: wait for the inputs' events, then run the node."""

    __slots__ = ("runtime", "registry", "node", "dep_keys")

    def __init__(
        self,
        runtime: StreamRuntime,
        registry: EventRegistry,
        node: GraphNode,
        dep_keys: tuple[Hashable, ...],
    ):
        self.runtime = runtime
        self.registry = registry
        self.node = node
        self.dep_keys = dep_keys

    def __call__(self, *values: Any) -> Any:
        self.runtime.synchronize(self.dep_keys, self.registry)
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
    _active = False  # set between setup and teardown
    #: Modules whose task functions give their inputs to host-side machinery (P2P).
    host_modules: tuple[str, ...] = ("distributed.shuffle",)
    #: How many kernel-failure records a worker keeps for keys not yet recomputed,
    #: and for how many seconds (a recomputation normally follows within milliseconds).
    max_failures = 1000
    failure_ttl = 60.0
    #: Seconds between releases of the inputs held for completed tasks.
    collect_interval = 0.5

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
        self.failures.clear()

    # ------------------------------------------------------------------ execution

    def transition(self, key: Hashable, start: str, finish: str, **kwargs: Any) -> None:
        """Wrap a task that starts executing; drop the entries of keys that go away."""
        if not self._active:
            return
        if finish == "executing":
            self._prepare(key)
            return
        if start in _RUNNING or finish in _GONE:
            self._wrapped.discard(key)
            if finish == "error":  # maybe a KernelError seen by a sync inside the task
                self._clear_stream_errors_soon()
        if finish in _GONE:
            self.registry.forget((key,))

    def _prepare(self, key: Hashable) -> None:
        ts = self.worker.state.tasks.get(key)
        if ts is None or ts.run_spec is None:
            return
        node = ts.run_spec
        dep_keys = tuple(node.dependencies)
        error, _ = self.failures.pop(key, (None, None))
        if error is None:
            error = self._failed_input(dep_keys)
            if error is not None:
                self._clear_stream_errors_soon()
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
            if self.registry.records(dep_keys):
                host = _AfterInputs(runtime, self.registry, node, dep_keys)
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

    def _failed_input(self, dep_keys: Iterable[Hashable]) -> KernelError | None:
        """The error of an input whose event has completed with one (never blocks)."""
        for record in self.registry.records(dep_keys):
            error = self._completed_error(record)
            if error is not None:
                return error
        return None

    def _completed_error(self, record: TaskRecord) -> KernelError | None:
        """``record``'s error if its event has completed with one; None if fine or pending."""
        backend = self.runtime.backend
        try:
            if not backend.done(record.event):
                return None
            backend.synchronize_event(record.event)  # completed: returns or raises at once
        except Exception as e:
            return _as_kernel_error(record.key, e)
        return None

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
        """Wait, off the event loop, for the events of ``keys``; return those that failed."""
        loop = asyncio.get_running_loop()
        while True:
            records = self.registry.records(keys)
            pending = [r for r in records if not self._done(r)]
            if not pending:
                break
            await loop.run_in_executor(self._egress, self._wait_events, pending)
        failed = {}
        for record in records:
            error = self._completed_error(record)
            if error is not None:
                failed[record.key] = error
        return failed

    def _done(self, record: TaskRecord) -> bool:
        try:
            return self.runtime.backend.done(record.event)
        except Exception:  # a CUDA error from the query: report it through synchronize
            return True

    def _wait_events(self, records: list[TaskRecord]) -> None:
        """Egress thread: block until each record's event has completed (errors come later)."""
        for record in records:
            with contextlib.suppress(Exception):  # read again by _completed_error
                self.runtime.backend.synchronize_event(record.event)

    def _before_spill(self, key: Hashable, value: Any) -> None:
        """First ``on_evict`` callback: the key's work must be complete before it is serialized."""
        record = self.registry.get(key)
        if record is None or self.runtime is None:
            return
        try:
            self.runtime.backend.synchronize_event(record.event)
        except Exception as e:
            # Spilled anyway (the value is garbage either way); the key is dropped next.
            error = _as_kernel_error(key, e)
            self.worker.loop.add_callback(self._drop, self.worker, {key: error})
            self._clear_stream_errors_soon()

    # ------------------------------------------------------------------ failures

    def _drop(self, worker: Any, failed: dict[Hashable, KernelError]) -> None:
        """Record the errors of corrupt results and release them, so they are recomputed.

        Runs on the event loop, outside the state machine. A key with dependents that
        still need it on this worker is released once they have left (they fail on
        their own through :meth:`_failed_input`).
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
