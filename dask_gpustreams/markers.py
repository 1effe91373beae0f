"""Marking task functions that block the host, for the stream launcher."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TypeVar

F = TypeVar("F", bound=Callable)

#: Attribute set on functions that block the host (the launcher runs them on host threads).
HOST_TASK_ATTR = "__gpustreams_host__"


def host_task(fn: F) -> F:
    """Mark ``fn`` as a task function that blocks the host; returns ``fn`` itself.

    The stream launcher (``scheduler="gpustreams"``) runs tasks calling it on
    its host threads, after waiting on the host for their inputs, instead of
    on the launching thread: use it for functions that wait for the device
    (``.get()``, ``.item()``), compute on host data, do I/O, sleep or lock.
    Unmarked functions that block are learned after two slow calls in a row. Elsewhere
    (a cluster's worker, Dask's own schedulers passed as functions) a marked task runs
    on its thread's pool stream, after the same host wait for its inputs.

    The mark is found where the task calls ``fn``: as its function, through a
    ``functools.partial`` of it at any depth (``partial(fn, scale=2)``), inside a fused
    task, and in a task nested in another task's arguments (a fused one too), where it
    runs after a host wait for its task's stream. Other wrappers (a subclass of
    ``partial``, a ``toolz.curry``, a lambda, a function of your own that calls ``fn``)
    hide it: mark them.
    """
    try:
        setattr(fn, HOST_TASK_ATTR, True)
    except (AttributeError, TypeError):  # a builtin or a bound method takes no attribute
        raise TypeError(
            f"host_task cannot mark {fn!r}: it takes no attribute; mark a function of your "
            "own that calls it instead (@host_task def f(*args): ...)"
        ) from None
    return fn


def is_host_task(fn: Callable) -> bool:
    """Whether ``fn`` was marked with :func:`host_task`, or is a ``functools.partial`` (at
    any depth) of a function that was, or of a partial that was: the partial calls it."""
    if getattr(fn, HOST_TASK_ATTR, False) is True:
        return True
    # The common case, an unmarked function, costs this type check (a subclass of partial
    # is not looked through: mark it, or what it wraps); a partial's own mark was read above.
    if type(fn) is not partial:
        return False
    fn = fn.func
    while getattr(fn, HOST_TASK_ATTR, False) is not True:
        if type(fn) is not partial:
            return False
        fn = fn.func
    return True
