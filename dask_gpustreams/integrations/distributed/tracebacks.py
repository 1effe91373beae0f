"""A worker's task tracebacks without the wrappers' frames, as without the plugin.

A worker sends a failed task's traceback as ``distributed.core.error_message``
builds it: ``distributed.utils.get_traceback`` drops the *leading* frames of
distributed's worker and of ``dask/_task_spec.py``, so the task's own frames
come first. Dask's ``admin.traceback.shorten`` is applied only where the
client raises synchronously (``Future.result``, ``Client.gather``); an
asynchronous client (``await future``) shows what the worker sent. With the
plugin, ``StreamTask.__call__`` and ``StreamRuntime.run`` sit between the
worker's frames and the task's, so they, and the ``Task.__call__`` after
them, would stay in front.

They cannot leave the stack: they run the task on its stream. So
:func:`install` (run at import of :mod:`dask_gpustreams`, which every worker
with the plugin has done) puts :func:`get_traceback` in place of the name
``error_message`` looks up at each call. It calls distributed's function,
then, only where a wrapper's frame leads, drops the leading frames of
:data:`~dask_gpustreams.integrations.tasks.TRACEBACK_SHORTEN`'s modules and
of ``dask/_task_spec.py``, always keeping the last. Other error messages are
left as distributed makes them.
"""

from __future__ import annotations

import re
import types

import distributed.core

from dask_gpustreams.integrations.patching import Patch
from dask_gpustreams.integrations.tasks import TRACEBACK_SHORTEN

#: The frames dropped while they lead, once a wrapper's frame leads.
_LEADING = re.compile(".*(" + "|".join((*TRACEBACK_SHORTEN, r"dask[\\/]_task_spec\.py")) + ")")
_WRAPPERS = re.compile(".*(" + "|".join(TRACEBACK_SHORTEN) + ")")


def strip_wrappers(tb: types.TracebackType | None) -> types.TracebackType | None:
    """``tb`` from its first frame that is neither a wrapper's nor ``Task.__call__``'s.

    Unchanged unless a wrapper's frame leads; the last frame always stays.
    """
    if tb is None or not _WRAPPERS.match(tb.tb_frame.f_code.co_filename):
        return tb
    while tb.tb_next is not None and _LEADING.match(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return tb


def get_traceback() -> types.TracebackType | None:
    """distributed's ``get_traceback()``, then :func:`strip_wrappers`."""
    return strip_wrappers(_get_traceback.original())


#: distributed's ``get_traceback`` (read by ``distributed.core.error_message``), wrapped.
_get_traceback = Patch(distributed.core, "get_traceback", get_traceback)


def install() -> None:
    """Make ``distributed.core.error_message`` use :func:`get_traceback`.

    Idempotent; :func:`uninstall` puts back the function it replaced.
    """
    _get_traceback.install()


def uninstall() -> None:
    """Undo :func:`install`."""
    _get_traceback.uninstall()
