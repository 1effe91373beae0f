"""The ``distributed`` integration: a worker plugin that runs every task on a stream pool.

:class:`StreamsPlugin` is a :class:`distributed.WorkerPlugin`. Install it with
``client.register_plugin(StreamsPlugin())``, by preloading ``dask_gpustreams``
on the workers or the scheduler, or by setting ``gpustreams.enabled`` before a
client is created (:mod:`dask_gpustreams.integrations.preload` lists the routes).
All its hooks run on the worker's event loop unless said otherwise.

Execution
    When a task goes ``ready -> executing``, :meth:`StreamsPlugin.transition`
    replaces its ``run_spec`` by :func:`~dask_gpustreams.integrations.tasks.wrap_task`
    of it (the worker reads the spec only after that transition), so the task
    runs in its worker thread on a pool stream of the worker's
    :class:`~dask_gpustreams.runtime.StreamRuntime`, waiting on the device for
    the events of inputs this worker produced, and records its own event in
    the worker's :class:`~dask_gpustreams.runtime.EventRegistry`. Inputs fetched
    from other workers arrive complete (see *Egress*) and have no event. The
    runtime is created at the first task (or at setup, on a worker that holds
    results already), so the streams appear after whatever dask-cuda and RMM set
    up at worker start. Not wrapped: coroutine tasks, data
    and tasks annotated to run on an executor that is not a thread pool (their
    spec would have to be pickled), and actors. Functions of
    ``distributed.shuffle`` (P2P transfer, barrier, unpack) hand their inputs to
    the comm layer, which serializes them outside the task: such a task waits
    on the host, in its worker thread, for its inputs' events and then runs as
    in plain Dask.

Egress
    A task's result may still be being written on the device when the worker
    declares it in memory; that is what lets dependents be queued without a
    host sync. Everything that copies a result off the device on the host
    therefore waits for that key's event first:

    - ``get_data`` (peer fetch, client gather, scheduler gather, AMM): the
      handler is wrapped. Keys whose events have completed are served at
      once; the events of the others (and of the work in their taint, see
      *Failures*; normally already complete) are waited for in a small thread
      pool (``gpustreams-egress``), so the event loop keeps running meanwhile.
      The wait is per key, never a device or stream sync (an event completes
      when the work enqueued before it on its stream has, as always).
    - spilling: a callback put first in the ``on_evict`` list of every
      ``zict.Buffer`` of ``worker.data`` (distributed's ``SpillBuffer``;
      dask-cuda's ``DeviceHostFile``, whose ``device_buffer`` and
      ``host_buffer`` are such buffers, found by type without importing
      dask-cuda) waits for the evicted key's event before it is serialized.
      Spilling runs on the event loop, so this one wait is blocking, for that
      key only, like the disk write that follows it.

Failures
    A task that raises fails as in plain Dask: the exception and traceback
    reach the client and dependents are not run. A kernel that fails
    asynchronously (``KernelError`` on the simulated device, a CUDA error on
    a GPU) is only seen after it, when its key is already in memory, and a
    scheduler has no ``memory -> erred`` transition for tasks. The plugin
    turns it into the failure of a task run.

    What failed: a key's value is corrupt if its own event completed with an
    error, or the event of any work it derives from on this worker did (its
    *taint*: the records of its inputs, of their inputs, ..., kept while not
    known to have succeeded). The plugin reads errors with
    ``Backend.event_error``, which returns an event's error every time
    without reporting it: a sync elsewhere (inside a task, say) may report a
    failure first, after which the device no longer passes it on to work
    that waits for it, and that work's own event says nothing. An error the
    plugin finds, it reports at once (a sync of the completed event), before
    the failure reaches a task, a dropped key or the client: a stream in
    error skips what is launched on it until a sync reports the error, and
    the user's next graph would otherwise run on such a stream and fail with
    this key's error.

    - A task whose inputs derive from work that has completed with an error
      fails with that :class:`~dask_gpustreams.KernelError` before it runs
      (a non-blocking check of completed events when it starts, in its worker
      thread for tasks on the streams: the driver calls stay off the event loop).
    - When an egress wait (``get_data``, spilling) finds a corrupt key, the
      key is not served; the worker records the error, drops the key and
      tells the scheduler (``release-worker-data``, as if the data were lost),
      which recomputes it for whoever wants it. If an input of the key has
      erred meanwhile, the key cannot be recomputed: the plugin's scheduler
      part (:class:`.ErredInputs`) errs it, blamed on that input, so nobody
      waits for it forever. When the recomputation runs
      on a worker that recorded the failure, the task raises the recorded
      ``KernelError`` instead of running again, so the client gets that
      error for that key, and dependents become erred as usual. A key with
      dependents queued or running on the worker is held until the plugin's
      ``transition`` hook sees the last of them leave (they fail through the
      first rule), then dropped.

    A ``get_data`` request is thus never failed (a failed request makes a
    peer's fetch and a client's gather retry forever), and no corrupt data is
    sent. After a failure, and after any task error, the egress threads
    also synchronize every stream of the runtime once, ignoring errors: this
    reports the failures that nobody has found yet, so they do not spill
    over into unrelated tasks either (on a GPU, a sticky CUDA error makes
    the worker unusable anyway; restart it). A key that nothing reads (no
    ``get_data``, no dependent: released unread, or a future never gathered)
    has its record asked in a later task's thread, before that task launches,
    once its kernel has ended, and a failure found there is reported too (on
    the sim only, where errors are not sticky). A worker that dies is handled
    by Dask as usual.

Lifetime
    The runtime holds each task's inputs, fetched ones included, until the
    task's event completes. Registry and taint entries are dropped when their
    keys are released, forgotten or erred (taints also once their work is
    known to have succeeded); failure records when they are used (at most
    :attr:`StreamsPlugin.max_failures` are kept, each for at most
    :attr:`StreamsPlugin.failure_ttl` seconds). A corrupt key held for its
    dependents is no longer held once it leaves memory on its own, or at
    teardown: distributed takes a plugin out of ``worker.plugins`` before its
    teardown, which therefore installs :class:`.WithheldKeys` first. Until
    the held keys have left memory, it makes each task that starts with one
    as input raise the key's error, the keys are released as before once
    their last readers have left, and ``get_data`` leaves them out.
    Each worker's plugin owns its
    runtime (in-process workers do not share one) and closes it at teardown,
    when it is removed or the worker closes: its streams and threads end.

Known limits
    - A recomputation that lands on a worker that did not see the failure
      runs the task again; a deterministic failure is then detected there
      too, so a key is recomputed at most once per worker before it errs. A
      transient failure may succeed on recomputation; its record then stays
      on the first worker and fails a run of the same key there within
      :attr:`StreamsPlugin.failure_ttl` seconds.
    - Data read without ``get_data``: a client running inside a worker
      (``get_client()`` in a task) reads that worker's own ``data`` directly
      (ordered and held for the task by :mod:`.gathered`, which raises a
      failure of their work); tasks on a process pool read their inputs
      without waiting (coroutine tasks wait in a thread first); the JIT-unspill
      ``ProxifyHostFile`` of dask-cuda before 26.10 spills without the
      per-key wait. With CuPy these paths stay ordered only
      through the legacy default stream (blocking pool streams, no per-thread
      default stream).
    - Data coming back to the device over TCP (unspilling, fetches from
      peers) is copied by distributed's deserializer (``protocol/cupy.py``,
      through RMM or Numba) on the legacy default stream, whatever CuPy's
      per-thread setting, and the blocking pool streams wait for it.
    - Removing the plugin waits for the tasks it wrapped and for their
      events; with a new plugin of the same name this happens before the new
      one is set up.
    - A result made while no plugin is set up (before the first registration,
      or while a setup waits for the old plugin's teardown) has no event. The
      setup notes the keys in memory or still being made then; the first
      reader of such a key (a task, ``get_data``, a spill) waits on the host for
      an event recorded on the backend's unpooled stream (CUDA's legacy default
      stream, which follows every thread's per-thread default stream), once.
      Work such a task launched on a non-blocking stream of its own (on the
      sim, any stream of its own) is not covered, as in plain Dask. Nor is a
      peer's fetch served by a worker whose plugin is not set up yet
      (registration reaches the workers one at a time): it does not wait, as
      in plain Dask.
    - A worker does not see the graph: with ``policy="critical-path"`` every
      task counts as not critical.
    - A taint lists the still-running work a key derives from: a chain that
      runs far ahead of the device keeps lists as long as its queued depth.
"""

from __future__ import annotations

import asyncio
import copy
import difflib
import functools
import logging
import weakref
from collections.abc import Collection, Hashable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from distributed import WorkerPlugin
from distributed.core import Status
from distributed.protocol.pickle import dumps
from tornado.ioloop import PeriodicCallback

from dask_gpustreams.config import StreamsConfig
from dask_gpustreams.diagnostics import prometheus
from dask_gpustreams.integrations.distributed.blocks import StreamBlocks
from dask_gpustreams.integrations.distributed.egress import Egress
from dask_gpustreams.integrations.distributed.erred_inputs import ErredInputs
from dask_gpustreams.integrations.distributed.execution import Execution, fail_task
from dask_gpustreams.integrations.distributed.failures import FailureRecords
from dask_gpustreams.integrations.distributed.provenance import Provenance
from dask_gpustreams.integrations.distributed.redefined import drop_stale_dependencies
from dask_gpustreams.integrations.distributed.withheld import WithheldKeys
from dask_gpustreams.runtime import EventRegistry, StreamRuntime

logger = logging.getLogger("dask_gpustreams")

#: The settings a worker's own ``--preload dask_gpustreams`` gave it: worker ->
#: (overrides, error). A plugin that the scheduler's preload or a client's
#: ``gpustreams.enabled`` registers replaces the worker's plugin when the worker
#: registers (same name), and keeps these (:meth:`StreamsPlugin.setup`).
PRELOADED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

#: The plugin whose setup started last on each worker, until its teardown ends: the
#: next setup makes it give way first (:meth:`StreamsPlugin.setup`).
LATEST: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


#: Worker task states of a key whose value a task not wrapped by this plugin made, or may
#: still make (its thread runs), when the plugin is set up.
_UNPOOLED = frozenset({"memory", "executing", "long-running", "cancelled", "resumed"})


def _log_failure(plugin: Any, work: asyncio.Future) -> None:
    """Log the failure of ``plugin``'s teardown, whose caller was cancelled (a closing
    worker's): nothing else would raise it."""
    if not work.cancelled() and work.exception() is not None:
        logger.error("gpustreams: the teardown of %r failed", plugin, exc_info=work.exception())


def _closing(worker: Any) -> bool:
    """Whether ``worker`` is closing (or closed): its plugins go, none is set up again."""
    return worker.status in (Status.closing, Status.closed, Status.failed)


class StreamsPlugin(WorkerPlugin):
    """Run the tasks of every worker on a pool of GPU streams, ordered by device events.

    Keyword arguments override ``gpustreams.*`` for the workers that get this
    plugin (``streams``, ``policy``, ``backend``, ``timeline``, ...: the fields
    of :class:`~dask_gpustreams.StreamsConfig`); the other keys come from each
    worker's dask config. They are validated here, on the client, and again
    against the worker's config in :meth:`setup`.

    Registering it again replaces it (``idempotent = False``), so the new
    settings apply: each worker tears the old plugin down (waiting for the
    tasks it wrapped and for their events) and sets up the new one, and
    workers that join later get the new one. A silent no-op would leave the
    workers on settings the client no longer shows, and refusing would need
    the registered settings, which only the scheduler holds. The client and
    scheduler preloads register it only where none is registered
    (:mod:`dask_gpustreams.integrations.preload`), so a client created later
    does not undo settings registered here. Register
    from the client, not from inside a task: the replacement waits for that task.

    Bad settings: a worker whose settings are bad (a ``gpustreams.*`` value or key
    of its config, or one the plugin carries) fails every task it runs with that
    ``ValueError``, prefixed ``gpustreams cannot start on worker <address>:``,
    rather than running them without the plugin; :meth:`setup` also raises it, so
    ``client.register_plugin`` raises it on the client. A user who asked for the
    streams thus gets the error at the first task, whichever route installed the
    plugin, and not a cluster that silently runs without it. (distributed keeps a
    plugin whose setup raised in ``worker.plugins``, and calls its hooks.) The
    preloads install :meth:`failing` plugins for the settings they find bad.

    On a worker, the plugin composes three parts: :class:`.Provenance` (the
    runtime, the events, taints and failure records of the worker's keys),
    :class:`.Execution` (the run_spec of each task that starts executing) and
    :class:`.Egress` (the waits of ``get_data`` and spilling). Each owns its
    state: the hooks and the other parts use it through its methods, and the
    properties below read it.

    Examples
    --------
    >>> client.register_plugin(StreamsPlugin(streams=4))  # doctest: +SKIP
    >>> dask.config.set({"gpustreams.enabled": True})  # doctest: +SKIP
    >>> client = Client(LocalCluster())  # same effect, every client  # doctest: +SKIP
    """

    name = "gpustreams"
    idempotent = False  # registering again applies the new settings (see above)
    #: Modules whose task functions give their inputs to host-side machinery (P2P): read at
    #: setup.
    host_modules: tuple[str, ...] = ("distributed.shuffle",)
    #: How many kernel-failure records a worker keeps for keys not yet recomputed,
    #: and for how many seconds (a recomputation normally follows within milliseconds):
    #: read at setup (:class:`.FailureRecords`).
    max_failures = 1000
    failure_ttl = 60.0
    #: Seconds between releases of the inputs held for completed tasks.
    collect_interval = 0.5
    #: Seconds teardown waits for the runtime's close (the work left on the device).
    close_timeout = 30.0
    #: The bad settings every task of this worker fails with (None: they are fine).
    error: Exception | None = None  # bad settings (ValueError) or a setup that failed
    #: Registered by a preload (the scheduler's, or a client's ``gpustreams.enabled``):
    #: on a worker whose own preload set it up, the worker's settings win (``PRELOADED``).
    from_preload = False
    _active = False  # True between setup and teardown
    _teardown_ended: asyncio.Future | None = None  # done once the teardown has ended
    _predecessor: StreamsPlugin | None = None  # while the setup waits for its teardown
    _displaced = False  # torn down by a later plugin's setup, still registered (see _end)
    _held: Collection[Hashable] = ()  # corrupt keys held for their dependents (Provenance.held)
    #: Done once the setup has told the scheduler's StreamBlocks this worker's
    #: ``gpustreams.blocks`` (None: not told since the last setup started).
    _told: asyncio.Future | None = None
    #: Setups that set this plugin up so far: a setup whose plugin was torn down and set up
    #: again (``_set_up_displaced``) while it awaited the scheduler goes no further.
    _setups = 0
    #: The worker this object was first set up on (a weak reference; see :meth:`_set_up_copy`).
    _owner: weakref.ref | None = None
    #: A copy of this plugin as it reached its first worker, whose copies the others set up.
    _given: StreamsPlugin | None = None

    def __init__(self, **overrides: Any):
        fields = StreamsConfig.__dataclass_fields__
        for name in overrides:
            if name not in fields:
                match = difflib.get_close_matches(name, fields, n=1)
                hint = f" did you mean {match[0]!r}?" if match else ""
                raise TypeError(
                    f"StreamsPlugin() got an unexpected keyword argument {name!r};{hint} "
                    f"allowed: {', '.join(fields)}"
                )
        StreamsConfig.from_dask_config(**overrides)  # fail here, before pickling
        self.overrides = overrides

    @classmethod
    def failing(cls, error: ValueError) -> StreamsPlugin:
        """A plugin that fails every task of the workers it reaches with ``error``.

        What a preload installs when the settings it was given are bad (see
        *Bad settings* above): distributed would only log an error the preload
        raised and run the worker, or the whole cluster, without the plugin.
        """
        plugin = cls.__new__(cls)
        plugin.overrides = {}
        plugin.error = error
        return plugin

    def __getstate__(self) -> dict:
        state = {"overrides": self.overrides}
        if self.error is not None:
            state["error"] = self.error
        if self.from_preload:
            state["from_preload"] = True
        return state

    def __repr__(self) -> str:
        if self.error is not None:
            return f"StreamsPlugin.failing({self.error!r})"
        args = ", ".join(f"{k}={v!r}" for k, v in self.overrides.items())
        return f"StreamsPlugin({args})"

    # The worker's state, for diagnostics and tests.

    @property
    def runtime(self) -> StreamRuntime | None:
        """The worker's stream runtime; None until its first task (or a setup that found
        results in memory, :meth:`.Provenance.note_unpooled`)."""
        return self.provenance.runtime

    @property
    def registry(self) -> EventRegistry:
        """The event of each key produced on this worker."""
        return self.provenance.registry

    @property
    def failures(self) -> FailureRecords:
        """key -> (KernelError of a result found corrupt, when): an ``OrderedDict``."""
        return self.provenance.failures

    def wait_for(self, keys: tuple[Hashable, ...]) -> None:
        """Block until the work ``keys`` derive from is done; raise its ``KernelError``.

        For keys read from the worker's memory as they are (a client inside a task,
        :mod:`.gathered`), which ``get_data``'s wait does not see. Nothing to wait for
        outside setup and teardown (no stream ran them).
        """
        if self._active:
            self.provenance.wait_inputs(keys)

    # ------------------------------------------------------------------ lifecycle

    async def setup(self, worker: Any) -> None:
        """Read the worker's config, wrap ``get_data``, hook spilling; guard the scheduler.

        The scheduler gets :class:`.ErredInputs` (once: it is idempotent), so a
        corrupt result whose input has erred errs instead of waiting forever, and
        :class:`.StreamBlocks`, told this worker's ``gpustreams.blocks``. Bad
        settings raise their ``ValueError``, and every task of the worker then
        fails with it (see *Bad settings* above).
        """
        if self._owner is None:
            self._owner = weakref.ref(worker)
            # Before this setup adds the worker's own to them (PRELOADED, an error naming it).
            self._given = copy.copy(self)  # __getstate__: the settings
        elif self._owner() is not worker:
            await self._set_up_copy(worker)
            return
        previous = LATEST.get(worker)
        LATEST[worker] = self
        if previous is not None:  # no two plugins run a worker's tasks (see _end)
            self._predecessor = previous
            try:
                await previous._end(worker, self)
            finally:
                self._predecessor = None
            if LATEST.get(worker) is not self or all(
                p is not self for p in worker.plugins.values()
            ):
                logger.warning(
                    "gpustreams: %r was replaced or removed on worker %s while its setup "
                    "waited for the old plugin's teardown (two registrations overlapped); it "
                    "sets nothing up",
                    self,
                    worker.address,
                )
                removed = LATEST.get(worker) is self  # and no setup started since
                self._give_way(worker)
                # Replaced under another name, and still registered: set up again once the
                # plugin that won goes, as one that the winner's setup tore down (see _end).
                self._displaced = any(p is self for p in worker.plugins.values())
                if removed and not _closing(worker):
                    # The teardown it waited for was not the last setup's: set up the
                    # plugin that one displaced, as that teardown would have.
                    await self._set_up_displaced(worker)
                return
        own = PRELOADED.get(worker) if self.from_preload else None
        if own is not None:  # the worker's own preload options and their error come first
            overrides, error = own
            self.overrides = {**self.overrides, **overrides}
            self.error = error or self.error
        # The error given is not raised itself: its traceback would hold this frame, and so
        # the worker, and PRELOADED keeps it (a value that holds its key: the worker for good).
        error = self.error
        if error is None:
            try:
                self.config = StreamsConfig.from_dask_config(**self.overrides)
            except ValueError as e:
                error = e
        elif not isinstance(error, ValueError):
            self._give_way(worker)
            raise error
        if error is not None:
            self.error = ValueError(f"gpustreams cannot start on worker {worker.address}: {error}")
            self._tasks = worker.state.tasks
            self._give_way(worker)
            raise self.error
        # Threads of the egress waits and of the clears of stream errors after failures.
        self._egress_threads = ThreadPoolExecutor(4, thread_name_prefix="gpustreams-egress")
        failures = FailureRecords(self.max_failures, self.failure_ttl)
        self.provenance = Provenance(worker, self.config, self._egress_threads, failures)
        self._held = self.provenance.held
        self.execution = Execution(worker, self.provenance, self.host_modules)
        self.egress = Egress(worker, self.provenance, self._egress_threads)
        self._collector = PeriodicCallback(self.provenance.collect, self.collect_interval * 1000)
        try:
            self.egress.install()
            self._collector.start()
            prometheus.register(worker, self)  # the dask_worker_gpustreams_* series of /metrics
            # Made while no plugin was set up: no event (Known limits). With no await
            # between here and _active, every other task is wrapped.
            self.provenance.note_unpooled(
                [ts.key for ts in worker.state.tasks.values() if ts.state in _UNPOOLED]
            )
        except Exception as e:
            # distributed only logs a setup error: undo, and fail the tasks instead of
            # running them off the streams, or half set up.
            self._collector.stop()
            prometheus.unregister(worker)
            self.egress.uninstall()
            self._egress_threads.shutdown(wait=False)
            self.error = RuntimeError(f"gpustreams cannot start on worker {worker.address}: {e!r}")
            self._tasks = worker.state.tasks
            self._give_way(worker)
            raise self.error from e
        self._active = True
        self._told = None
        self._setups += 1
        setup = self._setups
        if self.config.blocks == "auto":  # blocks give the keys they make new dependencies
            drop_stale_dependencies(worker)
        try:
            await worker.scheduler.register_scheduler_plugin(
                plugin=dumps(ErredInputs()), name=ErredInputs.name, idempotent=True
            )
        except Exception as e:  # e.g. dask_gpustreams not importable on the scheduler
            logger.warning(
                "gpustreams: could not install %s on the scheduler (%r); a result found "
                "corrupt after its input erred will not err, and gathering it will wait",
                ErredInputs.name,
                e,
            )
        try:
            await worker.scheduler.register_scheduler_plugin(
                plugin=dumps(StreamBlocks()), name=StreamBlocks.name, idempotent=True
            )
            # Torn down meanwhile (nothing told, nothing to undo), and maybe set up again by a
            # later setup, which tells the scheduler itself.
            if not self._active or self._setups != setup:
                return
            # The teardown tells the scheduler None once this has arrived (they travel on
            # two comms, in either order).
            told = self._told = asyncio.get_running_loop().create_future()
            try:
                await worker.scheduler.gpustreams_blocks(
                    worker=worker.address,
                    mode=self.config.blocks,
                    size=self.config.block_size,
                    host_modules=self.host_modules,
                )
            finally:
                told.set_result(None)
        except Exception as e:
            logger.warning(
                "gpustreams: could not install %s on the scheduler (%r); no stream blocks",
                StreamBlocks.name,
                e,
            )

    async def _set_up_copy(self, worker: Any) -> None:
        """Set up a copy of this plugin (its settings alone, as it reached its first worker,
        as a pickled one has them) in its place on ``worker``, another than the one it was
        set up on. One object reaches several workers only in one process, unpickled
        (``LocalCluster(processes=False, plugins={plugin})``); each setup would otherwise
        replace the last worker's state in it, whose tasks then ran off its streams."""
        plugin = copy.copy(self._given)  # not what the first worker's setup added
        for name, registered in list(worker.plugins.items()):
            if registered is self:
                worker.plugins[name] = plugin
        await plugin.setup(worker)

    def _give_way(self, worker: Any) -> None:
        """A setup that fails, or that finds its plugin replaced or removed, sets nothing up,
        so the next one has nothing to wait for here: ``LATEST`` forgets it (a failure's
        error holds the worker in its traceback, and a value that holds its key would keep
        the closed worker for good)."""
        if LATEST.get(worker) is self:
            del LATEST[worker]

    async def _end(self, worker: Any, successor: StreamsPlugin) -> None:
        """Return once this plugin's teardown has ended on ``worker``, where ``successor``'s
        setup starts: tear it down if it is still set up (one warning says which plugin
        runs the tasks), wait for a teardown that runs, and for what its own setup waits
        for if it has not been set up yet.

        distributed's ``Worker.plugin_add`` awaits the teardown of a plugin of the same
        name before it installs the new one. A registration that comes meanwhile finds the
        name free: its plugin is installed and set up, then replaced by the first one's
        without a teardown (its ``get_data`` wrapper and its runtime would stay, and it
        would run tasks beside the teardown's guard). Hence :meth:`setup` waits here.
        """
        if self._active:
            logger.warning(
                "gpustreams: %r is set up on worker %s while %r still was (two registrations "
                "overlapped, or two names); the older one is torn down now, so that one "
                "plugin runs the tasks. Register the plugin again if these are not the "
                "settings you registered last",
                successor,
                worker.address,
                self,
            )
            try:
                await self.teardown(worker)
            except Exception:  # as distributed logs a failed teardown; the setup goes on
                logger.exception("gpustreams: the teardown of %r failed", self)
            # Still registered under another name: set up again once the successor goes.
            self._displaced = any(p is self for p in worker.plugins.values())
        elif self._teardown_ended is not None:
            await asyncio.shield(self._teardown_ended)
        elif self._predecessor is not None:
            await self._predecessor._end(worker, successor)

    async def teardown(self, worker: Any) -> None:
        """Stop wrapping; wait for the work already wrapped; restore the worker; close the runtime.

        The runtime is this plugin's own: closing it (:meth:`.Provenance.close`, in an
        egress thread, as it waits for the work left on the device) ends its streams
        and threads.
        A closing worker still serves ``get_data`` until its listeners stop (distributed
        removes its plugins first), so the work of what is in memory is waited for there
        too; that wait and the runtime's close take at most ``close_timeout`` s in all (a
        close not done by then goes on in its thread; one warning says what was left undone
        and why); its corrupt keys stay withheld until
        it has closed. (No task adds a result any more: the close cancelled the worker's async
        instructions before it removed the plugins.)
        A plugin whose settings were bad, or whose setup gave way, set nothing up.
        """
        if not self._active:
            # One whose setup tore another down and then failed or gave way: with no setup
            # started since, set up the one it displaced, as a teardown that ends does.
            if LATEST.get(worker) is None and not _closing(worker):
                await self._set_up_displaced(worker)
            return
        self._active = False
        ended = self._teardown_ended = asyncio.get_running_loop().create_future()
        # Shielded: a closing worker cancels its handlers (an unregister's among them) and
        # the teardown goes on to its end, closing the runtime within close_timeout, not
        # cancelled halfway with the runtime open.
        work = asyncio.ensure_future(self._tear_down(worker))
        work.add_done_callback(lambda _: ended.set_result(None))
        try:
            await asyncio.shield(work)
        except asyncio.CancelledError:
            work.add_done_callback(functools.partial(_log_failure, self))  # none raises it
            raise
        finally:
            # Not torn down by a successor's setup, nor one's started meanwhile (it waits).
            last = LATEST.get(worker) is self
            if last:
                del LATEST[worker]
        if last and not _closing(worker):
            await self._set_up_displaced(worker)

    async def _set_up_displaced(self, worker: Any) -> None:
        """Removed from ``worker``, where this plugin's setup tore down another still
        registered under another name (:meth:`_end`): set that one up again, so that no
        registered plugin sits torn down while tasks run without streams."""
        displaced = [
            p for p in worker.plugins.values() if isinstance(p, StreamsPlugin) and p._displaced
        ]
        if not displaced:
            return
        plugin = displaced[-1]
        plugin._displaced = False
        logger.warning(
            "gpustreams: %r is removed from worker %s; %r, still registered there, is set up again",
            self,
            worker.address,
            plugin,
        )
        try:
            await plugin.setup(worker)
        except Exception:  # its own failure, not this teardown's (distributed would say so)
            logger.exception(
                "gpustreams: setting %r up again on worker %s failed", plugin, worker.address
            )

    async def _tear_down(self, worker: Any) -> None:
        """:meth:`teardown`'s work, once."""
        closing = _closing(worker)
        guard = None
        if not closing:
            # First, before any await: this plugin is out of worker.plugins already, so
            # only the guard sees the tasks that read held corrupt keys start.
            guard = WithheldKeys(
                worker,
                self.provenance,
                self.egress,
                self.execution.fail,
                self.execution.on_threads,
            )
            guard.install()
            # Only what the setup told: a teardown while the setup still awaits the
            # scheduler's plugins has nothing to undo (and on a new scheduler, no handler
            # yet: it logged "No handler gpustreams_blocks found"); the setup then tells
            # nothing. One told is undone once it has arrived, not before.
            told = self._told
            if told is not None:
                await asyncio.shield(told)
                try:
                    await worker.scheduler.gpustreams_blocks(worker=worker.address, mode=None)
                except Exception as e:  # the teardown goes on: its worker's work comes first
                    # Only 'auto' forms blocks: a worker left counted as 'off' keeps them off,
                    # as one with no plugin does.
                    blocks = self.config.blocks
                    if blocks == "auto":
                        left = "so its stream blocks run there without streams, one at a time,"
                    else:
                        left = "which forms no stream blocks, as no plugin would,"
                    logger.warning(
                        "gpustreams: could not tell the scheduler that worker %s has no "
                        "plugin any more (%r); it still counts it as 'blocks: %s', %s until "
                        "the worker leaves or a plugin is registered again",
                        worker.address,
                        e,
                        blocks,
                        left,
                    )
            # Until the worker closes: its close cancels the tasks' Worker.execute, and a
            # task whose execute was cancelled stays in its executing set for good (no
            # event comes); the waits below then take a closing worker's close_timeout.
            while self.execution.running_wrapped() and not _closing(worker):
                await asyncio.sleep(0.01)
            closing = _closing(worker)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.close_timeout  # a closing worker's, for both waits
        waiting = self.egress.wait_for(list(worker.data))
        # What the teardown left undone, and why: one warning, though one kernel that never
        # ends both keeps the results' work from ending and the runtime from closing.
        undone = []
        try:
            failed = await (asyncio.wait_for(waiting, self.close_timeout) if closing else waiting)
        except TimeoutError:
            undone.append(
                f"the work of the results on closing worker {worker.address} did not end"
                f" within {self.close_timeout} s; they may leave it incomplete"
            )
            failed = {}
        if failed:
            self.provenance.drop_corrupt(failed)
        self._collector.stop()
        prometheus.unregister(worker)
        self.egress.uninstall(withheld=self.provenance.held)
        left = max(0.0, deadline - loop.time()) if closing else self.close_timeout
        try:
            await self.provenance.close(left)
        except TimeoutError as e:
            undone.append(f"on worker {worker.address}, {e}" if not undone else str(e))
        if undone:
            logger.warning("gpustreams: %s", "; ".join(undone))
        if guard is not None:
            guard.torn_down()
        self._egress_threads.shutdown(wait=False)

    def transition(self, key: Hashable, start: str, finish: str, **kwargs: Any) -> None:
        """Wrap a task that starts executing; drop the entries of keys that go away.

        Called for every transition of every key on the event loop: the others
        (about four per task) return after two comparisons and a check that no
        corrupt result is held for its dependents (else they tell
        :meth:`.Provenance.transitioned`). With bad settings, each task that starts
        executing raises their error instead.
        """
        if finish == "executing":  # a dependent that starts executing still needs its inputs
            if self._active:
                try:
                    self.execution.prepare(key)
                except Exception as e:  # distributed only logs this: fail the task instead
                    self.execution.fail(key, e)
            elif self.error is not None:
                fail_task(self._tasks, key, self.error)
            return
        if self._held:  # a mapping: no call
            self.provenance.transitioned(key, finish)
        if (finish == "released" or finish == "error") and self._active:
            # ("forgotten" always comes after "released")
            self.provenance.forget(key)
            if finish == "error":  # maybe a KernelError seen by a sync inside the task
                self.provenance.clear_stream_errors_soon()
