"""Values a task gets from a client inside a worker: ordered, and held until its event.

A task that computes through ``worker_client()`` or ``get_client()`` gets its values
from ``Future.result`` or ``Client.gather``, and its kernels, on its own stream, may read
them after it returns. Once the future is released, the worker drops the key and its
block goes back to the arena of the stream it was made on, where the next allocation of
its size takes it. ``Client.gather`` inside a worker also takes a key of that worker
straight from its ``data``, without ``get_data``'s wait for the key's work (which may
still run on another stream; ``Future.result`` goes through ``get_data``). Without the
plugin every kernel runs on the legacy default stream, in order.

So :func:`install` (run at import of :mod:`dask_gpustreams`) wraps ``Client.sync``, through
which both run, inside distributed's ``shorten_traceback`` (a task error's traceback reads
as without the plugin). After a synchronous ``Client.gather`` that read keys of a worker's
memory (its ``local_worker``), that worker's plugin waits for their work and raises a
failure of it (:meth:`StreamsPlugin.wait_for`). In a thread that runs a task through the
stream runtime, the values of either call are then held as the task's inputs are, until
its event completes.
"""

from __future__ import annotations

from typing import Any

import distributed
from distributed.client import futures_of

from dask_gpustreams.integrations.distributed.plugin import StreamsPlugin
from dask_gpustreams.integrations.patching import Patch
from dask_gpustreams.runtime.context import active_task


def received(value: Any) -> Any:
    """``value``, got in this thread: held if a stream task runs here."""
    holds = active_task()[2]
    if holds is not None:
        holds.append(value)
    return value


#: The coroutines of ``Future.result`` and ``Client.gather`` that ``Client.sync`` runs.
GETTING = frozenset({"_result", "_gather"})


def sync(self: distributed.Client, func: Any, *args: Any, **kwargs: Any) -> Any:
    """``Client.sync``; then, for ``Future.result`` and ``Client.gather``, the gathered
    keys' work waited for and the values held (see the module's docstring)."""
    value = _sync.original(self, func, *args, **kwargs)
    name = getattr(func, "__name__", None)
    if name not in GETTING:
        return value
    asynchronous = kwargs.get("asynchronous")
    if self.asynchronous if asynchronous is None else asynchronous:
        return value  # an awaitable
    worker = kwargs.get("local_worker")
    if worker is not None and args:
        plugin = worker.plugins.get(StreamsPlugin.name)
        if isinstance(plugin, StreamsPlugin):
            plugin.wait_for(tuple(f.key for f in futures_of(args[0])))
    return received(value)


_sync = Patch(distributed.Client, "sync", sync)


def install() -> None:
    """Wrap ``Client.sync``. Idempotent; :func:`uninstall` undoes it."""
    _sync.install()


def uninstall() -> None:
    """Put back the function :func:`install` wrapped."""
    _sync.uninstall()
