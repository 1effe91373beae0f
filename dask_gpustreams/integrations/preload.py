"""Preloading ``dask_gpustreams``: ``dask_setup`` for workers, schedulers and clients.

``dask_gpustreams.dask_setup`` is this module's :data:`dask_setup`, so every
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
  workers included; each worker reads its own ``gpustreams.*`` config (the
  scheduler's is checked, not sent).
- a client: importing :mod:`dask_gpustreams` adds this module
  (:data:`CLIENT_PRELOAD`) to the *defaults* of ``distributed.client.preload``.
  A client created while
  ``gpustreams.enabled`` is true registers the plugin with its scheduler
  (unless one is registered already: a plugin registered with settings
  stays), which installs it on the current workers and on those that join later;
  with ``gpustreams.enabled`` false it does nothing. This covers
  ``Client()`` and ``Client(LocalCluster(...))`` (in-process or with worker
  processes) and clients of remote schedulers, dask-cuda clusters included.

Options
    :data:`dask_setup` is a click command: preload arguments set the plugin's
    settings, one option per ``gpustreams.*`` key of
    :class:`~dask_gpustreams.StreamsConfig` (``--streams``, ``--copy-streams``,
    ``--policy``, ``--backend``, ``--pinned-pool-size``, ``--launch-ahead``,
    ``--host-threads``, ``--launch-order``, ``--small-blocks``, ``--large-tasks``,
    ``--shared-blocks``, ``--blocks``, ``--block-size``, and the flags
    ``--timeline/--no-timeline``, ``--nvtx/--no-nvtx``).
    They override the config of the workers, as the keyword arguments of
    ``StreamsPlugin`` do. A worker's own preload options (and their errors) also
    win over the plugin that the scheduler's preload or a client's
    ``gpustreams.enabled`` registers, which replaces the worker's plugin when the
    worker registers (``PRELOADED``); ``client.register_plugin`` replaces them::

        dask worker tcp://host:8786 --preload dask_gpustreams --streams 4 --policy round-robin
        dask scheduler --preload dask_gpustreams --streams 4
        LocalCluster(preload=["dask_gpustreams"], preload_argv=["--streams", "4"])

    ``--create-cuda-context``, which dask-cuda passes to every preload, is
    accepted and ignored. dask-cuda also passes the arguments of ``dask cuda
    worker`` to its own preload, which refuses options it does not know: give a
    dask-cuda worker its settings through the environment
    (``DASK_GPUSTREAMS__STREAMS=4``). ``dask worker`` and ``dask scheduler`` read the
    first argument they do not know as the scheduler address, so give the address
    before the preload's options; with ``--scheduler-file`` use the environment.
    An option read as the address is refused when the command starts (a usage error
    naming it), as it would never reach the preload.

Bad settings
    distributed logs an error that a preload raises and goes on without it
    (``Failed to start preload``), so that a worker, or with the scheduler's
    preload a whole cluster, would run every task off the streams. So nothing
    here raises. An unknown option, a bad option value, or a bad
    ``gpustreams.*`` value or key in the config of the worker or the scheduler
    makes the preload install :meth:`StreamsPlugin.failing
    <dask_gpustreams.StreamsPlugin.failing>` instead: every task on the workers
    it reaches fails with that ``ValueError``, which names the worker, where the
    setting came from, the key or option, the value and what is allowed, e.g.
    ``gpustreams cannot start on worker tcp://10.0.0.5:40331:
    gpustreams.streams='abc' is invalid: allowed values are an int >= 1 and <=
    128``. The worker logs it when it starts, and ``status(client)`` shows it.
    The error thus reaches whoever computes, at their first task, and a client
    waiting for workers sees them join; a worker that refused to start would
    leave that client waiting, told nothing (the worker never registers).
    Since an option error is reported that way too, the command line accepts
    the options as they come and leaves their errors to the worker.

    A client cannot be failed from its preload either (``Client(...)`` returns
    whatever its preloads raise): with bad settings in the client's own config
    (``gpustreams.enabled`` set), ``Client(...)`` warns (``UserWarning``) with the
    error and registers nothing, so as not to fail the tasks of a cluster that
    other clients share; a worker that refuses the settings it registers is
    named in a warning too, and fails its tasks as above.

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

``dask_setup`` creates nothing on the device: the streams are created when
the first task runs, after dask-cuda's CUDA context and RMM setup.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
import weakref
from collections.abc import Callable
from dataclasses import Field, fields
from typing import Any

import click
import dask.config
import distributed  # noqa: F401  (its defaults must be registered before ours)

from dask_gpustreams.config import StreamsConfig, enabled

logger = logging.getLogger("dask_gpustreams")

#: The module added to the default of ``distributed.client.preload`` (this one).
CLIENT_PRELOAD = "dask_gpustreams.integrations.preload"


def _setup(server: Any, problem: str | None = None, **options: Any) -> Any:
    """Install :class:`~dask_gpustreams.StreamsPlugin` from a preload (:data:`dask_setup`).

    ``server`` is the preloading object: a ``Worker`` installs the plugin on
    itself, a ``Scheduler`` registers it for all its workers, a ``Client``
    registers it with its scheduler when ``gpustreams.enabled`` is true, with the
    client's settings that differ from the defaults as its arguments. A
    ``Nanny`` does nothing (use ``--preload``, which reaches its worker).
    ``options`` are the preload arguments (None where not given); ``problem`` is
    why they could not be read. Never raises (see *Bad settings*). Returns the
    awaitable that the preload machinery awaits, or None.
    """
    from distributed import Client, Scheduler, Worker

    from dask_gpustreams.integrations.distributed import StreamsPlugin
    from dask_gpustreams.integrations.distributed.plugin import PRELOADED

    overrides = {name: value for name, value in options.items() if value is not None}
    if isinstance(server, Worker):
        plugin = _plugin(problem, overrides, source="")
        PRELOADED[server] = (dict(plugin.overrides), plugin.error)  # before setup prefixes it
        return server.plugin_add(plugin, name=StreamsPlugin.name)  # logs a failed setup
    if isinstance(server, Scheduler):
        plugin = _plugin(problem, overrides, source="the scheduler's ")
        plugin.from_preload = True
        if plugin.error is not None:
            logger.error("gpustreams: every task will fail: %s", plugin.error)
        return _register(
            server.register_worker_plugin(None, **_plugin_message(plugin)), logger.error
        )
    if isinstance(server, Client):
        try:
            if not enabled():
                _created_off.add(server)
                return None
            if problem is not None:
                raise ValueError(f"preload argument: {problem}")
            # The client's settings reach workers that read another config (a cluster
            # made before they were set, remote workers), as StreamsPlugin's arguments.
            plugin = StreamsPlugin(**{**StreamsConfig.changed_settings(), **overrides})
        except ValueError as e:
            _warn(f"gpustreams is not installed by this client: {e}")
            return None
        plugin.from_preload = True
        return _register(server.scheduler.register_worker_plugin(**_plugin_message(plugin)), _warn)
    logger.info("gpustreams: preload ignored by %s; preload the worker instead", type(server))
    return None


#: The clients created while ``gpustreams.enabled`` was false, not yet checked by
#: :func:`warn_if_not_registered`.
_created_off: weakref.WeakSet = weakref.WeakSet()


def warn_if_not_registered(client: Any) -> None:
    """Warn where ``gpustreams.enabled`` is on at a compute through ``client``, which was
    created while it was off (so it registered no plugin), and no plugin runs there: its
    scheduler has none registered and no worker preloaded one.

    Once a client, with a call to its scheduler (and, where it has none, to its workers);
    not for an asynchronous client, which cannot make those calls here. Registering the
    plugin here instead would outlive a ``dask.config.set`` block, on a cluster that other
    clients may share.
    """
    if client not in _created_off:
        return
    _created_off.discard(client)
    if client.asynchronous:
        return
    from dask_gpustreams.integrations.distributed import StreamsPlugin

    name = StreamsPlugin.name
    try:
        running = client.run_on_scheduler(_registered, name) or _workers_run(client, name)
    except Exception:  # the compute that follows reports what is wrong with the client
        logger.debug("gpustreams: could not ask the cluster for its plugins", exc_info=True)
        return
    if not running:
        warnings.warn(
            f"gpustreams.enabled is on, but {client.id} was created while it was off, so it "
            "registered no StreamsPlugin, and none runs on its cluster: its workers run this "
            "compute without streams. Register it with "
            "client.register_plugin(dask_gpustreams.StreamsPlugin()), or set "
            "gpustreams.enabled before creating the Client.",
            UserWarning,  # the client's id in the text: Python shows each client's once
            stacklevel=4,
        )


def _workers_run(client: Any, name: str) -> bool:
    """Whether a worker of ``client`` runs the plugin ``name`` (its own preload's); True
    without workers, as those that join may."""
    answers = client.run(_has_plugin, name)
    return not answers or any(answers.values())


def _registered(name: str, dask_scheduler: Any) -> bool:
    return name in dask_scheduler.worker_plugins


def _has_plugin(name: str, dask_worker: Any) -> bool:
    return name in dask_worker.plugins


def _plugin(problem: str | None, overrides: dict, source: str) -> Any:
    """The plugin of a worker's or the scheduler's preload: failing, if its settings are bad.

    ``source`` (``""``, or ``"the scheduler's "``) says whose settings they are.
    """
    from dask_gpustreams.integrations.distributed import StreamsPlugin

    if problem is not None:
        return StreamsPlugin.failing(ValueError(f"{source}preload argument: {problem}"))
    try:
        return StreamsPlugin(**overrides)
    except ValueError as e:
        where = f"{source}config: " if source else ""
        return StreamsPlugin.failing(ValueError(f"{where}{e}"))


def _warn(message: str) -> None:
    """Warn the user of a client (its preload runs in the client's event loop thread)."""
    warnings.warn(message, UserWarning, stacklevel=2)


def _plugin_message(plugin: Any) -> dict:
    """A ``register_worker_plugin`` request that leaves a registered plugin in place.

    Idempotent, unlike ``client.register_plugin(StreamsPlugin(...))``: a
    client created while ``gpustreams.enabled`` is true (one made by
    ``get_client()`` in a task, say) neither replaces settings a user
    registered nor restarts the workers' plugin.
    """
    from distributed.protocol.pickle import dumps

    return {"plugin": dumps(plugin), "name": plugin.name, "idempotent": True}


async def _register(request: Any, report: Callable[[str], Any]) -> None:
    """Await a ``register_worker_plugin`` call; ``report`` each worker's setup error."""
    from distributed.core import clean_exception

    responses = await request
    for address, response in sorted((responses or {}).items()):
        if response.get("status") == "error":
            _, exc, _ = clean_exception(response["exception"], response["traceback"])
            if isinstance(exc, ValueError):  # bad settings: the error names the worker
                report(str(exc))
            else:
                report(f"gpustreams cannot start on worker {address}: {exc!r}")


#: The :class:`StreamsConfig` fields whose preload options take an int (``--streams``).
_INT_FIELDS = frozenset(f.name for f in fields(StreamsConfig) if f.type == "int")


def _check_option(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    """A preload option's value, checked as :class:`StreamsConfig` checks its key.

    An int option's string is read by ``int`` (as ``click.INT`` would); one that is no
    int goes to the check as written, whose error names it and the allowed range.
    """
    if value is not None:
        if param.name in _INT_FIELDS:
            with contextlib.suppress(ValueError):
                value = int(value)
        try:
            StreamsConfig(**{param.name: value})
        except ValueError as e:
            raise click.BadParameter(str(e)) from None
    return value


def _option(field: Field) -> click.Option:
    """The preload option of one :class:`StreamsConfig` field: ``--copy-streams``, ``--nvtx``.

    The others take a string, int options too (shown as ``INTEGER``): :func:`_check_option`
    reads it, so a value that is no int gets the library's message, with the allowed range.
    """
    flag = "--" + field.name.replace("_", "-")
    if field.type == "bool":
        return click.Option([f"{flag}/--no-{flag[2:]}"], default=None, callback=_check_option)
    metavar = "INTEGER" if field.name in _INT_FIELDS else None
    return click.Option([flag], metavar=metavar, default=None, callback=_check_option)


class SetupCommand(click.Command):
    """:data:`dask_setup`: a click command whose argument errors go to the plugin.

    :meth:`parse_args` runs in the process that starts the server (the command
    line, which only checks preload arguments) and again in the server when its
    preload starts. A usage error becomes the ``problem`` the command's callback
    reports (see *Bad settings*): raised there, distributed would log it and run
    without the plugin.
    """

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        _refuse_an_option_read_as_the_scheduler()
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as e:
            ctx.params = {"problem": e.format_message()}
            ctx.args = []
            return []


def _refuse_an_option_read_as_the_scheduler() -> None:
    """Raise a usage error where ``dask worker`` took a preload option for the scheduler.

    While ``dask worker`` or ``dask scheduler`` parses its command line, it is
    the current click context, and it checks the preload arguments with a context
    of its own. Its first positional argument, the scheduler address, also takes
    the first argument it does not know (``dask worker --scheduler-file f
    --preload dask_gpustreams --streams=4``): that option never reaches the
    preload, so it cannot be reported later.
    """
    outer = click.get_current_context(silent=True)
    address = outer.params.get("scheduler") if outer is not None else None
    if isinstance(address, str) and address.startswith("-"):
        raise click.UsageError(
            f"{address!r} was read as the scheduler address, not as an option of "
            "--preload dask_gpustreams: give the scheduler address before the preload's "
            "options (dask worker tcp://host:8786 --preload dask_gpustreams --streams 4), "
            "or set the setting in the environment (DASK_GPUSTREAMS__STREAMS=4)",
            ctx=outer,
        )


#: ``dask_setup`` of the preloads, a click command: one option per field of
#: :class:`StreamsConfig`, and dask-cuda's ``--create-cuda-context`` (ignored).
dask_setup = SetupCommand(
    "dask_setup",
    callback=_setup,
    params=[
        *(_option(field) for field in fields(StreamsConfig)),
        click.Option(
            ["--create-cuda-context/--no-create-cuda-context"],
            default=None,
            hidden=True,
            expose_value=False,
        ),
    ],
    help="Install dask_gpustreams' StreamsPlugin (options: gpustreams.* settings).",
)


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
