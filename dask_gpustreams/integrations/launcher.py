"""``scheduler="gpustreams"``: Dask's local scheduler interface over the stream launcher.

``get(dsk, keys)`` converts the graph once (dask.order priorities, the
transfer rewrites, the host tasks), runs it through
:class:`~dask_gpustreams.runtime.launcher.GraphLauncher` from the calling
thread, and returns the wanted values once their events are complete.
Dask's local callbacks (``ProgressBar``, ``Profiler``, ...) see every task,
as on the synchronous scheduler; nested computes inside tasks see none, as
in Dask.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any

from dask._task_spec import DataNode, Task, _execute_subgraph, convert_legacy_graph
from dask.callbacks import Callback, unpack_callbacks
from dask.core import flatten
from dask.local import nested_get
from dask.order import order
from dask.utils import key_split

from dask_gpustreams.integrations.local import hook
from dask_gpustreams.integrations.tasks import rewrite_transfers, transfer_rewrites
from dask_gpustreams.markers import host_task, is_host_task
from dask_gpustreams.runtime import get_runtime
from dask_gpustreams.runtime.context import task_state
from dask_gpustreams.runtime.launcher import GraphLauncher
from dask_gpustreams.transfers import to_host

#: The name under which :func:`get` is registered in ``dask.base.named_schedulers``.
SCHEDULER_NAME = "gpustreams"

host_task(to_host)  # a download waits for its copy


def blocks_host(node: Task) -> bool:
    """Whether ``node`` calls a :func:`~dask_gpustreams.host_task` (also inside a fused task)."""
    if node.func is _execute_subgraph:
        return any(isinstance(t, Task) and blocks_host(t) for t in node.args[0].values())
    return is_host_task(node.func)


class DaskCallbacks:
    """Dask's local callbacks, fed by the launcher with a state like ``get_async``'s."""

    def __init__(self, callbacks: Sequence[tuple], dsk: Mapping, deps: Mapping, results: dict):
        self.dsk = dsk
        starts, start_states, self._pre, self._post, self._finishes = unpack_callbacks(callbacks)
        self.state: dict[str, Any] = {
            "dependencies": deps,
            "dependents": {},
            "waiting": {k: set(v) for k, v in deps.items()},
            "waiting_data": {},
            "ready": [],
            "running": set(),
            "finished": set(),
            "released": set(),
            "cache": results,
        }
        for start in starts:
            start(dsk)
        for start_state in start_states:
            start_state(dsk, self.state)

    def pretask(self, key: Hashable) -> None:
        state = self.state
        state["waiting"].pop(key, None)
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


def get(dsk: Mapping, keys: Sequence[Hashable] | Hashable, cache: Mapping | None = None, **kwargs):
    """Compute ``keys`` of ``dsk`` on the stream launcher (``scheduler="gpustreams"``).

    Settings come from ``gpustreams.*`` in dask's config (``gpustreams.enabled``
    is not needed: choosing this scheduler is the switch). Other keyword
    arguments of Dask's local schedulers (``num_workers``, ``pool``, ...) are
    accepted and ignored: one thread launches, host tasks use the runtime's
    host threads.
    """
    if not isinstance(dsk, Mapping):
        dsk = dsk.__dask_graph__()
    dsk = convert_legacy_graph(dsk)
    runtime = get_runtime()
    wanted = set(flatten(keys)) if isinstance(keys, list) else {keys}
    table = transfer_rewrites(type(runtime.backend))
    values: dict = dict(cache or {})
    tasks: dict = {}
    dependencies: dict = {}
    host: set = set()
    for key, node in dsk.items():
        if isinstance(node, DataNode):
            values[key] = node.value
            continue
        if isinstance(node, Task):
            node = rewrite_transfers(node, table)
            if blocks_host(node):
                host.add(key)
        tasks[key] = node
        dependencies[key] = node.dependencies
    hooks = None
    if Callback.active and not getattr(task_state, "launching", False):
        active = [cb for cb in Callback.active if cb != hook._callback]
        if active:
            hooks = DaskCallbacks(active, dsk, dependencies, values)
    launcher = GraphLauncher(
        runtime, tasks, dependencies, order(dsk), wanted, values, host, key_split, hooks
    )
    errored = True
    try:
        results = launcher.run()
        errored = False
    finally:
        if hooks is not None:
            hooks.finish(errored)
    return nested_get(keys, results)
