"""Wrapping dask ``Task`` nodes so they run through the stream runtime (shared by integrations).

Importing this module appends :data:`TRACEBACK_SHORTEN` to the default of
Dask's ``admin.traceback.shorten``: ``compute``, ``persist`` and distributed's
``Future.result``/``Client.gather`` then drop the frames of the wrappers
between Dask's and the task's own, and a task error's traceback reads as
without the plugin. Dask's and distributed's patterns stay. As with
``distributed.client.preload`` (:mod:`.preload`), a value set in YAML, the
environment or ``dask.config.set`` replaces the default (add these patterns
to it), and ``dask.config.refresh()`` drops them. On distributed the client
shortens with its own config: a client process that never imports the
package shows the wrappers' frames. An asynchronous client shortens nothing;
the workers drop these frames (:mod:`.distributed.tracebacks`).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Hashable, Mapping
from inspect import CO_COROUTINE
from types import BuiltinFunctionType, FunctionType
from typing import Any

import dask.config
from dask._task_spec import Alias, GraphNode, Task, TaskRef, _execute_subgraph
from dask.sizeof import sizeof

from dask_gpustreams.integrations.subgraphs import lean_subgraphs
from dask_gpustreams.markers import is_host_task
from dask_gpustreams.runtime import EventRegistry, StreamRuntime, TaskRecord
from dask_gpustreams.transfers import to_device, to_host

logger = logging.getLogger("dask_gpustreams")

#: ``admin.traceback.shorten`` patterns: the modules whose frames sit between Dask's and a
#: task's own (the task wrappers, the runtime's ``run``, the local route's callbacks, the
#: launcher's loop, a stream block's launch and output getter). Modules that may raise errors
#: of their own (transfers, pool) are not here; a raise of the blocks' own (``BlockSkipped``)
#: is the last frame, which Dask always keeps.
TRACEBACK_SHORTEN = (
    r"dask_gpustreams[\\/]integrations[\\/](tasks|local|launcher|blocks|subgraphs)\.py",
    r"dask_gpustreams[\\/]integrations[\\/]distributed[\\/](execution|gathered)\.py",
    r"dask_gpustreams[\\/]runtime[\\/](runtime|launcher)\.py",
)


class ComputeRegistry(EventRegistry):
    """The registry of one compute on Dask's own threads, which counts the compute's tasks
    running there (:class:`StreamTask` tells it).

    Dask's ``get_async`` raises a task's exception at once, while other tasks of the
    graph still run, or wait for a thread, in its pool. :meth:`close`, at the compute's
    end, waits for those running, and a task that starts later raises instead of
    launching: the compute's drain then reports their kernels' failures, which the next
    compute on those streams raised before, as its own error (a ``KernelError`` naming a
    key of the failed graph).

    A task that runs again (``get_async`` reruns a failed one on the calling thread with
    ``rerun_exceptions_locally``) records its event under the same key: the earlier
    run's record is kept in :attr:`superseded`, for the compute's drain too.
    """

    #: Seconds :meth:`close` waits before it logs a warning that names what it waits for: a
    #: running task that waits for the caller (after the compute) would hang it silently.
    warn_after = 10.0

    def __init__(self, caller: Any = None) -> None:
        super().__init__()
        #: What the caller's work left to wait for (``order_after_caller``): host tasks wait
        #: for it, as a literal input may still be written there.
        self.caller = caller
        self._running = 0
        self._closed = False
        self._idle = threading.Condition(threading.Lock())
        #: The records of earlier runs of keys that ran again, replaced in the registry.
        self.superseded: list[TaskRecord] = []

    def begin(self, key: Hashable) -> None:
        """Task ``key`` starts in this thread (it raises if the compute has ended)."""
        with self._idle:
            if self._closed:
                raise RuntimeError(f"task {key!r} started after its compute ended")
            self._running += 1
            earlier = self._records.get(key)  # run again: its new record replaces this one
            if earlier is not None:
                self.superseded.append(earlier)

    def end(self) -> None:
        """A task that :meth:`begin` let start has returned or raised."""
        with self._idle:
            self._running -= 1
            if not self._running:
                self._idle.notify_all()

    def close(self) -> None:
        """Block until no task of the compute runs; none starts after."""
        with self._idle:
            self._closed = True
            warned = False
            while self._running:
                if not self._idle.wait(self.warn_after) and not warned:
                    warned = True
                    logger.warning(
                        "gpustreams: this compute failed; its error is raised once "
                        "the %d task(s) of the compute still running in Dask's threads return "
                        "(their kernels' failures are reported with it). A running task that "
                        "waits for something the caller does after the compute would hang it",
                        self._running,
                    )


class StreamTask(Task):
    """A task that runs ``node`` through the stream runtime, with its key and dependencies.

    A :class:`~dask._task_spec.Task` to Dask (its diagnostics see tasks as
    before), whose ``func``, ``args`` and ``kwargs`` are ``node``'s (an
    ``Alias`` reads as the identity of its target). Called by the scheduler
    with the values of its dependencies, as ``node`` would be (a fused task runs
    its inner tasks without ``dask.order``: :mod:`.subgraphs`). Pickled for
    another process (the multiprocessing scheduler), it becomes ``node``
    again: streams and events stay in this process.

    ``Task``'s own fields stay unset (``Task.__init__`` is not run: it would
    walk the arguments again); every method that reads them is overridden.
    """

    __slots__ = ("node", "runtime", "registry", "critical")
    #: Whether ``node`` calls a ``host_task`` (:class:`HostStreamTask`): if not, its plan
    #: is not searched for a host wait (:func:`.lean_subgraphs`).
    host_wait = False

    def __init__(
        self,
        node: GraphNode,
        runtime: StreamRuntime,
        registry: EventRegistry,
        critical: bool | None = None,
    ):
        self.key = node.key
        self._dependencies = node._dependencies  # GraphNode's slot: no property call
        self.node = node
        self.runtime = runtime
        self.registry = registry
        self.critical = critical

    @property
    def func(self) -> Any:  # type: ignore[override]
        node = self.node
        return node.func if isinstance(node, Task) else _alias_value

    @property
    def args(self) -> tuple:  # type: ignore[override]
        node = self.node
        return node.args if isinstance(node, Task) else (TaskRef(node.target),)

    @property
    def kwargs(self) -> dict:  # type: ignore[override]
        node = self.node
        return node.kwargs if isinstance(node, Task) else {}

    @property
    def data_producer(self) -> bool:  # read rarely: not copied at each wrap (the event loop)
        return self.node.data_producer

    @property
    def is_coro(self) -> bool:
        return self.node.is_coro  # cached by the node: one check per graph node

    def __call__(self, values: Mapping[Hashable, Any]) -> Any:
        # A fused task's plan is made here, in the task's thread: not on distributed's
        # event loop (Execution.prepare), and pickled, the task stays Dask's.
        node = lean_subgraphs(self.node, self.host_wait)
        registry = self.registry
        if type(registry) is not ComputeRegistry:
            return self.runtime.run(self.key, node, values, registry, self.critical)
        registry.begin(self.key)
        try:
            return self.runtime.run(self.key, node, values, registry, self.critical)
        finally:
            registry.end()

    def __reduce__(self):
        return self.node.__reduce__()

    def copy(self) -> StreamTask:
        return StreamTask(self.node, self.runtime, self.registry, self.critical)

    __copy__ = copy

    def __deepcopy__(self, memo: dict) -> StreamTask:
        return self.copy()

    def __hash__(self) -> int:
        return hash((StreamTask, self.key))

    def __dask_tokenize__(self) -> Any:
        return ("StreamTask", self.node, self.critical)

    def _get_token(self) -> str:
        from dask.tokenize import tokenize

        return tokenize(self.__dask_tokenize__())

    def __sizeof__(self) -> int:
        return object.__sizeof__(self) + sizeof(self.node)

    def substitute(self, subs: dict, key: Hashable | None = None) -> GraphNode:
        node = self.node.substitute(subs, key)
        return wrap_task(node, self.runtime, self.registry, self.critical)

    def __repr__(self) -> str:
        return f"StreamTask({self.node!r})"


class HostStreamTask(StreamTask):
    """The :class:`StreamTask` of a ``host_task``: it waits on the host for its inputs' work
    before it runs, as the launcher's host tasks do, so that host code reading them other
    than through its stream (a file write through GDS, a library on a stream of its own)
    sees them whole."""

    __slots__ = ()
    host_wait = True

    def __call__(self, values: Mapping[Hashable, Any]) -> Any:
        runtime, registry = self.runtime, self.registry
        if type(registry) is ComputeRegistry and registry.caller is not None:
            runtime.wait_caller(registry.caller)  # a literal input, the caller's
        wait = runtime.wait
        for record in registry.records(self._dependencies):
            error = wait(record)
            if error is not None:  # the failed work's error, not a value
                raise error.with_traceback(None)  # not this task's frames, kept with the error
        return super().__call__(values)

    def copy(self) -> HostStreamTask:
        return HostStreamTask(self.node, self.runtime, self.registry, self.critical)

    __copy__ = copy

    def __repr__(self) -> str:
        return f"HostStreamTask({self.node!r})"


def blocks_host(node: Task) -> bool:
    """Whether ``node`` calls a :func:`~dask_gpustreams.host_task` (also inside a fused task)."""
    func = node.func
    if func is _execute_subgraph:
        for t in node.args[0].values():  # noqa: SIM110 - a loop, not any(): per fused task
            if isinstance(t, Task) and blocks_host(t):
                return True
        return False
    return is_host_task(func)


def _alias_value(value: Any) -> Any:
    """The ``func`` of a wrapped ``Alias``: its target's value."""
    return value


@functools.cache
def transfer_rewrites(runtime: StreamRuntime) -> dict[int, Any]:
    """``id(f) -> replacement`` for the upload and download functions of ``runtime``'s device."""
    uploads, downloads = runtime.transfer_functions
    table = {id(f): to_device for f in uploads}
    table.update({id(f): to_host for f in downloads})
    return table


def rewrite_transfers(node: GraphNode, table: dict[int, Any]) -> GraphNode:
    """``node`` with calls of upload/download functions replaced by the staged copies.

    Looks into fused ``_execute_subgraph`` tasks, where ``map_blocks(cupy.asarray)``
    usually ends up; returns ``node`` itself when nothing changes.
    """
    if not isinstance(node, Task) or not table:
        return node
    func = node.func
    args = node.args
    if func is _execute_subgraph:
        inner = args[0]
        new_inner = {k: rewrite_transfers(v, table) for k, v in inner.items()}
        if all(new_inner[k] is inner[k] for k in inner):
            return node
        args = (new_inner, *args[1:])
    else:
        replacement = table.get(id(func))
        if replacement is None:
            for a in args:  # a loop, not any(): this runs once per task on the event loop
                if isinstance(a, Task):
                    break
            else:
                return node
        new_args = tuple(rewrite_transfers(a, table) for a in args)
        # Only the plain one-argument call: other arguments (dtype, order, stream, out)
        # keep their meaning with the original function.
        if len(args) != 1 or node.kwargs:
            replacement = None
        if replacement is None and all(a is b for a, b in zip(new_args, args, strict=True)):
            return node
        func = replacement or func
        args = new_args
    return Task(node.key, func, *args, _data_producer=node.data_producer, **node.kwargs)


def stream_node(node: GraphNode, table: dict[int, Any]) -> GraphNode | None:
    """What a :class:`StreamTask` of ``node`` runs, or None if ``node`` is not wrapped.

    A task's transfers are rewritten with ``table`` (:func:`rewrite_transfers`);
    an ``Alias`` runs as it is. None for data, coroutine tasks, an alias of its
    own key and nodes already wrapped. Whether a task is a coroutine is
    ``Task.is_coro``, but a plain function without attributes (such as a
    coroutine marker) is answered by its code flags, and a builtin is none, with
    no Python call: the distributed integration asks once per task on the
    worker's event loop (:meth:`.Execution.prepare`).
    """
    if type(node) is Task or (isinstance(node, Task) and not isinstance(node, StreamTask)):
        func = node.func
        if type(func) is FunctionType and not func.__dict__:
            if func.__code__.co_flags & CO_COROUTINE:
                return None
        elif type(func) is not BuiltinFunctionType and node.is_coro:
            return None
        return rewrite_transfers(node, table)
    if isinstance(node, Alias) and node.target != node.key:
        return node
    return None


def wrap_task(
    node: GraphNode,
    runtime: StreamRuntime,
    registry: EventRegistry,
    critical: bool | None = None,
    rewrites: dict[int, Any] | None = None,
) -> GraphNode:
    """``node`` as a :class:`StreamTask`, which runs it on a pool stream.

    Calls of the backend's upload/download functions inside it become staged
    copies on the copy streams (:func:`rewrite_transfers`). An ``Alias`` runs
    like an identity task, so it gets an event that covers its target's work
    (graph optimization turns most dask.array outputs into aliases: without
    one, their consumers and the final sync would not wait for the target).
    A ``host_task`` waits on the host for its inputs' work first (:class:`HostStreamTask`).
    Other nodes that are not plain synchronous tasks (data, coroutines) and
    nodes already wrapped are returned unchanged, so wrapping is idempotent
    (:func:`stream_node`). ``rewrites``: :func:`transfer_rewrites` of ``runtime``,
    made once for a whole graph (by default, made here).
    """
    if rewrites is None:
        rewrites = transfer_rewrites(runtime)
    inner = stream_node(node, rewrites)
    if inner is None:
        return node
    # A fused task that calls one waits too, as on the launcher (blocks_host), and so does a
    # subclass of Task: its StreamTask's class tells lean_subgraphs whether it calls one.
    cls = HostStreamTask if isinstance(inner, Task) and blocks_host(inner) else StreamTask
    return cls(inner, runtime, registry, critical)


def _add_traceback_shorten_default() -> None:
    """Append :data:`TRACEBACK_SHORTEN` to the default of ``admin.traceback.shorten``."""
    default = dask.config.merge(*dask.config.defaults).get("admin", {}).get("traceback", {})
    default = list(default.get("shorten") or ())
    missing = [p for p in TRACEBACK_SHORTEN if p not in default]
    if missing:
        shorten = [*default, *missing]
        dask.config.update_defaults({"admin": {"traceback": {"shorten": shorten}}})


_add_traceback_shorten_default()
