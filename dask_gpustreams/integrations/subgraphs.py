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
value. :func:`subgraph_plan` walks the inner graph depth first from the output,
visiting dependencies in the inner graph's own order (so the plan does not
depend on the hash seed), and notes after which task each value is read for
the last time; :func:`run_subgraph` runs such a plan and drops each value then,
as ``execute_graph`` does. A chain keeps one intermediate at a time; a wider
inner graph may hold one value more at its peak than in ``dask.order``'s order.

An inner task that calls a :func:`~dask_gpustreams.host_task` and reads a value made
by an inner task of its own fused task (``map_blocks(f)`` after a kernel, fused into
one task) runs after a host wait for the work its task's stream has queued so far
(:class:`HostStep`): the host wait made before the fused task covers only its inputs
from outside, and ``f`` would read the inner kernels' outputs unwritten. A ``host_task``
on a task nested in its own arguments waits after that task (:class:`AfterStream`),
inside a fused task too: that one wait covers the inner kernels before it as well. A
fused task nested in another task's arguments runs its plan too, where each inner task
that calls a ``host_task`` waits (:class:`HostStep`), whatever it reads: no host wait
covered that fused task's inputs either.

The routes that run tasks on streams use it (:func:`lean_subgraphs`): the
launcher's and stream blocks' launch plans, and the stream tasks of Dask's
threaded scheduler and of distributed's workers, in the task's own thread
(:class:`~dask_gpustreams.integrations.tasks.StreamTask`). Each tells it whether
the task calls a ``host_task`` (``blocks_host``, which the routes also read to wait
for the task's inputs): a task that calls none is not searched for a host wait, a cost
per task. With the plugin off, and for a block that runs on the host, Dask's
``_execute_subgraph`` runs.
"""

from __future__ import annotations

import copy
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

from dask._task_spec import GraphNode, Task, _execute_subgraph

from dask_gpustreams.markers import is_host_task
from dask_gpustreams.runtime.context import active_task
from dask_gpustreams.transfers import to_host

#: One inner task of a plan: its key, its node and the values to drop after it.
Step = tuple[Hashable, GraphNode, tuple[Hashable, ...]]


def subgraph_plan(
    inner: Mapping[Hashable, GraphNode], outkey: Hashable, host: bool = True, nested: bool = False
) -> tuple[Step, ...]:
    """The inner tasks that ``outkey`` needs, each after its inner dependencies (depth
    first, dependencies in ``inner``'s order), with the values read for the last time.
    ``host``: whether an inner task may call a ``host_task``; if not, none is searched
    for one (:class:`HostStep`). ``nested``: the fused task is nested in another task's
    arguments, so its inputs from outside got no host wait either: each inner task that
    calls a ``host_task`` waits, whatever it reads."""
    position = {k: i for i, k in enumerate(inner)}
    order: list[Hashable] = []
    uses: dict[Hashable, int] = {}  # dependency -> inner tasks that read it
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
        deps = inner[key].dependencies
        for d in deps:
            uses[d] = uses.get(d, 0) + 1
        # Pushed last first, so popped (visited) in inner's order.
        for d in sorted((d for d in deps if d in position), key=position.__getitem__)[::-1]:
            if d not in seen:
                stack.append((d, False))
    steps = []
    for key in order:
        node = inner[key]
        if host and _reads_own_kernels(node, position, nested):
            node = HostStep(node)
        drops = []
        for d in node.dependencies:
            uses[d] -= 1
            if not uses[d]:
                drops.append(d)
        steps.append((key, node, tuple(drops)))
    return tuple(steps)


class HostStep:
    """An inner task of a plan that calls a ``host_task`` and reads inner values (any
    values, in the plan of a fused task nested in another task's arguments): it runs
    after a host wait for the work its task's stream has queued so far (the inner
    kernels that made them), and raises that work's error instead of running on it."""

    __slots__ = ("node",)

    def __init__(self, node: GraphNode):
        self.node = node

    @property
    def dependencies(self) -> frozenset:
        return self.node.dependencies

    def __call__(self, values: Mapping[Hashable, Any]) -> Any:
        _wait_own_stream()
        return self.node(values)

    def __repr__(self) -> str:
        return f"HostStep({self.node!r})"


def _reads_own_kernels(node: GraphNode, inner: Mapping[Hashable, Any], nested: bool) -> bool:
    """Whether inner task ``node`` calls a ``host_task`` on values of ``inner``'s tasks (on
    any value, where its fused task is ``nested`` in another's arguments), with no host
    wait of its own: an :class:`AfterStream` task waits after its nested tasks, for all
    its stream's work, theirs and the inner tasks' before it."""
    if isinstance(node, Task) and type(node.func) is AfterStream:
        return False
    return _calls_host(node) and (nested or any(d in inner for d in node.dependencies))


def _calls_host(node: Any) -> bool:
    """Whether ``node`` calls a ``host_task``, also inside a fused task's plan; the
    runtime's own downloads (``to_host``) are left out: each orders its copy after its
    stream's work itself."""
    if isinstance(node, HostStep):
        return True
    if not isinstance(node, Task):
        return False
    if node.func is run_subgraph:
        return any(_calls_host(n) for _, n, _ in node.args[0])
    if type(node.func) is AfterStream:
        return True
    return is_host_task(node.func) and node.func is not to_host


class AfterStream:
    """The function of a task that calls a ``host_task`` on values made by tasks nested in
    its own arguments (``Task(k, f, Task(None, g, ...))``): ``Task`` runs those first, on
    the task's stream, so ``f`` runs after a host wait for that stream's work, as a
    :class:`HostStep` does."""

    __slots__ = ("func",)

    def __init__(self, func: Any):
        self.func = func

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        _wait_own_stream()
        return self.func(*args, **kwargs)

    def __repr__(self) -> str:
        return f"AfterStream({self.func!r})"


def _wait_own_stream() -> None:
    """Wait on the host for the work the running task's stream has queued; raise its error."""
    runtime, stream, _ = active_task()
    if runtime is not None and stream is not None:
        error = runtime.wait_stream(stream)
        if error is not None:
            raise error.with_traceback(None)


def _wraps(node: Task, nested: bool) -> bool:
    """Whether ``node`` calls a ``host_task`` (not ``to_host``) on values made on its task's
    stream: on a task nested in its arguments (``Task(k, f, Task(None, g))``), or, being
    nested in another's (``nested``: ``Task(k, g, Task(None, f, ...))``, a legacy graph's
    ``(g, (f, ...))``), whatever its arguments: its inputs' work, ``g``'s task's, got no
    host wait either, as ``g`` is no ``host_task``. A fused task nested in another's
    arguments does if one of its inner tasks does, or a task nested in one: its inner
    tasks run in its call, after no host wait of theirs (:func:`_after_stream`)."""
    func = node.func
    if func is _execute_subgraph:
        return nested and any(
            isinstance(t, Task) and _wants_wait(t, True) for t in node.args[0].values()
        )
    if type(func) is AfterStream or func is to_host or not is_host_task(func):
        return False
    return nested or any(isinstance(a, Task) for a in (*node.args, *node.kwargs.values()))


def _wants_wait(node: Task, nested: bool) -> bool:
    """Whether ``node`` or a task nested in its arguments, at any depth, :func:`_wraps`: a
    scan that copies nothing (most tasks that nest others call no ``host_task``)."""
    if _wraps(node, nested):
        return True
    for a in node.args:  # a loop, not any(): per task with a nested one
        if isinstance(a, Task) and _wants_wait(a, True):
            return True
    kwargs = node.kwargs
    return bool(kwargs) and any(
        isinstance(v, Task) and _wants_wait(v, True) for v in kwargs.values()
    )


def _after_stream(node: Task, nested: bool) -> Task:
    """A copy of ``node`` (of its own class: a ``List``, a ``Dict``; its dependencies
    unchanged) where each task that :func:`_wraps` calls its function after a host wait
    for its task's stream (:class:`AfterStream`), and each fused task that does runs its
    plan (:func:`run_subgraph`), where each inner task that calls a ``host_task`` waits
    (:class:`HostStep`); for a ``node`` that :func:`_wants_wait`."""
    new = copy.copy(node)
    new.args = tuple(
        _after_stream(a, True) if isinstance(a, Task) and _wants_wait(a, True) else a
        for a in node.args
    )
    if node.kwargs:
        new.kwargs = {
            k: _after_stream(v, True) if isinstance(v, Task) and _wants_wait(v, True) else v
            for k, v in node.kwargs.items()
        }
    if _wraps(node, nested):
        if node.func is _execute_subgraph:
            new.func = run_subgraph
            new.args = (_lean_plan(node.args[0], node.args[1], True, True), *new.args[1:])
        else:
            new.func = AfterStream(node.func)
    new._token = new._repr = None
    return new


def run_subgraph(
    plan: Sequence[Step], outkey: Hashable, inkeys: Sequence[Hashable], *dependencies: Any
) -> Any:
    """What ``_execute_subgraph`` returns for the inner graph of ``plan``
    (:func:`subgraph_plan`): the value of ``outkey`` given the values of ``inkeys``."""
    values = dict(zip(inkeys, dependencies, strict=False))  # as Dask: zip, unchecked
    for key, node, drops in plan:
        values[key] = node(values)
        for d in drops:
            del values[d]
    return values[outkey]


def _lean_plan(
    inner: Mapping[Hashable, GraphNode], outkey: Hashable, host: bool, nested: bool
) -> tuple[Step, ...]:
    """:func:`subgraph_plan` of a fused task's ``inner`` graph, each inner task lean
    (:func:`lean_subgraphs`) first."""
    return subgraph_plan(
        {k: lean_subgraphs(v, host) for k, v in inner.items()}, outkey, host, nested
    )


def lean_subgraphs(node: GraphNode, host: bool) -> GraphNode:
    """``node`` running its plan with :func:`run_subgraph` where it, or a task fused inside
    it, calls ``_execute_subgraph``; a ``host_task`` on a task nested in its arguments, or
    nested in another task's, after a host wait for its stream (:class:`AfterStream`), and
    a fused task nested in arguments that calls one running its plan, where each inner task
    that calls one waits (:class:`HostStep`); else ``node`` itself.

    ``host``: whether ``node`` calls a ``host_task``, also inside a fused task (what
    ``blocks_host`` says, or True); if not, a fused task's steps are not searched for a
    host wait (:class:`HostStep`). Tasks nested in arguments are searched whenever there
    are any: ``blocks_host`` reads a task's own function only."""
    if not isinstance(node, Task):
        return node
    if node.func is not _execute_subgraph:
        # Only a task with a task nested in it may call a host_task that needs the wait (an
        # Alias, DataNode or TaskRef argument queues no work on the stream); a Task subclass
        # too (a List or Dict node, such as delayed([...]) makes): copied of its own class.
        for a in node.args:  # a loop, not any(): this runs for every task
            if isinstance(a, Task):
                return _after_stream(node, False) if _wants_wait(node, False) else node
        if node.kwargs:
            for v in node.kwargs.values():
                if isinstance(v, Task):
                    return _after_stream(node, False) if _wants_wait(node, False) else node
        return node
    inner, outkey, *rest = node.args
    plan = _lean_plan(inner, outkey, host, False)
    return Task(
        node.key,
        run_subgraph,
        plan,
        outkey,
        *rest,
        _data_producer=node.data_producer,
        **node.kwargs,
    )
