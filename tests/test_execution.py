"""How a distributed worker's plugin decides, at ``executing``, what runs a task.

``Execution.prepare`` runs once per task on the worker's event loop: the
checks that depend only on the task's function are made at its first task
and kept while that function lives.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import types
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest
from dask._task_spec import Task
from distributed.core import Status

from dask_gpustreams import StreamsConfig, host_task, sim
from dask_gpustreams.backends.sim import SimBackend
from dask_gpustreams.integrations.distributed.execution import Execution
from dask_gpustreams.integrations.distributed.failures import FailureRecords
from dask_gpustreams.integrations.distributed.provenance import Provenance
from dask_gpustreams.integrations.tasks import StreamTask
from dask_gpustreams.transfers import to_device
from tests.test_hosttasks import nested_partial


class _Payload:
    """What a closure holds (a device array, say), watched by a weak reference."""


def _closure(payload):
    return lambda x: (payload, x)


@dataclass(frozen=True)
class _Step:
    """A callable that each task message brings as a new object, equal to the others."""

    k: int

    def __call__(self, x):
        return x + self.k


@pytest.fixture
def execution():
    threads = ThreadPoolExecutor(1)
    worker = SimpleNamespace(
        status=Status.running,
        state=SimpleNamespace(tasks={}, actors={}),
        executors={"default": threads},
    )
    provenance = Provenance(worker, StreamsConfig(backend="sim"), threads, FailureRecords(10, 60))
    yield Execution(worker, provenance, ("hostside_for_tests",)), worker.state.tasks
    asyncio.run(provenance.close(10.0))
    threads.shutdown()


@pytest.fixture
def decided(monkeypatch):
    """The keys of the tasks whose function's checks ran (``Execution._kind``), in order."""
    keys = []
    kind = Execution._kind
    monkeypatch.setattr(
        Execution, "_kind", lambda self, node: keys.append(node.key) or kind(self, node)
    )
    return keys


def _prepare(execution, tasks, key, func, *args):
    tasks[key] = SimpleNamespace(run_spec=Task(key, func, *args), annotations=None)
    execution.prepare(key)
    return tasks[key].run_spec


def test_a_functions_tasks_are_decided_once_while_it_lives(execution, decided):
    execution, tasks = execution
    payload = _Payload()
    watch = weakref.ref(payload)
    f = _closure(payload)
    del payload
    specs = [_prepare(execution, tasks, i, f, i) for i in range(3)]
    assert all(isinstance(s, StreamTask) for s in specs)
    assert decided == [0, 0]  # the first task: before and after the runtime started
    del f, specs
    tasks.clear()
    assert watch() is None  # the worker keeps no closure of a graph that is gone


def test_uploads_are_rewritten_from_the_first_task_on(execution):
    """The upload functions are known once the runtime starts, at the first wrapped task."""
    execution, tasks = execution
    specs = [_prepare(execution, tasks, i, sim.asarray, np.zeros(4)) for i in range(3)]
    assert [s.node.func is to_device for s in specs] == [True, True, True]


def test_instances_of_one_class_shipped_anew_with_each_task_are_decided_once(execution, decided):
    """A worker process unpickles each task's callable from its own message: by its class,
    with no ``__hash__`` or ``__eq__`` call (``_Counted`` below counts them)."""
    execution, tasks = execution
    first = _Step(1)
    specs = [_prepare(execution, tasks, i, _Step(1) if i else first, i) for i in range(3)]
    assert all(isinstance(s, StreamTask) for s in specs)
    assert decided == [0, 0]  # the first task (before and after the runtime started) only
    assert isinstance(_prepare(execution, tasks, "other", _Step(2), 0), StreamTask)
    assert decided == [0, 0]
    counted = [_Counted() for _ in range(3)]
    for i, f in enumerate(counted):
        _prepare(execution, tasks, ("counted", i), f, 0)
    assert [f.calls for f in counted] == [1, 0, 0]  # the first: its hash, into _kinds


def test_an_instance_with_a_module_or_a_coroutine_mark_of_its_own_is_decided_for_itself(
    execution,
):
    """The class decides only where :meth:`Execution._kind` would read the same: an
    instance named to a host-side module runs on the host side, one marked a coroutine
    (tornado's mark) runs as it is."""
    execution, tasks = execution
    assert isinstance(_prepare(execution, tasks, "plain", _Plain(), 0), StreamTask)
    host = _Plain()
    host.__module__ = "hostside_for_tests"  # the fixture's host_modules
    assert type(_prepare(execution, tasks, "host", host, 0)) is Task  # not wrapped
    marked = _Plain()
    marked.__tornado_coroutine__ = True
    assert type(_prepare(execution, tasks, "marked", marked, 0)) is Task
    assert isinstance(_prepare(execution, tasks, "again", _Plain(), 0), StreamTask)


def test_an_instance_marked_host_task_is_decided_for_itself(execution):
    """``host_task`` may mark an instance (its ``__dict__``), which a worker process gets
    with each task: an instance of a class decided unmarked still waits on the host for its
    inputs (``WorkerHostTask``), and an unmarked one after a marked one does not."""
    execution, tasks = execution
    runs = [
        (key, type(_prepare(execution, tasks, key, host_task(_Plain()) if marked else _Plain(), 0)))
        for key, marked in [("plain", False), ("marked", True), ("again", False), ("m2", True)]
    ]
    assert [(k, c.host_wait) for k, c in runs] == [
        ("plain", False),
        ("marked", True),
        ("again", False),
        ("m2", True),
    ]


class _Plain:
    """A callable instance with attributes of its own allowed (a ``__dict__``)."""

    def __call__(self, x):
        return x


def _inc(x):
    return x + 1


async def _co(x):
    return x


def test_partials_shipped_anew_with_each_task_are_decided_once_by_what_they_wrap(
    execution, decided
):
    """A partial has no ``__eq__``: found by the function it wraps, not by itself (a new
    entry per task before, each deciding anew); a partial of a coroutine function runs as
    it is; one with attributes of its own is decided for itself."""
    execution, tasks = execution
    specs = [_prepare(execution, tasks, i, functools.partial(_inc), i) for i in range(3)]
    assert all(isinstance(s, StreamTask) for s in specs)
    assert decided == [0, 0]
    assert type(_prepare(execution, tasks, "co", functools.partial(_co), 0)) is Task
    assert decided == [0, 0, "co"]
    odd = functools.partial(_inc)
    odd.__tornado_coroutine__ = True  # a mark of its own: tornado reads the partial's
    assert type(_prepare(execution, tasks, "odd", odd, 0)) is Task
    assert decided == [0, 0, "co", "odd"]


def test_partials_of_a_host_task_shipped_anew_wait_for_their_inputs(execution, decided):
    """A partial of a marked function (a partial of one too) runs after a host wait for its
    inputs (``WorkerHostTask``), decided once by the function it wraps; a partial of an
    unmarked function, decided by its own, does not wait."""
    execution, tasks = execution
    marked = host_task(_plain_copy(_inc))
    runs = [
        (key, _prepare(execution, tasks, key, func, 0).host_wait)
        for key, func in [
            ("m0", functools.partial(marked)),
            ("u0", functools.partial(_inc)),
            ("m1", functools.partial(marked)),
            ("u1", functools.partial(_inc)),
            ("nested", nested_partial(marked)),
        ]
    ]
    assert runs == [("m0", True), ("u0", False), ("m1", True), ("u1", False), ("nested", True)]
    assert decided == ["m0", "m0", "u0", "nested"]  # the first again, with the runtime


def _plain_copy(fn):
    """A new function object of ``fn``'s code (marked apart from it)."""
    return types.FunctionType(fn.__code__, fn.__globals__, fn.__name__)


class _Partial(functools.partial):
    """A partial of a class of its own, with a Python ``__call__``."""

    def __call__(self, *args):
        return super().__call__(*args)


def test_partials_of_a_subclass_are_decided_by_what_they_wrap_not_by_their_class(execution):
    execution, tasks = execution
    assert isinstance(_prepare(execution, tasks, "sync", _Partial(_inc), 0), StreamTask)
    assert type(_prepare(execution, tasks, "co", _Partial(_co), 0)) is Task  # not wrapped


def test_the_entries_of_dead_functions_wrapped_in_partials_do_not_pile_up(execution):
    """Each task brings a partial of a new closure that dies with it: swept, not kept."""
    execution, tasks = execution
    for i in range(500):
        _prepare(execution, tasks, i, functools.partial(_closure(None)), i)
        del tasks[i]
    assert len(execution._partial_kinds) <= 64


class _Base:
    """Equal to any instance of its class or a subclass (isinstance in ``__eq__``)."""

    def __init__(self, k):
        self.k = k

    def __eq__(self, other):
        return isinstance(other, _Base) and other.k == self.k

    def __hash__(self):
        return hash(self.k)

    def __call__(self, x):
        return x


class _HostSide(_Base):
    pass


_HostSide.__module__ = "hostside_for_tests"  # the fixture's host_modules


def test_an_equal_callable_of_another_type_is_decided_for_itself(execution):
    execution, tasks = execution
    assert isinstance(_prepare(execution, tasks, "gpu", _Base(1), 0), StreamTask)
    assert type(_prepare(execution, tasks, "host", _HostSide(1), 0)) is Task  # not wrapped


class _Touchy:
    """A callable whose equality raises, and whose instances all share a hash; its
    attribute reads go through a ``__getattr__`` (so its class does not decide)."""

    def __eq__(self, other):
        raise ValueError("no comparing")

    def __hash__(self):
        return 1

    def __getattr__(self, name):
        raise AttributeError(name)

    def __call__(self, x):
        return x


def test_a_callable_whose_equality_raises_is_decided_at_each_task(execution, decided):
    execution, tasks = execution
    keep = [_Touchy(), _Touchy()]  # alive together: the second's lookup meets the first's entry
    specs = [_prepare(execution, tasks, i, f, 0) for i, f in enumerate(keep)]
    assert all(isinstance(s, StreamTask) for s in specs)
    assert decided == [0, 0, 1]


def test_callables_with_no_weak_reference_held_by_their_module_are_decided_once(execution, decided):
    execution, tasks = execution
    specs = [_prepare(execution, tasks, i, np.negative, np.ones(2)) for i in range(3)]
    assert all(isinstance(s, StreamTask) for s in specs)
    assert decided == [0, 0]


def test_the_entries_of_dead_functions_do_not_pile_up(execution):
    """Each task brings a new equal callable that dies with it: its entry is swept, not kept."""
    execution, tasks = execution
    for i in range(500):
        _prepare(execution, tasks, i, _Step(1), i)
        del tasks[i]  # the task and its callable go
    assert len(execution._kinds) <= 64


class _Counted:
    """A callable equal to the others of its class, which counts its ``__hash__`` and ``__eq__``."""

    def __init__(self):
        self.calls = 0

    def __hash__(self):
        self.calls += 1
        return 1

    def __eq__(self, other):
        self.calls += 1
        return isinstance(other, _Counted)

    def __call__(self, x):
        return x


def test_the_tasks_of_one_function_object_neither_hash_nor_compare_it(execution, decided):
    """A graph's tasks share their function (a new object, equal to an earlier graph's, whose
    entry it finds): found by identity from its second task on, with no Python call."""
    execution, tasks = execution
    earlier = _Counted()  # an earlier graph's, still alive
    _prepare(execution, tasks, "earlier", earlier, 0)
    f = _Counted()
    _prepare(execution, tasks, 0, f, 0)
    first = earlier.calls + f.calls
    specs = [_prepare(execution, tasks, i, f, i) for i in range(1, 4)]
    assert all(isinstance(s, StreamTask) for s in specs)
    assert earlier.calls + f.calls == first
    assert decided == ["earlier", "earlier"]  # f's kind: found by equality at its first task


class _FunctionLike:
    """A callable that copies a function's attributes: ``inspect`` reads it as that function."""

    def __init__(self, f):
        for name in ("__code__", "__name__", "__defaults__", "__kwdefaults__", "__annotations__"):
            setattr(self, name, getattr(f, name))
        self.f = f

    def __call__(self, *args):
        return self.f(*args)


def test_a_function_like_instance_is_decided_for_itself(execution):
    """``Task.is_coro`` reads the code flags of an instance with a ``__code__`` of its own."""
    execution, tasks = execution
    assert isinstance(_prepare(execution, tasks, "sync", _FunctionLike(_inc), 0), StreamTask)
    assert type(_prepare(execution, tasks, "co", _FunctionLike(_co), 0)) is Task


def test_classes_shipped_by_value_with_each_graph_are_not_kept(execution):
    """A class made per graph (cloudpickle makes one per class it ships by value) dies with
    its instances, and what its methods close over with it."""
    execution, tasks = execution
    payloads = []
    for i in range(3 * 64):
        payload = _Payload()
        payloads.append(weakref.ref(payload))

        class Step:
            def __call__(self, x, payload=payload):
                return x

        _prepare(execution, tasks, i, Step(), 0)
        del tasks[i], payload, Step
    execution._last_func = None
    gc.collect()
    execution._sweep()
    gc.collect()
    assert sum(p() is not None for p in payloads) == 0
    assert len(execution._class_kinds) < 64


class _RaisingMark:
    @property
    def __tornado_coroutine__(self):
        raise RuntimeError("not configured")

    def __call__(self, x):
        return x


def test_a_raising_attribute_read_does_not_fail_the_task(execution):
    """``Task.is_coro`` takes a raising read for no coroutine; so does the class's entry."""
    execution, tasks = execution
    assert isinstance(_prepare(execution, tasks, "r", _RaisingMark(), 0), StreamTask)


def test_a_backends_transfer_partial_is_rewritten(execution, monkeypatch):
    """A partial that is a backend's upload function is staged, not found by what it wraps."""
    upload = functools.partial(sim.asarray)
    monkeypatch.setattr(SimBackend, "upload_functions", (sim.asarray, upload))
    execution, tasks = execution
    _prepare(execution, tasks, "user", functools.partial(sim.asarray), np.ones(2))
    assert _prepare(execution, tasks, "up", upload, np.ones(2)).node.func is to_device
