"""The process's stream runtimes: which exist, who holds them, and when they close.

One :class:`Runtimes` (``dask_gpustreams.runtime.runtime.runtimes``) is the
process's only registry of runtimes. It keeps two kinds:

- *shared* runtimes, one per backend, device and setting, for the local routes
  (:meth:`Runtimes.get`, :meth:`Runtimes.acquire`). A compute holds its runtime
  from start to end; of those that no compute holds, the :attr:`Runtimes.max_idle`
  most recently used stay open for the next compute, and older ones are closed.
  So changing settings often keeps the streams and threads bounded.
- *owned* runtimes (:meth:`Runtimes.create`): made for one owner, a worker's
  plugin, which closes them; never shared, never closed here.

:meth:`Runtimes.live` lists the open ones of both kinds, for diagnostics.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

from dask.utils import format_bytes

from dask_gpustreams.backends import (
    Backend,
    create_backend,
    current_device,
    reserve_hardware_queues,
    reserves_queues,
    resolve_backend,
)
from dask_gpustreams.config import StreamsConfig

if TYPE_CHECKING:
    from dask_gpustreams.runtime.runtime import StreamRuntime

logger = logging.getLogger("dask_gpustreams")


class Runtimes:
    """The shared runtimes of a process (per device and setting) and the owned ones.

    ``factory(backend, config)`` makes a runtime (:class:`StreamRuntime`).
    Every method is safe to call from any thread; none blocks on device work
    except where a runtime is closed.
    """

    #: Shared runtimes kept open while no compute holds them (the most recently used).
    max_idle = 4

    def __init__(self, factory: Callable[[Backend, StreamsConfig], StreamRuntime]):
        self._factory = factory
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        #: (backend, device, config) -> runtime, least recently used first.
        self._shared: OrderedDict[tuple, StreamRuntime] = OrderedDict()
        #: Backend name asked for -> the one it resolved to.
        self._resolved: dict[str, str] = {}
        #: Every runtime made, shared or owned, until it is garbage, in creation order.
        self._made: weakref.WeakValueDictionary[int, StreamRuntime] = weakref.WeakValueDictionary()
        #: Those of them made by :meth:`create`.
        self._owned: weakref.WeakSet[StreamRuntime] = weakref.WeakSet()

    def _check_pid(self) -> None:
        """In a forked child, forget the parent's runtimes (their threads are not here)."""
        if self._pid != os.getpid():
            self._reset()

    def get(self, config: StreamsConfig | None = None) -> StreamRuntime:
        """The shared runtime of the calling thread's device for ``config`` (made if needed).

        ``config`` defaults to dask's ``gpustreams.*``. Making one may close
        shared runtimes that no compute holds (see :attr:`max_idle`).
        """
        return self._shared_runtime(config, hold=False)

    def acquire(self, config: StreamsConfig | None = None) -> StreamRuntime:
        """:meth:`get`, held by the caller until it calls the runtime's ``release()``.

        A held runtime is never closed here, and its ``close()`` waits for it.
        """
        return self._shared_runtime(config, hold=True)

    def create(self, config: StreamsConfig | None = None) -> StreamRuntime:
        """A runtime of its own for the caller, which closes it; listed by :meth:`live`."""
        config = config if config is not None else StreamsConfig.from_dask_config()
        with self._lock:
            self._check_pid()
            resolved = self._resolve(config)
            runtime = self._factory(create_backend(resolved), config)
            self._made[next(self._ids)] = runtime
            self._owned.add(runtime)
        return runtime

    def live(self) -> list[StreamRuntime]:
        """The open runtimes, shared and owned, oldest first (a snapshot; makes none)."""
        with self._lock:
            self._check_pid()
            return [rt for rt in list(self._made.values()) if not rt.closed]

    def forget(self) -> None:
        """Drop the shared runtimes without closing them, so that :meth:`get` makes new ones.

        For a runtime that a hung compute holds; each stays listed by :meth:`live`
        until it is closed or garbage (then its simulated streams' threads end).
        """
        with self._lock:
            self._check_pid()
            self._shared.clear()

    def close_shared(self, timeout: float | None = None) -> None:
        """Close every shared runtime, cached or not, and forget how backends resolved.

        For tests and shutdown; owned runtimes are left to their owners. Each
        close waits up to ``timeout`` seconds for the computes holding it; the
        first ``TimeoutError`` is raised once all have been tried.
        """
        with self._lock:
            self._check_pid()
            made = [rt for rt in list(self._made.values()) if rt not in self._owned]
            self._shared.clear()
            self._resolved.clear()
        error = None
        for runtime in made:
            try:
                runtime.close(timeout)
            except TimeoutError as e:
                error = error or e
        if error is not None:
            raise error

    def _resolve(self, config: StreamsConfig) -> str:
        """The backend ``config.backend`` stands for in this process (resolved once). Locked."""
        resolved = self._resolved.get(config.backend)
        if resolved is None:
            if reserves_queues(config.backend):  # before anything here starts CUDA (read once)
                reserve_hardware_queues(config.streams + 2 * config.copy_streams)
            resolved = self._resolved[config.backend] = resolve_backend(config.backend)
        return resolved

    def _shared_runtime(self, config: StreamsConfig | None, hold: bool) -> StreamRuntime:
        config = config if config is not None else StreamsConfig.from_dask_config()
        idle: list[StreamRuntime] = []
        with self._lock:
            self._check_pid()
            resolved = self._resolve(config)
            key = (resolved, current_device(resolved), config)
            runtime = self._shared.get(key)
            if runtime is not None:
                try:
                    if hold:
                        runtime.acquire()
                    elif runtime.closed:
                        raise RuntimeError
                except RuntimeError:  # closed by someone else, maybe just now
                    del self._shared[key]
                    runtime = None
                else:
                    self._shared.move_to_end(key)
            if runtime is None:
                self._trim_other_settings(key[:2])
                runtime = self._shared[key] = self._factory(create_backend(resolved), config)
                self._made[next(self._ids)] = runtime
                idle = self._evict()
                if hold:
                    runtime.acquire()
        for old in idle:
            # Idle when chosen; one held meanwhile (acquired directly) stays open.
            with contextlib.suppress(TimeoutError):
                old.close(timeout=0)
        return runtime

    def _evict(self) -> list[StreamRuntime]:
        """Drop the least recently used idle shared runtimes beyond :attr:`max_idle`. Locked."""
        newest = next(reversed(self._shared))
        idle = [k for k, rt in self._shared.items() if k != newest and not rt._users]
        evicted = []
        for key in idle[: max(0, len(idle) - self.max_idle)]:
            evicted.append(self._shared.pop(key))
        if evicted:
            logger.info("gpustreams: closing %d runtimes of settings no longer used", len(evicted))
        return evicted

    def _trim_other_settings(self, device: tuple) -> None:
        """Free the idle pinned staging buffers of ``device``'s runtimes of other settings.

        Each setting keeps its runtime (computations may still use it), but a
        change of settings should not leave a second staging pool pinned. Locked.
        """
        for key, other in self._shared.items():
            if key[:2] == device:
                dropped = other.transfers.pinned.trim()
                if dropped:
                    logger.info(
                        "gpustreams: settings changed; freed %s of idle pinned staging of %r",
                        format_bytes(dropped),
                        other,
                    )
