"""Fused tasks that run their inner tasks without ordering them with ``dask.order``.

Graph optimization fuses chains of blockwise tasks into one task that calls
``dask._task_spec._execute_subgraph(inner, outkey, inkeys, *values)``. That runs
``execute_graph``, which orders the few inner tasks with ``dask.order`` at every
call. On the H200 (``benchmarks/results/h200-diag-0453abb/profile.txt``) the
8,194 calls of ``order`` inside the fused tasks of the rechunk workload took 2.6
of the launcher's 5.8 profiled seconds: more than the tasks' CuPy calls.

A fused task's inner graph has one output, and every inner task is an ancestor
of it; the inner tasks are Dask tasks, pure functions of their inputs. So any
order that runs each inner task after its inner dependencies computes the same
value. :func:`execute_subgraph` walks the inner graph depth first from the
output, which keeps a chain's intermediates to one at a time, and drops each
value after its last use, as ``execute_graph`` does.

Every route of the plugin runs fused tasks this way (:func:`lean_subgraphs`): the
launcher's and stream blocks' launch plans, and the tasks it wraps for Dask's
threaded scheduler and distributed's workers. With the plugin off, Dask's own
``_execute_subgraph`` runs.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any

from dask._task_spec import GraphNode, Task, _execute_subgraph


def execute_subgraph(
    inner: Mapping[Hashable, GraphNode],
    outkey: Hashable,
    inkeys: Sequence[Hashable],
    *dependencies: Any,
) -> Any:
    """What ``_execute_subgraph`` returns for the same arguments: the value of ``outkey``
    in ``inner``, given the values of ``inkeys``, with the inner tasks in depth-first order."""
    values = dict(zip(inkeys, dependencies, strict=False))  # as Dask: zip, unchecked
    order: list[Hashable] = []
    uses: dict[Hashable, int] = {}  # inner dependency -> inner tasks that read it
    stack: list[tuple[Hashable, bool]] = [(outkey, False)]
    seen: set[Hashable] = set()
    while stack:
        key, expanded = stack.pop()
        if expanded:
            order.append(key)  # after all its dependencies (a DAG: none is in progress)
            continue
        if key in seen:
            continue
        seen.add(key)
        stack.append((key, True))
        for d in inner[key].dependencies:
            uses[d] = uses.get(d, 0) + 1
            if d in inner and d not in seen:
                stack.append((d, False))
    for key in order:
        node = inner[key]
        values[key] = node(values)
        for d in node.dependencies:
            n = uses[d] - 1
            if n:
                uses[d] = n
            else:
                del values[d]
    return values[outkey]


def lean_subgraphs(node: GraphNode) -> GraphNode:
    """``node`` calling :func:`execute_subgraph` where it, or a task fused inside it, calls
    ``_execute_subgraph``; ``node`` itself when it fuses nothing."""
    if not isinstance(node, Task) or node.func is not _execute_subgraph:
        return node
    inner, *rest = node.args
    inner = {k: lean_subgraphs(v) for k, v in inner.items()}
    return Task(
        node.key, execute_subgraph, inner, *rest, _data_producer=node.data_producer, **node.kwargs
    )
