"""On the scheduler: a block whose input erred keeps the outputs that do not derive from it.

distributed errs every waiting dependent of an erred task (``_propagate_erred``):
a block's task, and so each of its getters, also the outputs that do not derive
from the erred input, which one task per key would compute. Told to err so,
a waiting block is cut in two instead (:class:`~.blocks.StreamBlocks` wraps the
scheduler's ``_transition``): it keeps the outputs that do not derive from the
erred inputs (a smaller :class:`~dask_gpustreams.integrations.blocks.StreamBlock`,
its getters re-indexed, the inputs it no longer reads released where nothing
else needs them) and keeps waiting; a new block task of the other outputs,
which reads the erred inputs, errs with the input's blame, so that their
getters raise the input's own exception, and ``Client.retry`` of them walks
back through it to the erred input and recomputes them.

:func:`plan_split` reads the scheduler's state and changes nothing; it gives
the reason where a block is not split (it then errs whole, as before), and
:func:`apply_split` relinks the tasks.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any, NamedTuple

from dask._task_spec import Alias, GraphNode, Task, TaskRef

from dask_gpustreams.integrations.blocks import StreamBlock, _downstream, _upstream, get_output

#: The states of a getter that a split can relink: one waiting for the block (the
#: block waits: no getter of it can be queued, processing or in no-worker), one that no
#: one needs now, and one already computed (by an earlier run of the block).
_GETTER_STATES = frozenset({"waiting", "released", "memory"})


class SplitPlan(NamedTuple):
    """How a block is cut: the run_specs of both parts, the keys they read, their getters."""

    good: Task  # the block's own run_spec from now on: the outputs that do not derive
    good_reads: frozenset  # the keys of the tasks it reads
    good_getters: list  # TaskStates, in the order of its outputs
    bad: Task | None  # the new block's run_spec (None: no output needed derives)
    bad_reads: frozenset
    bad_getters: list


def plan_split(ts: Any, new_key: Hashable) -> SplitPlan | str:
    """How ``ts``, a waiting block task with an erred input, is cut, the outputs that
    derive from its erred inputs going to a new block ``new_key``; or why it is not
    (a string: the block then errs whole, as before).

    Outputs whose getter was forgotten (no one needs them) go to neither part. The
    block keeps its key, so only one that no worker was ever sent is split.
    """
    spec = ts.run_spec
    block: StreamBlock = spec.func
    if block.key != ts.key or len(block.outputs) < 2:
        return "one output: it derives from every input"
    if ts.run_id is not None:
        # Sent back to waiting while a worker ran it (an input's replica lost, say), that
        # run may go on: sent the block again, the worker resumes it, and its tuple, of
        # the old outputs, would come under this key, where the getters read the new.
        return "it was sent to a worker before, whose run of it may resume"
    getters = _getters(ts, block)
    if isinstance(getters, str):
        return getters
    args = dict(zip(block.inputs, spec.args, strict=True))
    erred = {d.key for d in ts.dependencies if d.state == "erred"}
    failed = [k for k, arg in args.items() if _reads(arg) & erred]
    if not failed:
        return "no input erred"
    derived: set = set()
    for k in failed:
        derived |= _downstream(block.nodes, k)
    good = [k for k in block.outputs if k in getters and k not in derived]
    bad = [k for k in block.outputs if k in getters and k in derived]
    if not good:
        return "every output needed derives from the erred inputs"
    good_spec, good_reads = _part(spec, block, good, ts.key, args)
    bad_spec, bad_reads = _part(spec, block, bad, new_key, args) if bad else (None, frozenset())
    return SplitPlan(
        good_spec,
        good_reads,
        [getters[k] for k in good],
        bad_spec,
        bad_reads,
        [getters[k] for k in bad],
    )


def apply_split(ts: Any, plan: SplitPlan, other: Any, tasks: Mapping) -> dict:
    """Relink ``ts`` (the block) and ``other`` (the new block task, released; None where
    ``plan`` has no bad part) as ``plan`` says; return the scheduler's recommendations:
    ``other`` erred with ``ts``'s blame, the inputs no one needs now released, and
    ``ts`` processing where it waits for nothing now (released where no one needs it).

    A waiting getter of ``other`` waits for it (and errs with it, as ``other``'s erred
    transition errs each dependent not in memory); one in memory keeps its value.
    """
    recs: dict = {}
    if other is not None:
        other.priority = ts.priority
        other.retries = ts.retries
        other.worker_restrictions = ts.worker_restrictions
        other.loose_restrictions = ts.loose_restrictions
        for k in plan.bad_reads:
            other.add_dependency(tasks[k])
        n = len(plan.bad_getters)
        for i, getter in enumerate(plan.bad_getters):
            _move_getter(getter, ts, other)
            getter.run_spec = _getter_spec(getter.key, other.key, i, n)
        other.exception_blame = ts.exception_blame
        recs[other.key] = "erred"
    n = len(plan.good_getters)
    for i, getter in enumerate(plan.good_getters):
        getter.run_spec = _getter_spec(getter.key, ts.key, i, n)
    for dts in [d for d in ts.dependencies if d.key not in plan.good_reads]:
        _drop_input(ts, dts, recs)
    ts.run_spec = plan.good
    ts.exception_blame = None
    if not ts.waiters and not ts.who_wants:
        recs[ts.key] = "released"  # only moved getters waited for it: no one needs it now
    elif not ts.waiting_on:
        recs[ts.key] = "processing"  # (the scheduler queues it, or finds it no worker)
    return recs


def _getters(ts: Any, block: StreamBlock) -> dict[Hashable, Any] | str:
    """Output key -> getter TaskState of block task ``ts``, or why it cannot be split:
    a dependent that is no getter (a block that reads its tuple straight, whose
    sources would need rewriting) or a getter in a state a split does not relink."""
    index = {k: i for i, k in enumerate(block.outputs)}
    getters = {}
    for dts in ts.dependents:
        spec = dts.run_spec
        if not (
            type(spec) is Task
            and spec.func is get_output
            and spec.args == (TaskRef(ts.key), index.get(dts.key))
        ):
            return f"{dts.key!r} reads it and is no getter (a block reading its tuple straight)"
        if dts.state not in _GETTER_STATES:
            return f"its getter {dts.key!r} is {dts.state}"
        getters[dts.key] = dts
    return getters


def _reads(arg: Any) -> frozenset:
    """The keys that an argument of a block's task reads: a TaskRef's, or those of a
    direct read (a ``block_output`` task of another block's tuple)."""
    if isinstance(arg, TaskRef):
        return frozenset((arg.key,))
    return frozenset(getattr(arg, "dependencies", ()))


def _part(
    spec: Task, block: StreamBlock, outputs: list, key: Hashable, args: Mapping[Hashable, Any]
) -> tuple[Task, frozenset]:
    """The run_spec of the part of ``block`` (``spec``'s function) that computes
    ``outputs``, under ``key``, and the keys of the tasks it reads."""
    nodes: list[GraphNode] = _upstream(block.nodes, outputs)
    inside = {node.key for node in nodes}
    used = {d for node in nodes for d in node.dependencies if d not in inside}
    inputs = [k for k in block.inputs if k in used]
    sources = {k: v for k, v in block.sources.items() if k in used}
    part = StreamBlock(nodes, inputs, outputs, key, block.rescheduled, sources)
    refs = [args[k] for k in inputs]
    reads = frozenset().union(*map(_reads, refs))
    return Task(key, part, *refs, _data_producer=spec.data_producer), reads


def _getter_spec(key: Hashable, block: Hashable, i: int, n: int) -> GraphNode:
    """The run_spec of the getter of output ``i`` of the ``n`` of ``block``: with one
    output, a block's value is that output's (an Alias of it), else its tuple."""
    return Task(key, get_output, TaskRef(block), i) if n > 1 else Alias(key, block)


def _move_getter(getter: Any, ts: Any, other: Any) -> None:
    """Make ``getter`` read ``other`` instead of ``ts``; a waiting one waits for it.

    It is not one of ``other``'s waiters, as no task is of one that errs
    (``_propagate_erred`` drops them): leaving waiting as it errs, a waiter would
    release ``other`` (nothing else needs it), and its getters with it.
    """
    ts.dependents.discard(getter)
    getter.dependencies.discard(ts)
    if ts.waiters:
        ts.waiters.discard(getter)
    getter.add_dependency(other)
    if getter.state == "waiting":
        getter.waiting_on = {other}


def _drop_input(ts: Any, dts: Any, recs: dict) -> None:
    """Unlink ``dts`` from ``ts`` (it reads it no more); recommend forgetting it where no
    task reads it now and no client wants it, as the scheduler does for the inputs of a
    task it forgets (in any state: an erred one too, which a release would leave on the
    scheduler for good, as it would a task in memory, released with no dependent); else
    releasing it where no one else waits for it, as the scheduler does for the inputs of
    a task that errs."""
    ts.dependencies.discard(dts)
    dts.dependents.discard(ts)
    if ts.waiting_on:
        ts.waiting_on.discard(dts)
    if dts.waiters:
        dts.waiters.discard(ts)
    if dts.who_wants:
        return
    if not dts.dependents:
        recs[dts.key] = "forgotten"
    elif dts.state not in ("released", "erred") and not dts.waiters:
        recs[dts.key] = "released"
