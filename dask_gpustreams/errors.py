"""Exceptions raised by dask_gpustreams."""

from __future__ import annotations

from typing import Any


class KernelError(RuntimeError):
    """Work enqueued on a stream failed asynchronously.

    Raised at the next host synchronization that depends on the failed work
    (``SimArray.get()``, an event or stream sync, the runtime's egress sync),
    not where the work was launched. ``key`` is the task key that launched it,
    when known.
    """

    def __init__(self, key: Any, cause: str):
        self.key = key
        self.cause = cause
        where = f" launched by task {key!r}" if key is not None else ""
        super().__init__(f"kernel{where} failed: {cause}")

    def __reduce__(self):
        return (type(self), (self.key, self.cause))
