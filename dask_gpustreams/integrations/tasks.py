"""Wrapping dask ``Task`` nodes so they run through the stream runtime (shared by integrations)."""

from __future__ import annotations

import functools
from collections.abc import Hashable
from typing import Any

from dask._task_spec import Alias, GraphNode, Task, TaskRef, _execute_subgraph

from dask_gpustreams.runtime import EventRegistry, StreamRuntime
from dask_gpustreams.transfers import to_device, to_host


class OnStream:
    """The function of a wrapped task: runs the original node through the runtime."""

    __slots__ = ("runtime", "registry", "node", "dep_keys", "critical")

    def __init__(
        self,
        runtime: StreamRuntime,
        registry: EventRegistry,
        node: GraphNode,
        dep_keys: tuple[Hashable, ...],
        critical: bool | None,
    ):
        self.runtime = runtime
        self.registry = registry
        self.node = node
        self.dep_keys = dep_keys
        self.critical = critical

    def __call__(self, *values: Any) -> Any:
        inputs = dict(zip(self.dep_keys, values, strict=True))
        return self.runtime.run(self.node.key, self.node, inputs, self.registry, self.critical)

    def __repr__(self) -> str:
        return f"OnStream({self.node!r})"

    def __reduce__(self):
        # Pickled for another process (the multiprocessing scheduler): streams and
        # events stay here, so the task runs there as it would without the plugin.
        return (Unwrapped, (self.node, self.dep_keys))


class Unwrapped:
    """A wrapped task's function once it left the process: the original node, no stream."""

    __slots__ = ("node", "dep_keys")

    def __init__(self, node: GraphNode, dep_keys: tuple[Hashable, ...]):
        self.node = node
        self.dep_keys = dep_keys

    def __call__(self, *values: Any) -> Any:
        return self.node(dict(zip(self.dep_keys, values, strict=True)))


@functools.cache
def transfer_rewrites(backend: type) -> dict[int, Any]:
    """``id(f) -> replacement`` for the upload and download functions of a backend class."""
    table = {id(f): to_device for f in backend.upload_functions}
    table.update({id(f): to_host for f in backend.download_functions})
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
        new_args = tuple(rewrite_transfers(a, table) for a in args)
        # Only the plain one-argument call: other arguments (dtype, order, stream, out)
        # keep their meaning with the original function.
        replacement = table.get(id(func)) if len(args) == 1 and not node.kwargs else None
        if replacement is None and all(a is b for a, b in zip(new_args, args, strict=True)):
            return node
        func = replacement or func
        args = new_args
    return Task(node.key, func, *args, _data_producer=node.data_producer, **node.kwargs)


def wrap_task(
    node: GraphNode,
    runtime: StreamRuntime,
    registry: EventRegistry,
    critical: bool | None = None,
) -> GraphNode:
    """``node`` as a Task that runs it on a pool stream, keeping its key and dependencies.

    Calls of the backend's upload/download functions inside it become staged
    copies on the copy streams (:func:`rewrite_transfers`). An ``Alias`` runs
    like an identity task, so it gets an event that covers its target's work
    (graph optimization turns most dask.array outputs into aliases: without
    one, their consumers and the final sync would not wait for the target).
    Other nodes that are not plain synchronous tasks (data, coroutines) and
    nodes already wrapped are returned unchanged, so wrapping is idempotent.
    """
    if isinstance(node, Alias) and node.target != node.key:
        return Task(
            node.key,
            OnStream(runtime, registry, node, (node.target,), critical),
            TaskRef(node.target),
            _data_producer=node.data_producer,
        )
    if not isinstance(node, Task) or isinstance(node.func, OnStream) or node.is_coro:
        return node
    node = rewrite_transfers(node, transfer_rewrites(type(runtime.backend)))
    dep_keys = tuple(node.dependencies)
    return Task(
        node.key,
        OnStream(runtime, registry, node, dep_keys, critical),
        *(TaskRef(d) for d in dep_keys),
        _data_producer=node.data_producer,
    )
