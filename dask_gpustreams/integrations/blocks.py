"""Stream blocks: a sub-graph run as one task, through the stream launcher.

On distributed, every dependency step of a chain costs a scheduler round trip
(8-10 ms, most of it batching), longer than a GPU kernel. A
:class:`StreamBlock` is the function of one task that stands for several: the
worker that runs it launches its sub-graph onto its stream pool with the
:class:`~dask_gpustreams.runtime.launcher.GraphLauncher`, so the steps inside
wait for each other on the device, not for the scheduler. The scheduler side
that forms blocks is :mod:`.distributed.blocks`; :func:`partition` (here,
without distributed) chooses the groups.

A block returns its outputs (one value, or a tuple in :attr:`StreamBlock.outputs`
order) once their work has completed, as ``compute`` does: a task of it that
fails, by its kernel (the :class:`~dask_gpustreams.KernelError` naming the
inner key) or its code (its exception), fails the outputs that derive from it,
and only those; a kernel failure of another task, which left a stream in error
under the block's kernels, launches the block again (and past
:attr:`StreamBlock.relaunches`, raises :class:`BlockSkipped`, which
reschedules it on distributed, at most :attr:`StreamBlock.reschedules` times:
then :class:`BlockSkippedError` fails it). Intermediates are dropped
once their consumers inside the block are launched, as the launcher does.
Without a stream runtime (a worker without the plugin, a process pool) it runs
its tasks in priority order on the host, as Dask would.
"""

from __future__ import annotations

import copy
import heapq
import math
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping, Sequence
from functools import partial
from types import TracebackType
from typing import Any

from dask._task_spec import GraphNode, Task, TaskRef
from dask.utils import key_split
from distributed import Reschedule

from dask_gpustreams.errors import KernelError
from dask_gpustreams.integrations.launcher import launch_plan
from dask_gpustreams.runtime import StreamRuntime
from dask_gpustreams.runtime.launcher import GraphLauncher


class BlockSkipped(Exception):  # noqa: N818 - it is not an error of the block's
    """A block's kernels were skipped by other tasks' failures each time: run it again later.

    :meth:`StreamBlock.launch` raises it, with the last such ``KernelError``
    as :attr:`error`, after :attr:`StreamBlock.relaunches` launches again (or
    when one error comes back after it was reported). It is not a
    ``KernelError``: the block's inputs are good and none of its own kernels
    failed, so no error of another key is reported under the block's keys. On
    distributed the worker reschedules the block (``distributed.Reschedule``).
    """

    def __init__(self, error: KernelError):
        super().__init__(
            f"the block's kernels were skipped by the failure of {error.key!r} (another task)"
        )
        self.error = error

    def __reduce__(self):
        return BlockSkipped, (self.error,)


class BlockSkippedError(RuntimeError):
    """A block's kernels were skipped by other tasks' failures on every run it was given.

    :meth:`StreamBlock.launch` raises it in place of :class:`BlockSkipped`
    once the block has been rescheduled :attr:`StreamBlock.reschedules` times,
    so that a block is not rescheduled forever: it fails its outputs, with
    this error (naming the block's key, its runs and the last other key whose
    failure skipped it, :attr:`error`), not with that other key's error.
    """

    def __init__(self, key: Any, runs: int, launches: int, error: KernelError):
        super().__init__(
            f"stream block {key!r} was skipped by other tasks' failures on each of its {runs} "
            f"runs (rescheduled {runs - 1} times, the most that StreamBlock.reschedules allows), "
            f"the last by the failure of {error.key!r} after {launches} launches; none of its "
            "own tasks failed"
        )
        self.key = key
        self.runs = runs
        self.launches = launches
        self.error = error

    def __reduce__(self):
        return BlockSkippedError, (self.key, self.runs, self.launches, self.error)


class StreamBlock:
    """The function of a block task: ``nodes`` (in priority order) from ``inputs``' values.

    Called as a task function with the values of ``inputs``, in order; returns
    the value of its one output, or the tuple of ``outputs``' values. ``key``
    is its task's key (for errors); ``rescheduled`` counts the times its task
    was rescheduled after :class:`BlockSkipped` (the scheduler's
    :class:`~.distributed.blocks.StreamBlocks` counts them). ``sources`` maps
    an input read straight from another block's tuple to ``(that block's key,
    index)`` (index None: that block's value, where it has one output, as a split
    block's part may): :meth:`launch` finds it there, with no getter task between.
    """

    __slots__ = ("nodes", "inputs", "outputs", "key", "rescheduled", "sources")

    #: The most launches again after other tasks' failures skipped the block's kernels.
    relaunches = 3
    #: The most reschedules after :class:`BlockSkipped`; past them, :class:`BlockSkippedError`.
    reschedules = 3

    def __init__(
        self,
        nodes: Sequence[GraphNode],
        inputs: Sequence[Hashable],
        outputs: Sequence[Hashable],
        key: Hashable | None = None,
        rescheduled: int = 0,
        sources: Mapping[Hashable, tuple[Hashable, int | None]] | None = None,
    ):
        self.nodes = tuple(nodes)
        self.inputs = tuple(inputs)
        self.outputs = tuple(outputs)
        self.key = key
        self.rescheduled = rescheduled
        self.sources = dict(sources or {})

    def __reduce__(self):
        args = (self.nodes, self.inputs, self.outputs, self.key, self.rescheduled, self.sources)
        return StreamBlock, args

    def __repr__(self) -> str:
        return f"StreamBlock({len(self.nodes)} tasks, outputs={list(self.outputs)!r})"

    def derived_from(self, key: Hashable) -> set[Hashable]:
        """``key`` (an input) and the keys of the block's tasks that derive from it."""
        return _downstream(self.nodes, key)

    def part(self, outputs: Sequence[Hashable], key: Hashable) -> StreamBlock:
        """The block of the tasks that ``outputs`` derive from, under ``key``: it reads
        only the inputs those tasks read (a split block's part, :mod:`.distributed.split`)."""
        nodes = _upstream(self.nodes, outputs)
        inside = {node.key for node in nodes}
        used = {d for node in nodes for d in node.dependencies if d not in inside}
        inputs = [k for k in self.inputs if k in used]
        sources = {k: v for k, v in self.sources.items() if k in used}
        return StreamBlock(nodes, inputs, outputs, key, self.rescheduled, sources)

    def with_sources(self, sources: Mapping[Hashable, tuple[Hashable, int | None]]) -> StreamBlock:
        """This block, its inputs read straight from other blocks as ``sources`` says
        (a split block's reader, re-pointed to its parts: :mod:`.distributed.split`)."""
        return StreamBlock(
            self.nodes, self.inputs, self.outputs, self.key, self.rescheduled, sources
        )

    def _result(self, values: Mapping[Hashable, Any]) -> Any:
        if len(self.outputs) == 1:
            return values[self.outputs[0]]
        return tuple(values[k] for k in self.outputs)

    def __call__(self, *args: Any) -> Any:
        """On the host, in priority order (no stream runtime): as Dask runs the tasks."""
        values = dict(zip(self.inputs, args, strict=True))
        readers: dict[Hashable, int] = {}
        for node in self.nodes:
            for d in node.dependencies:
                readers[d] = readers.get(d, 0) + 1
        keep = set(self.outputs)
        for node in self.nodes:
            values[node.key] = node(values)
            for d in node.dependencies:
                readers[d] -= 1
                if not readers[d] and d not in keep:
                    del values[d]
        return self._result(values)

    def launch(
        self,
        runtime: StreamRuntime,
        values: Mapping[Hashable, Any],
        failures: Mapping[Hashable, KernelError] | None = None,
    ) -> Any:
        """Launch the block onto ``runtime``'s streams; return once its outputs are complete.

        ``values`` holds the inputs (or, for those in :attr:`sources`, the
        tuples of the blocks they come from: an input whose slot there holds a
        failure fails the outputs that derive from it, as a failed task of the
        block does), whose work must be complete (the worker checks them first).
        ``failures`` maps an input whose work the caller found failed to its
        error, which stands in for its value: it fails what derives from that
        input in the same way. Every event of the block is checked, so its
        outputs are known good when it returns (they need no event nor taint),
        even where a sync elsewhere reported the failure first.

        A failed task, its kernel (a kernel failure of an inner key) or its
        Python code (an exception it raised), fails the outputs that derive
        from it, as task per key would, and only those: the block is launched
        again without the tasks that derive from the failed one, for its other
        outputs. With one output, the task's error is raised (the
        ``KernelError`` naming the inner key, or the task's exception with its
        traceback); with several, each failed output's slot of the tuple holds
        its error, which :func:`block_output` (its getter) raises, and the
        tuple is returned.

        A ``KernelError`` of a key outside the block comes from another task
        whose failure left a stream in error under the block's kernels, which
        were then skipped: the inputs are good, so the block is launched again,
        once every stream of ``runtime`` has been synchronized (which reports
        such failures, so the device clears them before later work), at most
        :attr:`relaunches` times. Past that, or when one such error comes back,
        it raises :class:`BlockSkipped`, never the other key's error; once the
        block has been rescheduled :attr:`reschedules` times, it raises
        :class:`BlockSkippedError` instead. A CUDA error (sticky, of no key)
        raised outside the tasks' code is raised as is; one that a task's call
        raises fails what derives from that task, as its exception would. A
        task's ``distributed.Reschedule`` is raised as is: the block is
        rescheduled, whole.
        """
        nodes: Sequence[GraphNode] = self.nodes
        wanted = self.outputs
        failed: dict[Hashable, _Failed] = {}
        if failures:
            values = {**values, **{k: _Failed(e) for k, e in failures.items()}}
        sources = self.sources
        if sources:  # (each launch below copies the inputs it reads from ``values``)
            values = {
                k: _straight(values[s[0]], s[1]) if (s := sources.get(k)) else values[k]
                for k in self.inputs
            }
        for k in self.inputs:
            slot = values[k]
            if type(slot) is _Failed:
                # A failed output of the block it comes from, or an input whose work failed
                # (the worker found it), fails what derives from it here too, and only
                # that, as one task per key would.
                bad = _downstream(nodes, k)
                if len(self.outputs) == 1 and self.outputs[0] in bad:
                    block_output((slot,), 0)  # raises its error, with its task's frames
                failed.update((o, slot) for o in wanted if o in bad)
                wanted = tuple(o for o in wanted if o not in bad)
        if failed:
            nodes = _upstream(nodes, wanted)
        got: Mapping[Hashable, Any] = {}
        while wanted:
            got, raised = self._launch(runtime, values, nodes, wanted)
            if raised is None:
                break
            key, error = raised
            bad = _downstream(nodes, key)
            if len(self.outputs) == 1 and self.outputs[0] in bad:
                raise error
            slot = _Failed(error, None if isinstance(error, KernelError) else error.__traceback__)
            failed.update((k, slot) for k in wanted if k in bad)
            wanted = tuple(k for k in wanted if k not in bad)
            nodes = _upstream(nodes, wanted)
        return self._result({**got, **failed})

    def _launch(
        self,
        runtime: StreamRuntime,
        values: Mapping[Hashable, Any],
        nodes: Sequence[GraphNode],
        wanted: Sequence[Hashable],
    ) -> tuple[Mapping[Hashable, Any], tuple[Hashable, BaseException] | None]:
        """``nodes`` launched for ``wanted``, again after other tasks' failures (:meth:`launch`).

        Returns ``(values, None)``, or ``({}, (key, error))`` where the task
        ``key`` of ``nodes`` failed: its kernel (the ``KernelError`` names it)
        or its code (the launcher names the task whose exception it raised).
        Any other exception is raised.
        """
        tasks, dependencies, host = launch_plan(nodes, runtime)
        priority = {node.key: i for i, node in enumerate(nodes)}
        seen: list[KernelError] = []
        while True:
            cache = {k: v for k in self.inputs if type(v := values[k]) is not _Failed}
            args = (runtime, tasks, dependencies, priority, wanted, cache, host, key_split)
            launcher = GraphLauncher(*args, check=True)
            try:
                return launcher.run(), None
            except KernelError as e:
                if e.key in tasks:
                    return {}, (e.key, e)  # one of the block's own kernels failed
                if len(seen) >= self.relaunches or any(e is s for s in seen):
                    if self.rescheduled >= self.reschedules:  # not rescheduled forever
                        key = self.outputs[0] if self.key is None else self.key
                        runs, launches = 1 + self.rescheduled, 1 + len(seen)
                        raise BlockSkippedError(key, runs, launches, e) from None
                    raise BlockSkipped(e) from None
                seen.append(e)
                runtime.clear_errors()  # reports failures no sync has reported yet
            except Reschedule:
                raise  # a task asks to be rescheduled: its block is, whole (control flow)
            except Exception as e:
                if launcher.failed is None:
                    raise  # not a task's exception: the block fails
                return {}, (launcher.failed, e)


def _frameless(traceback: TracebackType) -> Any:
    """``traceback`` as a ``tblib.Traceback`` (names and lines, no frame), or None without tblib."""
    try:
        from tblib import Traceback
    except ImportError:
        return None
    return Traceback(traceback)


def _drop_chained_frames(error: BaseException) -> None:
    """The exceptions chained to ``error`` (cause, context) keep no frame of the task's.

    Their frames would hold the task's locals (its input arrays) for as long as
    the block's result lives; each keeps a frameless copy of its traceback
    (tblib's, whose frames hold no locals), or none without tblib.
    """
    seen = {id(error)}
    chained = [error.__cause__, error.__context__]
    while chained:
        e = chained.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if e.__traceback__ is not None:
            copy = _frameless(e.__traceback__)
            e.__traceback__ = None if copy is None else copy.as_traceback()
        chained += [e.__cause__, e.__context__]


class _Failed:
    """The slot of a block's output whose work failed: its getter raises :attr:`error`.

    ``traceback``: the frames of the task's exception (None for a kernel
    failure, whose frames are those of the sync that found it), kept as a
    ``tblib.Traceback`` (distributed's dependency; without it, none): their
    names and lines, which pickle (the tuple sent to another worker's getter)
    and hold none of the frames' values (the launch's inputs and results).
    The error itself is kept without its frames, for the same reason.
    """

    __slots__ = ("error", "traceback")

    def __init__(self, error: BaseException, traceback: Any = None):
        if isinstance(traceback, TracebackType):
            traceback = _frameless(traceback)
        self.error = error.with_traceback(None)
        _drop_chained_frames(self.error)
        self.traceback = traceback

    def __reduce__(self):
        return _Failed, (self.error, self.traceback)

    def __repr__(self) -> str:
        return f"_Failed({self.error!r})"


def read_straight(block: Hashable, index: int | None) -> GraphNode:
    """The argument of a block's task that reads output ``index`` of block ``block``
    straight from its value, with no getter task between (``index`` None: a block of
    one output, whose value is that output's). :attr:`StreamBlock.sources` says the same
    to :meth:`StreamBlock.launch`."""
    ref = TaskRef(block)
    return ref if index is None else Task(None, block_output, ref, index)


def _straight(value: Any, index: int | None) -> Any:
    """Output ``index`` of a block's ``value`` (None: the value of a block of one output)."""
    return value if index is None else value[index]


def block_output(values: Sequence[Any], i: int) -> Any:
    """The getter of a block's output ``i``: its value, or the error of its failed work."""
    value = values[i]
    if type(value) is _Failed:
        tb = None if value.traceback is None else value.traceback.as_traceback()
        # The error is shared by the outputs that derive from one task: not the frames of
        # an earlier raise, only the task's own.
        raise _fresh(value.error).with_traceback(tb)
    return value


async def get_output(values: tuple, i: int) -> Any:
    """A getter task's function on distributed: :func:`block_output`, as a coroutine.

    The worker runs a coroutine on its event loop: a getter only indexes a tuple,
    and the block checked its outputs' work before it returned, so there is nothing to
    wait for. Run in a worker thread, each getter paid the hop there and back; on the
    H200, tangled's wide shape at 8 ms (24 getters) went from 64.9 / 68.8% of the ideal
    to 71.6 / 72.9% (80d227e).
    """
    return block_output(values, i)


def _fresh(error: BaseException) -> BaseException:
    """A copy of ``error`` to raise, with its cause and context: the shared one stays
    frameless. Raised itself, it would keep the frames of each raise, and their values (a
    block reading it from another's tuple holds all its inputs there), in a cycle through
    the tuple that only the garbage collector frees. One that cannot be copied is raised
    itself."""
    try:
        fresh = copy.copy(error)
    except Exception:
        return error
    fresh.__cause__, fresh.__context__ = error.__cause__, error.__context__
    fresh.__suppress_context__ = error.__suppress_context__
    return fresh


def _downstream(nodes: Sequence[GraphNode], key: Hashable) -> set[Hashable]:
    """``key`` and the keys of ``nodes`` that derive from it."""
    readers: dict[Hashable, list[Hashable]] = {}
    for node in nodes:
        for d in node.dependencies:
            readers.setdefault(d, []).append(node.key)
    bad = {key}
    stack = [key]
    while stack:
        for k in readers.get(stack.pop(), ()):
            if k not in bad:
                bad.add(k)
                stack.append(k)
    return bad


def _upstream(nodes: Sequence[GraphNode], keys: Iterable[Hashable]) -> list[GraphNode]:
    """The ``nodes`` that ``keys`` derive from (and theirs), in their order."""
    by_key = {node.key: node for node in nodes}
    need = set(keys)
    stack = list(need)
    while stack:
        for d in by_key[stack.pop()].dependencies:
            if d in by_key and d not in need:
                need.add(d)
                stack.append(d)
    return [node for node in nodes if node.key in need]


def partition(
    candidates: Collection[Hashable],
    dependencies: Callable[[Hashable], Iterable[Hashable]],
    dependents: Callable[[Hashable], Iterable[Hashable]],
    level: Mapping[Hashable, int],
    n_workers: int,
    block_size: int = 64,
    order: Callable[[Hashable], Any] | None = None,
    bands: list | None = None,
    threads: int = 0,
    wanted: Callable[[Hashable], bool] | None = None,
) -> list[list[Hashable]]:
    """The groups of ``candidates`` worth a block each (two tasks or more); the estimate.

    ``dependencies``/``dependents`` give a key's neighbours in the whole graph
    (candidates or not), ``level`` each new key's longest path from the graph's
    inputs. A block saves the round trip of every dependency step inside it,
    and costs the parallelism of its tasks across workers and the wait for all
    its inputs before it starts. So:

    - every part (weakly connected component of the candidates) that is no
      larger than one worker's share (the grouped tasks over ``n_workers``) is
      a block: on one worker, every part. Parts :data:`PACK_DEPTH` tasks deep
      or more, where more of them than groups are needed arrive together, are
      packed (:func:`_pack_parts`): a block holds its thread until its device
      work is done, so the parts beyond the cluster's ``threads`` (all
      workers'; 0: no packing) would run one block after another, where packed
      they run on the streams at once (8 chains on a worker of one thread,
      dask-cuda's default, ran one at a time);
    - a larger part, on several workers, is cut into bands of levels whose
      independent pieces pack into ``n_workers`` groups of about equal size
      (:func:`_bands`): each group a block, one per worker, so the part still
      runs on every worker;
    - among the rest, *chains* are: runs of tasks where each one's only
      dependent is the next, and the next's only candidate dependency is it;
      a chain runs one task at a time anyway.

    A part that a path leaves and re-enters (through a task that is not a
    candidate) would depend on itself: it falls back to its chains. Chains
    never do (only their last task has dependents outside).

    ``block_size`` bounds what a block holds until it ends (:func:`_held`): its
    distinct inputs from outside and its outputs (keys read outside it, those
    that ``wanted(key)`` says a client wants, and those that nothing reads).
    A group that holds at most ``block_size`` values stays whole, up to
    :data:`MAX_BLOCK_TASKS` tasks: inside, intermediates go as their readers
    launch (:func:`_bounded`). A group that holds more, and has more than
    ``block_size`` tasks, is cut into pieces of at most ``block_size`` tasks. So
    no block holds more than ``block_size`` outputs, and a block of more tasks
    holds at most ``block_size`` values in all. The pieces are of about equal size, in the
    order of ``order(key)`` (the
    scheduler's priority, dask.order's: it runs the pieces of a reduction
    just before what combines them, so a piece keeps few outputs for later
    pieces, as task per key keeps few results in memory). Cut level by level
    instead, the first pieces would be all of a matmul's partial products,
    each held by its piece until a later one sums them; a group is cut level
    by level only where that shortens its critical path and holds few more
    outputs (:func:`_cut_shortest`). Where these cuts make the blocks depend
    on each other in a cycle, every group is cut in ``order``, then, if that
    too is cyclic (user priorities), in the order of ``(level, order(key))``,
    a dependency order; with neither ``order`` nor an acyclic cut, only the
    chains are grouped.

    ``bands``, if given, gets one entry per group returned: ``(band, bin)``
    for the groups of a part cut into bands (see :func:`_bands`), whose bins
    ``0 .. n_workers - 1`` are meant for one worker each, else None.
    """
    members = set(candidates)
    parent = {k: k for k in members}

    def find(k: Hashable) -> Hashable:
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    for k in members:
        for d in dependencies(k):
            if d in members:
                a, b = find(k), find(d)
                if a != b:
                    parent[a] = b
    parts: dict[Hashable, list[Hashable]] = {}
    for k in members:
        parts.setdefault(find(k), []).append(k)
    sort_key = (lambda k: (level[k], order(k))) if order is not None else level.__getitem__
    workers = max(1, n_workers)
    grouped = [part for part in parts.values() if len(part) >= 2]
    share = sum(map(len, grouped)) / workers  # the tasks each worker should get
    groups: list[tuple[list[Hashable], Any]] = []  # (keys, (band, bin) or None)
    whole: list[list[Hashable]] = []  # parts that are a block each, unless packed
    for part in grouped:
        if len(part) <= share and _convex(part, dependents, level):
            whole.append(part)  # one worker's share at most: the whole part
            continue
        left: list[Hashable] = part
        if workers > 1 and len(part) > share:
            first = 1 + max((t[0] for _, t in groups if t is not None), default=-1)
            banded, left = _bands(part, members, dependencies, level, workers, sort_key, first)
            groups.extend(banded)
        groups.extend((c, None) for c in _chains(left, set(left), dependencies, dependents))
    held = partial(_held, dependencies=dependencies, dependents=dependents, wanted=wanted)
    packed = _pack_parts(whole, threads, held, block_size, dependencies, level, sort_key)
    cut = [(g, None) for g in packed or whole] + groups

    bounded = partial(_bounded, held=held, block_size=block_size)
    shortest = (order, sort_key, dependencies, dependents, level)
    pieces = [(p, tag) for g, tag in cut for p in bounded(g, _cut_shortest, shortest)]
    acyclic = _acyclic([p for p, _ in pieces], level, dependencies)
    for fallback in (order, sort_key) if order is not None else ():
        if acyclic:
            break
        pieces = [(p, tag) for g, tag in cut for p in bounded(g, _cut, (fallback,))]
        acyclic = _acyclic([p for p, _ in pieces], level, dependencies)
    if not acyclic:
        chains = [
            c for part in parts.values() for c in _chains(part, members, dependencies, dependents)
        ]
        pieces = [(p, None) for c in chains for p in bounded(c, _cut, (sort_key,))]
    if bands is not None:
        bands.extend(tag for _, tag in pieces)
    return [p for p, _ in pieces]


def _bounded(
    group: list[Hashable],
    cutter: Callable,
    args: tuple,
    held: Callable[[list[Hashable]], int],
    block_size: int,
) -> list[list[Hashable]]:
    """``group`` in the pieces it is a block as (``cutter(group, max_tasks, *args)`` cuts).

    Whole where it holds at most ``block_size`` values and has at most
    :data:`MAX_BLOCK_TASKS` tasks; where it holds that few with more tasks, in pieces
    of :data:`MAX_BLOCK_TASKS` (a piece that then holds more, in pieces of
    ``block_size``); where it holds more, in pieces of ``block_size`` tasks.
    """
    if held(group) > block_size:
        return cutter(group, min(block_size, MAX_BLOCK_TASKS), *args)
    if len(group) <= MAX_BLOCK_TASKS:
        return [group]
    return [
        q
        for p in cutter(group, MAX_BLOCK_TASKS, *args)
        for q in ([p] if held(p) <= block_size else cutter(p, block_size, *args))
    ]


def _held(
    group: list[Hashable],
    dependencies: Callable[[Hashable], Iterable[Hashable]],
    dependents: Callable[[Hashable], Iterable[Hashable]],
    wanted: Callable[[Hashable], bool] | None,
) -> int:
    """The values ``group``'s block holds until it ends: its distinct inputs from outside,
    and its outputs (read outside, wanted by a client, or read by nothing: the graph's).

    Task per key could release or spill these earlier. The rest of a block's tasks are
    intermediates, dropped as their readers launch, so they do not count.
    """
    inside = set(group)
    inputs = {d for k in group for d in dependencies(k) if d not in inside}
    outputs = 0
    for k in group:
        readers = list(dependents(k))
        if not readers or any(c not in inside for c in readers) or (wanted and wanted(k)):
            outputs += 1
    return len(inputs) + outputs


def _bands(
    part: list[Hashable],
    members: set,
    dependencies: Callable[[Hashable], Iterable[Hashable]],
    level: Mapping[Hashable, int],
    workers: int,
    sort_key: Callable,
    first: int = 0,
) -> tuple[list[tuple[list[Hashable], tuple[int, int]]], list[Hashable]]:
    """``part``, too large for one worker, as ``workers`` groups per band of levels.

    A band is a run of levels whose tasks fall into independent pieces (weakly
    connected within the band) that pack into ``workers`` groups of about equal
    size (the smallest at least half the mean): those groups can run on every
    worker at once, and a band is as deep as that allows. A level narrower than
    ``workers`` joins no band, and a band of one level makes no groups (there is
    no dependency step inside to save, and each output of a block with several
    costs a getter task's round trip). Returns the groups (of two tasks or
    more), each with its ``(band, bin)`` (bands numbered from ``first``), and
    the tasks left over (for chains).
    """
    by_level: dict[int, list[Hashable]] = {}
    for k in part:
        by_level.setdefault(level[k], []).append(k)
    groups: list[tuple[list[Hashable], tuple[int, int]]] = []
    left: list[Hashable] = []
    number = [first]
    parent: dict[Hashable, Hashable] = {}
    size: dict[Hashable, int] = {}
    band: list[Hashable] = []
    # The band's pieces (roots of ``parent``), kept as levels join and merge: a level
    # costs its own keys, not the band's (which made a long band quadratic in its depth).
    roots: set[Hashable] = set()

    def find(k: Hashable) -> Hashable:
        while parent[k] != k:
            k = parent[k]
        return k

    def close() -> None:
        if len({level[k] for k in band}) < 2:  # no dependency step inside: nothing saved
            left.extend(band)  # (and each output would cost a getter's round trip)
            return
        pieces: dict[Hashable, list[Hashable]] = {}
        for k in band:
            pieces.setdefault(find(k), []).append(k)
        for i, group in enumerate(_pack(list(pieces.values()), workers, sort_key)):
            if len(group) >= 2:
                groups.append((group, (number[0], i)))
            else:
                left.extend(group)
        number[0] += 1

    for lv in sorted(by_level):
        keys = by_level[lv]
        joined: list[tuple[Hashable, Hashable]] = []  # (root merged, into root): undone if refused
        for k in keys:
            parent[k] = k
            size[k] = 1
        roots.update(keys)
        for k in keys:
            for d in dependencies(k):
                if d in parent and d in members:
                    a, b = find(k), find(d)
                    if a != b:
                        if size[a] > size[b]:
                            a, b = b, a
                        parent[a] = b
                        size[b] += size[a]
                        roots.discard(a)
                        joined.append((a, b))
        if _balanced([size[r] for r in roots], workers):
            band.extend(keys)
            continue
        for a, b in reversed(joined):  # refused: the band ends before this level
            parent[a] = a
            size[b] -= size[a]
            roots.add(a)
        for k in keys:
            del parent[k], size[k]
        roots.difference_update(keys)
        close()
        parent = {k: k for k in keys}
        size = dict.fromkeys(keys, 1)
        band = list(keys)
        roots = set(keys)
        if not _balanced([1] * len(keys), workers):  # narrower than the workers: no band
            left.extend(keys)
            parent, size, band, roots = {}, {}, [], set()
    close()
    return groups, left


#: The fewest tasks on a part's longest path for it to be packed with others into one
#: block. Packed, each of its outputs needs a getter task, where a part that is a block of
#: its own needs none; a deeper part holds its thread for more dependent kernels. A
#: heuristic: of three workloads of 2-deep parts on the H200, per-tile FFTs took 271 ms
#: packed against 174 ms a block each and the pipeline 1,419 against 1,179, while
#: small-chunks gained (393 against 488).
PACK_DEPTH = 3
#: The most tasks in a block that holds few values (``block-size``); a larger group of few
#: values is cut into pieces of this many. A block's run_spec is pickled on the scheduler's
#: event loop (helper-56 measured 0.4 ms at 63 tasks, 94 ms at 9,999, 0.62 s at 99,999), it
#: keeps an event per task (the event pool keeps 8,192), it holds a worker thread until its
#: device work is done (dask-cuda gives a worker one), and a failure relaunches it, whole.
MAX_BLOCK_TASKS = 4096


def _pack_parts(
    whole: list[list[Hashable]],
    threads: int,
    held: Callable[[list[Hashable]], int],
    block_size: int,
    dependencies: Callable[[Hashable], Iterable[Hashable]],
    level: Mapping[Hashable, int],
    sort_key: Callable,
) -> list[list[Hashable]] | None:
    """``whole`` (parts that are a block each) with the deep ones packed, or None if none is.

    Parts of one *wave* (:func:`_waves`: no path leads from one to another, so
    no packed group reads itself) and at least :data:`PACK_DEPTH` deep are
    packed into ``max(threads, their held values / block_size)`` groups (more where
    their tasks pass :data:`MAX_BLOCK_TASKS` a group), where there are more of them,
    groups of about equal tasks (the work), each holding at most ``block_size``
    values (``held(part)``: a group holds the sum of its parts', which share no task:
    an input two parts read counts twice) where its parts fit (:func:`_pack`), as a
    block may.
    """
    if not threads or len(whole) <= threads:  # no more blocks than threads: nothing to do
        return None
    deep = [p for p in whole if _depth(p, dependencies, level) >= PACK_DEPTH]
    waves = _waves(deep, dependencies, level) if len(deep) > threads else None
    if waves is None:
        return None
    by_wave: dict[int, list[list[Hashable]]] = {}
    for part, wave in zip(deep, waves, strict=True):
        by_wave.setdefault(wave, []).append(part)
    packed: list[list[Hashable]] = []
    for parts in by_wave.values():
        bins = max(
            threads,
            -(-sum(map(held, parts)) // block_size),
            -(-sum(map(len, parts)) // MAX_BLOCK_TASKS),
        )
        if len(parts) > bins:
            capacity = (block_size, MAX_BLOCK_TASKS)
            parts = _pack(parts, bins, sort_key, capacity, lambda p: (held(p), len(p)))
        packed.extend(parts)
    if len(packed) == len(deep):
        return None
    chosen = {id(p) for p in deep}
    return packed + [p for p in whole if id(p) not in chosen]


def _depth(
    part: list[Hashable],
    dependencies: Callable[[Hashable], Iterable[Hashable]],
    level: Mapping[Hashable, int],
) -> int:
    """The tasks on ``part``'s longest path, through its own tasks only."""
    inside: dict[Hashable, int] = dict.fromkeys(part, 0)
    for k in sorted(part, key=level.__getitem__):
        inside[k] = 1 + max((inside[d] for d in dependencies(k) if d in inside), default=0)
    return max(inside.values(), default=0)


def _waves(
    parts: list[list[Hashable]],
    dependencies: Callable[[Hashable], Iterable[Hashable]],
    level: Mapping[Hashable, int],
) -> list[int] | None:
    """Each part's wave: the most of ``parts`` that a path from the graph's inputs passes
    through before reaching it (through ``level``'s keys). A path from one part to another
    raises the other's wave, so parts of one wave never reach each other. None if the parts,
    each taken as one node, make a cycle (a part that a path leaves and re-enters)."""
    part_nodes = [object() for _ in parts]  # never equal to a key
    node: dict[Hashable, Any] = {k: k for k in level}
    for part, part_node in zip(parts, part_nodes, strict=True):
        for k in part:
            node[k] = part_node
    is_part = {id(n) for n in part_nodes}
    into: dict[Any, set] = {}
    indegree: dict[Any, int] = dict.fromkeys(node.values(), 0)
    for k in level:
        v = node[k]
        for d in dependencies(k):
            u = node.get(d)
            if u is None or u == v:
                continue
            edges = into.setdefault(u, set())
            if v not in edges:
                edges.add(v)
                indegree[v] += 1
    wave = dict.fromkeys(indegree, 0)
    ready = [u for u, n in indegree.items() if n == 0]
    seen = 0
    while ready:
        u = ready.pop()
        seen += 1
        passed = wave[u] + (id(u) in is_part)
        for v in into.get(u, ()):
            wave[v] = max(wave[v], passed)
            indegree[v] -= 1
            if indegree[v] == 0:
                ready.append(v)
    if seen < len(indegree):
        return None
    return [wave[n] for n in part_nodes]


def _balanced(sizes: list[int], workers: int) -> bool:
    """Whether pieces of ``sizes`` pack into ``workers`` bins, the smallest >= half the mean."""
    if len(sizes) < workers:
        return False
    loads = [0] * workers
    for n in sorted(sizes, reverse=True):
        loads[loads.index(min(loads))] += n
    return 2 * min(loads) * workers >= sum(sizes)


def _pack(
    pieces: list[list[Hashable]],
    workers: int,
    sort_key: Callable,
    capacity: tuple[int, ...] = (),
    cost: Callable[[list[Hashable]], tuple[int, ...]] | None = None,
) -> list[list[Hashable]]:
    """``pieces`` in ``workers`` bins of about equal size (tasks), largest piece first; with
    a ``capacity`` (and its ``cost``), a piece goes into the emptiest bin where each sum of
    ``cost(piece)`` stays within its bound, else into a bin of its own."""
    if capacity and cost is None:
        raise ValueError("_pack: a capacity needs the cost of a piece")
    bins: list[list[Hashable]] = [[] for _ in range(workers)]
    loads = [[0] * len(capacity) for _ in range(workers)]
    for piece in sorted(pieces, key=lambda p: (-len(p), min(map(sort_key, p)))):
        c = cost(piece) if cost is not None else ()
        room = [
            i
            for i, load in enumerate(loads)
            if all(x + y <= bound for x, y, bound in zip(load, c, capacity, strict=True))
        ]
        if room:
            i = min(room, key=lambda i: len(bins[i]))
            bins[i].extend(piece)
            loads[i] = [x + y for x, y in zip(loads[i], c, strict=True)]
        else:
            bins.append(list(piece))
            loads.append(list(c))
    return [b for b in bins if b]


def _cut(group: list[Hashable], max_tasks: int, sort_key: Callable) -> list[list[Hashable]]:
    """``group`` in pieces of at most ``max_tasks`` (of two tasks or more), by ``sort_key``."""
    if len(group) <= max_tasks:
        return [group]
    ordered = sorted(group, key=sort_key)
    n = -(-len(ordered) // max_tasks)
    bounds = [len(ordered) * i // n for i in range(n + 1)]
    pieces = [ordered[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    return [p for p in pieces if len(p) >= 2]


#: A cut level by level may hold this many times the outputs at once of a cut in the
#: scheduler's order, no more. A wavefront at width 32 holds 64 against 49 (a level's
#: inputs and outputs at a block's end), a tall-skinny QR of 64 row blocks 1.49x (with 4%
#: more bytes, and half the critical path); a tiled reduction or a rechunk would hold all
#: its partial results (matmul 463 against 63, rechunk 64 against 8).
HELD_SLACK = 1.5


def _cut_shortest(
    group: list[Hashable],
    max_tasks: int,
    order: Callable[[Hashable], Any] | None,
    sort_key: Callable[[Hashable], Any],
    dependencies: Callable[[Hashable], Iterable[Hashable]],
    dependents: Callable[[Hashable], Iterable[Hashable]],
    level: Mapping[Hashable, int],
) -> list[list[Hashable]]:
    """``group`` cut in ``order`` (few outputs held), or level by level where that has a
    shorter critical path through its pieces and holds at most :data:`HELD_SLACK` times
    as many outputs at once as ``order``'s cut.

    A block waits for every block it reads, so a cut's length is the longest path
    through its pieces, each as long as the longest path inside it. A wavefront
    (each task reads two of the level before, as chainlink does) cut in
    dask.order's diagonal order gives skinny diagonals, each almost as deep as the
    whole (at width 32, 8 of them one after the other); cut by levels, the depths
    add up to the whole's, and one level's outputs are held at a time. A tiled
    reduction cut by levels would hold all its partial products at once.
    """
    by_order = _cut(group, max_tasks, order or sort_key)
    if order is None or len(by_order) < 2:
        return by_order
    by_level = _cut(group, max_tasks, sort_key)
    if by_level == by_order:  # a chain, say: nothing to choose
        return by_order
    held, span = _cut_cost(by_order, group, dependencies, dependents, level)
    held_by_level, span_by_level = _cut_cost(by_level, group, dependencies, dependents, level)
    if span_by_level < span and held_by_level <= HELD_SLACK * held:
        return by_level
    return by_order


def _cut_cost(
    pieces: list[list[Hashable]],
    group: list[Hashable],
    dependencies: Callable[[Hashable], Iterable[Hashable]],
    dependents: Callable[[Hashable], Iterable[Hashable]],
    level: Mapping[Hashable, int],
) -> tuple[float, float]:
    """(the most outputs held at once, the longest path in tasks) of ``group`` cut into
    ``pieces``, run one at a time in their order as their inputs allow (inf, inf: the
    pieces form a cycle). An output is held from its piece's end until the last piece
    that reads it ends (a block holds its inputs until it ends); one read outside
    ``group``, to the end."""
    unit = {k: i for i, piece in enumerate(pieces) for k in piece}
    units = len(pieces)
    for k in group:
        if k not in unit:  # a task left out of the pieces runs alone
            unit[k] = units
            units += 1
    depth = [0] * units  # the longest path inside each unit, in tasks
    inside: dict[Hashable, int] = {}
    before: list[set[int]] = [set() for _ in range(units)]
    reads: list[set[Hashable]] = [set() for _ in range(units)]  # inputs from other units
    for k in sorted(group, key=level.__getitem__):
        u = unit[k]
        longest = 0
        for d in dependencies(k):
            v = unit.get(d)
            if v == u:
                longest = max(longest, inside[d])
            elif v is not None:
                before[u].add(v)
                reads[u].add(d)
        inside[k] = longest + 1
        depth[u] = max(depth[u], inside[k])
    readers: dict[Hashable, int] = {}  # output -> units still to read it (-1: read outside)
    made: list[list[Hashable]] = [[] for _ in range(units)]
    for k in group:
        u = unit[k]
        others = {unit.get(c) for c in dependents(k)} - {u}
        if others:
            readers[k] = -1 if None in others else len(others)
            made[u].append(k)
    after: list[list[int]] = [[] for _ in range(units)]
    waiting = [len(b) for b in before]
    for u, b in enumerate(before):
        for v in b:
            after[v].append(u)
    end = [0] * units
    ready = [u for u in range(units) if not waiting[u]]
    heapq.heapify(ready)
    done = held = peak = 0
    while ready:
        v = heapq.heappop(ready)
        done += 1
        end[v] += depth[v]
        held += len(made[v])  # its outputs, while its inputs are still held
        peak = max(peak, held)
        for k in reads[v]:
            readers[k] -= 1
            held -= readers[k] == 0
        for u in after[v]:
            end[u] = max(end[u], end[v])
            waiting[u] -= 1
            if not waiting[u]:
                heapq.heappush(ready, u)
    if done < units:
        return math.inf, math.inf
    return peak, max(end, default=0)


def _acyclic(
    groups: list[list[Hashable]],
    level: Mapping[Hashable, int],
    dependencies: Callable[[Hashable], Iterable[Hashable]],
) -> bool:
    """Whether the graph of ``level``'s keys, each group one node, has no cycle."""
    return _waves(groups, dependencies, level) is not None


def _convex(
    part: list[Hashable], dependents: Callable[[Hashable], Iterable[Hashable]], level: Mapping
) -> bool:
    """Whether no path leaves ``part`` and comes back (it would make the block its own input)."""
    inside = set(part)
    top = max(level[k] for k in part)
    stack = [d for k in part for d in dependents(k) if d not in inside]
    seen = set(stack)
    while stack:
        k = stack.pop()
        if level.get(k, top) >= top:
            continue  # a path from here can only reach higher levels
        for d in dependents(k):
            if d in inside:
                return False
            if d not in seen:
                seen.add(d)
                stack.append(d)
    return True


def _chains(
    part: list[Hashable],
    members: set,
    dependencies: Callable[[Hashable], Iterable[Hashable]],
    dependents: Callable[[Hashable], Iterable[Hashable]],
) -> list[list[Hashable]]:
    """The chains of two tasks or more in ``part``, each from its first task to its last."""
    nxt: dict[Hashable, Hashable] = {}
    for k in part:
        after = list(dependents(k))
        if len(after) != 1 or after[0] not in members:
            continue
        d = after[0]
        if [x for x in dependencies(d) if x in members] == [k]:
            nxt[k] = d
    heads = set(nxt) - set(nxt.values())
    chains = []
    for k in heads:
        chain = [k]
        while k in nxt:
            k = nxt[k]
            chain.append(k)
        chains.append(chain)
    return chains
