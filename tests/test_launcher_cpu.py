"""``gpustreams.pin-launcher``: the launching thread stays on one CPU while it launches."""

from __future__ import annotations

import functools
import os
import threading

import dask
import pytest
from dask import delayed

from dask_gpustreams import host_task, sim
from dask_gpustreams.runtime.cpu import kept_on_current_cpu, thread_cpus

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs thread affinity (Linux) and at least 2 CPUs",
)


@pytest.fixture
def launcher(gpustreams):
    """``launcher(streams, ...)``: settings of the sim runtime, plugin switch off."""
    return functools.partial(gpustreams, enabled=False)


def cpus_now():
    """The CPUs this thread may run on, and a small device array (a device task)."""
    return frozenset(os.sched_getaffinity(0)), sim.asarray([1.0])


@host_task
def cpus_on_a_host_thread(_):
    return frozenset(os.sched_getaffinity(0))


def launch(x):
    return x


@pytest.mark.parametrize("pin", [True, False])
def test_device_tasks_run_on_one_cpu_and_the_thread_gets_its_cpus_back(launcher, pin):
    """With ``pin-launcher`` (the default), the tasks the launching thread runs see one CPU;
    host tasks see the CPUs of the thread that made the runtime; after the compute the
    thread may run on all its CPUs again. Off: every task sees them all."""
    before = frozenset(os.sched_getaffinity(0))
    with launcher(streams=2, **{"pin-launcher": pin}):
        pair = delayed(cpus_now)()
        host = delayed(cpus_on_a_host_thread)(delayed(launch)(pair))
        (launched, _), on_host = dask.compute(pair, host, scheduler="gpustreams")
    assert frozenset(os.sched_getaffinity(0)) == before
    assert on_host == before
    if pin:
        assert len(launched) == 1 and launched <= before, launched
    else:
        assert launched == before


def test_a_nested_pin_leaves_the_outer_one():
    """Inside a pinned block (a nested compute's launcher), pinning again changes nothing,
    and the outer block still gives the thread all its CPUs back."""
    before = thread_cpus()
    with kept_on_current_cpu():
        one = thread_cpus()
        with kept_on_current_cpu():
            assert thread_cpus() == one
        assert thread_cpus() == one and len(one) == 1
    assert thread_cpus() == before


def test_threads_started_while_pinned_inherit_the_pin():
    """What the host threads undo (``HostThreads(cpus=...)``): Linux gives a new thread its
    creator's CPUs."""
    seen = []
    with kept_on_current_cpu():
        thread = threading.Thread(target=lambda: seen.append(thread_cpus()))
        thread.start()
        thread.join()
    assert len(seen[0]) == 1
