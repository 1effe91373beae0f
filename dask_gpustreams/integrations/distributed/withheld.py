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
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from distributed import WorkerPlugin

from dask_gpustreams.integrations.distributed.egress import Egress
from dask_gpustreams.integrations.distributed.provenance import Provenance


class WithheldKeys(WorkerPlugin):
    """Guards the corrupt keys a removed plugin's :class:`.Provenance` still holds (event loop)."""

    def __init__(
        self,
        worker: Any,
        provenance: Provenance,
        egress: Egress,
        fail: Callable[[Hashable, BaseException], None],
    ):
        self.name = f"gpustreams-withheld-{id(self):x}"
        self.worker = worker
        self.provenance = provenance
        self.egress = egress
        self.fail = fail
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
            return
        if provenance.held:  # a mapping: no call
            provenance.transitioned(key, finish)
        elif not self.tearing_down:
            self.remove()

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
