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
than the walk alone would hold its input (docs/measurements/launcher.md).
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
    ranked; a cycle is walked once and left for the launcher to report. The ranks
    are keyed by the keys of ``dependencies`` (an equal output, ``1.0`` for ``1``,
    finds its rank).
    """
    return _Walk(dependencies).ranks(outputs)


class _Walk:
    """One graph's ranking: the walk's stack, and the counts that free inputs early.

    Keys become positions (their order in ``dependencies``) once, so the walk
    hashes each key and each edge once, not at every step: Dask's tuple keys
    hash in Python each time, and a graph's walk allocates little (fewer
    garbage collections while a graph is launched).
    """

    def __init__(self, dependencies: Mapping[Hashable, Collection[Hashable]]):
        keys = list(dependencies)
        position = {key: i for i, key in enumerate(keys)}
        get = position.get
        inputs: list[list[int]] = []
        dependents: list[list[int]] = [[] for _ in keys]
        for i, deps in enumerate(dependencies.values()):
            found = [p for d in deps if (p := get(d)) is not None]
            if len(found) > 1:  # each input once: the counts below are of tasks, not edges
                found = sorted(set(found))
            inputs.append(found)
            for p in found:
                dependents[p].append(i)
        self._keys = keys
        self._position = position
        self._inputs = inputs
        self._dependents = dependents
        #: each task's inputs not ranked yet, and its readers not ranked yet
        self._missing = [len(found) for found in inputs]
        self._readers = [len(found) for found in dependents]
        self._entered = bytearray(len(keys))
        self._ranked = bytearray(len(keys))
        self._order: list[int] = []

    def ranks(self, outputs: Iterable[Hashable]) -> dict[Hashable, int]:
        inputs, entered, ranked = self._inputs, self._entered, self._ranked
        get = self._position.get
        roots = [p for key in outputs if (p := get(key)) is not None]
        for root in (*roots, *range(len(inputs))):
            if entered[root]:
                continue
            entered[root] = 1
            stack = [(root, iter(inputs[root]))]
            while stack:
                i, pending = stack[-1]
                for d in pending:
                    if not entered[d]:
                        entered[d] = 1
                        stack.append((d, iter(inputs[d])))
                        break
                else:
                    stack.pop()
                    if not ranked[i]:
                        self._rank(i)
        keys = self._keys
        return {keys[i]: rank for rank, i in enumerate(self._order)}

    def _rank(self, i: int) -> None:
        """Rank task ``i``, then every task that its rank makes a ready last consumer."""
        inputs, dependents, missing, readers = (
            self._inputs,
            self._dependents,
            self._missing,
            self._readers,
        )
        entered, ranked, order = self._entered, self._ranked, self._order
        todo = [i]
        while todo:
            i = todo.pop()
            ranked[i] = 1
            order.append(i)
            found = []
            for d in dependents[i]:
                missing[d] -= 1
                if not missing[d] and any(readers[j] == 1 for j in inputs[d]):
                    found.append(d)
            for j in inputs[i]:
                readers[j] -= 1
                if readers[j] == 1:
                    found.extend(d for d in dependents[j] if not missing[d] and not ranked[d])
            for d in reversed(found):
                if not entered[d]:
                    entered[d] = 1
                    todo.append(d)
