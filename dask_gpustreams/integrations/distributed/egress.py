"""Results leave the device only once their work has completed.

The *Egress* section of :mod:`.plugin`'s documentation. :class:`Egress` wraps
the worker's ``get_data`` handler, whose waits run in the egress threads so
that the event loop keeps running, and hooks spilling, whose wait blocks the
event loop for the evicted key only.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection, Hashable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from distributed.metrics import context_meter

from dask_gpustreams.diagnostics.fine_metrics import server_digest, wait_meter
from dask_gpustreams.errors import KernelError
from dask_gpustreams.integrations.distributed.provenance import Provenance


def _zict_buffers(data: Any) -> list:
    """``data`` and its attributes that are ``zict.Buffer`` s (SpillBuffer, DeviceHostFile)."""
    import zict

    found = []
    for candidate in (data, *getattr(data, "__dict__", {}).values()):
        if isinstance(candidate, zict.Buffer) and all(candidate is not b for b in found):
            found.append(candidate)
    return found


class Egress:
    """The waits of one worker before a result is copied off the device on the host."""

    def __init__(self, worker: Any, provenance: Provenance, threads: ThreadPoolExecutor):
        self.worker = worker
        self.provenance = provenance
        self.threads = threads
        #: The fast (LRU) mappings of the worker's zict buffers, whose evictions are hooked.
        self.evicting: list = []
        self._worker_get_data: Any = None  # the handler that get_data wraps
        #: Corrupt keys get_data leaves out after the plugin's removal, until restore().
        self.withheld: Collection[Hashable] = ()
        #: Requests (get_data, spills) that waited for events, and their seconds in all.
        self.waits = 0
        self.wait_seconds = 0.0
        # Routes the context_meter waits of get_data as the worker's own get_data does.
        self._get_data_digest = server_digest(worker, "get-data")

    def install(self) -> None:
        """Wrap the worker's ``get_data`` handler and hook its spilling (event loop)."""
        self._worker_get_data = self.worker.handlers["get_data"]
        self.worker.handlers["get_data"] = self.get_data
        self.evicting = [b.fast for b in _zict_buffers(self.worker.data)]
        for lru in self.evicting:
            lru.on_evict.insert(0, self.before_spill)

    def uninstall(self, withheld: Collection[Hashable] = ()) -> None:
        """Unhook spilling and restore the worker's ``get_data`` handler (event loop).

        ``withheld``: the corrupt keys still in memory, held for their dependents
        (:attr:`.Provenance.held`, read live: a key released is served again):
        :meth:`get_data` stays the handler and leaves them out until :meth:`restore`
        (:class:`.WithheldKeys`), so no peer or client gets their values.
        """
        for lru in self.evicting:
            if self.before_spill in lru.on_evict:
                lru.on_evict.remove(self.before_spill)
        self.withheld = withheld
        if not withheld:
            self.restore()

    def restore(self) -> None:
        """Nothing is withheld: the worker's own ``get_data`` again (event loop).

        Also where a plugin registered meanwhile wraps :meth:`get_data` as the
        worker's handler (it stays in that chain, passing every key through).
        """
        self.withheld = ()
        if self.worker.handlers.get("get_data") == self.get_data:
            self.worker.handlers["get_data"] = self._worker_get_data

    async def get_data(
        self,
        comm: Any,
        keys: Collection[Hashable],
        who: str | None = None,
        serializers: list[str] | None = None,
    ) -> Any:
        """``Worker.get_data`` once the events of ``keys`` have completed; failed keys left out.

        After the plugin's removal, also the :attr:`withheld` keys.
        """
        provenance = self.provenance
        unpooled = provenance.unpooled
        # Keys made while no plugin was set up: their work first (only for those: a noted key
        # nothing reads may stay noted for good, and each request would go to a thread).
        if unpooled and not unpooled.isdisjoint(keys):
            await asyncio.get_running_loop().run_in_executor(
                self.threads, provenance.settle_unpooled, keys
            )
        if len(provenance.registry):
            with context_meter.add_callback(self._get_data_digest, allow_offload=True):
                failed = await self.wait_for(keys)
            if failed:
                provenance.drop_corrupt(failed)
                keys = [k for k in keys if k not in failed]
                provenance.clear_stream_errors_soon()
        # Read after the wait: a teardown that ran meanwhile (a closing worker) may have
        # found a key corrupt and withheld it.
        if self.withheld:
            keys = [k for k in keys if k not in self.withheld]
        return await self._worker_get_data(comm, keys=keys, who=who, serializers=serializers)

    async def wait_for(self, keys: Collection[Hashable]) -> dict[Hashable, KernelError]:
        """Wait, off the event loop, for the work of ``keys``; return the keys whose work failed."""
        provenance = self.provenance
        loop = asyncio.get_running_loop()
        waited = None
        sources: dict[Hashable, list] = {}
        while True:
            # Updated, not replaced: a key whose record went during the wait (a teardown
            # cleared the registry, the key still in memory) keeps the records it had, whose
            # failure must still be found.
            sources.update(provenance.sources_by_key(keys))
            pending = provenance.pending(r for rs in sources.values() for r in rs)
            if not pending:
                break
            waited = waited or time.perf_counter()
            with wait_meter():
                await loop.run_in_executor(self.threads, provenance.wait_all, pending)
        if waited is not None:
            self.waits += 1
            self.wait_seconds += time.perf_counter() - waited
        failed = {}
        for key, records in sources.items():
            error = provenance.first_error(records)
            if error is not None:
                failed[key] = error
            else:
                provenance.succeeded(key)  # all done and fine
        return failed

    def before_spill(self, key: Hashable, value: Any) -> None:
        """First ``on_evict`` callback: the key's work must be complete before it is serialized."""
        provenance = self.provenance
        if provenance.unpooled:
            provenance.settle_unpooled((key,))  # blocks the loop, as the waits below
        if provenance.runtime is None:
            return
        records = provenance.sources((key,))
        if provenance.any_running(records):
            started = time.perf_counter()
            with wait_meter():
                provenance.wait_all(records)  # blocks the loop; errors read below
            self.waits += 1
            self.wait_seconds += time.perf_counter() - started
        for record in records:
            error = provenance.wait(record)  # complete: returns at once
            if error is not None:
                # Spilled anyway (the value is garbage either way); the key is dropped next.
                failed = {key: error}
                self.worker.loop.add_callback(provenance.drop_corrupt, failed)
                provenance.clear_stream_errors_soon()
                return
        provenance.succeeded(key)
