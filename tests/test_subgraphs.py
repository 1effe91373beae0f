"""Fused tasks run their inner tasks without ``dask.order`` on every stream route: Dask's values."""

from __future__ import annotations

import contextlib
import functools

import dask
import dask._task_spec
import dask.array as da
import dask.threaded
import numpy as np
import pytest
from dask._task_spec import Alias, DataNode, Task, TaskRef, _execute_subgraph

from dask_gpustreams import host_task, sim
from dask_gpustreams.integrations.launcher import launch_plan
from dask_gpustreams.integrations.subgraphs import (
    AfterStream,
    HostStep,
    lean_subgraphs,
    run_subgraph,
    subgraph_plan,
)
from dask_gpustreams.integrations.tasks import wrap_task
from dask_gpustreams.runtime import EventRegistry, get_runtime
from tests.test_distributed import cluster
from tests.test_hosttasks import nested_partial


def mix(tag, *values):
    """A value that records its inputs in order: any difference in what a task saw shows."""
    return (tag, *values)


def fused(inner: dict, out: str, inkeys: list[str], refs: list[str], key: str) -> Task:
    """What dask's fusion makes: ``key`` computes ``out`` of ``inner`` from ``refs``' values."""
    args = (TaskRef(k) for k in refs)
    return Task(key, _execute_subgraph, inner, out, tuple(inkeys), *args)


def random_inner(rng, n_inner: int, inkeys: list[str], depth: int = 0) -> dict:
    """``n_inner`` tasks over ``inkeys`` (some data, aliases and, one level down, fused
    tasks), then ``out-{depth}``, which reads them all: the one output."""
    inner: dict = {}
    keys = list(inkeys)
    for i in range(n_inner):
        key = f"t-{depth}-{i}"
        kind = rng.integers(0, 8)
        if kind == 0:
            inner[key] = DataNode(key, int(rng.integers(0, 100)))
        elif kind == 1:
            inner[key] = Alias(key, keys[rng.integers(0, len(keys))])
        elif kind == 2 and depth == 0:
            sub_inkeys = ["in-1-0", "in-1-1"]
            sub = random_inner(rng, 4, sub_inkeys, depth + 1)
            refs = [keys[j] for j in rng.integers(0, len(keys), 2)]
            inner[key] = fused(sub, "out-1", sub_inkeys, refs, key)
        else:
            n = min(len(keys), int(rng.integers(1, 4)))
            picks = sorted(rng.choice(len(keys), size=n, replace=False))
            inner[key] = Task(key, mix, key, *(TaskRef(keys[j]) for j in picks))
        keys.append(key)
    out = f"out-{depth}"
    inner[out] = Task(out, mix, out, *(TaskRef(k) for k in keys))
    return inner


@pytest.mark.parametrize("seed", range(20))
def test_run_subgraph_gives_dasks_value(seed):
    rng = np.random.default_rng(seed)
    inkeys = [f"in-0-{i}" for i in range(rng.integers(1, 4))]
    node = fused(random_inner(rng, int(rng.integers(1, 12)), inkeys), "out-0", inkeys, inkeys, "x")
    inner, out = node.args[:2]
    values = [("input", i) for i in range(len(inkeys))]
    assert run_subgraph(subgraph_plan(inner, out), out, inkeys, *values) == _execute_subgraph(
        inner, out, inkeys, *values
    )
    lean = lean_subgraphs(node, False)
    nested = [n for _, n, _ in lean.args[0] if isinstance(n, Task) and n.func is not mix]
    assert lean.func is run_subgraph and all(n.func is run_subgraph for n in nested)
    given = dict(zip(inkeys, values, strict=True))
    assert lean(given) == node(given)


def test_a_plain_task_is_left_as_it_is():
    node = Task("a", mix, "a", TaskRef("b"))
    assert lean_subgraphs(node, False) is node


class Tracked:
    alive = 0

    def __init__(self) -> None:
        Tracked.alive += 1

    def __del__(self) -> None:
        Tracked.alive -= 1


def step(previous: Tracked, peak: list) -> Tracked:
    peak[0] = max(peak[0], Tracked.alive)
    return Tracked()


def test_a_fused_chain_drops_each_value_after_its_last_use():
    peak = [0]
    inner = {"t-0": Task("t-0", step, TaskRef("in"), peak)}
    for i in range(1, 50):
        inner[f"t-{i}"] = Task(f"t-{i}", step, TaskRef(f"t-{i - 1}"), peak)
    source = Tracked()
    result = run_subgraph(subgraph_plan(inner, "t-49"), "t-49", ("in",), source)
    del source
    assert (type(result), peak[0], Tracked.alive) == (Tracked, 2, 1)


def test_an_inner_error_is_raised_as_it_is():
    def fail(x):
        raise ValueError(f"bad chunk {x}")

    inner = {"a": Task("a", fail, TaskRef("in")), "b": Task("b", mix, "b", TaskRef("a"))}
    with pytest.raises(ValueError, match="bad chunk 7"):
        run_subgraph(subgraph_plan(inner, "b"), "b", ("in",), 7)


PLAN_ORDER = """
from dask._task_spec import Task, TaskRef
from dask_gpustreams.integrations.subgraphs import subgraph_plan
inner = {f"t-{i}": Task(f"t-{i}", max, *(TaskRef(f"in-{j}") for j in range(6))) for i in range(12)}
inner["out"] = Task("out", max, *(TaskRef(k) for k in list(inner)))
print([key for key, _, _ in subgraph_plan(inner, "out")])
"""


def test_the_plan_is_the_same_under_any_hash_seed(run_python):
    """Which of two failing inner tasks raises, and when memory peaks, must not change
    from run to run: dependencies are visited in the inner graph's order, not a set's."""
    orders = {run_python(PLAN_ORDER, env={"PYTHONHASHSEED": str(seed)}) for seed in range(4)}
    assert orders == {str([f"t-{i}" for i in range(12)] + ["out"]) + "\n"}


@pytest.mark.parametrize("route", ["launcher", "threads", "distributed", "tasks-on-workers"])
def test_fused_tasks_run_without_ordering_them_on_every_route(gpustreams, monkeypatch, route):
    """Fails if a route leaves ``_execute_subgraph`` in place: each fused task would run
    ``execute_graph``, which orders its inner tasks with ``dask.order`` (about 0.1 ms of
    host time for a few inner tasks)."""
    calls = []
    original = dask._task_spec.execute_graph
    monkeypatch.setattr(
        dask._task_spec, "execute_graph", lambda *a, **k: calls.append(1) or original(*a, **k)
    )
    rng = np.random.default_rng(7)
    host = rng.standard_normal((256, 256))
    x = da.from_array(host, chunks=32).map_blocks(sim.asarray)
    y = ((x.rechunk((256, 16)) * 3 + 1) ** 2).sum(axis=0).map_blocks(sim.asnumpy)
    expected = ((host * 3 + 1) ** 2).sum(axis=0)
    np.testing.assert_allclose(y.compute(scheduler="sync"), expected)  # plugin off
    fused_by_dask = len(calls)
    calls.clear()
    with contextlib.ExitStack() as stack:
        stack.enter_context(gpustreams(enabled=route != "launcher"))
        if route == "distributed":  # stream blocks
            stack.enter_context(cluster(n_workers=1))
        elif route == "tasks-on-workers":
            stack.enter_context(cluster(n_workers=1, config={"gpustreams.blocks": "off"}))
        scheduler = {"launcher": "gpustreams", "threads": dask.threaded.get}.get(route)
        np.testing.assert_allclose(y.compute(scheduler=scheduler), expected)
    assert (fused_by_dask > 16, len(calls)) == (True, 0)


def download(x):
    return sim.asnumpy(x)


def test_launch_plan_finds_host_tasks_inside_fused_tasks(gpustreams):
    inner = {
        "a": Task("a", host_task(download), TaskRef("in")),
        "b": Task("b", mix, "b", TaskRef("a")),
    }
    with gpustreams():
        tasks, _, host = launch_plan([fused(inner, "b", ["in"], ["in"], "b")], get_runtime())
    assert (tasks["b"].func, host) == (run_subgraph, {"b"})


@host_task
def read(*values):
    return values


class SubTask(Task):
    __slots__ = ()


@pytest.mark.parametrize(
    "func",
    [read, functools.partial(read, 1), nested_partial(read, 1)],
    ids=["marked", "partial", "partial of a partial"],
)
def test_every_route_s_test_finds_a_partial_of_a_host_task(gpustreams, func):
    """The launcher (``launch_plan``), Dask's schedulers (the StreamTask's class) and a
    worker (:meth:`Execution._kind`) find a ``host_task`` through partials."""
    node = Task("k", func, TaskRef("in"))
    with gpustreams():
        runtime = get_runtime()
        assert launch_plan([node], runtime)[2] == {"k"}
        assert wrap_task(node, runtime, EventRegistry()).host_wait


def _fused_host_reads_inner(cls: type = Task, reader=read) -> Task:
    """A fused task whose ``host_task`` reads a value made by an inner task."""
    inner = {"p": Task("p", mix, "p", TaskRef("in")), "r": Task("r", reader, TaskRef("p"))}
    return cls("r", _execute_subgraph, inner, "r", ("in",), TaskRef("in"))


def _nested(node: Task) -> Task:
    """``node`` with no key, as a task nested in another's arguments."""
    return Task(None, node.func, *node.args)


#: Tasks whose lean form waits on the host once (a HostStep or an AfterStream).
WAITING = {
    "nested producer": Task("r", read, Task(None, mix, "p", TaskRef("in"))),
    "fused": _fused_host_reads_inner(),
    "fused in fused": Task(
        "o",
        _execute_subgraph,
        {"r": _fused_host_reads_inner(), "o": Task("o", mix, "o", TaskRef("r"))},
        "o",
        ("in",),
        TaskRef("in"),
    ),
    "fused, a Task subclass": _fused_host_reads_inner(SubTask),
    "fused, a partial": _fused_host_reads_inner(reader=functools.partial(read, "x")),
    "fused, a partial of a partial": _fused_host_reads_inner(reader=nested_partial(read, "x")),
    "nested producer, a partial": Task(
        "r", nested_partial(read, "x"), Task(None, mix, "p", TaskRef("in"))
    ),
    # A fused task nested in an argument: its host_task waits whatever it reads (its
    # fused task's inputs from outside got no host wait either).
    "nested fused": Task("o", mix, "o", _nested(_fused_host_reads_inner())),
    "nested fused, an input": Task(
        "o",
        mix,
        "o",
        _nested(fused({"r": Task("r", read, TaskRef("in"))}, "r", ["in"], ["in"], "r")),
    ),
    "nested fused in fused": fused(
        {"o": Task("o", mix, "o", _nested(_fused_host_reads_inner()))}, "o", ["in"], ["in"], "o"
    ),
    # One wait, not a HostStep and an AfterStream: the AfterStream covers the inner kernel.
    "nested producer in fused": fused(
        {
            "p": Task("p", mix, "p", TaskRef("in")),
            "r": Task("r", read, TaskRef("p"), Task(None, mix, "q", TaskRef("in"))),
        },
        "r",
        ["in"],
        ["in"],
        "r",
    ),
}


def host_waits(node) -> int:
    """How many host waits ``node``'s lean form makes (HostSteps and AfterStreams)."""
    if isinstance(node, HostStep):
        return 1 + host_waits(node.node)
    if not isinstance(node, Task):
        return 0
    if node.func is run_subgraph:
        steps, *args = node.args
        return sum(host_waits(n) for _, n, _ in steps) + sum(map(host_waits, args))
    own = int(type(node.func) is AfterStream)
    return own + sum(map(host_waits, (*node.args, *node.kwargs.values())))


@pytest.mark.parametrize("name", WAITING)
def test_a_task_that_calls_a_host_task_waits_once_on_every_route(gpustreams, name):
    """``lean_subgraphs`` searches for the host wait only where told the task calls a
    ``host_task``: each route must tell it so for these (the launcher and stream blocks by
    ``launch_plan``, Dask's schedulers by the StreamTask's class; a worker's tasks:
    ``tests/test_distributed.py``)."""
    node = WAITING[name]
    # A task nested in arguments is walked whatever the flag (blocks_host reads only a
    # task's own function); a fused task's steps only where the route says it calls one.
    unflagged = 1 if name.startswith("nested") else 0
    assert host_waits(lean_subgraphs(node, True)) == 1
    assert host_waits(lean_subgraphs(node, False)) == unflagged
    with gpustreams():
        runtime = get_runtime()
        tasks, _, _ = launch_plan([node], runtime)
        stream_task = wrap_task(node, runtime, EventRegistry())
        assert host_waits(tasks[node.key]) == 1
        assert host_waits(lean_subgraphs(stream_task.node, stream_task.host_wait)) == 1


def test_a_task_that_calls_no_host_task_is_not_searched(gpustreams):
    inner = {"p": Task("p", mix, "p", TaskRef("in")), "r": Task("r", mix, "r", TaskRef("p"))}
    node = fused(inner, "r", ["in"], ["in"], "r")
    with gpustreams():
        assert not wrap_task(node, get_runtime(), EventRegistry()).host_wait


@pytest.mark.parametrize(
    "node",
    [
        Task("k", mix, "k", Task(None, mix, "n", TaskRef("in"))),
        Task("k", mix, "k", dask._task_spec.List(TaskRef("in"), Task(None, mix, "n", 1))),
        Task("k", mix, "k", s=Task(None, mix, "n", TaskRef("in"))),
        Task(
            "k",
            mix,
            "k",
            _nested(fused({"a": Task("a", mix, "a", TaskRef("in"))}, "a", ["in"], ["in"], "a")),
        ),
    ],
    ids=["nested task", "List argument", "keyword argument", "fused task"],
)
def test_a_task_nesting_tasks_that_call_no_host_task_is_kept_as_it_is(node):
    """A task whose nested tasks call no host_task comes back itself: no AfterStream."""
    assert lean_subgraphs(node, False) is node
    assert lean_subgraphs(node, True) is node
