"""Wrapping dask ``Task`` nodes so they run through the stream runtime (shared by integrations)."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from dask._task_spec import GraphNode, Task, TaskRef

from dask_gpustreams.runtime import EventRegistry, StreamRuntime


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


def wrap_task(
    node: GraphNode,
    runtime: StreamRuntime,
    registry: EventRegistry,
    critical: bool | None = None,
) -> GraphNode:
    """``node`` as a Task that runs it on a pool stream, keeping its key and dependencies.

    Nodes that are not plain synchronous tasks (data, aliases, coroutines) and
    nodes already wrapped are returned unchanged, so wrapping is idempotent.
    """
    if not isinstance(node, Task) or isinstance(node.func, OnStream) or node.is_coro:
        return node
    dep_keys = tuple(node.dependencies)
    return Task(
        node.key,
        OnStream(runtime, registry, node, dep_keys, critical),
        *(TaskRef(d) for d in dep_keys),
        _data_producer=node.data_producer,
    )
