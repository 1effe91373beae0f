"""On the scheduler: a block whose input erred keeps the outputs that do not derive from it.

distributed errs every waiting dependent of an erred task (``_propagate_erred``):
a block's task, and so each of its getters, also the outputs that do not derive
from the erred input, which one task per key would compute. Told to err so,
a waiting (or released) block is cut instead (:class:`~.blocks.StreamBlocks` wraps
the scheduler's ``_transition``):

- a new block task (a smaller
  :class:`~dask_gpustreams.integrations.blocks.StreamBlock`, never sent to a
  worker) takes the outputs that derive from no erred input, their getters
  re-indexed, and waits for the inputs it reads;
- the outputs that derive from erred inputs err, each with the blame of an erred
  input it derives from, so that its getter raises that input's own exception
  and ``Client.retry`` of it walks back through it to that input. One block part
  per blame: the block's own key keeps the first (and errs through the
  scheduler's own transition), a new block task each further one.

The block's key goes to an erring part, never to the kept one: a worker that was
sent the block before (it waits again after an input's replica was lost, or its
worker died) may still finish that run, and the scheduler drops a result that
comes for an erred or forgotten key; under a kept key it would take the old tuple
for the new outputs.

:func:`plan_split` reads the scheduler's state and changes nothing; it gives the
reason where a block is not split (it then errs whole, as before), and
:func:`apply_split` relinks the tasks.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Any, NamedTuple

from dask._task_spec import Alias, Task, TaskRef

from dask_gpustreams.integrations.blocks import StreamBlock, get_output

#: The states of a getter that a split can relink: one waiting for the block (the
#: block waits: no getter of it can be queued, processing or in no-worker), one that no
#: one needs now, and one already computed (by an earlier run of the block).
_GETTER_STATES = frozenset({"waiting", "released", "memory"})


class Part(NamedTuple):
    """One part of a split block: its task's run_spec, what it reads, its getters."""

    spec: Task  # the run_spec of the part's block task (under the part's key)
    reads: frozenset  # the keys of the tasks it reads
    getters: list  # TaskStates, in the order of its outputs
    blame: Any  # the TaskState its outputs' errors are blamed on (None: the kept part)


class SplitPlan(NamedTuple):
    """How a block is cut: the part kept, and the parts that err, one per blame."""

    kept: Part | None  # the outputs that derive from no erred input, under a new key
    erred: list[Part]  # the first under the block's own key, the others under new keys


def plan_split(ts: Any, new_key: Callable[[], Hashable]) -> SplitPlan | None | str:
    """How ``ts``, a waiting or released block task with an erred input, is cut (new
    parts' keys from ``new_key()``); None where it errs whole as it is (its outputs
    derive from one blame, ``ts``'s own); or why it is not cut (a string: it then errs
    whole, its outputs with ``ts``'s blame).

    Each output that derives from erred inputs is blamed on the one ``ts`` errs with
    where it derives from it, else on the first, in the block's input order. Outputs
    whose getter was forgotten (no one needs them) go to no part.
    """
    spec = ts.run_spec
    block: StreamBlock = spec.func
    if block.key != ts.key or len(block.outputs) < 2:
        return None  # one output: it derives from every input
    if ts.who_wants:
        return "a client wants the block's own tuple"
    getters = _getters(ts, block)
    if isinstance(getters, str):
        return getters
    args = dict(zip(block.inputs, spec.args, strict=True))
    erred = {d.key: d.exception_blame for d in ts.dependencies if d.state == "erred"}
    blames = {}  # output key -> the blames of the erred inputs it derives from, in order
    for k, arg in args.items():
        for key in _reads(arg) & erred.keys():
            for out in block.derived_from(k):
                blames.setdefault(out, []).append(erred[key])
    if not blames:
        return "no input erred"
    kept = [k for k in block.outputs if k in getters and k not in blames]
    by_blame: dict[Any, list] = {}
    for k in block.outputs:
        if k in getters and k in blames:
            mine = blames[k]
            blame = ts.exception_blame if ts.exception_blame in mine else mine[0]
            by_blame.setdefault(blame, []).append(k)
    if not kept and list(by_blame) in ([], [ts.exception_blame]):
        return None
    if ts.exception_blame in by_blame:  # first: it keeps the block's key and blame
        by_blame = {ts.exception_blame: by_blame.pop(ts.exception_blame), **by_blame}
    parts = [
        _part(spec, block, outs, new_key() if i else ts.key, args, getters, blame)
        for i, (blame, outs) in enumerate(by_blame.items())
    ]
    return SplitPlan(
        _part(spec, block, kept, new_key(), args, getters, None) if kept else None, parts
    )


def apply_split(ts: Any, plan: SplitPlan, new: Mapping[Hashable, Any], tasks: Mapping) -> dict:
    """Relink ``ts`` (the block) and ``new`` (key -> the released new block tasks of
    ``plan``'s parts but the first erring one) as ``plan`` says; return the
    scheduler's recommendations: the kept part waiting where a getter of it waits,
    each further erring part erred with its blame, the inputs no one needs now
    forgotten or released, and ``ts`` forgotten where no part errs under its key.
    The caller then errs ``ts`` (its part's getters with it), where a part does.

    A waiting getter of a new part waits for it (and errs with it, as an erred
    task errs each dependent not in memory); one in memory keeps its value.
    """
    recs: dict = {}
    for part in [plan.kept, *plan.erred[1:]]:
        if part is None:
            continue
        other = new[part.spec.key]
        other.priority = ts.priority
        other.retries = ts.retries
        other.worker_restrictions = ts.worker_restrictions
        other.loose_restrictions = ts.loose_restrictions
        for k in part.reads:
            other.add_dependency(tasks[k])
        for getter in part.getters:
            _move_getter(getter, ts, other)
        _point_getters(part)
        if part.blame is None:
            if any(g.state == "waiting" for g in part.getters):
                for dts in other.dependencies:  # kept by it: erring ``ts`` releases no one
                    if dts.waiters is None:
                        dts.waiters = set()
                    dts.waiters.add(other)
                recs[other.key] = "waiting"
        else:
            other.exception_blame = part.blame
            recs[other.key] = "erred"
    mine = plan.erred[0] if plan.erred else None
    reads = mine.reads if mine else frozenset()
    for dts in [d for d in ts.dependencies if d.key not in reads]:
        _drop_input(ts, dts, recs)
    if mine is None:
        recs[ts.key] = "forgotten"  # (no getter, no dependency left)
    else:
        _point_getters(mine)
        ts.run_spec = mine.spec
        ts.exception_blame = mine.blame
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
    spec: Task,
    block: StreamBlock,
    outputs: list,
    key: Hashable,
    args: Mapping[Hashable, Any],
    getters: Mapping[Hashable, Any],
    blame: Any,
) -> Part:
    """The part of ``block`` (``spec``'s function) that computes ``outputs``, under ``key``."""
    part = block.part(outputs, key)
    refs = [args[k] for k in part.inputs]
    reads = frozenset().union(*map(_reads, refs))
    task = Task(key, part, *refs, _data_producer=spec.data_producer)
    return Part(task, reads, [getters[k] for k in outputs], blame)


def _point_getters(part: Part) -> None:
    """Make the getters of ``part`` read its outputs out of its block's value: with one
    output, a block's value is that output's (an Alias of it), else its tuple."""
    key, n = part.spec.key, len(part.getters)
    for i, getter in enumerate(part.getters):
        getter.run_spec = (
            Task(getter.key, get_output, TaskRef(key), i) if n > 1 else Alias(getter.key, key)
        )


def _move_getter(getter: Any, ts: Any, other: Any) -> None:
    """Make ``getter`` read ``other`` instead of ``ts``; a waiting one waits for it.

    It is not one of ``other``'s waiters: an erring ``other`` errs it all the same, and
    no task is a waiter of one that errs (``_propagate_erred`` drops them): leaving
    waiting as it errs, a waiter would release ``other`` (nothing else needs it), and
    its getters with it. A kept ``other`` finds its waiters as it goes waiting.
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
