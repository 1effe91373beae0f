"""A launch order for ready tasks that costs under 5 us a key.

The launcher ranks ready tasks only once more are ready than a round takes
(:class:`~dask_gpustreams.runtime.launcher.ReadyTasks`). ``dask.order`` ranks the
benchmark suite's graphs at 6-22 us a key (``benchmarks/probes/probe_order_cost``
on a CPU machine), about as much as the rest of a no-op task's launch, so a graph
of short kernels was launched at ``dask.order``'s pace. :func:`depth_first`
ranks tasks in the post-order of a depth-first walk from the outputs: each
output's inputs are launched, then it, before the next output's.

A walk alone holds too much where one chunk feeds two subtrees
(``x.max() - x.min()``: each chunk's ``max`` and ``min``): the second consumer
would rank only after the whole first subtree, so every chunk would be held
until then. So a task whose inputs are all ranked ranks at once, out of the
walk's turn, when it is the last consumer of one of them: it lets that input go.
Tasks that only share an input (a matmul's products of one row) still wait for
the walk, so they are not launched, and held, ahead of their consumers. The rule
does not know sizes: a last reader whose output is larger than the input it lets
go (an expansion), and whose consumer waits for another subtree, is held longer
than the walk alone would hold its input (docs/launcher.md).
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Iterable, Mapping


def depth_first(
    dependencies: Mapping[Hashable, Collection[Hashable]], outputs: Iterable[Hashable]
) -> dict[Hashable, int]:
    """``key -> rank`` of every key of ``dependencies`` (lower first).

    Ranks follow the post-order of a depth-first walk from each of ``outputs``
    in turn, a task's inputs visited in the order of ``dependencies`` (the
    graph's), so the ranks do not depend on set order or the hash seed; a
    task that is the last unranked consumer of an input ranks as soon as all
    its inputs have. Keys that no output reaches rank last, in that order too.
    Inputs that are not keys of ``dependencies`` (values known before) are not
    ranked; a cycle is walked once and left for the launcher to report.
    """
    return _Walk(dependencies).ranks(outputs)


class _Walk:
    """One graph's ranking: the walk's stack, and the counts that free inputs early."""

    def __init__(self, dependencies: Mapping[Hashable, Collection[Hashable]]):
        position = {key: i for i, key in enumerate(dependencies)}
        inputs: dict[Hashable, list[Hashable]] = {}
        dependents: dict[Hashable, list[Hashable]] = {key: [] for key in dependencies}
        for key, deps in dependencies.items():
            found = [d for d in deps if d in position]
            if len(found) > 1:  # each input once: the counts below are of tasks, not edges
                found = sorted(set(found), key=position.__getitem__)
            inputs[key] = found
            for d in found:
                dependents[d].append(key)
        self._inputs = inputs
        self._dependents = dependents
        #: each task's inputs not ranked yet, and its readers not ranked yet
        self._missing = {key: len(found) for key, found in inputs.items()}
        self._readers = {key: len(found) for key, found in dependents.items()}
        self._entered: set[Hashable] = set()
        self._ranks: dict[Hashable, int] = {}

    def ranks(self, outputs: Iterable[Hashable]) -> dict[Hashable, int]:
        inputs, entered, ranks = self._inputs, self._entered, self._ranks
        for root in (*outputs, *inputs):
            if root in entered or root not in inputs:
                continue
            entered.add(root)
            stack = [(root, iter(inputs[root]))]
            while stack:
                key, pending = stack[-1]
                for d in pending:
                    if d not in entered:
                        entered.add(d)
                        stack.append((d, iter(inputs[d])))
                        break
                else:
                    stack.pop()
                    if key not in ranks:
                        self._rank(key)
        return ranks

    def _rank(self, key: Hashable) -> None:
        """Rank ``key``, then every task that its rank makes a ready last consumer."""
        inputs, dependents, missing, readers = (
            self._inputs,
            self._dependents,
            self._missing,
            self._readers,
        )
        entered, ranks = self._entered, self._ranks
        todo = [key]
        while todo:
            key = todo.pop()
            ranks[key] = len(ranks)
            found = []
            for d in dependents[key]:
                missing[d] -= 1
                if not missing[d] and any(readers[i] == 1 for i in inputs[d]):
                    found.append(d)
            for i in inputs[key]:
                readers[i] -= 1
                if readers[i] == 1:
                    found.extend(d for d in dependents[i] if not missing[d] and d not in ranks)
            for d in reversed(found):
                if d not in entered:
                    entered.add(d)
                    todo.append(d)
