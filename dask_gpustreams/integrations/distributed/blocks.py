"""On the scheduler: stream blocks formed when a graph is submitted (``gpustreams.blocks``).

:class:`StreamBlocks` is a :class:`distributed.SchedulerPlugin` that each
worker's :class:`~dask_gpustreams.StreamsPlugin` installs and tells its
``gpustreams.blocks`` setting. While every worker says ``auto``, its
``update_graph`` hook regroups each submitted graph (``client.get``,
``compute``, ``persist``, ``submit``: every route ends there) before the
scheduler transitions any of its tasks: the groups that
:func:`~dask_gpustreams.integrations.blocks.partition` picks become one task
each, whose function is a :class:`~dask_gpustreams.integrations.blocks.StreamBlock`.

- A group with one output (a key the client wants, or one that a task outside
  the group reads) becomes that key's task: no extra task at all.
- A group with several outputs becomes a task of its own
  (``gpustreams-block-<token>``), and each output a getter task that picks
  its value out of the block's tuple, under the output's own key. A getter
  is a coroutine (:func:`get_output`): it runs on the worker's event loop,
  with no hop to a worker thread and back.
- The other keys of the group are forgotten: nothing outside needs them. A later
  graph that defines a live block's output (the same keys computed again, or a
  graph whose keys do not reach that definition) takes it as a future of that
  key: the definitions of live outputs are taken out of submitted graphs
  (:meth:`StreamBlocks._taskstates`), else the scheduler would link the output
  to the forgotten keys.
- ``gpustreams.block-size`` (the smallest that the workers say) bounds what
  a block holds until it ends: a group whose inputs from outside and outputs
  number at most that stays one block, up to 4,096 tasks
  (``MAX_BLOCK_TASKS``); a larger one is cut into blocks of at most that many
  tasks. So no block holds more
  outputs than that.

The block is then an ordinary task: work stealing, worker loss (it is
recomputed whole) and errors (a task's exception, or its kernel failure with
the ``KernelError`` naming the inner key, errs the outputs that derive from
it) behave as for any task. An input that errs errs only the outputs that
derive from it: the scheduler would err the whole block, which is split
first (:mod:`.split`, where it can be). Only new tasks in ``released`` state, with no
retries, no restrictions, no annotations that change where or how they run
and no erred inputs, are grouped: a task with retries runs again alone where
it fails, and inside a block its failure would err the outputs that derive
from it at once. The
scheduler cannot tell a GPU task from one that blocks the host: inside a
block, the launcher learns such task groups (more than 5 ms of host time a
call) and runs them on its host threads.

Why here and not in the graph optimization (``delayed_optimize`` /
``array_optimize``): see ``docs/cluster.md``. In short, the optimization hook
never sees ``client.get`` graphs, does not know the cluster, and must be set
on every client; this hook sees every submission, knows the workers and
which keys the clients want, and the regrouping happens before any task has
left ``released``.
"""

from __future__ import annotations

import functools
import logging
import operator
import uuid
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from time import time
from typing import Any, NamedTuple

from dask._task_spec import Alias, Task, TaskRef
from distributed import SchedulerPlugin

from dask_gpustreams.config import StreamsConfig
from dask_gpustreams.integrations.blocks import StreamBlock, get_output, partition, read_straight
from dask_gpustreams.integrations.distributed.split import SplitPlan, apply_split, plan_split

logger = logging.getLogger("dask_gpustreams")

#: Annotations that do not change where or how a task runs (a block may hold such tasks).
_NEUTRAL_ANNOTATIONS = frozenset({"span", "priority", "retries", "fuse"})

#: ``gpustreams.block-size`` where no worker said (the YAML default).
DEFAULT_BLOCK_SIZE = StreamsConfig.block_size

#: Prefix of the keys of blocks with several outputs.
BLOCK_PREFIX = "gpustreams-block"


class StreamBlocks(SchedulerPlugin):
    """Group the chains, parts and bands of each graph into block tasks (see ``partition``)."""

    name = "gpustreams-blocks"
    idempotent = True

    def __init__(self) -> None:
        #: worker address -> its ``gpustreams.blocks`` setting, while its plugin is active.
        self.modes: dict[str, str] = {}
        #: worker address -> its ``gpustreams.block-size`` (the bound on what a block holds).
        self.sizes: dict[str, int] = {}
        #: worker address -> the modules of its plugin's host-side task functions
        #: (``StreamsPlugin.host_modules``), and the prefixes of the modules whose tasks no
        #: block takes: distributed's (P2P) and those of every worker.
        self.host_modules: dict[str, tuple[str, ...]] = {}
        self._host_side: tuple[str, ...] = ("distributed",)
        #: Blocks formed, and tasks they stand for, since the scheduler started (diagnostics).
        self.blocks_formed = 0
        self.tasks_grouped = 0
        self.largest = 0  # tasks in the largest block formed
        #: Blocks split because an input erred (:meth:`_split`), since the scheduler started.
        self.blocks_split = 0
        #: The outputs of live blocks (key -> TaskState), which :meth:`_taskstates` hides.
        self.outputs: dict[Hashable, Any] = {}
        #: Whether this distributed lacks the hook that blocks need (they stay off).
        self.unsupported = False
        #: The keys of the tasks that the graph being submitted made (:meth:`_taskstates`),
        #: read by its ``update_graph``: only those may join a block. A task that was there
        #: before may be known to a worker with the dependencies of its definition, which
        #: a worker never drops: given a block's, it would wait there for one it cannot get.
        self._created: set = set()

    async def start(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        scheduler.handlers["gpustreams_blocks"] = self.set_mode
        generate = getattr(scheduler, "_generate_taskstates", None)
        if generate is None:
            logger.warning(
                "gpustreams: this distributed's Scheduler has no _generate_taskstates; "
                "stream blocks are off (gpustreams.blocks: auto is ignored)"
            )
            self.unsupported = True
        elif getattr(generate, "func", None) != self._taskstates:  # (a bound method is new)
            scheduler._generate_taskstates = functools.partial(self._taskstates, generate)
        transition = getattr(scheduler, "_transition", None)
        if transition is None:
            logger.warning(
                "gpustreams: this distributed's Scheduler has no _transition; a block "
                "whose input errs errs whole (every output), not only what derives from it"
            )
        elif getattr(transition, "func", None) != self._transition:
            scheduler._transition = functools.partial(self._transition, transition)

    def _transition(
        self,
        transition: Callable[..., tuple],
        key: Hashable,
        finish: str,
        *args: Any,
        **kwargs: Any,
    ) -> tuple:
        """The scheduler's ``_transition`` (``transition``), but a waiting or released block
        told to err because an input erred (no worker's report: no ``kwargs``) is split
        first (:meth:`_split`), so that only the outputs that derive from that input err,
        each with the blame of an erred input it derives from."""
        if finish == "erred" and not kwargs:
            split = self._split(key)
            if split is not None:
                recommendations, errs = split
                if not errs:
                    return recommendations, {}, {}
                recs, client_msgs, worker_msgs = transition(key, finish, *args, **kwargs)
                return {**recommendations, **recs}, client_msgs, worker_msgs
        return transition(key, finish, *args, **kwargs)

    def _split(self, key: Hashable) -> tuple[dict, bool] | None:
        """The recommendations after block ``key``, waiting or released, is split (see
        :mod:`.split`), and whether it errs still (a part of it under its key); None where
        it is no such block or is not split (it errs whole)."""
        ts = self.scheduler.tasks.get(key)
        if ts is None or ts.state not in ("waiting", "released") or ts.exception_blame is None:
            return None
        spec = ts.run_spec
        if type(spec) is not Task or type(spec.func) is not StreamBlock:
            return None
        try:
            plan = plan_split(ts, lambda: (f"{BLOCK_PREFIX}-{uuid.uuid4().hex}", 0))
        except Exception:  # nothing is changed yet: the block errs whole
            logger.warning("gpustreams: block %r not split, it errs whole", key, exc_info=True)
            return None
        if not isinstance(plan, SplitPlan):
            if plan is not None:
                logger.debug("gpustreams: block %r errs whole: %s", key, plan)
            return None
        new = {
            part.spec.key: self._new_block(part.spec.key, part.spec, ts)
            for part in [plan.kept, *plan.erred[1:]]
            if part is not None
        }
        blames = [part.blame.key for part in plan.erred]
        recommendations = apply_split(ts, plan, new, self.scheduler.tasks)
        self.blocks_split += 1
        logger.info(
            "gpustreams: block %r split as its inputs erred: %d outputs kept (as %r), "
            "%d err with the blames %r",
            key,
            len(plan.kept.outputs) if plan.kept else 0,
            plan.kept.spec.key if plan.kept else None,
            sum(len(part.outputs) for part in plan.erred),
            blames,
        )
        return recommendations, bool(plan.erred)

    def _taskstates(self, generate: Callable[..., tuple], *args: Any, **kwargs: Any) -> tuple:
        """The scheduler's ``_generate_taskstates`` (``generate``), with the definitions of
        live blocks' outputs taken out of its graph (``dsk``) first.

        The scheduler links every key it holds that a graph defines, reached from
        that graph's keys or not, to the keys its definition names. A block's inner
        keys are forgotten: linked to one, an output would wait for a task that never
        runs, and one the scheduler does not hold fails the graph with a ``KeyError``,
        tasks half made left behind (the same keys computed again, or a ``dask.array``
        graph whose persisted layer comes as futures but whose layers below it stay).
        Taken out, a live output is what a future in a graph is: a key the scheduler
        holds, which the graph's keys that read it wait for.
        """
        outputs = self.outputs
        dsk = kwargs["dsk"] if "dsk" in kwargs else args[1] if len(args) > 1 else None
        if outputs and dsk:
            tasks = self.scheduler.tasks
            for key in outputs.keys() & dsk.keys():  # walks the smaller of the two
                if tasks.get(key) is outputs[key]:
                    del dsk[key]
        result = generate(*args, **kwargs)
        if self.active():  # the tasks this graph made (new TaskStates): those a block may take
            new = result[1] if type(result) is tuple and len(result) > 1 else ()
            self._created = {ts.key for ts in new}
        return result

    def restart(self, scheduler: Any) -> None:
        """The scheduler forgets every task at once (no transitions): so do the outputs."""
        self.outputs.clear()

    def set_mode(
        self,
        worker: str,
        mode: str | None,
        size: int | None = None,
        host_modules: tuple[str, ...] = (),
    ) -> None:
        """Handler: ``worker``'s plugin has ``gpustreams.blocks`` = ``mode`` (None: removed),
        ``gpustreams.block-size`` = ``size`` and ``host_modules``, whose functions' tasks
        wait on the host for their inputs' work and so never run inside a block."""
        if mode is None:
            self.remove_worker(None, worker)
            return
        self.modes[worker] = mode
        if size is not None:
            self.sizes[worker] = size
        # One module named as a string is a prefix, as str.startswith reads it on the worker.
        self.host_modules[worker] = (
            (host_modules,) if isinstance(host_modules, str) else tuple(host_modules)
        )
        self._host_modules_changed()

    def remove_worker(self, scheduler: Any, worker: str, **kwargs: Any) -> None:
        self.modes.pop(worker, None)
        self.sizes.pop(worker, None)
        if self.host_modules.pop(worker, None) is not None:
            self._host_modules_changed()

    def _host_modules_changed(self) -> None:
        """Recompute the prefixes :meth:`_candidate` reads (once per change, not per task)."""
        modules = {m for ms in self.host_modules.values() for m in ms}
        self._host_side = ("distributed", *sorted(modules))

    def transition(
        self, key: Hashable, start: str, finish: str, *args: Any, stimulus_id: str, **kwargs: Any
    ) -> None:
        """Forget a forgotten output; count a block's reschedules in its ``StreamBlock``
        (on the event loop, every transition).

        A block skipped by other tasks' failures raises ``BlockSkipped``, and
        its worker ``Reschedule`` (the scheduler hears it as a ``processing ->
        released`` transition whose stimulus is the worker's ``reschedule-...``).
        The count travels with the block's run_spec to its next worker, where
        past ``StreamBlock.reschedules`` it fails (``BlockSkippedError``) instead
        of being rescheduled once more, forever. Work stealing and worker loss
        (other stimuli) do not count.
        """
        if finish == "forgotten":
            self.outputs.pop(key, None)
            return
        if start == "processing" and finish == "released" and stimulus_id.startswith("reschedule"):
            ts = self.scheduler.tasks.get(key)
            spec = None if ts is None else ts.run_spec
            if type(spec) is Task and type(spec.func) is StreamBlock:
                spec.func.rescheduled += 1

    def block_size(self) -> int:
        """The bound on what a block holds: the workers' smallest ``gpustreams.block-size``."""
        sizes = self.sizes
        known = [sizes[w] for w in self.scheduler.workers if w in sizes]
        return min(known) if known else DEFAULT_BLOCK_SIZE

    def active(self) -> bool:
        """Whether blocks are formed now: every worker has the plugin with ``blocks: auto``."""
        workers = self.scheduler.workers
        modes = self.modes
        return (
            not self.unsupported and bool(workers) and all(modes.get(w) == "auto" for w in workers)
        )

    def update_graph(
        self, scheduler: Any, *, client: str, tasks: list, stimulus_id: str, **kwargs: Any
    ) -> None:
        created, self._created = self._created, set()
        if not self.active():
            return
        try:
            orphans, plan = self._plan(client, tasks, created)
        except Exception as e:  # nothing is changed yet: the graph runs task per key
            logger.warning(
                "gpustreams: stream blocks not formed for a graph of %d tasks (%s: %s); "
                "its tasks run one per key",
                len(tasks),
                type(e).__name__,
                e,
                exc_info=True,
            )
            return
        if orphans:  # tasks a collision left that nothing needs (see _plan)
            self.scheduler.transitions(orphans, stimulus_id)
        self._apply(plan, stimulus_id)

    # --- the regrouping: a plan (which changes nothing), then its application -------------

    def _candidate(self, ts: Any, client: str, apart: dict[int, bool]) -> bool:
        """Whether ``ts``, just submitted, may run inside a block.

        ``apart`` caches, for one graph, whether a function's tasks run apart (by
        ``id``: the graph's tasks hold their functions while it is planned); most
        tasks of a graph share a few functions, and ``is_coro`` inspects each.
        """
        spec = ts.run_spec
        if ts.state != "released" or ts.actor or ts.waiters or ts.retries:
            return False
        if isinstance(spec, Task):
            func = spec.func
            own = apart.get(id(func))
            if own is None:
                own = apart[id(func)] = spec.is_coro or _module(func).startswith(self._host_side)
            if own:
                return False  # coroutines, P2P shuffles, host-side tasks: a task of their own
        elif not isinstance(spec, Alias):
            return False  # data, or no run_spec yet
        if ts.who_wants and any(cs.client_key != client for cs in ts.who_wants):
            return False
        if ts.worker_restrictions or ts.host_restrictions or ts.resource_restrictions:
            return False
        if ts.annotations and not _NEUTRAL_ANNOTATIONS.issuperset(ts.annotations):
            return False
        return all(d.exception_blame is None for d in ts.dependencies)

    def _plan(self, client: str, keys: list, created: set) -> tuple[dict, list[_BlockPlan]]:
        """The tasks to forget and the blocks to form for the graph of ``keys``; reads the
        scheduler, changes nothing.

        A key submitted again with other dependencies (one that no block holds: a
        collision, dask/dask#9888) keeps its task, which the scheduler links to none
        of them: those that nothing else needs come as tasks nothing needs. Grouped,
        they made a block with no output, a task left forever; they are forgotten.
        Only tasks the graph made (``created``) may join a block (see :attr:`_created`).
        """
        tasks = self.scheduler.tasks
        touched = [ts for k in keys if (ts := tasks.get(k)) is not None]
        orphans = [ts for ts in touched if _unneeded(ts)]
        if orphans:
            dead = _forgotten_with(orphans)
            touched = [ts for ts in touched if ts not in dead]
        forget = {ts.key: "forgotten" for ts in orphans}
        new = {ts.key for ts in touched if ts.state == "released"}
        apart: dict[int, bool] = {}
        candidates = [
            ts.key for ts in touched if ts.key in created and self._candidate(ts, client, apart)
        ]
        if len(candidates) < 2:
            return forget, []
        level = _levels(touched, new)
        bands: list = []
        workers = self.scheduler.workers
        groups = partition(
            candidates,
            lambda k: [d.key for d in tasks[k].dependencies],
            lambda k: [d.key for d in tasks[k].dependents],
            level,
            len(workers),
            self.block_size(),
            lambda k: tasks[k].priority,
            bands,
            sum(ws.nthreads for ws in workers.values()),
            lambda k: bool(tasks[k].who_wants),
        )
        # Root-task queuing: a block holding a task that the scheduler would queue (a
        # root-ish task, is_rootish) is itself root-ish, as Task.fuse makes a fused task
        # a data producer if any of its tasks is. It gets no worker restriction (which
        # would make is_rootish false and send it to its worker at once, saturated or
        # not): with worker-saturation finite it waits in the queue for a free thread.
        is_rootish = self.scheduler.is_rootish
        rootish = [any(is_rootish(tasks[k]) for k in group) for group in groups]
        places = self._spread(groups, bands, rootish)
        layouts = [_layout([tasks[k] for k in group]) for group in groups]
        block_of = {ts: b for b, layout in enumerate(layouts) for ts in layout.members}
        direct = _direct_reads(layouts, places, len(self.scheduler.workers) == 1, block_of)
        return forget, [
            _block_plan(layout, place, root, direct, b, block_of)
            for b, (layout, place, root) in enumerate(zip(layouts, places, rootish, strict=True))
        ]

    def _spread(self, groups: list[list], bands: list, rootish: list[bool]) -> list[str | None]:
        """The worker each group of a band is meant for (None: distributed decides).

        The bins of one band (see :func:`partition`) go to different workers, each
        to the one that holds, or is meant to compute, most of its inputs
        (ties: the worker given the fewest tasks so far). Distributed would put
        them all where their inputs are: on the worker of the first band.

        A ``rootish`` group gets none: it is queued as a root task, and the
        queue spreads such groups over the workers itself (each to the least
        busy worker with a free thread, when one is free); its tasks count
        as on no worker for the next band's votes. So a restricted block holds
        no root-ish task: task per key, the scheduler would not have queued
        any of its tasks either.
        """
        places: list[str | None] = [None] * len(groups)
        workers = sorted(self.scheduler.workers)
        if len(workers) < 2:
            return places
        tasks = self.scheduler.tasks
        by_band: dict[int, dict[int, list[int]]] = {}
        for i, tag in enumerate(bands):
            if tag is not None and not rootish[i]:
                by_band.setdefault(tag[0], {}).setdefault(tag[1], []).append(i)
        where: dict[Hashable, str] = {}
        given = dict.fromkeys(workers, 0)
        for band in sorted(by_band):
            bins = by_band[band]
            score: dict[int, dict[str, int]] = {}
            for b, indices in bins.items():
                votes = score[b] = dict.fromkeys(workers, 0)
                for i in indices:
                    inside = set(groups[i])
                    for k in groups[i]:
                        for d in tasks[k].dependencies:
                            if d.key in inside:
                                continue
                            if d.key in where:
                                votes[where[d.key]] += 1
                            for ws in d.who_has or ():
                                if ws.address in votes:
                                    votes[ws.address] += 1
            free = list(workers)
            size = {b: sum(len(groups[i]) for i in bins[b]) for b in bins}
            for b in sorted(bins, key=lambda b: (-size[b], b)):
                votes = score[b]
                best = max(free, key=lambda w: (votes[w], -given[w]))
                free.remove(best)
                given[best] += size[b]
                for i in bins[b]:
                    places[i] = best
                    where.update(dict.fromkeys(groups[i], best))
        return places

    def _apply(self, plan: list[_BlockPlan], stimulus_id: str) -> None:
        """Make the blocks of ``plan``, then forget the keys they replace.

        The relinking is undone if any of it raises, so the graph is either
        regrouped whole or left as submitted (and runs task per key).
        """
        undo: list[Callable[[], None]] = []
        try:
            for block in plan:
                self._form(block, undo)
            tasks = self.scheduler.tasks
            for block in plan:  # every block task exists now: link the direct reads
                head = block.outputs[0] if block.key is None else tasks[block.key]
                for key in block.reads:
                    head.add_dependency(tasks[key])
        except Exception as e:
            for step in reversed(undo):
                step()
            logger.warning(
                "gpustreams: stream blocks not formed for a graph (%s: %s), undone; "
                "its tasks run one per key",
                type(e).__name__,
                e,
                exc_info=True,
            )
            return
        forget: dict[Hashable, str] = {}
        for block in plan:
            self.blocks_formed += 1
            self.tasks_grouped += len(block.members)
            self.largest = max(self.largest, len(block.members))
            forget.update(block.forget)
            self.outputs.update((ts.key, ts) for ts in block.outputs if ts.key not in block.forget)
        if forget:
            self.scheduler.transitions(forget, stimulus_id)

    def _form(self, block: _BlockPlan, undo: list[Callable[[], None]]) -> None:
        """Relink the scheduler's tasks as ``block`` says; append to ``undo`` what reverts it."""
        for ts in block.members:
            old = (ts.run_spec, ts.priority, ts.worker_restrictions)
            old_deps, loose = set(ts.dependencies), ts.loose_restrictions
            undo.append(functools.partial(_restore, ts, old_deps, *old, loose))
            for d in old_deps:
                ts.dependencies.discard(d)
                d.dependents.discard(ts)
        if block.key is None:
            head = block.outputs[0]
            head.run_spec = block.spec
        else:
            head = self.scheduler.new_task(block.key, block.spec, "released", self._computation())
            undo.append(functools.partial(self._drop_task, head))
            self._join_span(head, block.members[0])
            for ts, getter in zip(block.outputs, block.getters, strict=True):
                if getter is not None:  # None: read by other blocks only, straight from it
                    ts.run_spec = getter
                    ts.add_dependency(head)
        head.priority = block.priority
        # A bin of a band: meant for this worker, else any. Never a root-ish block (one
        # holding a task the scheduler would queue, see _plan): a restriction would skip
        # root-task queuing (is_rootish is false for a restricted task).
        if block.worker is not None:
            head.worker_restrictions = {block.worker}
            head.loose_restrictions = True
        for d in block.inputs:
            head.add_dependency(d)

    def _drop_task(self, ts: Any) -> None:
        """Undo: forget ``ts``, a block task made by :meth:`_form` (its links are undone first)."""
        for d in list(ts.dependencies):
            ts.dependencies.discard(d)
            d.dependents.discard(ts)
        for d in list(ts.dependents):
            d.dependencies.discard(ts)
            ts.dependents.discard(d)
        if self.scheduler.tasks.get(ts.key) is ts:
            self.scheduler.transitions({ts.key: "forgotten"}, f"gpustreams-blocks-undo-{time()}")

    def _join_span(self, ts: Any, like: Any) -> None:
        """Put ``ts``'s new task group in the span of ``like``'s (spans need one per group)."""
        group = ts.group
        span_id = like.group.span_id
        extension = self.scheduler.extensions.get("spans")
        if group.span_id is None and span_id is not None and extension is not None:
            group.span_id = span_id
            extension.spans[span_id].groups.add(group)

    def _computation(self) -> Any:
        computations = self.scheduler.computations
        return computations[-1] if computations else None

    def _new_block(self, key: Hashable, spec: Task, like: Any) -> Any:
        """A new block task ``key`` (released), in the computation and span of ``like``'s."""
        group = like.group
        computation = next(
            (c for c in reversed(self.scheduler.computations) if group in c.groups), None
        )
        ts = self.scheduler.new_task(key, spec, "released", computation or self._computation())
        self._join_span(ts, like)
        return ts


@dataclass
class _BlockPlan:
    """One block to make: every object it needs, built before anything is changed."""

    members: list  # TaskStates, in priority order
    inputs: list  # TaskStates outside that its tasks read, but those in ``reads``' tuples
    outputs: list  # the tuple's: a None getter's is read by a block only, and forgotten
    spec: Task  # the run_spec of the block's task
    key: Hashable | None  # the block task's own key (several outputs), or None
    getters: list  # the outputs' run_specs (several outputs; None: no getter needed)
    priority: Any
    forget: dict = field(default_factory=dict)  # the members no one outside needs
    worker: str | None = None  # the worker a bin of a band is meant for
    reads: list = field(default_factory=list)  # keys of the blocks it reads straight from


class _Layout(NamedTuple):
    """A block's tasks before any is changed: ``key`` is None where it has one output."""

    members: list  # TaskStates, in dependency order
    inputs: list  # TaskStates outside the block that its tasks read
    outputs: list  # members a client wants or a task outside reads
    key: Hashable | None


def dependency_order(members: list) -> list:
    """``members`` (TaskStates) in priority order, each moved after its dependencies among them.

    A block's tasks run in this order on the host (``StreamBlock.__call__``); the
    scheduler's priority alone is no dependency order where user priorities
    (annotations) rank a task above what it reads.
    """
    by_priority = operator.attrgetter("priority")
    inside = set(members)
    placed: set = set()
    ordered = []
    for root in sorted(members, key=by_priority):
        stack = [root]
        while stack:
            ts = stack[-1]
            waiting = [d for d in ts.dependencies if d in inside and d not in placed]
            if waiting:
                stack.append(min(waiting, key=by_priority))
                continue
            stack.pop()
            if ts not in placed:
                placed.add(ts)
                ordered.append(ts)
    return ordered


def _layout(members: list) -> _Layout:
    """The layout of the block of ``members`` (TaskStates): inputs, outputs and key."""
    members = dependency_order(members)
    inside = set(members)
    inputs: dict[Any, None] = {}
    outputs = []
    for ts in members:
        for d in ts.dependencies:
            if d not in inside:
                inputs[d] = None
        if ts.who_wants or any(d not in inside for d in ts.dependents):
            outputs.append(ts)
    key = None if len(outputs) == 1 else (f"{BLOCK_PREFIX}-{uuid.uuid4().hex}", 0)
    return _Layout(members, list(inputs), outputs, key)


def _direct_reads(
    layouts: list[_Layout], places: list[str | None], one_worker: bool, block_of: Mapping[Any, int]
) -> dict[tuple[int, Any], tuple[Hashable, int]]:
    """``(reader, input) -> (block key, index)``: the inputs a block reads straight from
    another block's tuple, with no getter task (and its round trip) between.

    Only from a block whose outputs one other block reads, and no task outside
    a block (a client may want them): the tuple then lives as long as getters'
    values would (a block holds its inputs until it ends), and no longer. Only
    where both run on one worker (the cluster has one, or both are meant for
    the same): the whole tuple would move to read one output elsewhere.
    """
    direct = {}
    for b, layout in enumerate(layouts):
        if layout.key is None:
            continue
        readers = {block_of.get(x) for ts in layout.outputs for x in ts.dependents} - {b}
        if len(readers) != 1 or None in readers:
            continue
        [c] = readers
        if not (one_worker or (places[b] is not None and places[b] == places[c])):
            continue
        for i, ts in enumerate(layout.outputs):
            if any(block_of.get(x) == c for x in ts.dependents):
                direct[c, ts] = (layout.key, i)
    return direct


def _block_plan(
    layout: _Layout,
    worker: str | None,
    rootish: bool,
    direct: Mapping[tuple[int, Any], tuple[Hashable, int]],
    index: int,
    block_of: Mapping[Any, int],
) -> _BlockPlan:
    """The block of ``layout``: its task and getters.

    ``rootish``: whether a member is a task the scheduler would queue (root-ish);
    the block's task is then a data producer, which the scheduler queues too.
    ``direct`` (of :func:`_direct_reads`) says which inputs of block ``index``
    it reads straight from another block, and which outputs of it only other
    blocks read that way (they get no getter; ``block_of``: each grouped
    task's block).
    """
    members, inputs, outputs, key = layout
    refs: list[Any] = []
    sources: dict[Hashable, tuple[Hashable, int]] = {}
    for d in inputs:
        src = direct.get((index, d))
        if src is None:
            refs.append(TaskRef(d.key))
        else:
            sources[d.key] = src
            refs.append(read_straight(*src))
    block = StreamBlock(
        [ts.run_spec for ts in members],
        [d.key for d in inputs],
        [ts.key for ts in outputs],
        outputs[0].key if key is None else key,
        0,  # rescheduled
        sources,
    )
    gone: list = []
    if key is None:
        getters: list = []
        spec = Task(outputs[0].key, block, *refs, _data_producer=rootish)
    else:
        spec = Task(key, block, *refs, _data_producer=rootish)
        getters = []
        for i, ts in enumerate(outputs):
            readers = (block_of.get(x) for x in ts.dependents)
            if ts.who_wants or any(c != index and (c, ts) not in direct for c in readers):
                getters.append(Task(ts.key, get_output, TaskRef(key), i))
            else:
                getters.append(None)
                gone.append(ts)
    kept = set(outputs).difference(gone)
    return _BlockPlan(
        members,
        [d for d in inputs if (index, d) not in direct],
        outputs,
        spec,
        key,
        getters,
        members[0].priority,
        {ts.key: "forgotten" for ts in members if ts not in kept},
        worker,
        sorted({src[0] for src in sources.values()}, key=str),
    )


def _restore(
    ts: Any,
    dependencies: set,
    run_spec: Any,
    priority: Any,
    restrictions: set | None,
    loose: bool,
) -> None:
    """Undo: give ``ts`` back the dependencies, run_spec, priority and worker
    restrictions it had."""
    for d in list(ts.dependencies):
        ts.dependencies.discard(d)
        d.dependents.discard(ts)
    for d in dependencies:
        ts.dependencies.add(d)
        d.dependents.add(ts)
    ts.run_spec, ts.priority = run_spec, priority
    ts.worker_restrictions, ts.loose_restrictions = restrictions, loose


def _forgotten_with(orphans: list) -> set:
    """``orphans`` and the tasks the scheduler forgets with them (nothing else needs them)."""
    dead = set(orphans)
    stack = list(orphans)
    while stack:
        ts = stack.pop()
        for d in ts.dependencies:
            if d not in dead and not d.who_wants and all(x in dead for x in d.dependents):
                dead.add(d)
                stack.append(d)
    return dead


def _unneeded(ts: Any) -> bool:
    """Whether ``ts``, just submitted, is a task that no client and no other task needs."""
    return (
        ts.state == "released"
        and ts.run_spec is not None
        and not ts.who_wants
        and not ts.dependents
        and not ts.waiters
    )


def _module(func: Any) -> str:
    return getattr(func, "__module__", None) or ""


def _levels(touched: list, new: set) -> dict[Hashable, int]:
    """Each new key's longest path from the graph's inputs (old keys: level 0)."""
    level: dict[Hashable, int] = {}
    stack = list(touched)
    while stack:
        ts = stack[-1]
        if ts.key in level:
            stack.pop()
            continue
        if ts.key not in new:
            level[ts.key] = 0
            stack.pop()
            continue
        pending = [d for d in ts.dependencies if d.key not in level]
        if pending:
            stack.extend(pending)
            continue
        stack.pop()
        level[ts.key] = 1 + max((level[d.key] for d in ts.dependencies), default=-1)
    return level
