"""On the scheduler: a block whose input erred keeps the outputs that do not derive from it.

distributed errs every waiting dependent of an erred task (``_propagate_erred``):
a block's task, and so each of its getters, also the outputs that do not derive
from the erred input, which one task per key would compute. Told to err so,
a waiting (or released) block is cut instead (:class:`~.blocks.StreamBlocks` wraps
the scheduler's ``_transition``):

- a new block task (a smaller
  :class:`~dask_gpustreams.integrations.blocks.StreamBlock`, never sent to a
  worker) takes the outputs that derive from no erred input, their getters
  re-indexed, and the blocks that read them straight re-pointed to it; it waits
  for the inputs it reads;
- the outputs that derive from erred inputs err, each with the blame of an erred
  input it derives from, so that its getter raises that input's own exception
  and ``Client.retry`` of it walks back through it to that input. One block part
  per blame: the block's own key keeps the first (and errs through the
  scheduler's own transition), a new block task each further one.

The block's key goes to an erring part, never to the kept one: a worker that was
sent the block before (it waits again after an input's replica was lost, or its
worker died) may still finish that run. The scheduler drops a result that comes
for an erred or forgotten key, or under another run's id; but one that comes while
the key waits, under the id of its last run, it takes as the key's value: the old
tuple for the new outputs, had the kept part kept the key.

:func:`plan_split` reads the scheduler's state and changes nothing; it gives the
reason where a block is not split (it then errs whole, as before), and
:func:`apply_split` relinks the tasks.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Any, NamedTuple

from dask._task_spec import Alias, Task, TaskRef

from dask_gpustreams.integrations.blocks import StreamBlock, get_output, read_straight

#: The states of a dependent that a split can relink: one waiting for the block (the
#: block waits: no dependent of it can be queued, processing or in no-worker), one that
#: no one needs now, one already computed (by an earlier run of the block), and one
#: erred already (by another input: relinked, a retry of it reads the right part).
_RELINKED_STATES = frozenset({"waiting", "released", "memory", "erred"})


class Part(NamedTuple):
    """One part of a split block: its task's run_spec, what it reads, its outputs."""

    spec: Task  # the run_spec of the part's block task (under the part's key)
    reads: frozenset  # the keys of the tasks it reads
    outputs: tuple  # its outputs' keys, in its tuple's order
    blame: Any  # the TaskState its outputs' errors are blamed on (None: the kept part)


class SplitPlan(NamedTuple):
    """How a block is cut: the part kept, the parts that err, and who reads them."""

    kept: Part | None  # the outputs that derive from no erred input, under a new key
    erred: list[Part]  # one per blame: the first under the block's own key, the others new
    getters: dict  # output key -> its getter's TaskState
    straight: dict  # a block's TaskState that reads outputs straight -> {its input: output}


def plan_split(ts: Any, new_key: Callable[[], Hashable]) -> SplitPlan | None | str:
    """How ``ts``, a waiting or released block task with an erred input, is cut (new
    parts' keys from ``new_key()``); None where it errs whole as it is (its outputs
    derive from one blame, ``ts``'s own); or why it is not cut (a string: it then errs
    whole, its outputs with ``ts``'s blame).

    Each output that derives from erred inputs is blamed on the one ``ts`` errs with
    where it derives from it, else on the first, in the block's input order. Outputs
    that no getter and no block reads (no one needs them) go to no part.
    """
    spec = ts.run_spec
    block: StreamBlock = spec.func
    if block.key != ts.key or len(block.outputs) < 2:
        return None  # one output: it derives from every input
    if ts.who_wants:
        return "a client wants the block's own tuple"
    readers = _readers(ts, block)
    if isinstance(readers, str):
        return readers
    getters, straight = readers
    needed = set(getters).union(*(reads.values() for reads in straight.values()))
    args = dict(zip(block.inputs, spec.args, strict=True))
    erred = {d.key: d.exception_blame for d in ts.dependencies if d.state == "erred"}
    blames = {}  # output key -> the blames of the erred inputs it derives from, in order
    for k, arg in args.items():
        for key in _reads(arg) & erred.keys():
            for out in block.derived_from(k):
                blames.setdefault(out, []).append(erred[key])
    if not blames:
        return "no input erred"
    kept = [k for k in block.outputs if k in needed and k not in blames]
    by_blame: dict[Any, list] = {}
    for k in block.outputs:
        if k in needed and k in blames:
            mine = blames[k]
            blame = ts.exception_blame if ts.exception_blame in mine else mine[0]
            by_blame.setdefault(blame, []).append(k)
    if not kept and list(by_blame) in ([], [ts.exception_blame]):
        return None
    if ts.exception_blame in by_blame:  # first: it keeps the block's key and blame
        by_blame = {ts.exception_blame: by_blame.pop(ts.exception_blame), **by_blame}
    parts = [
        _part(spec, block, outs, new_key() if i else ts.key, args, blame)
        for i, (blame, outs) in enumerate(by_blame.items())
    ]
    kept_part = _part(spec, block, kept, new_key(), args, None) if kept else None
    return SplitPlan(kept_part, parts, getters, straight)


def apply_split(ts: Any, plan: SplitPlan, new: Mapping[Hashable, Any], tasks: Mapping) -> dict:
    """Relink ``ts`` (the block) and ``new`` (key -> the released new block tasks of
    ``plan``'s parts but the first erring one) as ``plan`` says; return the
    scheduler's recommendations: the kept part waiting where a task that reads it
    waits, each further erring part erred with its blame, the inputs no one needs now
    forgotten or released, and ``ts`` forgotten where no part errs under its key.
    The caller then errs ``ts`` (and what reads its part with it), where a part does.

    A waiting getter or block that reads a new part waits for it (and errs with it, as
    an erred task errs each dependent not in memory); a getter in memory keeps its value.
    """
    recs: dict = {}
    mine = plan.erred[0] if plan.erred else None
    parts = {part.spec.key: part for part in [plan.kept, *plan.erred] if part is not None}
    tasks_of = {key: ts if key == ts.key else new[key] for key in parts}  # (ts: mine's)
    where = {}  # output key -> (its part's key, its index there; None: the part's one output)
    for key, part in parts.items():
        n = len(part.outputs)
        where.update((out, (key, i if n > 1 else None)) for i, out in enumerate(part.outputs))
    for key, part in parts.items():
        other = tasks_of[key]
        if other is ts:
            continue
        other.priority = ts.priority
        other.retries = ts.retries
        other.worker_restrictions = ts.worker_restrictions
        other.loose_restrictions = ts.loose_restrictions
        for k in part.reads:
            other.add_dependency(tasks[k])
        if part.blame is not None:
            other.exception_blame = part.blame
            recs[key] = "erred"
    for out, getter in plan.getters.items():
        key, i = where[out]
        _relink(getter, ts, [tasks_of[key]])
        getter.run_spec = Alias(out, key) if i is None else Task(out, get_output, TaskRef(key), i)
    for reader, reads in plan.straight.items():
        _relink(reader, ts, [tasks_of[key] for key in {where[out][0] for out in reads.values()}])
        _repoint(reader, {k: where[out] for k, out in reads.items()})
    if plan.kept is not None:
        kept = tasks_of[plan.kept.spec.key]
        if any(dts.state == "waiting" for dts in kept.dependents):
            for dts in kept.dependencies:  # kept by it: erring ``ts`` releases no one
                if dts.waiters is None:
                    dts.waiters = set()
                dts.waiters.add(kept)
            recs[kept.key] = "waiting"
    reads = mine.reads if mine else frozenset()
    for dts in [d for d in ts.dependencies if d.key not in reads]:
        _drop_input(ts, dts, recs)
    if mine is None:
        recs[ts.key] = "forgotten"  # (nothing reads it, it reads nothing)
    else:
        ts.run_spec = mine.spec
        ts.exception_blame = mine.blame
    return recs


def _readers(ts: Any, block: StreamBlock) -> tuple[dict, dict] | str:
    """The dependents of block task ``ts``: output key -> its getter's TaskState, and each
    block that reads outputs straight from its tuple -> {its input key: output key}; or
    why it cannot be split (another kind of dependent, or one in a state a split does
    not relink)."""
    index = {k: i for i, k in enumerate(block.outputs)}
    getters: dict = {}
    straight: dict = {}
    for dts in ts.dependents:
        spec = dts.run_spec
        if type(spec) is not Task:
            return f"{dts.key!r} reads it and is no getter nor block"
        if spec.func is get_output and spec.args == (TaskRef(ts.key), index.get(dts.key)):
            getters[dts.key] = dts
        elif type(spec.func) is StreamBlock:
            reads = {k: src for k, src in spec.func.sources.items() if src[0] == ts.key}
            if not reads or any(i is None for _, i in reads.values()):
                return f"block {dts.key!r} reads it and not as its tuple"
            straight[dts] = {k: block.outputs[i] for k, (_, i) in reads.items()}
        else:
            return f"{dts.key!r} reads it and is no getter nor block"
        if dts.state not in _RELINKED_STATES:
            return f"its reader {dts.key!r} is {dts.state}"
    return getters, straight


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
    blame: Any,
) -> Part:
    """The part of ``block`` (``spec``'s function) that computes ``outputs``, under ``key``."""
    part = block.part(outputs, key)
    refs = [args[k] for k in part.inputs]
    reads = frozenset().union(*map(_reads, refs))
    task = Task(key, part, *refs, _data_producer=spec.data_producer)
    return Part(task, reads, tuple(outputs), blame)


def _relink(dts: Any, ts: Any, parts: list) -> None:
    """Make ``dts`` (a getter, or a block reading straight) read ``parts`` (TaskStates)
    instead of ``ts``, unless ``ts`` is one of them; a waiting one waits for them.

    It is no waiter of a part: an erring part errs it all the same, and no task is a
    waiter of one that errs (``_propagate_erred`` drops them): leaving waiting as it
    errs, a waiter would release that part (nothing else needs it), and its other
    readers with it. The kept part finds its waiters as it goes waiting.
    """
    if ts not in parts:
        _unlink(dts, ts)
    for other in parts:
        if other is not ts:
            dts.add_dependency(other)
            if dts.state == "waiting":
                if dts.waiting_on is None:
                    dts.waiting_on = set()
                dts.waiting_on.add(other)


def _repoint(reader: Any, reads: Mapping[Hashable, tuple[Hashable, int | None]]) -> None:
    """Give ``reader``, a block task, ``reads``: its inputs read straight from the parts
    of a split block -> (the part's key, the index there)."""
    spec = reader.run_spec
    block: StreamBlock = spec.func
    sources = {**block.sources, **reads}
    args = [
        read_straight(*reads[k]) if k in reads else arg
        for k, arg in zip(block.inputs, spec.args, strict=True)
    ]
    reader.run_spec = Task(
        spec.key, block.with_sources(sources), *args, _data_producer=spec.data_producer
    )


def _drop_input(ts: Any, dts: Any, recs: dict) -> None:
    """Unlink ``dts`` from ``ts`` (it reads it no more); recommend forgetting it where no
    task reads it now and no client wants it, as the scheduler does for the inputs of a
    task it forgets (in any state: an erred one too, which a release would leave on the
    scheduler for good, as it would a task in memory, released with no dependent); else
    releasing it where no one else waits for it, as the scheduler does for the inputs of
    a task that errs."""
    _unlink(ts, dts)
    if dts.who_wants:
        return
    if not dts.dependents:
        recs[dts.key] = "forgotten"
    elif dts.state not in ("released", "erred") and not dts.waiters:
        recs[dts.key] = "released"


def _unlink(dependent: Any, dependency: Any) -> None:
    """Make ``dependent`` read ``dependency`` no more: neither a dependency of it, nor
    waited on by it, nor waited for."""
    dependent.dependencies.discard(dependency)
    dependency.dependents.discard(dependent)
    if dependent.waiting_on:
        dependent.waiting_on.discard(dependency)
    if dependency.waiters:
        dependency.waiters.discard(dependent)
