"""Preloading ``dask_gpustreams``: ``dask_setup`` for workers, schedulers and clients.

``dask_gpustreams.dask_setup`` is this module's :func:`dask_setup`, so every
preload route names the package:

- a worker: ``dask worker --preload dask_gpustreams``, ``dask cuda worker
  --preload dask_gpustreams``, ``LocalCluster(preload=["dask_gpustreams"])``,
  ``LocalCUDACluster(preload=["dask_gpustreams"])`` or the
  ``distributed.worker.preload`` config key (which dask-cuda ignores: it
  always passes its own preload list). The worker installs
  :class:`~dask_gpustreams.StreamsPlugin` itself, configured from its own
  ``gpustreams.*`` config.
- a scheduler: ``dask scheduler --preload dask_gpustreams``. The scheduler
  registers the plugin for every worker that connects to it, dask-cuda
  workers included.
- a client: importing :mod:`dask_gpustreams` adds this module
  (:data:`CLIENT_PRELOAD`) to the *defaults* of ``distributed.client.preload``.
  A client created while
  ``gpustreams.enabled`` is true registers the plugin with its scheduler
  (unless one is registered already: a plugin registered with settings
  stays), which installs it on the current workers and on those that join later;
  with ``gpustreams.enabled`` false it does nothing. This covers
  ``Client()`` and ``Client(LocalCluster(...))`` (in-process or with worker
  processes) and clients of remote schedulers, dask-cuda clusters included.

Why a client preload for ``gpustreams.enabled``: the client is the one object
created in the process where the user sets the key, whatever the cluster, and
a plugin registered through it reaches every worker, present and future
(``Scheduler.worker_plugins``). A worker-side route would miss dask-cuda (its
preload list replaces ``distributed.worker.preload``) and remote clusters. The
default only applies while ``distributed.client.preload`` keeps its default
value: a list set in YAML, the environment or ``dask.config.set`` replaces it
(add ``"dask_gpustreams"`` to such a list), and ``dask.config.refresh()``
drops it (dask re-applies the first default of a key).

Why quiet: distributed logs three INFO lines for every preload of every
client ("Creating preload", "Import preload module", "Run preload setup"),
and a user who only imported the package did not ask for one. So the default
names this module, not the package, and a filter on the
``distributed.preloading`` logger drops those INFO lines for that name alone
(:class:`QuietClientPreload`), enabled or not. Its errors ("Failed to start
preload", logged at ERROR) and every line of a preload the user names
(``dask_gpustreams`` included) stay. Distributed has no other client-side
hook that runs once the client is connected (its ``extensions`` are built
before it connects, and event handlers subscribe at the scheduler).

``dask_setup`` is a plain function: preload arguments (dask-cuda passes
``--create-cuda-context`` to every preload) are ignored, where a click
command would fail on them. It creates nothing on the device: the streams are
created when the first task runs, after dask-cuda's CUDA context and RMM setup.
"""

from __future__ import annotations

import logging
from typing import Any

import dask.config
import distributed  # noqa: F401  (its defaults must be registered before ours)

from dask_gpustreams.config import enabled

logger = logging.getLogger("dask_gpustreams")

#: The module added to the default of ``distributed.client.preload`` (this one).
CLIENT_PRELOAD = "dask_gpustreams.integrations.preload"


def dask_setup(server: Any) -> Any:
    """Install :class:`~dask_gpustreams.StreamsPlugin` from a preload.

    ``server`` is the preloading object: a ``Worker`` installs the plugin on
    itself, a ``Scheduler`` registers it for all its workers, a ``Client``
    registers it with its scheduler when ``gpustreams.enabled`` is true. A
    ``Nanny`` does nothing (use ``--preload``, which reaches its worker).
    Returns the awaitable that the preload machinery awaits, or None.
    """
    from distributed import Client, Scheduler, Worker

    from dask_gpustreams.integrations.distributed import StreamsPlugin

    if isinstance(server, Worker):
        return server.plugin_add(StreamsPlugin(), name=StreamsPlugin.name, catch_errors=False)
    if isinstance(server, Scheduler):
        return _register(server.register_worker_plugin(None, **_plugin_message(StreamsPlugin())))
    if isinstance(server, Client):
        if not enabled():
            return None
        return _register(
            server.scheduler.register_worker_plugin(**_plugin_message(StreamsPlugin()))
        )
    logger.info("gpustreams: preload ignored by %s; preload the worker instead", type(server))
    return None


def _plugin_message(plugin: Any) -> dict:
    """A ``register_worker_plugin`` request that leaves a registered plugin in place.

    Idempotent, unlike ``client.register_plugin(StreamsPlugin(...))``: a
    client created while ``gpustreams.enabled`` is true (one made by
    ``get_client()`` in a task, say) neither replaces settings a user
    registered nor restarts the workers' plugin.
    """
    from distributed.protocol.pickle import dumps

    return {"plugin": dumps(plugin), "name": plugin.name, "idempotent": True}


async def _register(request: Any) -> None:
    """Await a ``register_worker_plugin`` call; raise the first worker's setup error."""
    responses = await request
    for address, response in (responses or {}).items():
        if response.get("status") == "error":
            from distributed.core import clean_exception

            _, exc, tb = clean_exception(response["exception"], response["traceback"])
            raise RuntimeError(f"gpustreams plugin failed to start on {address}") from exc


class QuietClientPreload(logging.Filter):
    """Drops ``distributed.preloading``'s INFO lines about :data:`CLIENT_PRELOAD`.

    Every line of other preloads, and the ERROR lines of this one, pass.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not (
            record.levelno <= logging.INFO
            and isinstance(record.args, tuple)
            and record.args[:1] == (CLIENT_PRELOAD,)
        )


_quiet_client_preload = QuietClientPreload()


def _add_client_preload_default() -> None:
    """Append :data:`CLIENT_PRELOAD` to the default of ``distributed.client.preload``."""
    default = dask.config.merge(*dask.config.defaults)["distributed"]["client"]["preload"]
    default = [default] if isinstance(default, str) else list(default)
    if CLIENT_PRELOAD not in default:
        preload = [*default, CLIENT_PRELOAD]
        dask.config.update_defaults({"distributed": {"client": {"preload": preload}}})


_add_client_preload_default()
logging.getLogger("distributed.preloading").addFilter(_quiet_client_preload)
