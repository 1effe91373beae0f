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
  its value out of the block's tuple, under the output's own key.
- The other keys of the group are forgotten: nothing outside needs them.

The block is then an ordinary task: work stealing, retries (the most of its
tasks'), worker loss (it is recomputed whole) and errors (the first task
exception, or the ``KernelError`` naming the inner key) behave as for any
task. Only new tasks in ``released`` state, with no restrictions, no
annotations that change where or how they run and no erred inputs, are
grouped. The scheduler cannot tell a GPU task from one that blocks the host:
inside a block, the launcher learns such task groups (more than 5 ms of host
time a call) and runs them on its host threads.

Why here and not in the graph optimization (``delayed_optimize`` /
``array_optimize``): see ``docs/cluster.md``. In short, the optimization hook
never sees ``client.get`` graphs, does not know the cluster, and must be set
on every client; this hook sees every submission, knows the workers and
which keys the clients want, and the regrouping happens before any task has
left ``released``.
"""

from __future__ import annotations

import logging
import operator
import uuid
from collections.abc import Hashable
from typing import Any

from dask._task_spec import Alias, Task, TaskRef
from distributed import SchedulerPlugin

from dask_gpustreams.integrations.blocks import StreamBlock, partition

logger = logging.getLogger("dask_gpustreams")

#: Annotations that do not change where or how a task runs (a block may hold such tasks).
_NEUTRAL_ANNOTATIONS = frozenset({"span", "priority", "retries", "fuse"})

#: Prefix of the keys of blocks with several outputs.
BLOCK_PREFIX = "gpustreams-block"


class StreamBlocks(SchedulerPlugin):
    """Group the chains (and, on small clusters, the parts) of each graph into block tasks."""

    name = "gpustreams-blocks"
    idempotent = True

    def __init__(self) -> None:
        #: worker address -> its ``gpustreams.blocks`` setting, while its plugin is active.
        self.modes: dict[str, str] = {}
        #: Blocks formed, and tasks they stand for, since the scheduler started (diagnostics).
        self.blocks_formed = 0
        self.tasks_grouped = 0

    async def start(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        scheduler.handlers["gpustreams_blocks"] = self.set_mode
        logging.getLogger("distributed.scheduler").addFilter(_quiet_block_collisions)

    def set_mode(self, worker: str, mode: str | None) -> None:
        """Handler: ``worker``'s plugin has ``gpustreams.blocks`` = ``mode`` (None: removed)."""
        if mode is None:
            self.modes.pop(worker, None)
        else:
            self.modes[worker] = mode

    def remove_worker(self, scheduler: Any, worker: str, **kwargs: Any) -> None:
        self.modes.pop(worker, None)

    def active(self) -> bool:
        """Whether blocks are formed now: every worker has the plugin with ``blocks: auto``."""
        workers = self.scheduler.workers
        modes = self.modes
        return bool(workers) and all(modes.get(w) == "auto" for w in workers)

    def update_graph(
        self, scheduler: Any, *, client: str, tasks: list, stimulus_id: str, **kwargs: Any
    ) -> None:
        if not self.active():
            return
        try:
            self._regroup(client, tasks, stimulus_id)
        except Exception:  # distributed would only log it; the graph then runs task per key
            logger.exception("gpustreams: stream blocks not formed for this graph")

    # --- the regrouping ---------------------------------------------------------------------

    def _candidate(self, ts: Any, client: str) -> bool:
        """Whether ``ts``, just submitted, may run inside a block."""
        spec = ts.run_spec
        if ts.state != "released" or ts.actor or ts.waiters:
            return False
        if isinstance(spec, Task):
            if spec.is_coro or _module(spec.func).startswith("distributed"):
                return False  # coroutines, P2P shuffles: they need a task of their own
        elif not isinstance(spec, Alias):
            return False  # data, or no run_spec yet
        if ts.who_wants and any(cs.client_key != client for cs in ts.who_wants):
            return False
        if ts.worker_restrictions or ts.host_restrictions or ts.resource_restrictions:
            return False
        if ts.annotations and not _NEUTRAL_ANNOTATIONS.issuperset(ts.annotations):
            return False
        return all(d.exception_blame is None for d in ts.dependencies)

    def _regroup(self, client: str, keys: list, stimulus_id: str) -> None:
        tasks = self.scheduler.tasks
        touched = [ts for k in keys if (ts := tasks.get(k)) is not None]
        # A key submitted again while its block lives collides: the scheduler keeps the
        # block's task and links nothing to the key's new dependencies, the block's inner
        # keys, which come back as tasks that nothing needs. Forget them (and what only
        # they need), as plain Dask, whose tasks collide with their own kind, never has them.
        orphans = {ts.key: "forgotten" for ts in touched if _unneeded(ts)}
        if orphans:
            self.scheduler.transitions(orphans, stimulus_id)
            touched = [ts for ts in touched if tasks.get(ts.key) is ts]
        new = {ts.key for ts in touched if ts.state == "released"}
        candidates = [ts.key for ts in touched if self._candidate(ts, client)]
        if len(candidates) < 2:
            return
        level = _levels(touched, new)
        groups = partition(
            candidates,
            lambda k: [d.key for d in tasks[k].dependencies],
            lambda k: [d.key for d in tasks[k].dependents],
            level,
            len(self.scheduler.workers),
        )
        forget: dict[Hashable, str] = {}
        for group in groups:
            forget.update(self._form(client, [tasks[k] for k in group]))
        if forget:
            self.scheduler.transitions(forget, stimulus_id)

    def _form(self, client: str, members: list) -> dict[Hashable, str]:
        """Make ``members`` one block task; return the recommendations that forget the rest."""
        members.sort(key=operator.attrgetter("priority"))
        inside = set(members)
        inputs: dict[Any, None] = {}
        outputs = []
        for ts in members:
            for d in ts.dependencies:
                if d not in inside:
                    inputs[d] = None
            if ts.who_wants or any(d not in inside for d in ts.dependents):
                outputs.append(ts)
        block = StreamBlock(
            [ts.run_spec for ts in members], [d.key for d in inputs], [ts.key for ts in outputs]
        )
        retries = max(ts.retries for ts in members)
        priority = members[0].priority
        for ts in members:
            for d in list(ts.dependencies):
                ts.dependencies.discard(d)
                d.dependents.discard(ts)
        refs = [TaskRef(d.key) for d in inputs]
        if len(outputs) == 1:
            head = outputs[0]
            head.run_spec = Task(head.key, block, *refs)
        else:
            key = (f"{BLOCK_PREFIX}-{uuid.uuid4().hex}", 0)
            head = self.scheduler.new_task(
                key, Task(key, block, *refs), "released", self._computation()
            )
            self._join_span(head, members[0])
            for i, ts in enumerate(outputs):
                ts.run_spec = Task(ts.key, operator.getitem, TaskRef(key), i)
                ts.add_dependency(head)
        head.priority = priority
        head.retries = retries
        for d in inputs:
            head.add_dependency(d)
        self.blocks_formed += 1
        self.tasks_grouped += len(members)
        kept = set(outputs)
        return {ts.key: "forgotten" for ts in members if ts not in kept}

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


def _module(func: Any) -> str:
    return getattr(func, "__module__", None) or ""


def _unneeded(ts: Any) -> bool:
    """Whether ``ts``, just submitted, is a task that no client and no other task needs."""
    return (
        ts.state == "released"
        and ts.run_spec is not None
        and not ts.who_wants
        and not ts.dependents
        and not ts.waiters
    )


class QuietBlockCollisions(logging.Filter):
    """Drops the scheduler's warning of a key submitted again while its block lives.

    Its task then has the block's run_spec and dependencies, not those of the
    graph submitted again, so distributed warns that they differ (dask/dask#9888)
    and keeps the block's task, which computes the same value. Warnings about
    other keys pass.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.msg
        if not (isinstance(msg, str) and msg.startswith("Detected different `run_spec`")):
            return True
        old = msg.partition("old run_spec: ")[2].partition("\n")[0]
        return not ("StreamBlock(" in old or f"'{BLOCK_PREFIX}-" in old)


_quiet_block_collisions = QuietBlockCollisions()


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
