"""Critical-path policy: tasks on a longest path of the graph get high-priority streams."""

from __future__ import annotations

import graphlib
from collections.abc import Hashable, Iterable, Mapping

from dask_gpustreams.runtime.policies.base import (
    StreamPolicy,
    TaskInfo,
    least_loaded,
    register_policy,
)
from dask_gpustreams.runtime.pool import PoolView, StreamSlot


@register_policy
class CriticalPath(StreamPolicy):
    """Critical tasks first on high-priority streams; the rest on the others.

    A quarter of the pool (at least one stream, and at least one left over)
    is created with the device's top priority, so the GPU schedules the blocks
    of critical kernels first when both kinds are queued. A critical task takes
    the least-loaded stream of the whole pool, high-priority streams winning
    ties, so a graph that is mostly critical still spreads; other tasks keep
    to the normal streams. Without graph knowledge (``critical`` is None, as
    on distributed workers) every task takes the least-loaded stream.
    """

    name = "critical-path"
    needs_critical_path = True

    def high_priority_streams(self, n_streams: int) -> int:
        return max(1, n_streams // 4) if n_streams > 1 else 0

    def select(self, task: TaskInfo, pool: PoolView) -> StreamSlot:
        slots = pool.slots
        n_high = pool.n_high_priority
        if n_high == 0 or task.critical is None or task.critical:
            return least_loaded(pool, slots)
        return least_loaded(pool, slots[n_high:])


def critical_keys(dependencies: Mapping[Hashable, Iterable[Hashable]]) -> set[Hashable]:
    """Keys on a longest dependency path of the graph (depth + height == path length).

    ``dependencies`` maps every key to the keys it depends on (keys outside
    the mapping are ignored). Linear in the size of the graph.
    """
    deps = {k: [d for d in v if d in dependencies] for k, v in dependencies.items()}
    dependents: dict[Hashable, list[Hashable]] = {k: [] for k in deps}
    for k, ds in deps.items():
        for d in ds:
            dependents[d].append(k)
    order = graphlib.TopologicalSorter(deps).static_order()
    topo = list(order)
    depth: dict[Hashable, int] = {}
    for k in topo:
        depth[k] = 1 + max((depth[d] for d in deps[k]), default=0)
    height: dict[Hashable, int] = {}
    for k in reversed(topo):
        height[k] = 1 + max((height[d] for d in dependents[k]), default=0)
    longest = max(depth.values(), default=0)
    return {k for k in topo if depth[k] + height[k] - 1 == longest}
