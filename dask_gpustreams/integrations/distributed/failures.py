"""The records of one worker's corrupt results, which a recomputation of their keys raises.

Part of the *Failures* section of :mod:`.plugin`'s documentation. When an
egress wait finds a result corrupt, the worker records its error here
(:meth:`FailureRecords.record`) and releases the key, so that the scheduler
recomputes it; when the key starts executing again on this worker, its task
takes the record (:meth:`FailureRecords.take`) and raises that error instead
of running. Records not taken go after a while (:meth:`FailureRecords.expire`).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Hashable, Mapping

from dask_gpustreams.errors import KernelError

logger = logging.getLogger("dask_gpustreams")


class FailureRecords(OrderedDict):
    """key -> (the :class:`KernelError` of its corrupt result, when it was recorded).

    Oldest first. At most :attr:`max_failures` records are kept, each for at most
    :attr:`ttl` seconds of the monotonic clock: plain values (the plugin's, at
    setup), read at each use. A mapping, so that the check made once per task on
    the event loop (``if records:``) is no Python call; only its methods write it.
    Event loop only.
    """

    def __init__(self, max_failures: int, ttl: float):
        super().__init__()
        self.max_failures = max_failures
        self.ttl = ttl

    def record(self, failed: Mapping[Hashable, KernelError]) -> None:
        """Record the errors of the corrupt results ``failed`` (key -> error), logged once.

        A key recorded again becomes the newest; beyond :attr:`max_failures` the
        oldest records go.
        """
        for key, error in failed.items():
            if key not in self:
                logger.error(
                    "gpustreams: result of %r is corrupt (%s): dropped; its recomputation "
                    "on this worker raises this error",
                    key,
                    error,
                )
            self[key] = (error, time.monotonic())
            self.move_to_end(key)
        while len(self) > self.max_failures:
            self.popitem(last=False)

    def take(self, key: Hashable) -> BaseException | None:
        """The recorded error of ``key``'s earlier result, removed; None if there is none."""
        if not self:
            return None
        error, _ = self.pop(key, (None, None))
        return error

    def expire(self) -> None:
        """Drop the records older than :attr:`ttl` seconds."""
        expired = time.monotonic() - self.ttl
        while self and next(iter(self.values()))[1] < expired:
            self.popitem(last=False)
