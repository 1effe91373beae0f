"""Values a task gets from a client inside a worker: ordered, and held until its event.

A task that computes through ``worker_client()`` or ``get_client()`` gets its values
from ``Future.result`` or ``Client.gather``. A key of its own worker comes straight from
that worker's ``data``, without ``get_data``'s wait: its kernels may still run on
another pool stream, and once the future is released the worker drops the key and its
block goes back to that stream's arena, while the calling task's kernels, on its own
stream, may read it after the task returns. Without the plugin both kernels run on the
legacy default stream, in order.

So :func:`install` (run at import of :mod:`dask_gpustreams`) wraps ``Client.sync``, through
which both run, inside distributed's ``shorten_traceback`` (a task error's traceback reads
as without the plugin). In a thread that runs a task through the stream runtime, once
such a call returns, the runtime waits for the work enqueued so far on every stream (the
values' among it), and the values are held as the task's inputs are, until its event
completes. Elsewhere, other calls, and an asynchronous client's (which return
awaitables), are unchanged. A kernel of the gathered key that failed is not raised here:
its value is what it left.
"""

from __future__ import annotations

import inspect
from typing import Any

import distributed

from dask_gpustreams.integrations.patching import Patch
from dask_gpustreams.runtime.context import active_task


def received(value: Any) -> Any:
    """``value``, gathered in this thread: ordered and held if a stream task runs here."""
    runtime, _, holds = active_task()
    if holds is not None and not inspect.isawaitable(value):
        runtime.wait_enqueued()
        holds.append(value)
    return value


#: The coroutines of ``Future.result`` and ``Client.gather`` that ``Client.sync`` runs.
GATHERING = frozenset({"_result", "_gather"})


def sync(self: distributed.Client, func: Any, *args: Any, **kwargs: Any) -> Any:
    """``Client.sync``; then :func:`received` for ``Future.result`` and ``Client.gather``."""
    value = _sync.original(self, func, *args, **kwargs)
    if getattr(func, "__name__", None) in GATHERING:
        return received(value)
    return value


_sync = Patch(distributed.Client, "sync", sync)


def install() -> None:
    """Wrap ``Client.sync``. Idempotent; :func:`uninstall` undoes it."""
    _sync.install()


def uninstall() -> None:
    """Put back the function :func:`install` wrapped."""
    _sync.uninstall()
