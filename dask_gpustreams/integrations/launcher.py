"""``scheduler="gpustreams"``: Dask's local scheduler interface over the stream launcher.

``get(dsk, keys)`` converts the graph once (the transfer rewrites, the host
tasks; priorities once they matter, by ``gpustreams.launch-order``), runs it through
:class:`~dask_gpustreams.runtime.launcher.GraphLauncher` from the calling
thread, and returns the wanted values once their events are complete.
Dask's local callbacks (``ProgressBar``, ``Profiler``, ...) see every task,
as on the synchronous scheduler; nested computes inside tasks see none, as
in Dask.
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Iterable, Mapping, MutableMapping, Sequence
from functools import partial
from typing import Any

import dask.config
from dask._task_spec import DataNode, GraphNode, Task, convert_legacy_graph
from dask.callbacks import local_callbacks, normalize_callback, unpack_callbacks
from dask.core import flatten, getcycle
from dask.local import nested_get
from dask.order import order
from dask.utils import key_split

from dask_gpustreams.config import parse_bool
from dask_gpustreams.integrations.subgraphs import lean_subgraphs
from dask_gpustreams.integrations.tasks import blocks_host, rewrite_transfers, transfer_rewrites
from dask_gpustreams.markers import host_task
from dask_gpustreams.runtime import StreamRuntime, acquire_runtime
from dask_gpustreams.runtime.launcher import GraphLauncher
from dask_gpustreams.runtime.ordering import depth_first
from dask_gpustreams.transfers import to_host

#: The name under which :func:`get` is registered in ``dask.base.named_schedulers``.
SCHEDULER_NAME = "gpustreams"

host_task(to_host)  # a download waits for its copy


def launch_plan(
    nodes: Iterable[GraphNode], runtime: StreamRuntime
) -> tuple[dict[Hashable, GraphNode], dict[Hashable, Any], set[Hashable]]:
    """What :class:`GraphLauncher` takes of a graph's task nodes: ``(tasks, dependencies, host)``.

    Transfers are rewritten for ``runtime``'s device, the keys of tasks that
    call a :func:`~dask_gpustreams.host_task` are collected in ``host``, and
    fused tasks run their inner tasks without ``dask.order``
    (:func:`~dask_gpustreams.integrations.subgraphs.lean_subgraphs`).
    """
    table = transfer_rewrites(runtime)
    tasks: dict[Hashable, GraphNode] = {}
    dependencies: dict[Hashable, Any] = {}
    host: set[Hashable] = set()
    for node in nodes:
        key = node.key
        if isinstance(node, Task):
            node = rewrite_transfers(node, table)
            calls_host = blocks_host(node)
            if calls_host:
                host.add(key)
            node = lean_subgraphs(node, calls_host)
        tasks[key] = node
        dependencies[key] = node.dependencies
    return tasks, dependencies, host


class DaskCallbacks:
    """Dask's local callbacks, fed by the launcher with a state like ``get_async``'s.

    ``start(dsk)`` runs before the graph is read, as in ``get_async``, so that a
    callback may still change it (``dask.cache.Cache`` does).
    """

    def __init__(self, callbacks: Sequence[tuple]):
        self._starts, self._start_states, self._pre, self._post, self._finishes = unpack_callbacks(
            callbacks
        )
        self.dsk: Mapping = {}
        self.state: dict[str, Any] = {}

    def start(self, dsk: Mapping) -> None:
        self.dsk = dsk
        for start in self._starts:
            start(dsk)

    def start_state(self, deps: Mapping, results: dict) -> None:
        dependents: dict = {k: set() for k in deps}
        for key, ds in deps.items():
            for d in ds:
                dependents.setdefault(d, set()).add(key)
        self.state = {
            "dependencies": deps,
            "dependents": dependents,
            "waiting": {k: set(v) for k, v in deps.items() if v},
            "waiting_data": {},
            "ready": [k for k, v in deps.items() if not v],
            "running": set(),
            "finished": set(),
            "released": set(),
            "cache": results,
        }
        for start_state in self._start_states:
            start_state(self.dsk, self.state)

    def pretask(self, key: Hashable) -> None:
        state = self.state
        if state["waiting"].pop(key, None) is None:
            with contextlib.suppress(ValueError):
                state["ready"].remove(key)
        state["running"].add(key)
        for f in self._pre:
            f(key, self.dsk, state)

    def posttask(self, key: Hashable, result: Any, worker: int) -> None:
        state = self.state
        state["running"].discard(key)
        state["finished"].add(key)
        for f in self._post:
            f(key, result, self.dsk, state, worker)

    def finish(self, errored: bool) -> None:
        for f in self._finishes:
            f(self.dsk, self.state, errored)


def get(
    dsk: Mapping,
    keys: Sequence[Hashable] | Hashable,
    cache: MutableMapping | None = None,
    callbacks: Sequence[Any] | None = None,
    *,
    host_threads: bool = True,
    rerun_exceptions_locally: bool | None = None,
    **kwargs: Any,
):
    """Compute ``keys`` of ``dsk`` on the stream launcher (``scheduler="gpustreams"``).

    Settings come from ``gpustreams.*`` in dask's config (``gpustreams.enabled``
    is not needed: choosing this scheduler is the switch). ``callbacks`` are
    Dask callback tuples used instead of the active ones, as in ``get_async``.
    ``rerun_exceptions_locally`` (else Dask's config of that name, as ``get_async``
    reads it): a host task that raised on a host thread runs again on the calling
    thread, whose exception is raised (so a debugger's post-mortem stops there).
    Other keyword arguments of Dask's local schedulers (``num_workers``,
    ``pool``, ...) are accepted and ignored: one thread launches, host tasks
    use the runtime's host threads, or, with ``host_threads=False``, run on the
    launching thread too (Dask's synchronous scheduler by name while enabled:
    :func:`~dask_gpustreams.integrations.local.sync_get`).
    """
    # Not needed here, but a bad value is an error on every route, as the other keys are
    # (an unknown key too: the runtime's settings raise it, so no warning of it here).
    parse_bool("enabled", dask.config.get("gpustreams.enabled", False))
    if not isinstance(dsk, Mapping):
        dsk = dsk.__dask_graph__()
    dsk = convert_legacy_graph(dsk)
    if cache is None:  # as get_async: the caller's cache (or the config's) gets the results
        cache = dask.config.get("cache", None)
    if rerun_exceptions_locally is None:
        rerun_exceptions_locally = dask.config.get("rerun_exceptions_locally", False)
    rerun = bool(rerun_exceptions_locally)
    runtime = acquire_runtime()  # held until the graph ends, so it is not closed meanwhile
    try:
        # Dask's own local_callbacks: the global callbacks are this compute's, and a compute
        # that a task starts meanwhile sees none of them, as in get_async.
        with local_callbacks(callbacks) as active:
            return _launch(runtime, dsk, keys, cache, active, host_threads, rerun)
    finally:
        runtime.release()


def needed_keys(dsk: Mapping, outputs: Iterable[Hashable]) -> set[Hashable] | None:
    """The keys of ``dsk`` that ``outputs`` depend on, themselves included (as in Dask's
    ``get_async``, a compute runs no task that its keys do not need); None if that is every
    key: no key that nothing reads is unwanted (a graph Dask's optimization culled)."""
    wanted = set(outputs)
    read = set().union(*(node.dependencies for node in dsk.values()))
    if wanted.issuperset(dsk.keys() - read):
        return None
    needed: set[Hashable] = set()
    stack = list(wanted)
    while stack:
        key = stack.pop()
        if key not in needed and key in dsk:
            needed.add(key)
            stack.extend(dsk[key].dependencies)
    return needed


def _launch(
    runtime: StreamRuntime,
    dsk: Mapping,
    keys: Sequence[Hashable] | Hashable,
    cache: MutableMapping | None,
    callbacks: Sequence[Any],
    host_threads: bool,
    rerun: bool,
):
    """Run the graph with Dask's callbacks around it: each callback's finish is called
    however the compute ends, as in ``get_async``."""
    hooks = None
    if callbacks:
        hooks = DaskCallbacks([normalize_callback(cb) for cb in callbacks])
        hooks.start(dsk)
        if not all(isinstance(v, GraphNode) for v in dsk.values()):
            # A start callback may put values in the graph (dask.cache.Cache does).
            dsk = {k: v if isinstance(v, GraphNode) else DataNode(k, v) for k, v in dsk.items()}
    errored = True
    try:
        results = _run(runtime, dsk, keys, cache, hooks, host_threads, rerun)
        errored = False
    finally:
        if hooks is not None:
            hooks.finish(errored)
    return nested_get(keys, results)


def _run(
    runtime: StreamRuntime,
    dsk: Mapping,
    keys: Sequence[Hashable] | Hashable,
    cache: MutableMapping | None,
    hooks: DaskCallbacks | None,
    host_threads: bool,
    rerun: bool,
) -> MutableMapping:
    """Launch what ``keys`` need of ``dsk``; return the results (``cache``, if given);
    ``rerun``: see :class:`GraphLauncher`'s ``rerun_locally``."""
    outputs = list(flatten(keys)) if isinstance(keys, list) else [keys]
    values: MutableMapping = {} if cache is None else cache
    needed = needed_keys(dsk, outputs)
    nodes = []
    for key, node in dsk.items():
        if needed is not None and key not in needed:
            continue
        if isinstance(node, DataNode):
            values[key] = node.value
        else:
            nodes.append(node)
    if needed is not None:
        # Dask's order raises for a cycle anywhere in the graph, needed or not.
        cycle = getcycle(dsk, [k for k in dsk if k not in needed])
        if cycle:
            raise RuntimeError(
                "Cycle detected between the following keys:\n  -> "
                + "\n  -> ".join(map(str, cycle))
            )
    tasks, dependencies, host = launch_plan(nodes, runtime)
    if hooks is not None:
        hooks.start_state(dependencies, values)
    # dask.order's ranks also for a run one task at a time, as Dask's synchronous scheduler
    # (after a retry that ran out of device memory): computed only then.
    sync_priority = partial(order, dsk)
    if runtime.config.launch_order == "dask":
        priority = sync_priority
    else:
        priority = partial(depth_first, dependencies, outputs)
    launcher = GraphLauncher(
        runtime,
        tasks,
        dependencies,
        priority,
        outputs,
        values,
        host,
        key_split,
        hooks,
        host_threads=host_threads,
        sync_priority=sync_priority,
        rerun_locally=rerun,
    )
    with runtime.isolated():  # the caller's thread: as it was after the compute
        return launcher.run()
