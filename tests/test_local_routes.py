"""What a user of Dask's local schedulers relies on, on every local route of the plugin.

Dask's synchronous scheduler by name (``"sync"``: the launcher, every task on the calling
thread), the launcher (``"gpustreams"``) and, for comparison, the function
``dask.local.get_sync`` (Dask's ``get_async``, each task through the runtime).
"""

from __future__ import annotations

import copy
import functools
import random

import dask
import dask.array as da
import dask.local
import dask.threaded
import numpy as np
import pytest
from dask import delayed
from dask._task_spec import GraphNode, List, Task, TaskRef, _execute_subgraph
from dask.callbacks import Callback

import dask_gpustreams
from dask_gpustreams import sim
from tests.test_hosttasks import nested_partial

GET_SYNC = pytest.param(dask.local.get_sync, id="get_sync")
ROUTES = [GET_SYNC, "sync", "gpustreams"]


def _inner(x):
    # A nested compute on one of Dask's own local schedulers (get_async behind it).
    return dask.compute(delayed(lambda v: v + 1)(x), scheduler=dask.local.get_sync)[0]


@pytest.mark.parametrize("scheduler", ROUTES)
def test_a_nested_compute_sees_none_of_the_outer_compute_s_callbacks(gpustreams, scheduler):
    """As in Dask, only the outermost compute sees ``Callback.active`` (a ProgressBar or a
    Profiler): a compute that a task starts must not report its tasks as the outer graph's."""
    starts, pre = [], []
    cb = Callback(start=lambda dsk: starts.append(1), pretask=lambda k, d, s: pre.append(k))
    with gpustreams(), cb:
        assert dask.compute(delayed(_inner)(1), scheduler=scheduler) == (2,)
    assert (len(starts), len(pre)) == (1, 1)


def _fill(out, v):
    out[...] = v


def _produce(v):
    out = sim.empty(1000)
    sim.launch(_fill, out, v)
    return out


@dask_gpustreams.host_task
def _read_current_stream(x):
    return float(sim.asnumpy(x)[-1])  # syncs the current stream, which waited for x's


@dask_gpustreams.host_task
def _read_off_stream(x):
    # A deepcopy of a SimArray snapshots its buffer as a copy on no stream of the task's (on
    # a GPU: a file write through GDS, a copy on another stream): host_task promises that
    # the inputs are complete on the host first.
    return float(copy.deepcopy(x).get()[-1])


@pytest.fixture
def slow_kernels():
    """Kernels sleep up to 4 ms, at random: a read that does not wait for one sees the poison."""
    device = sim.get_device()
    device.kernel_delay = (0.0, 0.004)
    yield
    device.kernel_delay = (0.0, 0.0)


def _chains_give_their_values(schedule, chain):
    """5 graphs of 6 chains, ``chain(i, j, v) -> (tasks, key)`` each; the keys give their ``v``."""
    rng = random.Random(0)
    for i in range(5):
        dsk, keys, values = {}, [], []
        for j in range(6):
            v = rng.random()
            tasks, key = chain(i, j, v)
            dsk.update(tasks)
            keys.append(key)
            values.append(v)
        assert list(schedule(dsk, keys)) == values


@pytest.mark.parametrize("reader", [_read_current_stream, _read_off_stream])
@pytest.mark.parametrize(
    "scheduler", ["sync", "gpustreams", GET_SYNC, pytest.param(dask.threaded.get, id="threaded")]
)
def test_a_host_task_reads_its_inputs_complete(
    gpustreams, on_the_launcher, slow_kernels, scheduler, reader
):
    """Producers with random kernel delays; exact values, on the calling thread (``"sync"``)
    as on host threads, and on Dask's own schedulers passed as functions (each task through
    the runtime: a host task waits on the host for its inputs there too)."""
    rng = random.Random(0)
    with gpustreams(streams=4):
        for _ in range(10):
            values = [rng.random() for _ in range(6)]
            parts = [delayed(reader)(delayed(_produce)(v)) for v in values]
            assert list(dask.compute(*parts, scheduler=scheduler)) == values


def _ident(v):
    return v


@pytest.mark.parametrize(
    "scheduler", ["gpustreams", GET_SYNC, pytest.param(dask.threaded.get, id="threaded")]
)
def test_a_host_task_fused_with_its_dependent_reads_its_inputs_complete(
    gpustreams, on_the_launcher, slow_kernels, scheduler
):
    """A host task fused into one task with its dependent (as linear fusion makes them) waits
    on the host for the fused task's inputs on every route, as the launcher's does."""

    def chain(i, j, v):
        produced = Task(("p", i, j), _produce, v)
        read = Task(("r", i, j), _read_off_stream, TaskRef(produced.key))
        out = Task(("o", i, j), _ident, TaskRef(read.key))
        return {produced.key: produced, out.key: GraphNode.fuse(read, out)}, out.key

    with gpustreams(streams=4):
        _chains_give_their_values(dask.base.get_scheduler(scheduler=scheduler), chain)


@pytest.mark.parametrize("reader", [_read_current_stream, _read_off_stream])
@pytest.mark.parametrize(
    "scheduler", ["sync", "gpustreams", GET_SYNC, pytest.param(dask.threaded.get, id="threaded")]
)
def test_a_host_task_fused_with_its_producer_reads_its_input_complete(
    gpustreams, on_the_launcher, slow_kernels, scheduler, reader
):
    """A host task fused into one task with the kernel that makes its input (``map_blocks``
    after an upload and a kernel: dask.array's blockwise fusion) reads it whole: the host
    wait for the fused task's inputs from outside does not cover the inner kernels. Before,
    ``_read_off_stream`` read the poison (NaN) on every route."""

    def chain(i, j, v):
        produced = Task(("p", i, j), _produce, v)
        read = Task(("r", i, j), reader, TaskRef(produced.key))
        return {read.key: GraphNode.fuse(produced, read)}, read.key

    with gpustreams(streams=4):
        _chains_give_their_values(dask.base.get_scheduler(scheduler=scheduler), chain)


@pytest.mark.parametrize(
    "scheduler", ["sync", "gpustreams", GET_SYNC, pytest.param(dask.threaded.get, id="threaded")]
)
def test_a_host_task_in_map_blocks_after_a_kernel_reads_its_input_complete(
    gpustreams, on_the_launcher, slow_kernels, scheduler
):
    """The same through dask.array: the upload, the kernels and the host task fused into one
    task per chunk (before: stale or poisoned values on every route)."""
    host = np.arange(64.0).reshape(8, 8)
    with gpustreams(streams=4):
        for _ in range(3):
            x = da.from_array(host, chunks=4).map_blocks(sim.asarray) * 3 + 1
            got = x.map_blocks(_snapshot_twice).sum(axis=0).compute(scheduler=scheduler)
            np.testing.assert_array_equal(sim.asnumpy(got), ((host * 3 + 1) * 2).sum(axis=0))


@pytest.mark.parametrize(
    "scheduler", ["sync", "gpustreams", GET_SYNC, pytest.param(dask.threaded.get, id="threaded")]
)
def test_a_host_task_on_a_task_nested_in_its_arguments_reads_its_input_complete(
    gpustreams, on_the_launcher, slow_kernels, scheduler
):
    """``Task(k, host_fn, Task(None, produce, v))``: the nested task's kernel runs on the
    task's stream, after the host wait for its inputs (before: the poison, NaN)."""

    def chain(i, j, v):
        key = ("r", i, j)
        return {key: Task(key, _read_off_stream, Task(None, _produce, v))}, key

    with gpustreams(streams=4):
        _chains_give_their_values(dask.base.get_scheduler(scheduler=scheduler), chain)


def _nested_read_of_a_nested_producer(i, j, v):
    """``Task(k, _ident, Task(None, host_fn, Task(None, _produce, v)))``, a legacy graph's
    ``(_ident, (host_fn, (_produce, v)))``."""
    read = Task(None, _read_off_stream, Task(None, _produce, v))
    return {("r", i, j): Task(("r", i, j), _ident, read)}, ("r", i, j)


def _nested_read_of_an_input(i, j, v):
    """``Task(k, _ident, Task(None, host_fn, TaskRef(p)))``: ``p`` made by another task."""
    produced = Task(("p", i, j), _produce, v)
    read = Task(None, _read_off_stream, TaskRef(produced.key))
    return {produced.key: produced, ("r", i, j): Task(("r", i, j), _ident, read)}, ("r", i, j)


def _fused_nested_read_of_an_inner_value(i, j, v):
    """A fused task whose inner task nests the host call: ``_ident(host_fn(p))``, ``p`` inner."""
    produced = Task(("p", i, j), _produce, v)
    read = Task(("r", i, j), _ident, Task(None, _read_off_stream, TaskRef(produced.key)))
    return {read.key: GraphNode.fuse(produced, read)}, read.key


def _deep_read_of_an_input(i, j, v):
    """Two levels down: ``Task(k, _ident, Task(None, _ident, Task(None, host_fn, TaskRef(p))))``."""
    produced = Task(("p", i, j), _produce, v)
    read = Task(None, _ident, Task(None, _read_off_stream, TaskRef(produced.key)))
    return {produced.key: produced, ("r", i, j): Task(("r", i, j), _ident, read)}, ("r", i, j)


def _read_in_a_list_argument(i, j, v):
    """In a ``List`` argument: ``Task(k, _first, List(Task(None, host_fn, TaskRef(p))))``."""
    produced = Task(("p", i, j), _produce, v)
    listed = List(Task(None, _read_off_stream, TaskRef(produced.key)))
    return {produced.key: produced, ("r", i, j): Task(("r", i, j), _first, listed)}, ("r", i, j)


@pytest.mark.parametrize(
    "chain",
    [
        _nested_read_of_a_nested_producer,
        _nested_read_of_an_input,
        _fused_nested_read_of_an_inner_value,
        _deep_read_of_an_input,
        _read_in_a_list_argument,
    ],
)
@pytest.mark.parametrize(
    "scheduler", ["sync", "gpustreams", GET_SYNC, pytest.param(dask.threaded.get, id="threaded")]
)
def test_a_host_task_nested_in_another_task_s_arguments_reads_its_input_complete(
    gpustreams, on_the_launcher, slow_kernels, scheduler, chain
):
    """A ``host_task`` called by a task nested in the arguments of a task that is none
    (``Task(k, g, Task(None, host_fn, ...))``) waits for its task's stream too, whether its
    input is made by a task nested in it, by another task, or inside the same fused task
    (before: the poison, NaN, or a stale value on every route)."""
    with gpustreams(streams=4):
        _chains_give_their_values(dask.base.get_scheduler(scheduler=scheduler), chain)


class _SubTask(Task):
    """A subclass of ``Task`` (a library's own task class)."""

    __slots__ = ()


def _first(values):
    return values[0]


def _list_of_a_read_of_an_input(i, j, v):
    """A graph's ``List`` node (as ``delayed([...])`` makes one, its key set as Dask does),
    whose element calls a ``host_task`` on another task's value: ``[host_fn(p)]``."""
    produced = Task(("p", i, j), _produce, v)
    listed = List(Task(None, _read_off_stream, TaskRef(produced.key)))
    listed.key = ("l", i, j)
    out = Task(("r", i, j), _first, TaskRef(listed.key))
    return {produced.key: produced, listed.key: listed, out.key: out}, out.key


def _subtask_nesting_a_read_of_an_input(i, j, v):
    """A ``Task`` subclass whose argument calls a ``host_task``: ``g(host_fn(p))``."""
    produced = Task(("p", i, j), _produce, v)
    read = _SubTask(("r", i, j), _ident, Task(None, _read_off_stream, TaskRef(produced.key)))
    return {produced.key: produced, read.key: read}, read.key


@pytest.mark.parametrize(
    "chain", [_list_of_a_read_of_an_input, _subtask_nesting_a_read_of_an_input]
)
@pytest.mark.parametrize(
    "scheduler", ["sync", "gpustreams", GET_SYNC, pytest.param(dask.threaded.get, id="threaded")]
)
def test_a_host_task_nested_in_a_list_node_or_a_task_subclass_reads_its_input_complete(
    gpustreams, on_the_launcher, slow_kernels, scheduler, chain
):
    """A ``host_task`` nested in a graph node that is a ``Task`` subclass (a ``List`` node,
    a library's task class) waits for its task's stream as in a plain ``Task`` (before: the
    poison, NaN, or a stale value on every route; the node was not walked)."""
    with gpustreams(streams=4):
        _chains_give_their_values(dask.base.get_scheduler(scheduler=scheduler), chain)


@dask_gpustreams.host_task
def _read_both(x, y):
    a, b = (float(copy.deepcopy(v).get()[-1]) for v in (x, y))
    return a if a == b else float("nan")


@pytest.mark.parametrize(
    "scheduler", ["sync", "gpustreams", GET_SYNC, pytest.param(dask.threaded.get, id="threaded")]
)
def test_a_host_task_on_a_nested_task_and_an_inner_value_reads_both_complete(
    gpustreams, on_the_launcher, slow_kernels, scheduler
):
    """Inside a fused task, a ``host_task`` that reads a value of its fused task's kernels
    and one of a task nested in its arguments: its one host wait, after the nested task,
    covers both."""

    def chain(i, j, v):
        produced = Task(("p", i, j), _produce, v)
        key = ("r", i, j)
        read = Task(key, _read_both, TaskRef(produced.key), Task(None, _produce, v))
        return {key: GraphNode.fuse(produced, read)}, key

    with gpustreams(streams=4):
        _chains_give_their_values(dask.base.get_scheduler(scheduler=scheduler), chain)


@dask_gpustreams.host_task
def _snapshot_twice(x):
    return sim.asarray(copy.deepcopy(x).get() * 2)


def _boom(x):
    raise ValueError("a task no key needs")


def _inc(x):
    return x + 1


@pytest.mark.parametrize("scheduler", ROUTES)
def test_only_the_tasks_the_keys_need_run(gpustreams, scheduler):
    """As Dask's ``get_async``, which runs what the wanted keys depend on: a task no key
    needs neither runs nor fails the compute."""
    with gpustreams():
        schedule = dask.base.get_scheduler(scheduler=scheduler)
        assert schedule({"a": 1, "b": (_inc, "a"), "c": (_boom, "a")}, "b") == 2


@pytest.mark.parametrize("scheduler", ROUTES)
def test_an_unoptimized_slice_computes_only_its_chunks(gpustreams, scheduler):
    calls = []

    def block(b):
        calls.append(b.shape)
        return b

    x = da.ones(10, chunks=2).map_blocks(block)
    calls.clear()  # map_blocks' meta calls
    with gpustreams():
        x[:2].compute(scheduler=scheduler, optimize_graph=False)
    assert len(calls) == 1


@pytest.mark.parametrize("scheduler", ROUTES)
def test_the_cache_argument_is_filled(gpustreams, scheduler):
    """``get_async`` computes into ``cache=`` (a user's dict), as Dask documents."""
    cache: dict = {}
    with gpustreams():
        dask.base.get_scheduler(scheduler=scheduler)({"a": 1, "b": (abs, "a")}, "b", cache=cache)
    assert cache.get("b") == 1


@pytest.mark.parametrize("scheduler", ROUTES)
def test_data_no_key_needs_stays_out_of_the_cache(gpustreams, scheduler):
    cache: dict = {}
    with gpustreams():
        schedule = dask.base.get_scheduler(scheduler=scheduler)
        schedule({"a": 1, "big": [0, 1, 2], "b": (abs, "a")}, "b", cache=cache)
    assert cache == {"b": 1}


@pytest.mark.parametrize("scheduler", ROUTES)
def test_a_cycle_no_key_needs_still_finishes_the_callbacks(gpustreams, scheduler):
    """``get_async`` calls every started callback's finish (errored) when the graph has a
    cycle; a ProgressBar's timer thread would otherwise run, and print, for ever."""
    events = []
    cb = Callback(start=lambda d: events.append("start"), finish=lambda d, s, e: events.append(e))
    dsk = {"a": 1, "b": (_inc, "a"), "x": (_inc, "y"), "y": (_inc, "x")}
    with gpustreams(), cb:
        schedule = dask.base.get_scheduler(scheduler=scheduler)
        with pytest.raises(RuntimeError, match="Cycle detected"):
            schedule(dsk, "b")
    assert events == ["start", True]


class _CacheHit(Callback):
    """What ``dask.cache.Cache._start`` does on a hit: the node becomes the raw value."""

    def _start(self, dsk):
        if "b" in dsk:
            dsk["b"] = 70


@pytest.mark.parametrize("scheduler", ROUTES)
def test_a_start_callback_may_replace_a_node_by_its_value(gpustreams, scheduler):
    """``dask.cache.Cache`` puts cached values in the graph in its ``_start``; the task it
    replaces does not run."""
    calls = []

    def slow(x):
        calls.append(x)
        return x * 10

    with gpustreams(), _CacheHit():
        schedule = dask.base.get_scheduler(scheduler=scheduler)
        assert schedule({"a": 1, "b": (slow, "a"), "c": (_inc, "b")}, "c") == 71
    assert calls == []


# --- a host_task behind functools.partial; a host_task in a nested fused task -------------


@dask_gpustreams.host_task
def _read_at(x, index):
    """:func:`_read_off_stream` of element ``index``: partials of it bind ``index``."""
    return float(copy.deepcopy(x).get()[index])


#: A partial of a marked function, and a partial of a partial of one: the mark is the
#: function's, not the partial's.
_PARTIAL_READ = functools.partial(_read_at, index=-1)
_PARTIAL_OF_A_PARTIAL_READ = nested_partial(_read_at, index=-1)


def _partial_reads_an_input(reader):
    def chain(i, j, v):
        produced = Task(("p", i, j), _produce, v)
        read = Task(("r", i, j), reader, TaskRef(produced.key))
        return {produced.key: produced, read.key: read}, read.key

    return chain


def _partial_fused_with_its_producer(reader):
    def chain(i, j, v):
        produced = Task(("p", i, j), _produce, v)
        read = Task(("r", i, j), reader, TaskRef(produced.key))
        return {read.key: GraphNode.fuse(produced, read)}, read.key

    return chain


def _partial_fused_with_its_dependent(reader):
    def chain(i, j, v):
        produced = Task(("p", i, j), _produce, v)
        read = Task(("r", i, j), reader, TaskRef(produced.key))
        out = Task(("o", i, j), _ident, TaskRef(read.key))
        return {produced.key: produced, out.key: GraphNode.fuse(read, out)}, out.key

    return chain


def _partial_on_a_nested_producer(reader):
    def chain(i, j, v):
        key = ("r", i, j)
        return {key: Task(key, reader, Task(None, _produce, v))}, key

    return chain


def _partial_nested_in_another_task_s_arguments(reader):
    def chain(i, j, v):
        produced = Task(("p", i, j), _produce, v)
        read = Task(None, reader, TaskRef(produced.key))
        return {produced.key: produced, ("r", i, j): Task(("r", i, j), _ident, read)}, ("r", i, j)

    return chain


@pytest.mark.parametrize("reader", [_PARTIAL_READ, _PARTIAL_OF_A_PARTIAL_READ], ids=["1", "2"])
@pytest.mark.parametrize(
    "chain",
    [
        _partial_reads_an_input,
        _partial_fused_with_its_producer,
        _partial_fused_with_its_dependent,
        _partial_on_a_nested_producer,
        _partial_nested_in_another_task_s_arguments,
    ],
)
@pytest.mark.parametrize(
    "scheduler", ["sync", "gpustreams", GET_SYNC, pytest.param(dask.threaded.get, id="threaded")]
)
def test_a_partial_of_a_host_task_reads_its_input_complete(
    gpustreams, on_the_launcher, slow_kernels, scheduler, chain, reader
):
    """``functools.partial(host_fn, ...)`` (a partial of one too) is a ``host_task``: as a
    task's function, inside a fused task and nested in arguments (before: the poison, NaN,
    or a stale value on every route; the mark was looked up on the partial only)."""
    with gpustreams(streams=4):
        _chains_give_their_values(dask.base.get_scheduler(scheduler=scheduler), chain(reader))


@pytest.mark.parametrize(
    "scheduler", ["sync", "gpustreams", GET_SYNC, pytest.param(dask.threaded.get, id="threaded")]
)
def test_a_delayed_partial_of_a_host_task_reads_its_input_complete(
    gpustreams, on_the_launcher, slow_kernels, scheduler
):
    """``delayed(functools.partial(host_fn, ...))(x)``: the task's function is the partial."""
    rng = random.Random(0)
    with gpustreams(streams=4):
        for _ in range(10):
            values = [rng.random() for _ in range(6)]
            parts = [delayed(_PARTIAL_READ)(delayed(_produce)(v)) for v in values]
            assert list(dask.compute(*parts, scheduler=scheduler)) == values


@pytest.mark.parametrize(
    "scheduler", ["sync", "gpustreams", GET_SYNC, pytest.param(dask.threaded.get, id="threaded")]
)
def test_a_partial_of_a_host_task_in_map_blocks_reads_its_input_complete(
    gpustreams, on_the_launcher, slow_kernels, scheduler
):
    """``map_blocks(functools.partial(host_fn, ...))`` after kernels, fused with them."""
    host = np.arange(64.0).reshape(8, 8)
    with gpustreams(streams=4):
        for _ in range(3):
            x = da.from_array(host, chunks=4).map_blocks(sim.asarray) * 3 + 1
            snap = functools.partial(_snapshot_times, factor=2)
            got = x.map_blocks(snap).sum(axis=0).compute(scheduler=scheduler)
            np.testing.assert_array_equal(sim.asnumpy(got), ((host * 3 + 1) * 2).sum(axis=0))


@dask_gpustreams.host_task
def _snapshot_times(x, factor):
    return sim.asarray(copy.deepcopy(x).get() * factor)


def _nested_fused(node: Task) -> Task:
    """``node``, a fused task, as a task nested in another's arguments (no key of its own)."""
    return Task(None, node.func, *node.args, _data_producer=node.data_producer, **node.kwargs)


def _nested_fused_read_of_an_inner_value(reader):
    """``Task(k, _ident, <fused: host_fn(produce(v))>)``: the host step reads its fused
    task's kernel's value."""

    def chain(i, j, v):
        produced = Task(("p", i, j), _produce, v)
        read = Task(("q", i, j), reader, TaskRef(produced.key))
        nested = _nested_fused(GraphNode.fuse(produced, read))
        return {("r", i, j): Task(("r", i, j), _ident, nested)}, ("r", i, j)

    return chain


def _nested_fused_read_of_an_input(reader):
    """``Task(k, _ident, <fused: _ident(host_fn(p))>)``, ``p`` made by another task."""

    def chain(i, j, v):
        produced = Task(("p", i, j), _produce, v)
        read = Task(("q", i, j), reader, TaskRef(produced.key))
        out = Task(("o", i, j), _ident, TaskRef(read.key))
        nested = _nested_fused(GraphNode.fuse(read, out))
        return {produced.key: produced, ("r", i, j): Task(("r", i, j), _ident, nested)}, ("r", i, j)

    return chain


def _nested_fused_read_of_a_nested_producer(reader):
    """``Task(k, _ident, <fused: _ident(host_fn(in))>(produce(v)))``: the nested fused
    task's input is made by a task nested in its own arguments."""

    def chain(i, j, v):
        read = Task(("q", i, j), reader, TaskRef(("in", i, j)))
        out = Task(("o", i, j), _ident, TaskRef(read.key))
        inner = {read.key: read, out.key: out}
        nested = Task(
            None, _execute_subgraph, inner, out.key, (("in", i, j),), Task(None, _produce, v)
        )
        return {("r", i, j): Task(("r", i, j), _ident, nested)}, ("r", i, j)

    return chain


def _fused_nesting_a_fused_read(reader):
    """A fused task whose inner task nests a fused task: ``_ident(<fused: host_fn(p)>)``,
    ``p`` an inner value of the outer fused task."""

    def chain(i, j, v):
        produced = Task(("p", i, j), _produce, v)
        read = Task(("q", i, j), reader, TaskRef(("in", i, j)))
        nested = Task(
            None,
            _execute_subgraph,
            {read.key: read},
            read.key,
            (("in", i, j),),
            TaskRef(produced.key),
        )
        out = Task(("r", i, j), _ident, nested)
        return {out.key: GraphNode.fuse(produced, out)}, out.key

    return chain


@pytest.mark.parametrize("reader", [_read_off_stream, _PARTIAL_READ], ids=["marked", "partial"])
@pytest.mark.parametrize(
    "chain",
    [
        _nested_fused_read_of_an_inner_value,
        _nested_fused_read_of_an_input,
        _nested_fused_read_of_a_nested_producer,
        _fused_nesting_a_fused_read,
    ],
)
@pytest.mark.parametrize(
    "scheduler", ["sync", "gpustreams", GET_SYNC, pytest.param(dask.threaded.get, id="threaded")]
)
def test_a_host_task_in_a_fused_task_nested_in_arguments_reads_its_input_complete(
    gpustreams, on_the_launcher, slow_kernels, scheduler, chain, reader
):
    """A ``host_task`` inside a fused task that is itself nested in another task's arguments
    waits for its task's stream before it runs: its input, made inside the nested fused
    task, by another task or by a task nested in it, is complete (before: the poison, NaN,
    or a stale value on every route; a nested fused task's steps were not searched)."""
    with gpustreams(streams=4):
        _chains_give_their_values(dask.base.get_scheduler(scheduler=scheduler), chain(reader))
