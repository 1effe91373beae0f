"""``gpustreams.enabled`` reaches the stream launcher when the compute names no scheduler.

A compute whose collections default to Dask's threaded scheduler runs on the launcher
(one thread launches every task), and so does one that names Dask's threaded or
synchronous scheduler (the latter with every task on the calling thread); Dask's
schedulers asked for as such (their functions, a pool) and the others are kept.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import threading
import time
import warnings
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any

import dask
import dask.array as da
import dask.base
import dask.local
import dask.threaded
import numpy as np
import pytest
from dask import delayed

import dask_gpustreams
from dask_gpustreams import sim
from dask_gpustreams.diagnostics.status import runtime_counts
from dask_gpustreams.integrations import local
from dask_gpustreams.runtime.runtime import live_runtimes


def _thread_of(_: object) -> int:
    return threading.get_ident()


def _threads(**compute_kwargs) -> set[int]:
    """The threads that ran 16 independent tasks (and the tasks' result, checked)."""
    parts = [delayed(_thread_of)(i, dask_key_name=f"where-{i}") for i in range(16)]
    return set(dask.compute(*parts, **compute_kwargs))


def test_enabled_without_a_named_scheduler_runs_on_the_launcher(gpustreams):
    a = np.arange(64.0).reshape(8, 8)
    x = da.from_array(a, chunks=4).map_blocks(sim.asarray)
    with gpustreams():
        assert dask.base.get_scheduler(collections=[x]) is local.threaded_get
        got = sim.asnumpy(((x + 1) * x).sum(axis=0).compute())
        assert _threads() == {threading.get_ident()}  # launched from this thread
        persisted = (x * 2).persist()
    np.testing.assert_array_equal(got, ((a + 1) * a).sum(axis=0))
    np.testing.assert_array_equal(sim.asnumpy(persisted.compute(scheduler="sync")), a * 2)


@pytest.mark.parametrize("named", ["argument", "config", "alias", "upper case", "empty config"])
def test_dask_s_threaded_scheduler_by_name_runs_on_the_launcher(gpustreams, named):
    """Dask's threads took 0.67-0.92x plain threads' time on 4 of 13 workloads on the H200;
    a name is no request for them (a user's ``scheduler: threads`` config among others)."""
    name = {"alias": "threading", "upper case": "Threads", "empty config": ""}.get(named, "threads")
    with gpustreams():
        if named.endswith("config"):
            with dask.config.set(scheduler=name):
                assert dask.base.get_scheduler(collections=[delayed(1)]) is local.threaded_get
                threads = _threads()
        else:
            assert dask.base.get_scheduler(scheduler=name) is local.threaded_get
            threads = _threads(scheduler=name)
    assert threads == {threading.get_ident()}  # launched from this thread


@pytest.mark.parametrize(
    "asked", ["function", "config function", "pool", "pool argument", "num_workers"]
)
def test_dask_s_threads_are_kept_where_asked_for_as_such(gpustreams, asked):
    with gpustreams(), ThreadPoolExecutor(4) as pool:
        if asked == "function":
            assert dask.base.get_scheduler(scheduler=dask.threaded.get) is local.threads_get
            threads = _threads(scheduler=dask.threaded.get, num_workers=4)
        elif asked == "config function":
            with dask.config.set(scheduler=dask.threaded.get, num_workers=4):
                assert dask.base.get_scheduler(collections=[delayed(1)]) is local.threads_get
                threads = _threads()
        elif asked == "pool":
            with dask.config.set(pool=pool, scheduler="threads"):
                assert dask.base.get_scheduler(collections=[delayed(1)]) is local.threads_get
                threads = _threads()
        elif asked == "pool argument":
            threads = _threads(scheduler="threads", pool=pool)
        else:
            threads = _threads(num_workers=4)
    assert threading.get_ident() not in threads  # Dask's pool threads, not the caller's
    assert len(threads) > 1


class _AtOnce:
    """Counts the tasks that run at once. Each task, host work, waits up to 0.2 s for
    ``goal`` tasks to run with it, so that a route that lets that many run at once shows
    it however the threads are scheduled."""

    def __init__(self, goal: int):
        self.goal = goal
        self.running = self.most = 0
        self.threads: set[int] = set()
        self.changed = threading.Condition()

    def __call__(self, i: int) -> int:
        with self.changed:
            self.running += 1
            self.most = max(self.most, self.running)
            self.threads.add(threading.get_ident())
            self.changed.notify_all()
            self.changed.wait_for(lambda: self.running >= self.goal, timeout=0.2)
            self.running -= 1
        return i


@pytest.mark.parametrize("given", ["argument", "config"])
def test_num_workers_one_runs_one_task_at_a_time_on_the_launcher(gpustreams, given):
    """``num_workers=1`` (a library that is not thread-safe), passed to the compute or set
    in Dask's config, runs one task at a time, as Dask's one thread does: on the launcher,
    every task on the calling thread. Before, the config's 1 ran host work on the launcher's
    host threads, two tasks at once."""
    at_once = _AtOnce(goal=2)
    tasks = [delayed(at_once)(i) for i in range(8)]
    with gpustreams():
        if given == "argument":
            got = dask.compute(*tasks, num_workers=1)
        else:
            with dask.config.set(num_workers=1):
                got = dask.compute(*tasks)
    assert got == tuple(range(8))
    assert at_once.most == 1 and at_once.threads == {threading.get_ident()}


def test_num_workers_in_the_config_bounds_the_tasks_at_once(gpustreams):
    """A thread count in Dask's config below what the launcher runs at once (its thread
    and 3 host threads here) runs on Dask's threads, at most that many tasks at once."""
    at_once = _AtOnce(goal=3)
    tasks = [delayed(dask_gpustreams.host_task(at_once))(i) for i in range(6)]
    with gpustreams(**{"host-threads": 3}), dask.config.set(num_workers=2):
        assert dask.compute(*tasks) == tuple(range(6))
    assert at_once.most == 2 and threading.get_ident() not in at_once.threads


def test_num_workers_in_the_config_above_the_launcher_s_threads_keeps_the_launcher(
    gpustreams,
):
    """A thread count in Dask's config larger than ``gpustreams.host-threads``, at least what
    the launcher runs at once (a common global setting, as ``scheduler: threads`` is), keeps
    the launcher."""
    with gpustreams(**{"host-threads": 2}), dask.config.set(num_workers=3):
        assert _threads() == {threading.get_ident()}  # launched from this thread


def test_num_workers_in_the_config_equal_to_the_host_threads_runs_on_dask_s_threads(
    gpustreams,
):
    """The boundary: a count of ``gpustreams.host-threads`` is below what the launcher runs
    at once (its thread too), so it runs on Dask's threads."""
    with gpustreams(**{"host-threads": 2}), dask.config.set(num_workers=2):
        threads = _threads()
    assert threading.get_ident() not in threads and len(threads) <= 2


@pytest.mark.parametrize("count", [True, np.int64(1)], ids=["True", "numpy"])
def test_num_workers_one_spelt_otherwise_runs_one_task_at_a_time_on_dask_s_threads(
    gpustreams, count
):
    """Only a plain ``int`` is read as a count: Dask takes ``True`` and a NumPy 1 as one
    thread, and so do Dask's threads here, one task at a time."""
    at_once = _AtOnce(goal=2)
    tasks = [delayed(at_once)(i) for i in range(3)]
    with gpustreams():
        assert dask.compute(*tasks, num_workers=count) == (0, 1, 2)
    assert at_once.most == 1 and threading.get_ident() not in at_once.threads


@dask_gpustreams.host_task
def _host_thread_of(_: object) -> int:
    return threading.get_ident()


def _slow_thread_of(_: object) -> int:
    time.sleep(0.01)  # host work: learned as such after two calls on the launcher
    return threading.get_ident()


@pytest.mark.parametrize("named", ["argument", "config", "alias", "upper case"])
def test_dask_s_synchronous_scheduler_by_name_runs_every_task_in_the_calling_thread(
    gpustreams, named
):
    """The launcher, whose per-task cost is under plain sync's, with host tasks (marked, or
    slow ones it would learn) where they come, on the calling thread, as Dask's sync runs
    them: the user asked for one thread."""
    name = {"alias": "single-threaded", "upper case": "Sync"}.get(named, "sync")
    parts = [delayed(_host_thread_of)(i, dask_key_name=f"host-{i}") for i in range(8)]
    parts += [delayed(_slow_thread_of)(i, dask_key_name=f"slow-{i}") for i in range(8)]
    with gpustreams():
        if named == "config":
            with dask.config.set(scheduler=name):
                assert dask.base.get_scheduler(collections=[delayed(1)]) is local.sync_get
                threads = set(dask.compute(*parts))
        else:
            assert dask.base.get_scheduler(scheduler=name) is local.sync_get
            threads = set(dask.compute(*parts, scheduler=name))
        elsewhere = set(dask.compute(*parts[:8], scheduler="gpustreams"))
    assert threads == {threading.get_ident()}
    assert threading.get_ident() not in elsewhere  # marked: host threads, unless asked


def test_other_schedulers_are_kept(gpustreams):
    with gpustreams():
        kept = dask.base.get_scheduler(scheduler=dask.local.get_sync)
    assert kept is dask.local.get_sync


def _tasks_run() -> dict[int, int]:
    return {id(rt): runtime_counts(rt)["tasks_run"] for rt in live_runtimes()}


@pytest.mark.parametrize(
    "how",
    [
        "scheduler='processes'",
        "scheduler=pool",
        "pool config",
        "pool argument",
        "threaded.get with a pool argument",
    ],
)
def test_other_processes_run_as_plain_dask_and_say_so_once(gpustreams, how):
    """Their tasks run in other processes, which the runtime does not reach: the compute
    runs as plain Dask (no runtime of this process runs it), with one warning a process."""
    parts = [delayed(sum)([i, 1]) for i in range(4)]
    local.warn_once.cache_clear()
    with contextlib.ExitStack() as stack:
        pool = stack.enter_context(ProcessPoolExecutor(2))
        stack.enter_context(gpustreams())
        kwargs = {
            "scheduler='processes'": {"scheduler": "processes"},
            "scheduler=pool": {"scheduler": pool},
            "pool config": {},
            "pool argument": {"pool": pool},
            "threaded.get with a pool argument": {"scheduler": dask.threaded.get, "pool": pool},
        }[how]
        if how == "pool config":
            stack.enter_context(dask.config.set(pool=pool))
        before = _tasks_run()
        with pytest.warns(UserWarning, match="^gpustreams: this compute runs its tasks in other"):
            assert dask.compute(*parts, **kwargs) == (1, 2, 3, 4)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert dask.compute(*parts, **kwargs) == (1, 2, 3, 4)
        assert _tasks_run() == before


def _held_sum(values: list, entered: Any, release: Any) -> int:
    entered.set()
    release.wait(120)
    return sum(values)


def test_a_processes_compute_leaves_the_config_of_other_threads_as_it_is(gpustreams):
    """It runs as plain Dask without changing the config, which other threads read: a
    compute of theirs while its task runs goes on streams, and the config is as it was."""
    local.warn_once.cache_clear()
    with multiprocessing.Manager() as manager, ThreadPoolExecutor(1) as pool:
        entered, release = manager.Event(), manager.Event()
        part = delayed(_held_sum)([1, 2], entered, release)
        with gpustreams(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            future = pool.submit(dask.compute, part, scheduler="processes")
            try:
                assert entered.wait(120)  # its task runs, in another process
                assert _threads() == {threading.get_ident()}  # on the launcher, meanwhile
            finally:
                release.set()
            assert future.result() == (3,)
            assert dask.config.get("gpustreams.enabled") is True


def test_disabled_keeps_dask_s_default(gpustreams):
    with gpustreams(), dask.config.set({"gpustreams.enabled": False}):
        assert dask.base.get_scheduler(collections=[delayed(1)]) is dask.threaded.get


def test_a_distributed_client_wins():
    from distributed import Client, LocalCluster

    with (
        dask.config.set({"gpustreams.enabled": True, "gpustreams.backend": "sim"}),
        LocalCluster(n_workers=1, processes=False, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        schedule = dask.base.get_scheduler(collections=[delayed(1)])
        assert schedule is not dask_gpustreams.get
        assert getattr(schedule, "__self__", None) is client


def warning_after(client_id: str) -> str:
    return (
        f"gpustreams.enabled is on, but {client_id} was created while it was off, so it "
        "registered no StreamsPlugin, and none runs on its cluster: its workers run this "
        "compute without streams. Register it with "
        "client.register_plugin(dask_gpustreams.StreamsPlugin()), or set "
        "gpustreams.enabled before creating the Client."
    )


@pytest.mark.parametrize("plugin", ["none", "registered", "preloaded by the workers"])
def test_enabled_after_the_client_was_created_warns_where_no_plugin_runs(plugin):
    """The client registers the plugin when it is created; enabled only later, its workers
    run without streams, and the first compute through each such client says so (under
    Python's default filters, which show a text once a place)."""
    from distributed import Client, LocalCluster

    preload = ["dask_gpustreams"] if plugin == "preloaded by the workers" else []
    said, expected = [], []
    with (
        dask.config.set({"gpustreams.backend": "sim"}),
        LocalCluster(n_workers=1, processes=False, dashboard_address=":0", preload=preload) as lc,
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("default")
        for _ in range(2):  # two clients, each created while off
            with Client(lc) as client:
                if plugin == "registered":
                    client.register_plugin(dask_gpustreams.StreamsPlugin())
                with dask.config.set({"gpustreams.enabled": True}):
                    assert delayed(sum)([1, 2]).compute() == 3
                    assert delayed(sum)([3, 4]).compute() == 7
                expected.append(warning_after(client.id))
        said = [str(w.message) for w in caught if "created while" in str(w.message)]
    assert said == (expected if plugin == "none" else [])


def test_uninstall_puts_dask_s_get_scheduler_back(gpustreams):
    local.uninstall()
    try:
        assert dask.base.get_scheduler is not local.get_scheduler
        with gpustreams():
            assert dask.base.get_scheduler(collections=[delayed(1)]) is dask.threaded.get
    finally:
        local.install()
    assert dask.base.get_scheduler is local.get_scheduler
