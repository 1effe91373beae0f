"""A launch order for ready tasks that costs 1-2 us a key.

The launcher ranks ready tasks only once more are ready than a round takes
(:class:`~dask_gpustreams.runtime.launcher.ReadyTasks`). ``dask.order`` ranks the
benchmark suite's graphs at 6-22 us a key (``benchmarks/probes/probe_order_cost``
on a CPU machine), about as much as the rest of a no-op task's launch, so a graph
of short kernels was launched at ``dask.order``'s pace. :func:`depth_first`
ranks tasks in the post-order of a depth-first walk from the outputs: each
output's inputs are launched, then it, before the next output's. It is the
order of ``gpustreams.launch-order: depth-first``, not the default: where one
chunk feeds two subtrees (``x.max() - x.min()``: each chunk's ``max`` and
``min``), the second consumer ranks only after the whole first subtree, so every
such chunk is held until then, where ``dask.order`` runs both consumers soon
after the chunk. On trees and chains (a chunk read by one subtree) its
intermediates' consumers come soon after them too.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Iterable, Mapping


def depth_first(
    dependencies: Mapping[Hashable, Collection[Hashable]], outputs: Iterable[Hashable]
) -> dict[Hashable, int]:
    """``key -> rank`` of every key of ``dependencies`` (lower first).

    Ranks follow the post-order of a depth-first walk from each of ``outputs``
    in turn, a task's inputs visited in the order of ``dependencies`` (the
    graph's), so the ranks do not depend on set order or the hash seed. Keys
    that no output reaches rank last, in that order too. Inputs that are not
    keys of ``dependencies`` (values known before) are not ranked; a cycle is
    walked once and left for the launcher to report.
    """
    position = {key: i for i, key in enumerate(dependencies)}
    ranks: dict[Hashable, int] = {}
    entered: set[Hashable] = set()
    for root in (*outputs, *dependencies):
        if root in entered or root not in position:
            continue
        entered.add(root)
        stack = [(root, _inputs(dependencies[root], position))]
        while stack:
            key, inputs = stack[-1]
            for d in inputs:
                if d not in entered:
                    entered.add(d)
                    stack.append((d, _inputs(dependencies[d], position)))
                    break
            else:
                stack.pop()
                ranks[key] = len(ranks)
    return ranks


def _inputs(deps: Collection[Hashable], position: Mapping[Hashable, int]) -> Iterable[Hashable]:
    """The inputs of ``deps`` that are tasks, in graph order, as an iterator."""
    if len(deps) < 2:
        return iter([d for d in deps if d in position])
    return iter(sorted((d for d in deps if d in position), key=position.__getitem__))
