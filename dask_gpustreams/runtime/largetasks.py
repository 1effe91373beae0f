"""Which kinds of task are large: their kernels fill the device on their own.

The launcher's allocator notes the largest block each task allocates
(``Backend.launch_allocator``). A task group (its key prefix, as for
:mod:`~dask_gpustreams.runtime.hosttasks`) whose task allocated a block of at
least ``gpustreams.large-tasks`` bytes is large from then on, across computes,
until one of its tasks allocates less. The ``auto`` policy runs large tasks on
two streams: more would only run more of them at once in the memory they hold,
and keep more free blocks cached (CuPy's pool keeps one arena per stream).
"""

from __future__ import annotations

from collections.abc import Hashable


class LargeTasks:
    """The task groups learned to allocate blocks of at least :attr:`size` bytes."""

    def __init__(self, size: int):
        #: The smallest block that makes a task large; 0: none is.
        self.size = size
        self._groups: set[Hashable] = set()

    def __bool__(self) -> bool:
        return bool(self._groups)

    def __contains__(self, group: Hashable) -> bool:
        return group in self._groups

    def groups(self) -> list[Hashable]:
        """The groups learned to be large."""
        return list(self._groups)

    def observe(self, group: Hashable, largest: int) -> None:
        """A task of ``group`` allocated blocks of at most ``largest`` bytes."""
        if largest >= self.size:
            self._groups.add(group)
        else:
            self._groups.discard(group)
