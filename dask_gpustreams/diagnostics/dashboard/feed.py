"""The data of the dashboard page: the workers' timing records, fetched while a page is open.

Two halves, neither of which imports Bokeh:

- on each worker, :class:`WorkerFeed` is the ``gpustreams_timeline`` handler
  (installed on demand by :func:`install_worker_feed`). A call returns the
  records of the worker's runtime that completed since the previous call
  (:class:`RecordCursor`), their device times on the host clock, and, with
  ``timing=True``, keeps the runtime's timeline on for ``lease`` seconds;
- on the scheduler, :class:`TimelineFeed` (:func:`timeline_feed`) polls every
  worker with one ``Scheduler.broadcast`` every :attr:`TimelineFeed.interval`
  seconds while at least one page session is open, and keeps the last
  :attr:`TimelineFeed.maxlen` records for the pages to read with
  :meth:`TimelineFeed.since`.

Timing while the page is open: a runtime created with ``gpustreams.timeline``
off records no timing events. A poll with ``timing=True`` gives it a timeline
(:meth:`StreamRuntime.enable_timeline`; :meth:`StreamRuntime.run` reads it for each task),
and the worker drops it again once no poll has renewed the lease for ``lease``
seconds (the page closed, or the scheduler went away) and no task is executing
(a task reads the attribute twice). The last page session to close also sends
``timing=False``. A runtime created with ``gpustreams.timeline`` on keeps its
timeline. Tasks launched before the first poll that finds the worker's runtime
(which is created at its first task) have no timing events and are not shown.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

from dask.utils import key_split

from dask_gpustreams.diagnostics.timeline import RecordCursor

logger = logging.getLogger("dask_gpustreams")

#: The worker handler that :class:`TimelineFeed` calls.
OP = "gpustreams_timeline"
#: The name of the worker plugin whose runtime is read.
PLUGIN = "gpustreams"

#: What a worker's reply says of its timing.
TIMING_STATES = {
    "config": "on (gpustreams.timeline)",
    "page": "on while the page is open",
    "no-runtime": "on at the first poll after the worker's first task",
    "off": "off",
    "no-plugin": "no gpustreams plugin",
}


class WorkerFeed:
    """On a worker: the ``gpustreams_timeline`` handler, and the timing the page turned on.

    :meth:`poll` runs on the worker's event loop; the only wait (for the
    clock anchor event of :func:`~dask_gpustreams.diagnostics.timeline.timeline`)
    runs in a thread.
    """

    #: Seconds between checks whether a timeline turned on by the page can be dropped.
    recheck = 1.0

    def __init__(self, worker: Any):
        self.worker = worker
        self.lease_until = 0.0
        self._forced: Any = None  # the runtime whose timeline this feed turned on
        self._cursor: RecordCursor | None = None
        self._timer: asyncio.TimerHandle | None = None

    def _runtime(self) -> tuple[Any, str | None]:
        plugin = self.worker.plugins.get(PLUGIN)
        if not getattr(plugin, "_active", False):
            return None, "no-plugin"
        runtime = getattr(plugin, "runtime", None)
        return runtime, None if runtime is not None else "no-runtime"

    async def poll(
        self, timing: bool = True, lease: float = 10.0, limit: int = 20_000, timeout: float = 10.0
    ) -> dict:
        """``{"timing": state, "records": [...]}``: the records completed since the last poll.

        Each record has ``key`` (as a string), ``name`` (its prefix), ``device``,
        ``pool``, ``stream``, ``start`` and ``end`` (host clock seconds,
        ``time.time``); at most the newest ``limit``. ``timing``: keep the
        runtime's timeline on for ``lease`` more seconds (True), or let it go
        now (False). ``state`` is a key of :data:`TIMING_STATES`.
        """
        runtime, state = self._runtime()
        if timing:
            self.lease_until = time.monotonic() + lease
            if runtime is not None and runtime.enable_timeline():
                self._forced = runtime
        else:
            self.lease_until = 0.0
            if self._timer is not None:  # let it go now, not at the end of the last lease
                self._timer.cancel()
                self._timer = None
        if self._forced is not None and self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(
                max(0.0, self.lease_until - time.monotonic()), self._expire
            )
        if runtime is None:
            return {"timing": state, "records": []}
        if not runtime.timeline_enabled:
            state = "off"
        else:
            state = "page" if runtime is self._forced else "config"
        if self._cursor is None or self._cursor.runtime is not runtime:
            self._cursor = RecordCursor(runtime)
        ready = self._cursor.take()[-limit:] if limit > 0 else []
        records: list[dict] = []
        if ready:
            from dask_gpustreams.diagnostics.timeline import _runtime_records

            try:
                records = await asyncio.to_thread(_runtime_records, runtime, ready, timeout)
            except Exception as e:  # e.g. the runtime closed meanwhile
                logger.debug("gpustreams: timeline records of %r dropped: %r", runtime, e)
        for r in records:
            r["name"] = key_split(r["key"])
            r["key"] = str(r["key"])
        return {"timing": state, "records": records}

    def _expire(self) -> None:
        """Drop the timeline the page turned on once its lease is over and no task executes."""
        self._timer = None
        runtime = self._forced
        if runtime is None:
            return
        left = self.lease_until - time.monotonic()
        state = self.worker.state
        if left <= 0 and not state.executing and not state.long_running:
            runtime.disable_timeline()
            self._forced = None
            return
        delay = left if left > 0 else self.recheck
        self._timer = asyncio.get_running_loop().call_later(delay, self._expire)


def install_worker_feed(dask_worker: Any) -> bool:
    """Add the ``gpustreams_timeline`` handler to a worker (idempotent; for ``client.run``)."""
    handler = dask_worker.handlers.get(OP)
    if not isinstance(getattr(handler, "__self__", None), WorkerFeed):
        dask_worker.handlers[OP] = WorkerFeed(dask_worker).poll
    return True


class TimelineFeed:
    """On the scheduler: the records of every worker, polled while a page session is open.

    Made by :func:`timeline_feed` (one per scheduler). Runs on the
    scheduler's event loop; :meth:`poll` only awaits.
    """

    #: Seconds between polls while a page session is open.
    interval = 1.0
    #: Seconds a poll keeps timing on in the workers whose runtime has no timeline.
    lease = 10.0
    #: Records kept for the pages.
    maxlen = 20_000

    def __init__(self, scheduler: Any):
        self.scheduler = scheduler
        self.records: deque[dict] = deque(maxlen=self.maxlen)
        #: Records received so far (the position after the newest in :meth:`since`).
        self.total = 0
        #: worker address -> a key of :data:`TIMING_STATES`, from its last reply.
        self.timing: dict[str, str] = {}
        #: Open page sessions.
        self.sessions = 0
        self._installed: set[str] = set()
        self._lock = asyncio.Lock()
        self._callback: Any = None  # a tornado PeriodicCallback while sessions are open
        self._polling: asyncio.Task | None = None  # the periodic poll in progress
        self._tasks: set[asyncio.Task] = set()

    def since(self, cursor: int) -> tuple[list[dict], int]:
        """The records received after position ``cursor`` (those still kept), and the new cursor."""
        records = self.records
        first = self.total - len(records)
        start = max(cursor, first) - first
        return [records[i] for i in range(start, len(records))], self.total

    async def poll(self, timing: bool = True) -> list[dict]:
        """Fetch the new records of every worker; return them (also kept in :attr:`records`).

        Each record is a worker's (see :meth:`WorkerFeed.poll`) plus ``worker``
        (its address); they are sorted by start. Workers get the handler at
        their first poll (one ``run`` message each). Errors of single workers
        are logged by the broadcast and skipped.
        """
        async with self._lock:
            from distributed.protocol.pickle import dumps

            scheduler = self.scheduler
            workers = list(scheduler.workers)
            self._installed &= set(workers)
            missing = [w for w in workers if w not in self._installed]
            if missing:
                replies = await scheduler.broadcast(
                    msg={"op": "run", "function": dumps(install_worker_feed), "wait": True},
                    workers=missing,
                    on_error="ignore",
                )
                self._installed.update(
                    w for w, r in replies.items() if isinstance(r, dict) and r.get("status") == "OK"
                )
            targets = [w for w in workers if w in self._installed]
            replies = await scheduler.broadcast(
                msg={"op": OP, "timing": timing, "lease": self.lease, "limit": self.maxlen},
                workers=targets,
                on_error="ignore",
            )
            new: list[dict] = []
            for worker in targets:
                reply = replies.get(worker)
                if not isinstance(reply, dict) or "records" not in reply:
                    self._installed.discard(worker)  # e.g. restarted at the same address
                    continue
                self.timing[worker] = reply["timing"]
                for r in reply["records"]:
                    r["worker"] = worker
                    new.append(r)
            for gone in set(self.timing) - set(workers):
                del self.timing[gone]
            new.sort(key=lambda r: (r["start"], r["end"]))
            self.records.extend(new)
            self.total += len(new)
            return new

    # ------------------------------------------------------------------ page sessions

    def open_session(self) -> None:
        """A page session opened: poll every :attr:`interval` seconds from now on."""
        from tornado.ioloop import PeriodicCallback

        self.sessions += 1
        if self._callback is None:
            self._callback = PeriodicCallback(self._tick, self.interval * 1000)
            self._callback.start()
            self._tick()

    def close_session(self) -> None:
        """A page session closed: after the last one, stop polling and let timing go."""
        self.sessions = max(0, self.sessions - 1)
        if not self.sessions:
            self._stop()
            if self._scheduler_running():
                self._spawn(self.poll(timing=False))

    def _stop(self) -> None:
        if self._callback is not None:
            self._callback.stop()
            self._callback = None

    def _scheduler_running(self) -> bool:
        from distributed.core import Status

        return self.scheduler.status == Status.running

    def _tick(self) -> None:
        if not self._scheduler_running():
            self._stop()
        elif self._polling is None or self._polling.done():  # never two polls at once
            self._polling = self._spawn(self.poll())

    def _spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)  # a reference until it ends
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.warning("gpustreams: dashboard poll failed: %r", task.exception())


_feeds: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def timeline_feed(scheduler: Any) -> TimelineFeed:
    """The scheduler's :class:`TimelineFeed` (created at the first call)."""
    feed = _feeds.get(scheduler)
    if feed is None:
        feed = _feeds[scheduler] = TimelineFeed(scheduler)
    return feed


def busy_fraction(spans: Iterable[tuple[float, float]], lo: float, hi: float) -> float:
    """The part of ``[lo, hi]`` covered by ``spans`` (``(start, end)`` pairs of one stream).

    The tasks of one stream run one after the other, so their overlaps with
    the window add up; the result is clipped to 1.
    """
    if hi <= lo:
        return 0.0
    busy = sum(max(0.0, min(end, hi) - max(start, lo)) for start, end in spans)
    return min(1.0, busy / (hi - lo))


def timing_summary(timing: dict[str, str], order: Sequence[str] = tuple(TIMING_STATES)) -> str:
    """``"on (gpustreams.timeline): 2 workers; ..."`` for the page's header."""
    counts: dict[str, int] = {}
    for state in timing.values():
        counts[state] = counts.get(state, 0) + 1
    parts = [
        f"{TIMING_STATES.get(s, s)}: {n} worker{'s' if n != 1 else ''}"
        for s in (*order, *sorted(set(counts) - set(order)))
        if (n := counts.get(s))
    ]
    return "; ".join(parts) or "no workers yet"
