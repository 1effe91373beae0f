"""What Dask's and distributed's own tests expect of a process that imports the plugin.

Issue 12's peer-suite causes: the local route never registers a global
callback, and stays on under nested and concurrent computes (A, A2); wrapped
tasks are Dask ``Task`` nodes (B); a task error's traceback shows no plugin
frame (C); a client logs no preload line (E).
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import textwrap
import threading
import time
import traceback

import dask
import dask.array as da
import dask.local
import dask.threaded
import distributed.core
import numpy as np
import pytest
from dask import delayed
from dask._task_spec import Alias, Task, TaskRef
from dask.callbacks import Callback
from dask.diagnostics import Profiler
from dask.sizeof import sizeof
from dask.tokenize import tokenize
from distributed import Client, LocalCluster
from distributed.utils_test import captured_logger

from dask_gpustreams import sim
from dask_gpustreams.integrations import local, preload, tasks
from dask_gpustreams.integrations.distributed import tracebacks
from dask_gpustreams.integrations.tasks import StreamTask, wrap_task
from dask_gpustreams.runtime import EventRegistry, get_runtime

TIMEOUT = 30  # seconds any wait below may take before the test fails


def on_pool_stream(*args):
    """Whether this task runs with a pool stream current (through the runtime)."""
    device = sim.get_device()
    return device.current_stream() is not device.default_stream


def fill(out, value):
    time.sleep(0.001)
    out[...] = value


def add(out, a, b):
    time.sleep(0.001)
    np.add(a, b, out=out)


def leaf(value):
    out = sim.empty(4, "float64")
    sim.launch(fill, out, value)
    return out


def total(a, b):
    out = sim.empty(4, "float64")
    sim.launch(add, out, a, b)
    return out


# --- A and A2: no global callback, on under nested and concurrent computes -----------------


def test_no_global_callback_after_import_nor_after_computes(run_python):
    code = textwrap.dedent(
        """
        import dask
        from dask.callbacks import Callback
        import dask_gpustreams
        from dask_gpustreams import sim

        def on_pool_stream():
            return sim.get_device().current_stream() is not sim.get_device().default_stream

        assert not Callback.active, Callback.active
        assert dask.delayed(on_pool_stream, pure=False)().compute() is False
        assert not Callback.active, Callback.active
        with dask.config.set({"gpustreams.enabled": True, "gpustreams.backend": "sim"}):
            assert dask.delayed(on_pool_stream, pure=False)().compute() is True
            assert dask.delayed(on_pool_stream, pure=False)().compute(scheduler="sync") is True
            assert not Callback.active, Callback.active
        print("ok")
        """
    )
    assert run_python(code).splitlines()[-1] == "ok"


def test_callbacks_active_stay_the_users_while_enabled(gpustreams):
    seen = []
    user = Callback(pretask=lambda key, dsk, state: seen.append(key))
    with gpustreams(streams=2):
        assert delayed(on_pool_stream, pure=False)().compute()
        assert Callback.active == set()
        with user:
            assert Callback.active == {user._callback}
            assert delayed(on_pool_stream, pure=False)(dask_key_name="x").compute()
        assert Callback.active == set()
    assert seen == ["x"]


def test_overlapping_computes_from_two_threads_and_later_ones_run_through_the_runtime(
    gpustreams,
):
    """B starts while A's task runs and ends after A's compute: with a global callback, B
    would miss it, and restoring the empty set B saw would drop it for good."""
    a_running, a_done = threading.Event(), threading.Event()
    both_running = threading.Barrier(2, timeout=TIMEOUT)
    results: dict[str, object] = {}

    def task_a():
        on = on_pool_stream()
        a_running.set()
        both_running.wait()
        return on

    def task_b():
        on = on_pool_stream()
        both_running.wait()
        assert a_done.wait(TIMEOUT)
        return on

    def compute(name, fn, before=None):
        try:
            if before is not None:
                assert before.wait(TIMEOUT)
            results[name] = delayed(fn, pure=False)().compute()
        except BaseException as e:  # reported by the main thread
            results[name] = e
        finally:
            if name == "a":
                a_done.set()

    with gpustreams(streams=2):
        threads = [
            threading.Thread(target=compute, args=("a", task_a)),
            threading.Thread(target=compute, args=("b", task_b, a_running)),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT)
        assert not any(t.is_alive() for t in threads)
        assert results == {"a": True, "b": True}
        for scheduler in (dask.threaded.get, dask.local.get_sync, "sync"):
            assert delayed(on_pool_stream, pure=False)().compute(scheduler=scheduler)
    assert Callback.active == set()


def nested_compute(scheduler):
    inner = delayed(total)(delayed(leaf)(1.0), delayed(leaf)(2.0))
    on_outer = on_pool_stream()
    on_inner = delayed(on_pool_stream, pure=False)().compute(scheduler=scheduler)
    values = inner.compute(scheduler=scheduler).get()
    return on_outer, on_inner, values.tolist()


@pytest.mark.parametrize(
    "outer",
    [
        pytest.param(dask.threaded.get, id="threads"),
        pytest.param(dask.local.get_sync, id="get_sync"),
        "sync",
    ],
)
@pytest.mark.parametrize(
    "inner",
    [
        pytest.param(dask.threaded.get, id="threads"),
        pytest.param(dask.local.get_sync, id="get_sync"),
        "sync",
    ],
)
def test_nested_compute_in_a_task_runs_through_the_runtime(gpustreams, outer, inner):
    with gpustreams(streams=3):
        got = delayed(nested_compute)(inner).compute(scheduler=outer)
    assert got == (True, True, [3.0] * 4)


def test_disabled_leaves_dasks_callbacks_unchanged():
    with local.local_callbacks() as callbacks:
        assert list(callbacks) == []
    explicit = [(None, None, None, None, None)]
    with local.local_callbacks(explicit) as callbacks:
        assert callbacks is explicit


def test_install_is_idempotent_and_uninstall_bypasses_the_runtime(gpustreams):
    import dask.local

    assert dask.local.local_callbacks is local.local_callbacks
    local.install()
    assert local._local_callbacks.original is dask.callbacks.local_callbacks
    try:
        local.uninstall()
        with gpustreams(streams=2):
            assert delayed(on_pool_stream, pure=False)().compute() is False
    finally:
        local.install()
    with gpustreams(streams=2):
        assert delayed(on_pool_stream, pure=False)().compute() is True


# --- B: wrapped tasks are Dask tasks --------------------------------------------------------


def test_wrapped_tasks_are_dask_tasks(gpustreams):
    with gpustreams(streams=2):
        node = Task("y", np.add, TaskRef("x"), 1, _data_producer=True)
        wrapped = wrap_task(node, get_runtime(), EventRegistry())
        assert isinstance(wrapped, Task) and type(wrapped) is StreamTask
        assert (wrapped.func, wrapped.args, wrapped.kwargs) == (np.add, node.args, {})
        assert wrapped.dependencies == {"x"} and wrapped.data_producer
        assert not wrapped.is_coro and not wrapped.has_subgraph()
        assert wrapped == wrap_task(node, get_runtime(), EventRegistry())
        assert tokenize(wrapped) == tokenize(wrapped.copy()) != tokenize(node)
        assert hash(wrapped) == hash(wrapped.copy())
        assert wrapped._get_token() == wrapped.copy()._get_token() != node._get_token()
        assert sizeof(wrapped) >= sizeof(node)
        assert repr(wrapped) == f"StreamTask({node!r})"
        assert wrap_task(wrapped, get_runtime(), EventRegistry()) is wrapped
        assert pickle.loads(pickle.dumps(wrapped)).args == node.args

        alias = wrap_task(Alias("z", "y"), get_runtime(), EventRegistry())
        assert isinstance(alias, Task) and alias.dependencies == {"y"}
        assert alias.args == (TaskRef("y"),) and alias.kwargs == {}
        assert alias.func(5) == 5
        assert alias({"y": 5}) == 5


def test_profiler_sees_dask_tasks(gpustreams):
    dsk = {"a": 1, "b": 2, "c": (np.add, "a", "b"), "d": (np.multiply, "c", 2)}
    with gpustreams(streams=2), Profiler() as prof:
        assert dask.get(dsk, "d") == 6
        assert dask.threaded.get(dsk, "d") == 6
    assert sorted(r.key for r in prof.results) == ["c", "c", "d", "d"]
    assert all(isinstance(r.task, StreamTask) for r in prof.results)
    assert all(isinstance(r.task, Task) for r in prof.results)


def test_wrapping_allocates_one_object_per_task(gpustreams):
    """No per-task host cost beyond the wrapper itself (issue 12, cause B)."""
    import tracemalloc

    with gpustreams(streams=2):
        runtime, registry = get_runtime(), EventRegistry()
        nodes = [Task(("y", i), np.negative, TaskRef(("x", i))) for i in range(1000)]
        wrap_task(nodes[0], runtime, registry)  # warm caches
        # tracemalloc also counts other threads' allocations (an earlier test's sim stream
        # thread ending, say): the fewest of three measurements is the wrapping's own.
        counts = []
        for _ in range(3):
            tracemalloc.start()
            try:
                before = tracemalloc.take_snapshot()
                wrapped = [wrap_task(n, runtime, registry) for n in nodes]
                after = tracemalloc.take_snapshot()
            finally:
                tracemalloc.stop()
            counts.append(sum(s.count_diff for s in after.compare_to(before, "filename")))
            assert len(wrapped) == 1000
            del wrapped
    assert min(counts) <= 1000 + 10, counts  # the wrappers, plus the list that holds them


# --- C: tracebacks as without the plugin ----------------------------------------------------


def f1():
    return 1 / 0


def f2():
    return f1() + 5


def f3():
    return f2() + 1


def error_frames(fn):
    with pytest.raises(ZeroDivisionError) as e:
        fn()
    return [
        (frame.f_code.co_filename, frame.f_code.co_name) for frame, _ in traceback.walk_tb(e.tb)
    ]


def assert_frames_as_plain(fn, gpustreams):
    plain = error_frames(fn)
    with gpustreams(streams=2):
        frames = error_frames(fn)
    assert [f for f in frames if "dask_gpustreams" in f[0]] == []
    assert [name for _, name in frames] == [name for _, name in plain]
    assert [name for _, name in frames][-3:] == ["f3", "f2", "f1"]


@pytest.mark.parametrize(
    "scheduler",
    [
        pytest.param(dask.threaded.get, id="threads"),
        pytest.param(dask.local.get_sync, id="get_sync"),
        "sync",
        "gpustreams",
    ],
)
@pytest.mark.parametrize("method", ["compute", "persist"])
def test_task_error_traceback_has_no_plugin_frames(gpustreams, scheduler, method):
    def run():
        getattr(dask, method)(delayed(f3)(), scheduler=scheduler)

    assert_frames_as_plain(run, gpustreams)


def f3_block(block):
    return block + f3()


@pytest.mark.parametrize("scheduler", [pytest.param(dask.threaded.get, id="threads"), "gpustreams"])
def test_fused_task_error_traceback_has_no_plugin_frames(gpustreams, scheduler):
    """A task fused by dask.array's optimization runs through :mod:`.subgraphs`: its frames
    are shortened as the plugin's others."""
    x = da.ones(8, chunks=4)
    y = ((x + 1) * 2).map_blocks(f3_block, meta=np.array((), dtype=float))

    def run():
        y.compute(scheduler=scheduler)

    assert_frames_as_plain(run, gpustreams)


def distributed_error_frames(enabled):
    config = {"gpustreams.enabled": enabled, "gpustreams.backend": "sim"}
    with (
        dask.config.set(config),
        Client(processes=False, n_workers=1, threads_per_worker=2, dashboard_address=":0") as c,
    ):
        plugins = c.run(lambda dask_worker: list(dask_worker.plugins)).popitem()[1]
        assert ("gpustreams" in plugins) is enabled
        futures = [c.submit(f3, pure=False), c.compute(delayed(f3)())]
        return [error_frames(f.result) for f in futures] + [error_frames(lambda: c.gather(futures))]


def test_task_error_traceback_on_distributed_has_no_plugin_frames():
    plain = distributed_error_frames(False)
    got = distributed_error_frames(True)
    for frames, plain_frames in zip(got, plain, strict=True):
        assert [f for f in frames if "dask_gpustreams" in f[0]] == []
        assert [name for _, name in frames] == [name for _, name in plain_frames]
        assert [name for _, name in frames][-3:] == ["f3", "f2", "f1"]


async def async_error_frames(enabled, processes):
    config = {"gpustreams.enabled": enabled, "gpustreams.backend": "sim"}
    with dask.config.set(config):
        async with (
            LocalCluster(
                n_workers=1, processes=processes, asynchronous=True, dashboard_address=":0"
            ) as lc,
            Client(lc, asynchronous=True) as c,
        ):
            frames = []
            for method in ("await", "result", "gather"):
                future = c.submit(f3, pure=False)
                with pytest.raises(ZeroDivisionError) as e:
                    if method == "await":
                        await future
                    elif method == "result":
                        await future.result()
                    else:
                        await c.gather(future)
                frames.append([f.f_code.co_name for f, _ in traceback.walk_tb(e.tb)])
            return frames


@pytest.mark.parametrize("processes", [False, True])
def test_task_error_traceback_of_an_asynchronous_client_has_no_plugin_frames(processes):
    """An asynchronous client shows the frames the worker sent, without admin.traceback.shorten."""
    plain = asyncio.run(async_error_frames(False, processes))
    got = asyncio.run(async_error_frames(True, processes))
    assert got == plain
    assert all(frames[-3:] == ["f3", "f2", "f1"] for frames in got)


def test_worker_traceback_strip_leaves_other_tracebacks():
    try:
        f3()
    except ZeroDivisionError as e:
        tb = e.__traceback__
    assert tracebacks.strip_wrappers(tb) is tb
    assert tracebacks.strip_wrappers(None) is None
    assert distributed.core.get_traceback is tracebacks.get_traceback


def test_traceback_default_keeps_dasks_and_is_added_once():
    shorten = dask.config.get("admin.traceback.shorten")
    dask_default = dask.config.defaults[0]["admin"]["traceback"]["shorten"]
    assert shorten[: len(dask_default)] == dask_default
    assert shorten[len(dask_default) :] == list(tasks.TRACEBACK_SHORTEN)
    tasks._add_traceback_shorten_default()
    assert dask.config.get("admin.traceback.shorten") == shorten
    with dask.config.set({"admin.traceback.shorten": ["mine"]}):
        assert dask.config.get("admin.traceback.shorten") == ["mine"]


# --- E: a client logs no preload line -------------------------------------------------------


@pytest.mark.parametrize("enabled", [False, True])
def test_client_logs_no_preload_line_and_installs_the_plugin_when_enabled(enabled):
    config = {"gpustreams.enabled": enabled, "gpustreams.backend": "sim"}
    with (
        dask.config.set(config),
        captured_logger("distributed") as log,
        Client(processes=False, n_workers=1, dashboard_address=":0") as c,
    ):
        assert c.submit(on_pool_stream, pure=False).result() is enabled
        plugins = c.run(lambda dask_worker: list(dask_worker.plugins)).popitem()[1]
    assert ("gpustreams" in plugins) is enabled
    assert "preload" not in log.getvalue().lower()


def test_quiet_filter_keeps_errors_and_other_preloads():
    def record(level, msg, name):
        return logging.LogRecord("distributed.preloading", level, __file__, 1, msg, (name,), None)

    quiet = preload.QuietClientPreload()
    assert not quiet.filter(record(logging.INFO, "Creating preload: %s", preload.CLIENT_PRELOAD))
    assert quiet.filter(
        record(logging.ERROR, "Failed to start preload: %s", preload.CLIENT_PRELOAD)
    )
    assert quiet.filter(record(logging.INFO, "Creating preload: %s", "dask_gpustreams"))
    assert preload._quiet_client_preload in logging.getLogger("distributed.preloading").filters
