"""What stays of a removed :class:`.StreamsPlugin` while corrupt keys it found are in memory.

distributed takes a plugin out of ``worker.plugins`` before it calls its
teardown, and no transition reaches it after that. A corrupt key held for the
dependents that still need it (:meth:`.Provenance.transitioned`) would then stay
in memory: its new readers would run on its value, unchecked, and the worker's
own ``get_data`` would serve it. So the teardown puts :class:`WithheldKeys` in
``worker.plugins`` first, under a name of its own. Until the last such key has
left memory, it makes each task that starts executing with one of them as input
raise that key's recorded :class:`~dask_gpustreams.KernelError` (the check the
plugin made when tasks started), hands the other transitions to the
:class:`.Provenance` (which releases a key once its last reader has left), and
the plugin's :class:`.Egress` leaves the keys out of ``get_data``. Then it
restores the worker's ``get_data`` and removes itself.

While the teardown runs, the tasks that start executing are no longer wrapped,
yet their inputs may be results whose kernels the removed plugin's streams are
still running (the teardown waits for those, but a task may start before then).
So each such task waits on the host, in its worker thread, for its inputs' pending
work before it runs, as a host-side task does, and for the work it queued on its
thread's stream before it returns (:class:`_Unwrapped`): its result has no event
for the next plugin's tasks to wait for. One whose inputs' work failed raises that
error; its own kernels' failures stay unchecked, as before. Until this, a plugin
registered again (``client.register_plugin(StreamsPlugin(...))`` with new settings)
or unregistered while a graph ran gave that graph's tasks inputs not yet written,
and their readers results not yet written (NaN on the sim; on CUDA, wherever the
task's stream does not follow the pool's, as with ``CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any

from distributed import WorkerPlugin

from dask_gpustreams.integrations.distributed.egress import Egress
from dask_gpustreams.integrations.distributed.execution import (
    Raises,
    coroutine_after_inputs,
    with_func,
)
from dask_gpustreams.integrations.distributed.provenance import Provenance

if TYPE_CHECKING:
    from dask_gpustreams.runtime.runtime import StreamRuntime


class _Unwrapped:
    """Task function of a task that starts while the plugin's teardown runs: no stream of
    the pool runs it, so it waits on the host for its inputs' work (``wait_inputs``, None
    where none is pending), runs the node, and waits for the work it queued on its
    thread's stream: its result has no event that a task of the next plugin could wait
    for, and its inputs may be freed once it returns."""

    __slots__ = ("wait_inputs", "node", "dep_keys", "runtime")

    def __init__(
        self,
        wait_inputs: Callable[[tuple[Hashable, ...]], None] | None,
        node: Any,
        dep_keys: tuple[Hashable, ...],
        runtime: StreamRuntime,
    ):
        self.wait_inputs = wait_inputs
        self.node = node
        self.dep_keys = dep_keys
        self.runtime = runtime

    def __call__(self, *values: Any) -> Any:
        if self.wait_inputs is not None:
            self.wait_inputs(self.dep_keys)
        result = self.node(dict(zip(self.dep_keys, values, strict=True)))
        # Its kernels' failures stay unchecked, as they were (the plugin is gone: the
        # guide's "Not there yet"): the wait orders its result and returns such an error.
        self.runtime.wait_current_stream()
        return result

    def __repr__(self) -> str:
        return f"_Unwrapped({self.node!r})"


class WithheldKeys(WorkerPlugin):
    """Guards the corrupt keys a removed plugin's :class:`.Provenance` still holds (event loop)."""

    def __init__(
        self,
        worker: Any,
        provenance: Provenance,
        egress: Egress,
        fail: Callable[[Hashable, BaseException], None],
        on_threads: Callable[[Any], bool] | None = None,
    ):
        self.name = f"gpustreams-withheld-{id(self):x}"
        self.worker = worker
        self.provenance = provenance
        self.egress = egress
        self.fail = fail
        #: Whether a task state's task runs in a worker thread (:meth:`.Execution.on_threads`):
        #: one that runs in another process (a process-pool executor) is left as it is.
        self.on_threads = on_threads
        #: While the plugin's teardown runs: keys may still be found corrupt, so the
        #: guard stays even when none is held.
        self.tearing_down = True

    def install(self) -> None:
        """Into ``worker.plugins`` (no setup to await: it takes effect at once)."""
        self.worker.plugins[self.name] = self

    def transition(self, key: Hashable, start: str, finish: str, **kwargs: Any) -> None:
        provenance = self.provenance
        if finish == "executing":
            provenance.fail_if_reads_held(key, self.fail)
            if self.tearing_down:
                self._after_inputs(key)
            return
        if provenance.held:  # a mapping: no call
            provenance.transitioned(key, finish)
        elif not self.tearing_down:
            self.remove()

    def _after_inputs(self, key: Hashable) -> None:
        """``key``'s task, which starts unwrapped, waits on the host for its inputs' pending
        work first, and for its own work on its thread's stream at its end
        (:class:`_Unwrapped`)."""
        ts = self.worker.state.tasks.get(key)
        node = getattr(ts, "run_spec", None)
        runtime = self.provenance.runtime
        if node is None or runtime is None:
            return  # (no runtime: nothing ran on the streams)
        if key in self.worker.state.actors or isinstance(getattr(node, "func", None), Raises):
            return  # an actor; or failed already (a held corrupt input)
        coroutine = getattr(node, "is_coro", False)
        if not coroutine and self.on_threads is not None and not self.on_threads(ts):
            return  # in another process: _Unwrapped (the runtime) cannot go there
        dep_keys = tuple(node.dependencies)
        try:
            error, pending = self.provenance.input_states(dep_keys)
        except Exception:  # the runtime closed meanwhile: its work is done
            error, pending = None, ()
        if error is not None:
            self.fail(key, error)
            return
        # Inputs made while no plugin was set up, still noted: waited for as pending ones.
        unpooled = self.provenance.unpooled
        noted = unpooled and not unpooled.isdisjoint(dep_keys)
        wait = self.provenance.wait_inputs if pending or noted else None
        if coroutine:  # on the event loop: it waits for its inputs in a thread first
            if wait is not None:
                after = coroutine_after_inputs(wait, node, dep_keys)
                ts.run_spec = with_func(node, after, dep_keys)
            return
        ts.run_spec = with_func(node, _Unwrapped(wait, node, dep_keys, runtime), dep_keys)

    def torn_down(self) -> None:
        """The plugin's teardown has ended: the guard goes once nothing is held (now, if so)."""
        self.tearing_down = False
        if not self.provenance.held:
            self.remove()

    def remove(self) -> None:
        """Nothing is held any more: the worker's own ``get_data`` again, and this plugin out."""
        self.egress.restore()
        if self.worker.plugins.get(self.name) is self:
            del self.worker.plugins[self.name]

    def teardown(self, worker: Any) -> None:
        """The worker closes (or the plugin is removed by name): serve as before."""
        self.egress.restore()
