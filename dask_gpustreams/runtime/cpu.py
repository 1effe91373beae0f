"""Keeping the launching thread on one CPU while it launches a graph (Linux).

With 0.5 ms kernels on 8 streams the device runs a task every 62 us, about the
launcher's host cost per task, so how fast the launching thread runs decides the
device's share of work. On the H200's host, processes whose every thread was
pinned to one or two CPUs met 80% of the hand launch on every wide shape (7 of
7), unpinned ones in 10 of 17 (``benchmarks/results/h200-cpu-2fb973e/``).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
from collections.abc import Callable, Iterator


@functools.cache
def _sched_getcpu() -> Callable[[], int] | None:
    """libc's ``sched_getcpu`` (the CPU the calling thread runs on), or None without it."""
    try:
        getcpu = ctypes.CDLL(None).sched_getcpu
    except (AttributeError, OSError):
        return None
    getcpu.restype = ctypes.c_int
    getcpu.argtypes = []
    return getcpu


def thread_cpus() -> frozenset[int] | None:
    """The CPUs the calling thread may run on; None where the OS has no thread affinity."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    return frozenset(os.sched_getaffinity(0))


def run_on(cpus: frozenset[int]) -> None:
    """Let the calling thread run on ``cpus`` (a thread started by a pinned one inherits
    its pin); left as it is where the OS refuses (a cpuset changed meanwhile)."""
    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, cpus)


@contextlib.contextmanager
def kept_on_current_cpu() -> Iterator[None]:
    """The calling thread stays on the CPU it runs on now until the block ends; then it
    may run wherever it could before.

    Only the calling thread is pinned (``sched_setaffinity`` of thread 0), not the
    process; a thread it starts meanwhile inherits the pin, unless it calls
    :func:`run_on` (the runtime's host threads do). A no-op where the OS has no
    thread affinity (not Linux), where the thread may run on one CPU only already (a
    nested compute inside the block), and where the OS refuses the change (a cpuset
    changed meanwhile): pinning only speeds up.
    """
    getcpu = _sched_getcpu() if hasattr(os, "sched_setaffinity") else None
    if getcpu is None:
        yield
        return
    allowed = os.sched_getaffinity(0)
    cpu = getcpu()
    if len(allowed) < 2 or cpu not in allowed:
        yield
        return
    try:
        os.sched_setaffinity(0, (cpu,))
    except OSError:
        yield
        return
    try:
        yield
    finally:
        run_on(frozenset(allowed))
