"""The local (threaded or synchronous) scheduler: each compute's graph goes through the runtime.

While ``gpustreams.enabled`` is true, a compute that would run on Dask's threaded
scheduler, by default or by name (``scheduler="threads"`` or ``"threading"``, as
an argument or the ``scheduler`` config key), runs on the stream launcher instead
(``scheduler="gpustreams"``, :mod:`.launcher`): :func:`install` puts
:func:`get_scheduler` in place of ``dask.base.get_scheduler``, which
``dask.compute`` and ``persist`` look up as a module global at call time. Dask's
own threads, each task through the runtime as below, took 0.67-0.92x plain
threads' time on 4 of 13 workloads on the H200, where the launcher was faster than
both plain modes on all 13. Dask's threads are kept where the user asks for them
as such: a thread pool set as Dask's ``pool`` config, an executor or the function
``dask.threaded.get`` passed as the scheduler, ``pool=`` passed to the compute, a
``num_workers`` above 1 passed to the compute, or one in Dask's config from 2 to
``gpustreams.host-threads`` (:func:`threaded_get`: ``num_workers=1`` runs on the launcher
with every task on the calling thread, and a larger count in the config keeps the
launcher). Dask's synchronous scheduler by name
(``"sync"``, ``"synchronous"``, ``"single-threaded"``) runs on the launcher too, with
every task on the calling thread, host tasks included (:func:`sync_get`): its cost per
task is under plain sync's, where each task through the runtime on Dask's sync scheduler
added 12-33 us on the H200. The function ``dask.local.get_sync`` is kept, as is every
other scheduler, but those that run tasks in other processes (``"processes"``, a process
pool as the scheduler or Dask's ``pool``), which run as plain Dask with a warning
(:func:`processes_get`). The launcher launches from one thread (host tasks run on the
runtime's host threads).

:func:`install` also puts
:func:`local_callbacks` in place of ``dask.local.local_callbacks``, the context
manager through which ``dask.local.get_async`` (behind ``dask.threaded.get``,
``get_sync`` and ``dask.multiprocessing.get``) resolves its callbacks at the
start of every compute. While ``gpustreams.enabled`` is true, read per compute,
it adds :data:`hook`'s callbacks to that compute's own list. Then every task
runs through the stream runtime in the pool thread that executes it, and
before ``compute`` returns the events of the results handed back are waited
for (one host sync at the end, none per task). While disabled it returns
Dask's list unchanged.

Why not a registered :class:`dask.callbacks.Callback`:

- A registered callback lives in ``Callback.active``, a set that Dask's own
  tests and users expect to hold only their callbacks
  (``assert not Callback.active``).
- ``dask.callbacks.local_callbacks`` swaps ``Callback.active`` for an empty set
  while a compute runs and puts the saved set back at its end. So a nested
  compute inside a task, and a compute another thread starts meanwhile, see no
  global callback. When two computes on two threads overlap, the one that ends
  last restores the empty set it saw: a registered hook would be gone for the
  rest of the process.

Added per compute, the hook is in every local compute's list, nested and
concurrent ones included, and never in ``Callback.active``. (Dask's rule that
only the outermost compute sees the global callbacks still holds for the
user's; a nested compute's tasks run on pool streams too.) Dask offers no
per-compute hook of its own: the collections bind ``dask.threaded.get`` at
import (``__dask_scheduler__``), and a callback cannot change the graph's
executor. ``get_async`` looks ``local_callbacks`` up as a module global at call
time, so replacing that one name is enough; the replacement calls Dask's
function first, so ``Callback.active`` keeps Dask's semantics.

The hook's ``_finish`` comes first in the list and its ``_start`` last: the
other callbacks' ``_start`` see the graph as Dask gives it (``dask.cache.Cache``
may still replace nodes), and their ``_finish`` see complete results.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
import multiprocessing.pool
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import dask.base
import dask.callbacks
import dask.config
import dask.local
import dask.threaded
from distributed import Client

from dask_gpustreams.config import StreamsConfig, enabled, warn_once
from dask_gpustreams.integrations.launcher import get as launcher_get
from dask_gpustreams.integrations.patching import Patch
from dask_gpustreams.integrations.preload import warn_if_not_registered
from dask_gpustreams.integrations.tasks import ComputeRegistry, transfer_rewrites, wrap_task
from dask_gpustreams.runtime import StreamRuntime, acquire_runtime
from dask_gpustreams.runtime.context import active_task
from dask_gpustreams.runtime.policies import critical_keys

logger = logging.getLogger("dask_gpustreams")


class LocalSchedulerHook:
    """Runs local-scheduler graphs through the stream runtime while enabled.

    ``_start`` and ``_finish`` have the signatures of Dask's callbacks; they
    run on the thread that calls ``compute`` and may block there.
    """

    def __init__(self) -> None:
        # id(graph) -> its runtime, its tasks' events and the runtime's reported failures
        # when it began (StreamRuntime.reported_failures).
        self._runs: dict[int, tuple[StreamRuntime, ComputeRegistry, int]] = {}
        self._lock = threading.Lock()
        self._advised = False

    def callbacks(self, others: Sequence[tuple]) -> list[tuple]:
        """``others`` (Dask callback tuples) with this hook's finish first and start last."""
        return [
            (None, None, None, None, self._finish),
            *others,
            (self._start, None, None, None, None),
        ]

    def _start(self, dsk: dict) -> None:
        runtime = acquire_runtime()  # held until _finish, so it is not closed meanwhile
        try:
            reports = runtime.reported_failures()  # before this graph's first launch
            caller = runtime.order_after_caller()  # inputs this thread is still writing
        except BaseException:
            runtime.release()  # _finish finds no run of this graph to release
            raise
        registry = ComputeRegistry(caller)
        with self._lock:
            self._runs[id(dsk)] = (runtime, registry, reports)
        if not self._advised:
            self._advised = True
            logger.info(
                "gpustreams: running this graph's tasks through the stream runtime from "
                "Dask's scheduler threads; compute(scheduler='gpustreams') launches the whole "
                "graph from one thread and is faster on GPU graphs"
            )
        critical: set | None = None
        if runtime.needs_critical_path:
            critical = critical_keys({k: v.dependencies for k, v in dsk.items()})
        rewrites = transfer_rewrites(runtime)  # once per graph
        for key, node in dsk.items():
            dsk[key] = wrap_task(
                node, runtime, registry, None if critical is None else key in critical, rewrites
            )

    def _finish(self, dsk: dict, state: dict[str, Any], errored: bool) -> None:
        with self._lock:
            run = self._runs.pop(id(dsk), None)
        if run is None:
            return
        runtime, registry, reports = run
        try:
            # A failed compute ends while other tasks of it still run in Dask's threads:
            # their work is this graph's, drained below.
            registry.close()
            for record in registry.superseded:
                # A task's earlier run (rerun_exceptions_locally): its kernels' failure is
                # this graph's too, reported here, not by the next compute on its stream.
                runtime.report(record)
            if errored:
                # The exception being raised wins; wait for this graph's work so that a
                # kernel failure it left behind is reported here, not by the next compute.
                runtime.drain(registry)
            else:
                results = state.get("cache", {})
                try:
                    runtime.synchronize(results, registry)
                    if runtime.reported_failures() != reports:
                        # A failure cleared while this graph ran may have let its work
                        # run on unwritten output, the results' events clean: every
                        # event of its work is checked.
                        runtime.synchronize(registry, registry)
                except BaseException:
                    # The first failure found wins; another kernel of the graph may have
                    # failed too (on another stream): reported here, not by the next compute.
                    runtime.drain(registry)
                    runtime.collect()
                    runtime.release_events(registry)
                    raise
                holds = active_task()[2]
                if holds is not None:
                    # A nested compute: the calling task's kernels, on its own stream, may
                    # read these after it returns; held as its inputs are, until its event.
                    holds.extend(results.values())
            runtime.collect()
            runtime.release_events(registry)
        finally:
            runtime.release()


hook = LocalSchedulerHook()


@contextlib.contextmanager
def local_callbacks(callbacks: Sequence[tuple] | None = None) -> Iterator[Sequence[tuple]]:
    """Dask's ``local_callbacks(callbacks)``, plus :data:`hook`'s while ``gpustreams.enabled``."""
    with _local_callbacks.original(callbacks) as resolved:
        on = enabled() and not getattr(_processes, "plain", False)
        yield hook.callbacks(resolved) if on else resolved


#: Names under which Dask's ``named_schedulers`` give its threaded scheduler.
THREADED_NAMES = frozenset({"threads", "threading"})
#: Names under which Dask's ``named_schedulers`` give its synchronous scheduler.
SYNC_NAMES = frozenset({"sync", "synchronous", "single-threaded"})


def threaded_get(dsk: Any, keys: Any, **kwargs: Any) -> Any:
    """Dask's threaded scheduler while enabled: the stream launcher, or Dask's threads (each
    task through the runtime) where the compute asks for them with ``pool=``.

    A thread count, ``num_workers`` (the compute's, else Dask's config, as Dask reads it),
    bounds the tasks that run at once, as in Dask: 1 (a library that is not thread-safe)
    runs every task on the launching thread, one at a time (:func:`sync_get`); a larger
    count passed to the compute keeps Dask's threads; one in the config keeps the launcher
    where it is larger than ``gpustreams.host-threads`` (the launcher runs its own thread's
    task and at most that many host tasks at once), else Dask's threads. Only a plain
    ``int`` is read so (not ``True``, ``1.0`` or a NumPy integer): other values go to Dask's
    threads, which take or reject them as without the plugin.
    """
    if kwargs.get("pool") is not None:
        return threads_get(dsk, keys, **kwargs)
    asked = kwargs.get("num_workers")
    workers = asked or dask.config.get("num_workers", None)
    if workers is None:
        return launcher_get(dsk, keys, **kwargs)
    if workers == 1 and type(workers) is int:
        return sync_get(dsk, keys, **kwargs)
    if (
        not asked
        and type(workers) is int
        and workers > StreamsConfig.from_dask_config().host_threads
    ):
        return launcher_get(dsk, keys, **kwargs)
    return threads_get(dsk, keys, **kwargs)  # (Dask raises for a bad count, as without us)


def threads_get(dsk: Any, keys: Any, **kwargs: Any) -> Any:
    """Dask's threaded scheduler, asked for by function or with a pool in Dask's config,
    while enabled: each task through the runtime on Dask's threads, or plain Dask where
    the compute's ``pool=`` runs tasks in other processes."""
    if _is_process_pool(kwargs.get("pool")):
        return processes_get(dask.threaded.get, dsk, keys, **kwargs)
    return dask.threaded.get(dsk, keys, **kwargs)


def sync_get(dsk: Any, keys: Any, **kwargs: Any) -> Any:
    """Dask's synchronous scheduler by name while enabled: the stream launcher with every
    task on the calling thread, host tasks too, one at a time, as Dask's runs them."""
    return launcher_get(dsk, keys, host_threads=False, **kwargs)


def get_scheduler(get=None, scheduler=None, collections=None, cls=None) -> Any:
    """Dask's ``get_scheduler``; :func:`threaded_get` for Dask's threaded scheduler, by
    default or by name, and :func:`sync_get` for its synchronous one by name, while
    enabled (see the module's docstring)."""
    schedule = _get_scheduler.original(
        get=get, scheduler=scheduler, collections=collections, cls=cls
    )
    if schedule is dask.threaded.get or schedule is dask.local.get_sync:
        if not enabled():
            return schedule
        named = scheduler if scheduler is not None else dask.config.get("scheduler", None)
        name = named.lower() if isinstance(named, str) else None
        if schedule is dask.local.get_sync:
            return sync_get if name in SYNC_NAMES else schedule
        pool = dask.config.get("pool", None)
        if _is_process_pool(pool):
            return functools.partial(processes_get, schedule)
        if (not named or name in THREADED_NAMES) and pool is None:
            return threaded_get
        if schedule is dask.threaded.get:
            return threads_get
    elif isinstance(getattr(schedule, "__self__", None), Client):
        if enabled():
            warn_if_not_registered(schedule.__self__)
    elif _in_other_processes(schedule, scheduler) and enabled():
        return functools.partial(processes_get, schedule)
    return schedule


def _in_other_processes(schedule: Any, scheduler: Any) -> bool:
    """Whether ``schedule`` runs tasks in other processes: Dask's multiprocessing scheduler
    (a Bag's default), or a ``ProcessPoolExecutor`` passed as the scheduler."""
    processes = dask.base.named_schedulers.get("processes")
    return (processes is not None and schedule is processes) or isinstance(
        scheduler, concurrent.futures.ProcessPoolExecutor
    )


def _is_process_pool(pool: Any) -> bool:
    """Whether ``pool``, given to Dask's threaded scheduler, runs tasks in other processes."""
    return isinstance(pool, concurrent.futures.ProcessPoolExecutor) or (
        isinstance(pool, multiprocessing.pool.Pool)
        and not isinstance(pool, multiprocessing.pool.ThreadPool)
    )


#: ``plain`` is set while :func:`processes_get` runs a compute on this thread: then
#: :func:`local_callbacks` adds no hook. Per thread, not per context: a thread pool that
#: copies contexts into its tasks would otherwise carry it into their nested computes.
_processes = threading.local()


def processes_get(schedule: Any, dsk: Any, keys: Any, **kwargs: Any) -> Any:
    """``schedule``, which runs tasks in other processes (:func:`_in_other_processes`, or a
    process pool), while enabled: the runtime does not reach them, so it runs them as plain
    Dask, and says so once. Only this compute: the config, which other threads read, stays
    as it is."""
    warn_once(
        "gpustreams: this compute runs its tasks in other processes (scheduler='processes', "
        "a Bag's default, or a process pool), where the stream runtime does not run: it runs "
        "as plain Dask (scheduler='threads' or 'gpustreams' runs it on streams)"
    )
    outer, _processes.plain = getattr(_processes, "plain", False), True
    try:
        return schedule(dsk, keys, **kwargs)
    finally:
        _processes.plain = outer


#: Dask's ``local_callbacks`` (all local schedulers read it) and ``get_scheduler``, wrapped.
_local_callbacks = Patch(dask.local, "local_callbacks", local_callbacks)
_get_scheduler = Patch(dask.base, "get_scheduler", get_scheduler)


def install() -> None:
    """Make local computes reach the runtime while enabled (see the module's docstring).

    Idempotent: the functions it replaces (Dask's, or other wrappers of them) are
    the ones :func:`local_callbacks` and :func:`get_scheduler` call, and
    :func:`uninstall` puts them back.
    """
    _local_callbacks.install()
    _get_scheduler.install()


def uninstall() -> None:
    """Undo :func:`install`: local computes bypass the runtime, even while enabled."""
    _local_callbacks.uninstall()
    _get_scheduler.uninstall()
