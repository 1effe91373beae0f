"""The run_spec each task gets when it starts executing on a worker.

The *Execution* section of :mod:`.plugin`'s documentation. A task that runs
in a worker thread is wrapped to run on the streams; a host-side task waits
for its inputs' work first; a task whose inputs (or whose own earlier run)
failed on the device raises that failure instead of running. Other tasks
keep their run_spec.
"""

from __future__ import annotations

import asyncio
import sys
import weakref
from collections.abc import Callable, Hashable, Mapping
from collections.abc import Set as AbstractSet
from functools import partial
from types import FunctionType
from typing import Any

from dask._task_spec import GraphNode, Task, TaskRef, _execute_subgraph
from distributed import Reschedule

from dask_gpustreams.diagnostics.fine_metrics import launch_meter
from dask_gpustreams.integrations.blocks import BlockSkipped, StreamBlock
from dask_gpustreams.integrations.distributed.provenance import Provenance
from dask_gpustreams.integrations.subgraphs import lean_subgraphs
from dask_gpustreams.integrations.tasks import (
    StreamTask,
    blocks_host,
    rewrite_transfers,
    stream_node,
    transfer_rewrites,
)
from dask_gpustreams.markers import HOST_TASK_ATTR, is_host_task
from dask_gpustreams.runtime import StreamRuntime


class Raises:
    """Task function that raises ``exc``: a task failed before it ran."""

    __slots__ = ("exc",)

    def __init__(self, exc: BaseException):
        self.exc = exc

    def __call__(self, *args: Any) -> Any:
        raise self.exc.with_traceback(None)  # not the frames of the sync that found it

    def __repr__(self) -> str:
        return f"Raises({self.exc!r})"


class _AfterInputs:
    """Task function of a host-side task: wait for the inputs' work, then run the node."""

    __slots__ = ("wait_inputs", "node", "dep_keys")

    def __init__(
        self,
        wait_inputs: Callable[[tuple[Hashable, ...]], None],
        node: GraphNode,
        dep_keys: tuple[Hashable, ...],
    ):
        self.wait_inputs = wait_inputs
        self.node = node
        self.dep_keys = dep_keys

    def __call__(self, *values: Any) -> Any:
        self.wait_inputs(self.dep_keys)
        return self.node(dict(zip(self.dep_keys, values, strict=True)))

    def __repr__(self) -> str:
        return f"_AfterInputs({self.node!r})"


def coroutine_after_inputs(
    wait_inputs: Callable[[tuple[Hashable, ...]], None],
    node: GraphNode,
    dep_keys: tuple[Hashable, ...],
) -> Callable[..., Any]:
    """Task function of a coroutine task (run on the event loop): wait for the inputs'
    work in a thread, then await the node. Its result may be an input, or made from
    one, and has no event of its own: its readers would not wait for the input's kernel."""

    async def after_inputs(*values: Any) -> Any:
        await asyncio.get_running_loop().run_in_executor(None, wait_inputs, dep_keys)
        return await node(dict(zip(dep_keys, values, strict=True)))

    return after_inputs


class WorkerStreamTask(StreamTask):
    """A :class:`StreamTask` of a worker: checks its inputs, then launches, metered.

    Runs in the worker thread: the checks of the inputs' events (each a driver
    call, which releases the GIL and so makes the event loop wait to get it back)
    stay off the event loop. An input whose work failed makes the task raise that
    :class:`~dask_gpustreams.KernelError` before it launches anything; the inputs'
    pending work becomes the key's taint. Before it launches, the failures that
    nothing read are reported (:meth:`.Provenance.report_unread`), lest its work be
    skipped on a stream they left in error; after, its record is watched for one
    (:meth:`.Provenance.watch`). A stream block
    (:class:`~dask_gpustreams.integrations.blocks.StreamBlock`) waits for its
    inputs' work, then launches its tasks onto the pool and returns once they
    are complete (its key has no event); an input whose work failed fails only
    the outputs that derive from it (its slot of the tuple holds the
    ``KernelError``, see ``StreamBlock.launch``), as task per key. The launch is metered as
    ``gpustreams-launch`` (fine metrics). :class:`Execution` makes one subclass
    per worker, whose class attribute :attr:`provenance` is that worker's, and
    makes it of what ``wrap_task`` would wrap (:func:`stream_node`). Only
    tasks that are not coroutines are wrapped, so :attr:`is_coro` is a class
    attribute: ``Worker.execute`` reads it on the event loop with no call.
    """

    __slots__ = ()
    provenance: Provenance
    #: ``provenance.unpooled``: inputs made while no plugin was set up, waited for first.
    unpooled: AbstractSet[Hashable]
    is_coro = False  # type: ignore[assignment]  # (StreamTask's reads the node's)
    #: A ``host_task``'s class: its inputs' work done before it runs (a host wait), as on the
    #: launcher, so that host code reading them other than through its stream sees them whole.
    #: Decided by the task's function, so False for a fused task: :meth:`__call__` looks
    #: into that one.
    host_wait = False

    def __call__(self, values: Mapping[Hashable, Any]) -> Any:
        provenance = self.provenance
        # A class attribute, and a set's method: no Python call unless an input is noted (a
        # noted key nothing reads may stay noted for good).
        if self.unpooled and not self.unpooled.isdisjoint(self._dependencies):
            provenance.settle_unpooled(self._dependencies)
        error, pending = provenance.input_states(self._dependencies)
        node = self.node
        block = type(node) is Task and type(node.func) is StreamBlock
        if error is not None and not block:
            provenance.clear_stream_errors_soon()
            raise error.with_traceback(None)  # not the frames of the sync that found it
        provenance.report_unread()  # before this task's launch: failures nobody read
        if block:
            provenance.free_retired()  # here, not on the event loop that retired them
            # Its tasks launch on other streams: the inputs' work must be done. An input
            # whose work failed fails only the outputs that derive from it, as task per key.
            failures = None
            if error is not None or pending:
                failures = provenance.input_failures(tuple(self._dependencies))
                if failures or error is not None:
                    provenance.clear_stream_errors_soon()
                if not failures and error is not None:  # found by no input's records: fails whole
                    raise error.with_traceback(None)
            try:
                with launch_meter():
                    return node.func.launch(self.runtime, values, failures)
            except BlockSkipped:  # no failure of its own: recompute, report no other key's
                raise Reschedule() from None
        # A class attribute (no call); a fused task that calls a host_task is found here, in
        # this thread, not on the event loop, where its kind is its function's
        # (_execute_subgraph: one per worker).
        host = self.host_wait or (
            isinstance(node, Task) and node.func is _execute_subgraph and blocks_host(node)
        )
        if pending:
            if host:
                provenance.wait_inputs(tuple(self._dependencies))
            else:
                provenance.note_pending(self.key, pending)
        node = lean_subgraphs(node, host)  # in this thread, as StreamTask does
        try:
            with launch_meter():
                return self.runtime.run(self.key, node, values, self.registry, self.critical)
        finally:  # after the launch, and here, not on the event loop that retired them
            provenance.watch(self.key)
            provenance.free_retired()

    def copy(self) -> WorkerStreamTask:
        return type(self)(self.node, self.runtime, self.registry, self.critical)

    __copy__ = copy

    def substitute(self, subs: dict, key: Hashable | None = None) -> GraphNode:
        node = super().substitute(subs, key)
        if isinstance(node, StreamTask):  # (a HostStreamTask too: this class says how it runs)
            node.__class__ = type(self)
        return node


def with_func(node: GraphNode, func: Any, dep_keys: tuple[Hashable, ...]) -> Task:
    """A task of ``node``'s key and dependencies calling ``func(*values of dep_keys)``."""
    return Task(node.key, func, *(TaskRef(d) for d in dep_keys), _data_producer=node.data_producer)


def fail_task(tasks: Mapping[Hashable, Any], key: Hashable, exc: BaseException) -> None:
    """Make ``key``'s task in ``tasks`` (a worker's ``state.tasks``) raise ``exc``, not run."""
    ts = tasks.get(key)
    if ts is not None and ts.run_spec is not None:
        node = ts.run_spec
        ts.run_spec = with_func(node, Raises(exc), tuple(node.dependencies))


#: How the tasks of one function run (:attr:`Execution._kinds`): as they are (coroutines), on
#: the host side after their inputs' work, or on the streams (rewritten whole by
#: :func:`stream_node`, or only where a task stands in their arguments; a ``host_task``
#: on the streams after a host wait for its inputs' work).
_AS_IS, _HOST, _STREAM, _REWRITE, _STREAM_AFTER_INPUTS = 0, 1, 2, 3, 4


#: Entries of :attr:`Execution._kinds` from which dead ones are swept, at the least.
_SWEEP_AT_LEAST = 64


def _class_decides(func: Any) -> bool:
    """Whether ``func``'s tasks run as its class says (:attr:`Execution._class_kinds`): an
    instance of a class with a Python ``__call__`` and plain attribute reads, with no
    coroutine mark of its own (``Task.is_coro`` reads the marks, not ``__call__``), and no
    partial (whether one is a coroutine is its function's)."""
    cls = type(func)
    return (
        type(cls.__call__) is FunctionType  # (a task function is callable)
        and not isinstance(func, partial)
        and getattr(cls, "__getattr__", None) is None
        and cls.__getattribute__ is object.__getattribute__
        and getattr(func, "_is_coroutine_marker", None) is None
        and not getattr(func, "__tornado_coroutine__", False)
        and getattr(func, "__code__", None) is None  # function-like: is_coro reads its flags
    )


def _held_by_its_module(func: Any) -> bool:
    """Whether ``func`` is what its module holds under its name (a singleton: ``numpy.add``)."""
    module = sys.modules.get(getattr(func, "__module__", None) or "")
    name = getattr(func, "__name__", None)
    return module is not None and isinstance(name, str) and getattr(module, name, None) is func


class Execution:
    """Replaces the run_spec of each task that starts executing on one worker (event loop).

    :meth:`prepare` runs once per task on the worker's event loop, so it reads
    only what the task needs and caches what is per executor or per function,
    not per task. ``host_modules``: the modules of the functions of host-side
    tasks (the plugin's, read at setup).
    """

    def __init__(self, worker: Any, provenance: Provenance, host_modules: tuple[str, ...]):
        self.worker = worker
        self.provenance = provenance
        self._host_modules = host_modules
        #: A weak reference to a task function -> (its type, how its tasks run: ``_AS_IS``,
        #: ``_HOST``, ...), decided at its first task: the module and coroutine checks are
        #: per function, not per task. Keyed as ``weakref.WeakKeyDictionary`` keys them (a
        #: reference equals another whose live referents are equal), with no call of a
        #: mapping's method per lookup: a callable shipped anew in each task message (a frozen
        #: dataclass) finds its equal, of its own type only. Weak, so that a function shipped
        #: by value with each graph (a closure over a device array) is not kept alive; a dead
        #: entry equals only itself, and :meth:`_sweep` drops it. A callable with no weak
        #: reference (numpy's ufuncs) is its own key if its module holds it (a singleton), else
        #: decided per task.
        self._kinds: dict[Any, tuple[type, int]] = {}
        self._sweep_at = _SWEEP_AT_LEAST
        #: The function of the last task decided (weakly) and its kind. A graph's tasks share
        #: their function object, which this finds by identity: a lookup in :attr:`_kinds`
        #: makes a weak reference, and calls the function's ``__hash__`` and ``__eq__`` if it
        #: is equal to the key it finds but not that key's referent (two Python calls per task
        #: for a dataclass, about 2 us of the event loop's time).
        self._last_func: weakref.ref | None = None
        self._last_kind = _AS_IS
        #: A worker process gets each task's function anew, unpickled from its own message: a
        #: partial (no ``__eq__``) or an instance. A partial with no attributes of its own
        #: runs as what it wraps says (its module is ``functools``; whether it is a coroutine
        #: is its function's), so its kind is kept by that function, weakly (as
        #: :attr:`_kinds`): no Python call per task, where :attr:`_kinds` missed every time.
        self._partial_kinds: dict[Any, tuple[type, int]] = {}
        #: An instance of a Python class (a ``__call__`` of its own: a dataclass, toolz's
        #: ``Compose``) runs as its class says, if it has its class's module, no coroutine
        #: mark of its own and is no transfer function (what :meth:`_kind` reads): class ->
        #: (its module, the kind), with no ``__hash__`` or ``__eq__`` call per task. Keyed by a
        #: weak reference to the class (swept with the others): a class shipped by value
        #: (cloudpickle) is new with each graph, and its methods may close over device arrays.
        #: The entry also keeps whether that instance was marked ``host_task`` (a mark may be
        #: an instance's own): an instance marked otherwise is decided for itself.
        self._class_kinds: dict[weakref.ref, tuple[Any, int, bool]] = {}
        self._tasks = worker.state.tasks
        self._actors = worker.state.actors
        # What each task reads of the provenance, bound once (no call per task): the failure
        # records it takes from, the registry its task records its event in.
        self._failures = provenance.failures
        self._registry = provenance.registry
        #: executor name -> whether it is a thread pool (tasks on it run wrapped).
        self._thread_pools: dict[str, bool] = {}
        # The worker's executors exist before its plugins are set up.
        self._default_on_threads = self._on_threads("default")
        self._unpooled = provenance.unpooled
        shared = {"__slots__": (), "provenance": provenance, "unpooled": self._unpooled}
        self._task_class = type("WorkerStreamTask", (WorkerStreamTask,), shared)
        self._host_task_class = type(
            "WorkerHostTask", (WorkerStreamTask,), {**shared, "host_wait": True}
        )
        #: The runtime, once the first task made it, and its backend's transfer rewrites.
        self._runtime: StreamRuntime | None = None
        self._rewrites: dict[int, Any] = {}

    def prepare(self, key: Hashable) -> None:
        """Give ``key``'s task, which starts executing, the run_spec to run it with.

        A task that runs on the streams (one that :func:`wrap_task` would wrap)
        checks its inputs in its worker thread (:class:`WorkerStreamTask`); the
        others, host-side tasks among them, are checked here.
        """
        ts = self._tasks.get(key)
        if ts is None:
            return
        node = ts.run_spec
        if node is None:
            return
        if self._failures:  # a mapping: no call
            error = self._failures.take(key)
            if error is not None:
                ts.run_spec = with_func(node, Raises(error), tuple(node.dependencies))
                return
        kind = _AS_IS
        if not (self._actors and key in self._actors) and (
            self._thread_pool(ts) if ts.annotations else self._default_on_threads
        ):
            if type(node) is Task:
                func = node.func
                last = self._last_func  # by identity first: a graph's tasks share their function
                if last is not None and last() is func:
                    kind = self._last_kind
                elif (  # by its class: what _kind reads, with no Python call
                    by_class := self._class_kinds.get(weakref.ref(cls := type(func)))
                ) is not None and (
                    getattr(func, "__module__", None) is by_class[0]
                    # host_task marks an instance: its own, not its class's (no call)
                    and getattr(func, HOST_TASK_ATTR, False) is by_class[2]
                    and getattr(func, "_is_coroutine_marker", None) is None
                    and not getattr(func, "__tornado_coroutine__", False)
                    and getattr(func, "__code__", None) is None
                    and id(func) not in self._rewrites
                ):
                    kind = by_class[1]
                elif (  # by the function it wraps
                    cls is partial and not func.__dict__ and id(func) not in self._rewrites
                ):
                    inner = func.func
                    try:
                        known = self._partial_kinds.get(weakref.ref(inner))
                    except Exception:  # no weak reference to it (a ufunc), or no hash
                        known = None
                    if known is not None and known[0] is type(inner):
                        kind = known[1]
                    else:
                        kind = self._partial_kind(node, inner)
                else:
                    try:  # by equality (a callable shipped by value arrives as a new, equal object)
                        last = weakref.ref(func)
                        known = self._kinds.get(last)
                    except Exception:  # no weak reference to it; or its __hash__ or __eq__ raised
                        last = None
                        known = self._known_strongly(func)
                    if known is not None and known[0] is type(func):
                        kind = known[1]
                    else:
                        kind = self._remember(node)
                    self._last_func = last
                    self._last_kind = kind
            else:
                kind = self._kind(node)
            if kind >= _STREAM:
                runtime = self._runtime
                if runtime is None:
                    try:
                        runtime = self._start_runtime()
                    except Exception as e:  # a bad backend: fail the task, not the worker
                        ts.run_spec = with_func(node, Raises(e), tuple(node.dependencies))
                        return
                    # again, with the backend's transfer functions
                    kind = self._remember(node) if type(node) is Task else self._kind(node)
                # As wrap_task (stream_node): a plain task's transfers are rewritten only if
                # a task stands in its arguments (the rare case).
                inner = node
                if kind == _REWRITE:
                    inner = stream_node(node, self._rewrites)
                else:
                    for a in node.args:  # a loop, not any(): no call
                        if isinstance(a, Task):
                            inner = rewrite_transfers(node, self._rewrites)
                            break
                cls = self._host_task_class if kind == _STREAM_AFTER_INPUTS else self._task_class
                ts.run_spec = cls(inner, runtime, self._registry)
                return
        provenance = self.provenance
        error, pending = provenance.input_states(node.dependencies)
        if error is not None:
            provenance.clear_stream_errors_soon()
            ts.run_spec = with_func(node, Raises(error), tuple(node.dependencies))
            return
        if pending:
            provenance.note_pending(key, pending)
        # Inputs made while no plugin was set up: waited for as pending ones (wait_inputs).
        if pending or (self._unpooled and not self._unpooled.isdisjoint(node.dependencies)):
            dep_keys = tuple(node.dependencies)
            if kind == _HOST:  # it waits for its inputs' work first, in its thread
                host = _AfterInputs(provenance.wait_inputs, node, dep_keys)
                ts.run_spec = with_func(node, host, dep_keys)
            elif node.is_coro and not (self._actors and key in self._actors):
                # the same, in a thread, before it runs on the event loop
                coro = coroutine_after_inputs(provenance.wait_inputs, node, dep_keys)
                ts.run_spec = with_func(node, coro, dep_keys)

    def _kind(self, node: GraphNode) -> int:
        """How ``node`` runs: on the host side (``host_modules``), on the streams, or as it is.

        On the streams, a plain task whose function is neither a transfer nor a
        fused subgraph is :data:`_STREAM`; others are :data:`_REWRITE`, and go
        through :func:`stream_node` whole.
        """
        func = getattr(node, "func", None)
        if (getattr(func, "__module__", None) or "").startswith(self._host_modules):
            return _HOST
        if stream_node(node, {}) is None:
            return _AS_IS
        if type(node) is not Task or func is _execute_subgraph or id(func) in self._rewrites:
            return _REWRITE
        return _STREAM_AFTER_INPUTS if is_host_task(func) else _STREAM

    def _remember(self, node: Task) -> int:
        """:meth:`_kind` of a plain task, kept while its function lives (if it can be), and
        for its class where the class decides (:attr:`_class_kinds`)."""
        kind = self._kind(node)
        func = node.func
        try:  # (an attribute read can raise: Task.is_coro took that as no coroutine)
            if id(func) not in self._rewrites and _class_decides(func):
                entry = (getattr(func, "__module__", None), kind, is_host_task(func))
                self._class_kinds[weakref.ref(type(func))] = entry
        except Exception:
            pass
        self._sweep_if_due()
        try:
            key = weakref.ref(func)
        except TypeError:  # no weak reference to it
            key = func if _held_by_its_module(func) else None
        if key is None:
            return kind
        try:  # a try, not contextlib.suppress (two calls): this runs for each new function
            self._kinds[key] = (type(func), kind)
        except Exception:  # unhashable, or its __hash__ raised: decided at each task
            return kind
        return kind

    def _partial_kind(self, node: Task, inner: Any) -> int:
        """:meth:`_kind` of ``node``, a task of a partial of ``inner`` with no attributes of
        its own, kept by ``inner`` while it lives (one with no weak reference, a ufunc, or
        no hash is decided per task)."""
        kind = self._kind(node)
        self._sweep_if_due()
        try:  # a try, not contextlib.suppress (two calls): this runs for each new function
            self._partial_kinds[weakref.ref(inner)] = (type(inner), kind)
        except Exception:  # no weak reference to it, or its __hash__ raised
            return kind
        return kind

    def _known_strongly(self, func: Any) -> tuple[type, int] | None:
        """The entry of ``func`` as its own key (no weak reference to it), if any."""
        try:
            return self._kinds.get(func)
        except Exception:  # unhashable, or its __hash__ or __eq__ raised
            return None

    def _entries(self) -> int:
        return len(self._kinds) + len(self._partial_kinds) + len(self._class_kinds)

    def _sweep_if_due(self) -> None:
        """:meth:`_sweep` once the entries of the three caches reach ``_sweep_at``."""
        if self._entries() >= self._sweep_at:
            self._sweep()

    def _sweep(self) -> None:
        """Drop the entries of dead functions: dead references, equal hashes among them,
        would lengthen every lookup. The next sweep is due when the live entries doubled."""
        for kinds in (self._kinds, self._partial_kinds, self._class_kinds):
            for key in [k for k in kinds if type(k) is weakref.ref and k() is None]:
                del kinds[key]
        self._sweep_at = 2 * self._entries() + _SWEEP_AT_LEAST

    def _start_runtime(self) -> StreamRuntime:
        """The worker's runtime (made at its first task), and what is per runtime."""
        runtime = self.provenance.task_runtime()
        self._rewrites = transfer_rewrites(runtime)
        self._last_func = None  # its kind was decided without the transfer functions
        self._runtime = runtime
        return runtime

    def fail(self, key: Hashable, exc: BaseException) -> None:
        """Make ``key``'s task raise ``exc`` instead of running (preparing it failed)."""
        fail_task(self._tasks, key, exc)

    def running_wrapped(self) -> bool:
        """Whether a task that runs on the streams is still executing, or is about to.

        A task is wrapped (:meth:`prepare`) as it transitions to executing; its
        ``Worker.execute`` starts on a later turn of the event loop, and only then does
        ``active_keys`` have its key. The worker's ``executing`` and ``long_running`` sets
        have it from the transition on: without them, a teardown between the two closed
        the runtime that the task then ran on ("this stream pool is closed").
        """
        tasks = self._tasks
        state = self.worker.state
        return any(
            isinstance(ts.run_spec, StreamTask) for ts in (*state.executing, *state.long_running)
        ) or any(
            isinstance(getattr(tasks.get(k), "run_spec", None), StreamTask)
            for k in self.worker.active_keys
        )

    def on_threads(self, ts: Any) -> bool:
        """Whether ``ts`` runs in one of the worker's threads (not in another process)."""
        return self._thread_pool(ts) if ts.annotations else self._default_on_threads

    def _thread_pool(self, ts: Any) -> bool:
        """Whether ``ts`` (with annotations) runs in a worker thread, as ``Worker.execute`` says."""
        name = ts.annotations.get("executor", "default")
        known = self._thread_pools.get(name)
        return self._on_threads(name) if known is None else known

    def _on_threads(self, name: str) -> bool:
        """Whether the worker's executor ``name`` is a thread pool (cached once it exists)."""
        executor = self.worker.executors.get(name)
        known = executor is not None and "ThreadPoolExecutor" in str(type(executor))
        if executor is not None:
            self._thread_pools[name] = known
        return known
