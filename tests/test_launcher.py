"""The stream launcher (``scheduler="gpustreams"``) on the simulated device.

Kernels sleep for seeded random times before they write and reused memory
is poisoned, so a task launched before its producer's work is waited for, or
an input block reused while still read, shows up as a wrong value.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import io
import logging
import re
import sys
import threading
import time

import dask
import dask.array as da
import numpy as np
import pytest
from dask import delayed
from dask._task_spec import DataNode, Task, TaskRef
from dask.callbacks import Callback
from dask.diagnostics import ProgressBar

import dask_gpustreams
import dask_gpustreams.integrations.launcher as launcher_module
from dask_gpustreams import KernelError, host_task, sim
from dask_gpustreams.backends.sim import SimBackend
from dask_gpustreams.integrations.launcher import get as launcher_get
from dask_gpustreams.runtime import StreamPool, get_runtime
from dask_gpustreams.runtime.launcher import GraphLauncher
from dask_gpustreams.transfers import to_device
from tests.test_local_scheduler import (
    BUILTIN_POLICIES,
    META,
    StillRunningWarning,
    array_workload,
    combine,
    download,
    failing,
    leaf,
    slow_add,
    slow_scale,
    tree_workload,
)

CHUNK = 1 << 15  # float64 elements: 256 KiB

#: Seconds a barrier of host tasks waits before the test fails.
TIMEOUT = 30.0


def exact_runs(rng, runs: int) -> bool:
    """The array and tree workloads ``runs`` times on the launcher; True if all were exact."""
    exact = True
    for _ in range(runs):
        t, expected_t = array_workload(rng)
        tr, expected_tr = tree_workload(rng)
        for optimize in (True, False):
            got_t, got_tr = dask.compute(
                t.map_blocks(download, meta=META),
                tr,
                scheduler="gpustreams",
                optimize_graph=optimize,
            )
            exact &= np.array_equal(got_t, expected_t) and np.array_equal(got_tr, expected_tr)
    return exact


# --- ordering --------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", BUILTIN_POLICIES)
@pytest.mark.parametrize("streams", [1, 2, 4, 8])
def test_results_are_exact(launcher, rng, streams, policy):
    with launcher(streams=streams, policy=policy):
        assert exact_runs(rng, runs=2)
        assert get_runtime().collect() == 0


def test_missing_event_waits_give_wrong_values(launcher, rng, monkeypatch):
    """The test above is meaningful: without the device-side waits, values go wrong."""
    monkeypatch.setattr(StreamPool, "wait", lambda self, slot, producer, event, seq: None)
    with launcher(streams=4):
        assert not exact_runs(rng, runs=3)


class LaunchOrder:
    """Launch hooks that note the keys in the order the launcher starts them."""

    def __init__(self) -> None:
        self.keys: list = []

    def pretask(self, key) -> None:
        self.keys.append(key)

    def posttask(self, key, result, worker) -> None:
        pass


class CountedOrder:
    """A lazy priority: ``ranks`` when called, counting the calls."""

    def __init__(self, ranks: dict) -> None:
        self.ranks = ranks
        self.calls = 0

    def __call__(self) -> dict:
        self.calls += 1
        return self.ranks


def test_chains_side_by_side_launch_without_their_order(launcher, rng):
    """8 chains on 8 streams never have more ready tasks than streams: no order is computed."""
    n, depth = 8, 6
    tasks, deps = {}, {}
    for c in range(n):
        tasks[(c, 0)] = lambda v, c=c: leaf(float(c), 16, rng.uniform(0, 0.002))
        deps[(c, 0)] = ()
        for d in range(1, depth):
            delay = rng.uniform(0, 0.002)
            tasks[(c, d)] = lambda v, c=c, d=d, s=delay: combine(v[(c, d - 1)], v[(c, d - 1)], s)
            deps[(c, d)] = ((c, d - 1),)
    priority = CountedOrder({k: i for i, k in enumerate(tasks)})
    wanted = {(c, depth - 1) for c in range(n)}
    with launcher(streams=n, policy="auto"):
        out = GraphLauncher(get_runtime(), tasks, deps, priority, wanted).run()
    assert priority.calls == 0
    assert [out[(c, depth - 1)].get()[0] for c in range(n)] == [
        c * 2.0 ** (depth - 1) for c in range(n)
    ]


def test_more_ready_tasks_than_streams_launch_in_priority_order(launcher):
    """Once more tasks are ready than a round takes, the order is computed, once, and followed."""
    n = 12
    tasks = {i: (lambda v, i=i: leaf(float(i), 16, 0.0)) for i in range(n)}
    deps = {i: () for i in range(n)}
    priority = CountedOrder({i: n - i for i in range(n)})  # the last key is the most urgent
    seen = LaunchOrder()
    with launcher(streams=2, policy="round-robin"):
        out = GraphLauncher(get_runtime(), tasks, deps, priority, set(tasks), hooks=seen).run()
    assert priority.calls == 1
    assert seen.keys == list(reversed(range(n)))
    assert [out[i].get()[0] for i in range(n)] == [float(i) for i in range(n)]


def delayed_chains(n: int, depth: int = 4) -> list:
    """``n`` independent chains of ``depth`` sim kernels (``leaf``, then ``combine``)."""
    outs = []
    for c in range(n):
        x = delayed(leaf)(float(c), 16, 0.0)
        for _ in range(depth):
            x = delayed(combine)(x, x, 0.0)
        outs.append(x)
    return outs


@pytest.mark.parametrize(
    "launch_order, function", [("depth-first", "depth_first"), ("dask", "order")]
)
def test_compute_orders_the_graph_only_when_more_tasks_are_ready_than_streams(
    launcher, monkeypatch, launch_order, function
):
    """Through ``compute``: 4 chains on 4 streams skip the order; 6 chains compute it, by
    ``gpustreams.launch-order``."""
    calls = []
    real = getattr(launcher_module, function)
    monkeypatch.setattr(launcher_module, function, lambda *a: calls.append(1) or real(*a))
    with launcher(streams=4, policy="auto", **{"launch-order": launch_order}):
        got = dask.compute(*delayed_chains(4), scheduler="gpustreams")
        assert calls == []
        more = dask.compute(*delayed_chains(6), scheduler="gpustreams")
        assert calls == [1]
    assert [x.get()[0] for x in got] == [c * 16.0 for c in range(4)]
    assert [x.get()[0] for x in more] == [c * 16.0 for c in range(6)]


@pytest.mark.parametrize("wanted", ["c", "a"])
def test_a_cycle_is_raised_as_in_dask(launcher, wanted):
    """A cycle raises Dask's error naming its keys, whether or not a wanted key is on it."""
    dsk = {
        "a": Task("a", combine, TaskRef("b"), TaskRef("b"), 0.0),
        "b": Task("b", combine, TaskRef("a"), TaskRef("a"), 0.0),
        "c": Task("c", leaf, 1.0, 16, 0.0),
    }
    with pytest.raises(RuntimeError, match="Cycle detected") as plain:
        dask.get(dsk, [wanted])
    with launcher(streams=2), pytest.raises(RuntimeError, match="Cycle detected") as ours:
        launcher_get(dsk, [wanted])
    assert set(re.findall(r"-> (\w)", str(ours.value))) == {"a", "b"}
    assert set(re.findall(r"-> (\w)", str(plain.value))) == {"a", "b"}
    assert get_runtime().collect() == 0  # the work launched before (task c) drained


def test_named_scheduler_and_callable_are_the_launcher(launcher):
    assert dask.base.named_schedulers["gpustreams"] is dask_gpustreams.get
    with launcher(streams=2):
        x = delayed(leaf)(2.0, 8, 0.01)
        np.testing.assert_array_equal(x.compute(scheduler=dask_gpustreams.get)._view, [2.0] * 8)
        with dask.config.set(scheduler="gpustreams"):
            np.testing.assert_array_equal(x.compute()._view, [2.0] * 8)


# --- memory lifetime -------------------------------------------------------------------------


def produce():
    return sim.asarray(np.full(CHUNK, 3.0))


def slow_double(x, delay):
    out = sim.empty(CHUNK)
    sim.launch(slow_scale, out, x, 2.0, delay)
    return out


def allocate():
    return sim.empty(CHUNK)  # a block of x's size, on x's stream


def first_of(y, z):
    return y


def poisoned_runs(launcher, tasks, deps, runs: int, **settings) -> int:
    """Of ``runs`` runs of ``tasks`` (ranked in their order, on 3 streams placed by
    ``test-placement``), those whose ``final`` read poison; any other result is 6.0."""
    priority = {k: i for i, k in enumerate(tasks)}
    poisoned = 0
    with launcher(streams=3, policy="test-placement", **settings):
        runtime = get_runtime()
        for _ in range(runs):
            out = GraphLauncher(runtime, tasks, deps, priority, {"final"}).run()["final"]
            host = out.get()
            assert np.isnan(host).all() or (host == 6.0).all(), host[:4]
            poisoned += bool(np.isnan(host).any())
    return poisoned


def reuse_scenario(launcher, by_key, rng, runs: int) -> int:
    """x on stream 0, a slow reader on stream 1, then an allocation on stream 0 once the
    launcher has dropped x (its only consumer is launched). Returns runs that read poison.

    The launcher takes ready tasks in rounds of one per stream (3 here): two idle
    tasks fill the first round, so the allocation comes in the round after the reader's.
    """
    by_key.update({"produce": 0, "consume": 1, "allocate": 0, "final": 2, "idle-1": 2})
    tasks = {
        "produce": lambda v: produce(),
        "idle-1": lambda v: None,
        "idle-2": lambda v: None,
        "consume": lambda v: slow_double(v["produce"], rng.uniform(0.01, 0.03)),
        "allocate": lambda v: allocate(),
        "final": lambda v: first_of(v["consume"], v["allocate"]),
    }
    deps = {
        "produce": (),
        "idle-1": (),
        "idle-2": (),
        "consume": ("produce",),
        "allocate": (),
        "final": ("consume", "allocate"),
    }
    return poisoned_runs(launcher, tasks, deps, runs)


def test_inputs_are_held_until_the_consumer_event(launcher, by_key, rng):
    assert reuse_scenario(launcher, by_key, rng, runs=10) == 0


def test_reuse_reads_poison_without_holding(launcher, by_key, rng, monkeypatch):
    """The test above is meaningful: dropping the held inputs gives poison."""
    record = StreamPool.record
    monkeypatch.setattr(
        StreamPool,
        "record",
        lambda self, slot, event, refs, *a: record(self, slot, event, None, *a),
    )
    assert reuse_scenario(launcher, by_key, rng, runs=10) >= 1


def chain_peak(length: int, delay: float, scheduler: str = "gpustreams") -> tuple[int, np.ndarray]:
    """Peak bytes of live sim arrays while a chain of ``length`` tasks runs, and its result."""
    pool = sim.get_default_memory_pool()
    peak = [0]

    def step(x):
        out = sim.empty(CHUNK)
        sim.launch(slow_scale, out, x, 1.0, delay)
        peak[0] = max(peak[0], pool.used_bytes())
        return out

    x = delayed(produce)()
    for _ in range(length):
        x = delayed(step)(x)
    result = delayed(download)(x).compute(scheduler=scheduler)
    return peak[0], result


def test_intermediates_are_released_as_their_consumers_launch(launcher):
    """A long chain holds a few chunks at a time, not one per task."""
    with launcher(streams=4, policy="round-robin", **{"launch-ahead": "1 MiB"}):
        peak, result = chain_peak(200, 0.0)
    np.testing.assert_array_equal(result, np.full(CHUNK, 3.0))
    assert peak <= 16 * CHUNK * 8, f"peak {peak / (CHUNK * 8):.0f} chunks of a 200-task chain"


def test_launch_ahead_bounds_memory_of_slow_kernels(launcher):
    """With kernels slower than the host, the launcher runs ahead by ``launch-ahead`` bytes."""
    peaks = {}
    for ahead in ("1 MiB", "64 MiB"):
        with launcher(streams=4, policy="round-robin", **{"launch-ahead": ahead}):
            peaks[ahead], result = chain_peak(60, 0.002)
        np.testing.assert_array_equal(result, np.full(CHUNK, 3.0))
    assert peaks["1 MiB"] <= 16 * CHUNK * 8, peaks
    assert peaks["64 MiB"] > 2 * peaks["1 MiB"], peaks


def test_a_chain_on_one_stream_holds_what_plain_sync_holds(on_the_launcher, launcher):
    """Kernels slower than the host, run ahead by 64 MiB: a chain whose steps stay on one
    stream holds what plain sync holds (its input and its output), not one chunk per step
    launched ahead (64 of 80), as the delayed workload held 16 paths of matmul and tanh at
    the H200's sizes: an input that its producer allocated on the stream of its consumer
    needs no hold, its block being reused in that stream's order. Exact (a block reused
    too early reads poison)."""
    _, _ = chain_peak(4, 0.0, scheduler="sync")  # the pool's arenas warm for both
    sync_peak, expected = chain_peak(80, 0.002, scheduler="sync")
    with launcher(streams=4, policy="auto", **{"launch-ahead": "64 MiB"}):
        peak, result = chain_peak(80, 0.002)
    np.testing.assert_array_equal(result, expected)
    np.testing.assert_array_equal(result, np.full(CHUNK, 3.0))
    assert peak <= sync_peak + CHUNK * 8, (peak / (CHUNK * 8), sync_peak / (CHUNK * 8))


def stale_address_scenario(launcher, by_key, runs: int) -> int:
    """(helper-52's review of 355f74b.) Outer task ``p`` (stream 0) allocates and frees
    a shared block T (address A noted as 'made on stream 0'), then runs a nested compute
    whose host task ``h`` (stream 1, on a host thread, its own allocator) is handed A
    again through the shared arena's give-back. ``p`` returns h's array: made_on says
    stream 0 (the stale entry of T), but its lease is stream 1's. ``c`` (stream 0) reads
    it; were it not held, once dropped it would be reused at once by ``a`` on stream 1
    while c's kernel still reads it. Returns the runs whose result read poison."""
    by_key.update({"p": 0, "c": 0, "a": 1, "final": 2, "i1": 0, "i2": 0, "h": 1})
    by_key.update({"idle-1": 2, "idle-2": 2})

    def p(v):
        t = sim.empty(CHUNK)  # a shared block on stream 0: made[A] = stream 0
        del t  # freed on stream 0 (cached for it, given back once stream 0 passes the free)
        inner_tasks = {
            "i1": lambda v: None,  # the first event on stream 0 after the free
            "i2": lambda v: time.sleep(0.02),  # its record sees i1 complete
            "h": lambda v: leaf(3.0, CHUNK, 0.0),  # host thread, stream 1: gets A back
        }
        inner_deps = {"i1": (), "i2": ("i1",), "h": ("i2",)}
        prio = {k: i for i, k in enumerate(inner_tasks)}
        inner = GraphLauncher(get_runtime(), inner_tasks, inner_deps, prio, {"h"}, host={"h"}).run()
        return inner["h"]

    def c(v):
        time.sleep(0.02)  # p's event complete by c's record: p's hold of h's array goes
        return slow_double(v["p"], 0.1)

    # Rounds of 3 (3 streams), by rank: p and the idle tasks, then c and a (a after c, so
    # that p's value, dropped once c is launched, is freed just before a allocates).
    tasks = {
        "p": p,
        "idle-1": lambda v: None,
        "idle-2": lambda v: None,
        "c": c,
        "a": lambda v: sim.empty(CHUNK),
        "final": lambda v: v["c"],
    }
    deps = {k: () for k in tasks}
    deps.update({"c": ("p",), "final": ("c", "a")})
    settings = {"shared-blocks": "256 KiB", "small-blocks": 0, "large-tasks": 0}
    return poisoned_runs(launcher, tasks, deps, runs, **settings)


def test_a_nested_computes_result_at_an_address_the_task_freed_is_held(
    on_the_launcher, launcher, by_key
):
    """A task that ran a nested compute is never taken to own its result: the address its
    allocator noted may have gone to another stream's host task meanwhile. Without that
    exception all 5 runs read poison."""
    poisoned = stale_address_scenario(launcher, by_key, runs=5)
    assert poisoned == 0, f"{poisoned} of 5 runs read poison"


def alias_scenario(launcher, by_key, rng, runs: int) -> int:
    """x allocated on stream 1, passed through by a task on stream 0 whose slow reader is on
    stream 0 too; then an allocation on stream 1 once the launcher has dropped x. Returns
    the runs that read poison: x's block came from stream 1's arena, so the reader on
    stream 0 must hold it although its producer (the pass-through) ran on its stream.

    Rounds of 3 tasks (3 streams), in rank order: the idle tasks put the reader and the
    allocation in one round, the allocation after the reader; the third waits for stream
    0, so that its record there releases what the pass-through held (x, for stream 1).
    """
    placement = {"produce": 1, "alias": 0, "consume": 0, "allocate": 1, "final": 2}
    by_key.update({**placement, "idle-1": 2, "idle-2": 2, "idle-3": 0, "idle-4": 2})
    tasks = {
        "produce": lambda v: produce(),
        "idle-1": lambda v: None,
        "idle-2": lambda v: None,
        "alias": lambda v: v["produce"],
        "idle-3": lambda v: sim.get_device().current_stream().synchronize(),
        "idle-4": lambda v: None,
        "consume": lambda v: slow_double(v["alias"], rng.uniform(0.01, 0.03)),
        "allocate": lambda v: allocate(),
        "final": lambda v: first_of(v["consume"], v["allocate"]),
    }
    deps = {k: () for k in tasks}
    deps.update({"alias": ("produce",), "consume": ("alias",), "final": ("consume", "allocate")})
    return poisoned_runs(launcher, tasks, deps, runs)


def test_an_input_passed_through_from_another_stream_is_held(launcher, by_key, rng):
    assert alias_scenario(launcher, by_key, rng, runs=10) == 0


def test_passed_through_input_reads_poison_if_taken_for_its_producers(
    launcher, by_key, rng, monkeypatch
):
    """The test above is meaningful: an input taken for memory its producer allocated on the
    consumer's stream, though another stream's arena gave it, is reused too early."""
    from dask_gpustreams.backends import sim as sim_backend

    monkeypatch.setattr(sim_backend._SimMeter, "made_on", lambda self, value, stream: True)
    assert alias_scenario(launcher, by_key, rng, runs=10) >= 1


def accumulate_in_place(x, delay, *, launched):
    """Add 1 to ``x`` on the device, in place, and return it (as a tiled gemm accumulates)."""
    launched.append(time.perf_counter())
    sim.launch(slow_add, x, x, ONE, delay)
    return x


ONE = np.ones(CHUNK)


def test_an_input_updated_in_place_is_no_new_output_for_launch_ahead(launcher):
    """Tasks that return their input, updated in place, add no memory: with a launch-ahead
    of 4 chunks, 4 chains of 12 such updates (slower on the device than on the host) are
    all launched long before the device is done, and every update is applied in order."""
    chains = 4
    keys = [("x", c, 12) for c in range(chains)]
    shares = []
    for _ in range(3):  # the best of 3: a host stalled by others' load delays the launches
        launched: list[float] = []
        step = functools.partial(accumulate_in_place, launched=launched)
        dsk = {}
        for c in range(chains):
            dsk[("x", c, 0)] = (sim.asarray, np.full(CHUNK, float(c)))
            for i in range(1, 13):
                dsk[("x", c, i)] = (step, ("x", c, i - 1), 0.01)
        with launcher(streams=4, policy="auto", **{"launch-ahead": "1 MiB"}):
            t0 = time.perf_counter()
            results = launcher_get(dsk, keys)
            wall = time.perf_counter() - t0
        for c, result in enumerate(results):
            np.testing.assert_array_equal(result.get(), np.full(CHUNK, c + 12.0))
        shares.append((launched[-1] - t0) / wall)
        if shares[-1] < 0.5:
            break
    # Counted as new outputs, the 5th update would wait for the first, and so on: the last
    # launch would come after 11 of each chain's 12 device steps (a share near 0.9, each
    # time); one stalled run on a loaded 2-core CI machine gave 0.76.
    assert min(shares) < 0.5, shares


def settled_pool():
    """The sim's default pool once the garbage of earlier tests is collected and its free
    blocks freed: a device array left alive by another test (an in-process worker's) would
    otherwise go back mid-test to the arena of a stream closed since, which no stream of
    this test takes from."""
    gc.collect()
    pool = sim.get_default_memory_pool()
    pool.free_all_blocks()
    return pool


@contextlib.contextmanager
def device_limit(chunks: int):
    """The sim device full but for ``chunks`` chunks beyond the arrays alive now."""
    pool = settled_pool()
    pool.set_capacity(pool.used_bytes() + chunks * CHUNK * 8)
    try:
        yield
    finally:
        pool.set_capacity(None)


def test_a_task_out_of_device_memory_runs_again_once_the_launched_work_is_done(launcher, caplog):
    """Running ahead of slow kernels holds more than a chain needs (``launch-ahead`` is 64
    MiB, the device has room for 12 chunks): a task that finds the device full waits for
    the work launched before it and runs again, and the chain is exact, as on plain sync."""
    with device_limit(12):
        _, expected = chain_peak(60, 0.002, scheduler="sync")
        with (
            launcher(streams=4, policy="round-robin", **{"launch-ahead": "64 MiB"}),
            caplog.at_level(logging.WARNING, logger="dask_gpustreams"),
        ):
            _, result = chain_peak(60, 0.002)
    np.testing.assert_array_equal(expected, np.full(CHUNK, 3.0))
    np.testing.assert_array_equal(result, expected)
    assert re.search(r"task .*step.* ran out of device memory; it runs again", caplog.text)


HOST_TWOS = np.full(CHUNK, 2.0)


def test_the_retry_starts_without_the_failed_attempts_memory(launcher):
    """The failed attempt's temporaries and uploads are gone when the task runs again: only
    its input is in use then, and the retry fits where the attempt did not."""
    pool = sim.get_default_memory_pool()
    in_use: list[int] = []

    def add_upload(x):
        in_use.append((pool.used_bytes() - base) // (CHUNK * 8))
        y = to_device(HOST_TWOS)  # held by the task until its event
        total = sim.empty(CHUNK)
        sim.launch(np.add, x, y, out=total)
        out = sim.empty(CHUNK)
        sim.launch(slow_scale, out, total, 1.0, 0.0)
        return out

    x = delayed(produce)()
    for _ in range(2):
        x = delayed(slow_double)(x, 0.05)
    x = delayed(add_upload)(x)
    with (
        device_limit(5),
        launcher(streams=4, policy="round-robin", **{"launch-ahead": "64 MiB"}),
    ):
        base = pool.used_bytes()
        result = delayed(download)(x).compute(scheduler="gpustreams")
    np.testing.assert_array_equal(result, np.full(CHUNK, 14.0))
    assert len(in_use) == 2 and in_use[1] == 1, in_use


def fails_later(out, x, delay):
    time.sleep(delay)
    raise ZeroDivisionError("kernel failed")


def failing_step(x):
    out = sim.empty(CHUNK)
    sim.launch(fails_later, out, x, 0.002)
    return out


def test_a_kernel_failure_before_a_retry_is_still_raised(launcher):
    """Waiting for the device before a retry leaves an earlier kernel's failure to the
    event that reports it: the compute raises it, naming the failed task."""
    x = delayed(produce)()
    for i in range(60):
        if i == 3:
            x = delayed(failing_step)(x, dask_key_name="the-failing-step")
        else:
            x = delayed(slow_double)(x, 0.002)
    with (
        device_limit(12),
        launcher(streams=4, policy="round-robin", **{"launch-ahead": "64 MiB"}),
        pytest.raises(KernelError, match="the-failing-step"),
    ):
        delayed(download)(x).compute(scheduler="gpustreams")


def test_without_the_retry_running_ahead_fails_where_plain_dask_fits(launcher, monkeypatch):
    """The control of the test above: the same chain, its out-of-memory errors not caught."""
    monkeypatch.setattr(SimBackend, "out_of_memory_errors", ())
    with (
        device_limit(12),
        launcher(streams=4, policy="round-robin", **{"launch-ahead": "64 MiB"}),
        pytest.raises(sim.OutOfMemoryError),
    ):
        chain_peak(60, 0.002)


class EachKey(Callback):
    """Dask callbacks that count each key's ``pretask`` and ``posttask``."""

    def __init__(self) -> None:
        super().__init__()
        self.pre: dict = {}
        self.post: dict = {}

    def _pretask(self, key, dsk, state):
        self.pre[key] = self.pre.get(key, 0) + 1

    def _posttask(self, key, result, dsk, state, id):
        self.post[key] = self.post.get(key, 0) + 1


def three_leaves_summed() -> tuple:
    """``(a + b) + c`` of three leaf chunks, downloaded: three chunks at most in plain sync's
    order (``a``, ``b``, their sum, then ``c``), four once a round launched all three leaves."""
    a, b, c = (delayed(leaf)(v, CHUNK, 0.002) for v in (1.0, 2.0, 4.0))
    return delayed(download)(delayed(combine)(delayed(combine)(a, b, 0.002), c, 0.002))


def test_a_graph_whose_retry_runs_out_of_memory_runs_again_one_task_at_a_time(launcher, caplog):
    """A round of 3 streams launches all three leaves; their sums' retry finds the device
    (3 chunks) full of values and runs out of memory too. The graph then runs again from its
    start one task at a time, as plain sync, and fits; the callbacks hear each key once."""
    graph = three_leaves_summed()
    with device_limit(3):
        expected = graph.compute(scheduler="sync")
        counts = EachKey()
        with (
            launcher(streams=3, policy="round-robin"),
            caplog.at_level(logging.WARNING, logger="dask_gpustreams"),
            counts,
        ):
            result = graph.compute(scheduler="gpustreams")
    np.testing.assert_array_equal(expected, np.full(CHUNK, 7.0))
    np.testing.assert_array_equal(result, expected)
    assert re.search(r"task .*combine.* ran out of device memory again", caplog.text)
    keys = set(graph.__dask_graph__())
    assert counts.pre == dict.fromkeys(keys, 1)
    assert counts.post == dict.fromkeys(keys, 1)


def test_a_graph_that_does_not_fit_one_task_at_a_time_raises_out_of_memory(launcher):
    """With room for 2 chunks, ``a + b`` does not fit in any order: the second run's retry
    raises the device's error."""
    with (
        device_limit(2),
        launcher(streams=3, policy="round-robin"),
        pytest.raises(sim.OutOfMemoryError),
    ):
        three_leaves_summed().compute(scheduler="gpustreams")


@host_task
def host_mean_later(x, delay, calls):
    calls.append(time.perf_counter())
    time.sleep(delay)
    return float(x.mean())


@host_task
def host_fails_later(x, delay, calls):
    calls.append(time.perf_counter())
    time.sleep(delay)
    raise ZeroDivisionError("host task failed")


@pytest.mark.parametrize("fails", [False, True])
def test_host_tasks_running_when_the_graph_runs_again_are_heard_once(launcher, caplog, fails):
    """A host task still running on its thread when the sum's retry runs out of memory
    ends before the graph runs again (it runs twice): the callbacks hear its key once. If
    it raised, its error is the compute's at once: the graph does not run again (a second
    run might not raise it)."""
    graph = three_leaves_summed()
    calls: list[float] = []
    host = delayed(host_fails_later if fails else host_mean_later)(
        HOST_TWOS, 0.2, calls, dask_key_name="host"
    )
    # The first round, on 4 streams, takes the host task and the three leaves.
    both = delayed(lambda mean, total: (total, mean))(host, graph, dask_key_name="both")
    counts = EachKey()
    with (
        device_limit(3),
        launcher(streams=4, policy="round-robin"),
        caplog.at_level(logging.WARNING, logger="dask_gpustreams"),
        counts,
    ):
        if fails:
            with pytest.raises(ZeroDivisionError, match="host task failed"):
                both.compute(scheduler="gpustreams")
        else:
            total, mean = both.compute(scheduler="gpustreams")
    if fails:
        assert len(calls) == 1
        assert not re.search(r"ran out of device memory again", caplog.text)
        return
    assert re.search(r"ran out of device memory again", caplog.text)
    assert len(calls) == 2 and calls[1] - calls[0] >= 0.2, calls
    np.testing.assert_array_equal(total, np.full(CHUNK, 7.0))
    assert mean == 2.0
    keys = set(both.__dask_graph__())
    assert counts.pre == dict.fromkeys(keys, 1)
    assert counts.post == dict.fromkeys(keys, 1)


def fill_chunks(out, value):
    out.fill(value)


def sum_into(out, *xs):
    time.sleep(0.001)
    out.fill(0.0)
    for x in xs:
        out[: x.size] += x[: out.size]


def chunks_of(value, chunks):
    out = sim.empty(chunks * CHUNK)
    sim.launch(fill_chunks, out, value)
    return out


def summed(chunks, *xs):
    out = sim.empty(chunks * CHUNK)
    sim.launch(sum_into, out, *xs)
    return out


def outputs_of_shared_leaves():
    """Five outputs (a fuzzed graph, chunks a value): ``n6`` and ``n7`` read both 1-chunk
    leaves ``n0`` and ``n1``; ``dask.order`` ranks ``n7`` (``n0``'s last reader) after the
    2-chunk ``n2`` and ``n5``, but Dask's synchronous scheduler runs it as soon as ``n6``
    has run (the last it made ready), and lets ``n0`` go."""
    n0, n1 = (delayed(chunks_of)(v, 1, dask_key_name=f"n{v:.0f}") for v in (0.0, 1.0))
    n2, n3, n4 = (delayed(chunks_of)(v, 2, dask_key_name=f"n{v:.0f}") for v in (2.0, 3.0, 4.0))
    n5 = delayed(summed)(2, n2, n4, dask_key_name="n5")
    n6 = delayed(summed)(1, n0, n1, dask_key_name="n6")
    n7 = delayed(summed)(1, n0, n1, dask_key_name="n7")
    n8 = delayed(chunks_of)(8.0, 1, dask_key_name="n8")
    n9 = delayed(summed)(2, n1, n4, n6, dask_key_name="n9")
    n10 = delayed(summed)(1, n9, dask_key_name="n10")
    return delayed(download_all)(n3, n5, n7, n8, n10, dask_key_name="out")


def download_all(*xs):
    return [x.get() for x in xs]


def test_the_run_one_task_at_a_time_takes_dask_synchronous_order(launcher):
    """The second run takes ready tasks as Dask's synchronous scheduler does (the last made
    ready first), not by rank alone: it fits where plain sync fits."""
    graph = outputs_of_shared_leaves()
    expected = graph.compute(scheduler="sync")
    with device_limit(8):
        again = graph.compute(scheduler="sync")
        assert all(np.array_equal(g, w) for g, w in zip(again, expected, strict=True))
        with launcher(streams=8, policy="auto"):
            got = graph.compute(scheduler="gpustreams")
    assert [float(x[0]) for x in expected] == [3.0, 6.0, 1.0, 8.0, 6.0]
    assert all(np.array_equal(g, w) for g, w in zip(got, expected, strict=True))


# --- small blocks apart ---------------------------------------------------------------------

SMALL_BLOCKS = "64 KiB"  # below CHUNK's 256 KiB, above the row sums' 1 KiB


def row_sums(rng):
    """``(sin(x)**2 + x*0.5).sum(axis=1)`` over 64 sim chunks of 256 KiB: three temporaries of
    a chunk's size per task and a small result, as the workloads' elementwise; and NumPy's."""
    host = rng.random((2048, 2048), dtype=np.float32)
    x = da.from_array(host, chunks=256).map_blocks(sim.asarray).persist(scheduler="sync")
    return (da.sin(x) ** 2 + x * 0.5).sum(axis=1), (np.sin(host) ** 2 + host * 0.5).sum(axis=1)


def pinned_after_persist(launcher, rng, small_blocks) -> tuple[int, np.ndarray, np.ndarray]:
    """Bytes the pool cannot free while the small results of 8 streams live, and the values;
    the second of two computes, as every stream's arena holds free chunks then."""
    pool = sim.get_default_memory_pool()
    y, expected = row_sums(rng)
    with launcher(streams=8, policy="round-robin", **{"small-blocks": small_blocks}):
        y.compute(scheduler="gpustreams")
        (kept,) = dask.persist(y, scheduler="gpustreams")
        sim.get_device().synchronize()
    pool.free_all_blocks()
    pinned = pool.total_bytes() - pool.used_bytes()
    return pinned, kept.map_blocks(download, meta=META).compute(scheduler="sync"), expected


def test_small_results_leave_no_large_block_pinned(on_the_launcher, launcher, rng, monkeypatch):
    """With small requests apart, 8 streams' small results pin no chunk-sized block: a
    result carved out of a free one would keep that whole block."""
    monkeypatch.setattr(sim.get_device(), "kernel_delay", (0.0, 0.001))
    pinned, got, expected = pinned_after_persist(launcher, rng, SMALL_BLOCKS)
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    assert pinned < 64 << 10, f"{pinned / 2**10:.0f} KiB pinned"


def test_without_small_blocks_apart_each_stream_pins_a_block(on_the_launcher, launcher, rng):
    """The control of the test above: ``small-blocks: 0``, as before, pins chunk-sized
    blocks (all but their small part: a block minus 1 KiB each)."""
    pinned, got, expected = pinned_after_persist(launcher, rng, 0)
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    assert pinned >= 255 << 10, f"{pinned / 2**10:.0f} KiB pinned"


def test_eight_streams_fit_a_device_nearly_as_full_as_plain_sync_needs(
    on_the_launcher, launcher, rng
):
    """Capped 4.4 chunks above its inputs, the sim device runs the row sums on 8 streams as
    plain sync does (without small blocks apart, 13 runs of 15 ran out of memory there:
    benchmarks/results/cpu-misc/sim-pressure-a4213bb.txt)."""
    pool = sim.get_default_memory_pool()
    y, expected = row_sums(rng)
    for _ in range(3):
        pool.free_all_blocks()
        pool.set_capacity(pool.used_bytes() + int(4.4 * (256 << 10)))
        try:
            with launcher(streams=8, policy="round-robin", **{"small-blocks": SMALL_BLOCKS}):
                got = y.map_blocks(download, meta=META).compute(scheduler="gpustreams")
        finally:
            pool.set_capacity(None)
        np.testing.assert_allclose(got, expected, rtol=1e-5)


def test_small_blocks_leave_another_allocator_alone(on_the_launcher, launcher, rng):
    """An allocator that is not the pool's (standing for RMM's) serves every request on the
    stream current then, and the thread's allocator is the pool's again after the compute."""
    pool = sim.get_default_memory_pool()
    sizes: list[int] = []
    streams: set[int] = set()

    def counting(nbytes, stream):
        sizes.append(nbytes)
        streams.add(stream)
        return pool.malloc(nbytes, stream)

    y, expected = row_sums(rng)
    with launcher(streams=8, **{"small-blocks": SMALL_BLOCKS}):
        with sim.using_allocator(counting):
            got = y.map_blocks(download, meta=META).compute(scheduler="gpustreams")
        pool_streams = {slot.stream.id for slot in get_runtime().pool.slots}
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    assert min(sizes) < 64 << 10 and max(sizes) >= 256 << 10, sizes
    assert streams <= pool_streams | {sim.get_device().default_stream.id}, streams
    assert sim.get_allocator() == pool.malloc


def test_closing_the_runtime_frees_its_small_blocks_arenas(on_the_launcher, launcher, rng):
    """The arenas that held the pool streams' small blocks go with those streams: once the
    runtime is closed, the pool holds no free block (no free_all_blocks needed)."""
    pool = sim.get_default_memory_pool()
    y, expected = row_sums(rng)
    with launcher(streams=8, **{"small-blocks": SMALL_BLOCKS}):
        runtime = get_runtime()
        got = y.map_blocks(download, meta=META).compute(scheduler="gpustreams")
        runtime.close(timeout=30)
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    assert pool.total_bytes() == pool.used_bytes()


# --- large tasks -----------------------------------------------------------------------------


def scaled_on(streams_seen, x):
    """``x * 2``, noting the stream it is launched on."""
    streams_seen.append(sim.get_device().current_stream().id)
    out = sim.empty(x.shape)
    sim.launch(slow_scale, out, x, 2.0, 0.002)
    return out


@pytest.mark.parametrize("large_tasks", ["128 KiB", 0])
def test_large_tasks_run_on_two_streams(on_the_launcher, launcher, large_tasks):
    """16 independent tasks that allocate 256 KiB each, on 8 busy streams: once the first
    has (``large-tasks`` 128 KiB), the others all go to 2 streams; with it off they
    spread. Exact."""
    seen: list[int] = []
    inputs = [delayed(leaf)(float(i), CHUNK, 0.004) for i in range(16)]
    outs = [delayed(download)(delayed(scaled_on)(seen, x)) for x in inputs]
    config = {"large-tasks": large_tasks, "small-blocks": SMALL_BLOCKS}
    with launcher(streams=8, policy="auto", **config):
        got = dask.compute(*outs, scheduler="gpustreams")
    assert [g.tolist() for g in got] == [[2.0 * i] * CHUNK for i in range(16)]
    if large_tasks:
        assert len(set(seen[1:])) <= 2, seen
    else:
        assert len(set(seen)) > 2, seen


def test_large_tasks_are_learned_under_a_peak_tracker_on_the_pools_malloc(
    on_the_launcher, launcher
):
    """``bench_workloads`` tracks the simulated pool's peak by wrapping its ``malloc`` as
    the pool's own attribute (``functools.wraps``): the launcher's allocator still stands
    in, so its large tasks keep to 2 streams as on the GPU. Exact."""
    pool = sim.get_default_memory_pool()
    malloc = pool.malloc
    tracked: list[int] = []

    def tracker(nbytes, stream):
        tracked.append(nbytes)
        return malloc(nbytes, stream)

    seen: list[int] = []
    inputs = [delayed(leaf)(float(i), CHUNK, 0.004) for i in range(16)]
    outs = [delayed(download)(delayed(scaled_on)(seen, x)) for x in inputs]
    try:
        pool.malloc = functools.wraps(malloc)(tracker)
        config = {"large-tasks": "128 KiB", "small-blocks": SMALL_BLOCKS}
        with launcher(streams=8, policy="auto", **config):
            got = dask.compute(*outs, scheduler="gpustreams")
    finally:
        del pool.malloc
    assert [g.tolist() for g in got] == [[2.0 * i] * CHUNK for i in range(16)]
    assert len(set(seen[1:])) <= 2, seen
    assert max(tracked) >= 256 << 10  # the tracker saw the large blocks


@host_task
def scaled_on_host(streams_seen, x):
    """:func:`scaled_on`, downloaded: a host task."""
    return sim.asnumpy(scaled_on(streams_seen, x))


def test_host_tasks_of_a_large_group_run_on_its_two_streams(on_the_launcher, launcher):
    """A group learned large on the launcher keeps to the large tasks' 2 streams when its
    tasks run on host threads (4 at once), as a large group learned to block the host
    does on the H200 (qr): on every stream each would leave its blocks cached. Exact."""
    config = {"large-tasks": "128 KiB", "small-blocks": SMALL_BLOCKS, "host-threads": 4}
    with launcher(streams=8, policy="auto", **config):
        for task in (scaled_on, scaled_on_host):
            seen: list[int] = []
            inputs = [delayed(leaf)(float(i), CHUNK, 0.004) for i in range(16)]
            outs = [delayed(task)(seen, x, dask_key_name=f"big-{i}") for i, x in enumerate(inputs)]
            got = dask.compute(*[delayed(sim.asnumpy)(o) for o in outs], scheduler="gpustreams")
            assert [g.tolist() for g in got] == [[2.0 * i] * CHUNK for i in range(16)]
            assert "big" in get_runtime().large_tasks
    assert len(set(seen)) <= 2, seen


def test_a_group_stays_large_across_computes_until_a_task_allocates_less(on_the_launcher, launcher):
    """Learned in one compute, a large group's first task of the next compute goes to the
    2 streams too; a task of it that allocates no large block makes it small again."""
    config = {"large-tasks": "128 KiB", "small-blocks": SMALL_BLOCKS}
    streams_used = []
    with launcher(streams=8, policy="auto", **config):
        for n in (CHUNK, CHUNK, 1024):
            seen: list[int] = []
            inputs = [delayed(leaf)(float(i), n, 0.004) for i in range(16)]
            outs = [delayed(download)(delayed(scaled_on)(seen, x)) for x in inputs]
            got = dask.compute(*outs, scheduler="gpustreams")
            assert [g.tolist() for g in got] == [[2.0 * i] * n for i in range(16)]
            streams_used.append(len(set(seen)))
            large = get_runtime().large_tasks
            assert ("scaled_on" in large) is (n == CHUNK)
            assert sorted(large.groups()) == (["leaf", "scaled_on"] if n == CHUNK else [])
    assert streams_used[1] <= 2 < streams_used[2], streams_used


def allocator_seen():
    """Whether this thread's allocator is the pool's own ``malloc`` (no launcher's)."""
    return sim.get_allocator() == sim.get_default_memory_pool().malloc


@host_task
def allocator_seen_on_a_host_thread():
    return allocator_seen()


@pytest.mark.parametrize(
    ("small_blocks", "large_tasks", "shared_blocks"),
    [("64 KiB", 0, 0), (0, "128 KiB", 0), (0, 0, "128 KiB"), (0, 0, 0)],
)
def test_the_launchers_allocator_is_off_only_with_its_keys_0(
    launcher, small_blocks, large_tasks, shared_blocks
):
    """Tasks on the launching thread allocate through the launcher's allocator while any
    of its keys is set, host tasks while ``small-blocks`` or ``shared-blocks`` is (they
    are not metered); with all 0 none is installed (so a task may call
    ``cupy.cuda.set_allocator``, which CuPy refuses inside another)."""
    config = {
        "small-blocks": small_blocks,
        "large-tasks": large_tasks,
        "shared-blocks": shared_blocks,
    }
    with launcher(streams=4, **config):
        own_on_launcher, own_on_host = dask.compute(
            delayed(allocator_seen)(),
            delayed(allocator_seen_on_a_host_thread)(),
            scheduler="gpustreams",
        )
    assert own_on_launcher is not bool(small_blocks or large_tasks or shared_blocks)
    assert own_on_host is not bool(small_blocks or shared_blocks)
    assert allocator_seen()


def allocate_on(nbytes, x):
    """A result of ``nbytes`` (float64), after ``x``."""
    out = sim.empty(nbytes // 8)
    sim.launch(np.copyto, out, x[0])
    return out


def test_a_small_group_after_a_large_task_stays_small(on_the_launcher, launcher):
    """The meter starts again at each task: a group whose blocks are metered but below
    ``large-tasks``, launched after a large task, is not learned as large."""
    config = {"large-tasks": "128 KiB", "small-blocks": SMALL_BLOCKS}
    x = delayed(leaf)(1.0, 4, 0.0)
    big = delayed(allocate_on)(256 << 10, x, dask_key_name="big-0")
    mid = delayed(allocate_on)(96 << 10, big, dask_key_name="mid-0")
    with launcher(streams=4, policy="auto", **config):
        got = delayed(download)(mid).compute(scheduler="gpustreams")
        large = get_runtime().large_tasks
        assert ("big" in large, "mid" in large) == (True, False)
    np.testing.assert_array_equal(got, np.ones(12 << 10))


def cached_after_row_sums(launcher, rng, large_tasks) -> int:
    """Free bytes the pool keeps cached after the row sums on 8 busy streams, and check them."""
    pool = sim.get_default_memory_pool()
    y, expected = row_sums(rng)
    pool.free_all_blocks()
    config = {"large-tasks": large_tasks, "small-blocks": SMALL_BLOCKS}
    with launcher(streams=8, policy="auto", **config):
        got = y.map_blocks(download, meta=META).compute(scheduler="gpustreams")
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    return pool.total_bytes() - pool.used_bytes()


def two_step_paths_peak(launcher, rng, large_tasks) -> float:
    """Peak chunks alive beyond the inputs while 32 independent paths of two chunk-sized
    steps (slow kernels) and a small last step run on 8 streams; results checked."""
    pool = sim.get_default_memory_pool()
    peak = [0]

    def step(x, delay):
        out = sim.empty(x.shape)
        sim.launch(slow_scale, out, x, 2.0, delay)
        peak[0] = max(peak[0], pool.used_bytes())
        return out

    inputs = [sim.asarray(np.full(CHUNK, float(i))) for i in range(32)]
    base = pool.used_bytes()
    paths = [
        delayed(filled_after)(
            delayed(step)(delayed(step)(x, rng.uniform(0.0005, 0.002)), rng.uniform(0.0005, 0.002))
        )
        for x in inputs
    ]
    config = {"large-tasks": large_tasks, "small-blocks": SMALL_BLOCKS}
    with launcher(streams=8, policy="auto", **config):
        got = dask.compute(*[delayed(download)(p) for p in paths], scheduler="gpustreams")
    for i, g in enumerate(got):
        np.testing.assert_array_equal(g, np.full(1, 4.0 * i))
    return (peak[0] - base) / (CHUNK * 8)


def filled_after(x):
    """A one-element array of ``x``'s first value (a small step that reads ``x``)."""
    out = sim.empty(1)
    sim.launch(lambda o, a: np.copyto(o, a[:1]), out, x)
    return out


def test_a_round_launches_as_many_large_tasks_as_their_streams(on_the_launcher, launcher, rng):
    """With the paths' steps large (``large-tasks`` 128 KiB), ``auto`` runs them on 2
    streams and each round launches 2 of them: the chunks alive are those of a few paths,
    less than half of what 8 paths side by side hold (large tasks off). Exact."""
    large = two_step_paths_peak(launcher, rng, "128 KiB")
    spread = two_step_paths_peak(launcher, rng, 0)
    assert large <= spread / 2, (large, spread)


def test_large_tasks_keep_two_streams_of_free_blocks(on_the_launcher, launcher, rng, monkeypatch):
    """The row sums' tasks (chunk-sized temporaries of 256 KiB) are large at ``large-tasks``
    128 KiB: the pool caches 2 streams' temporaries (and the first task's), not up to 8."""
    monkeypatch.setattr(sim.get_device(), "kernel_delay", (0.0005, 0.001))
    large = cached_after_row_sums(launcher, rng, "128 KiB")
    spread = cached_after_row_sums(launcher, rng, 0)
    chunk = 256 << 10
    assert large <= 2 * 4 * chunk < spread, (large / chunk, spread / chunk)


# --- host tasks ------------------------------------------------------------------------------


def busy_leaf(i, delay):
    return leaf(float(i), 16, delay)


def host_blocker(seconds):
    time.sleep(seconds)
    return seconds


def blocking_graph(blocker, n: int, host_s: float, kernel_s: float):
    """A host task first in priority, and ``n`` independent device tasks of ``kernel_s``."""
    tasks = {"blocker": lambda v: blocker(host_s)}
    tasks.update({("leaf", i): (lambda v, i=i: busy_leaf(i, kernel_s)) for i in range(n)})
    deps = {k: () for k in tasks}
    priority = {k: i for i, k in enumerate(tasks)}
    return tasks, deps, priority


def test_marked_host_task_does_not_delay_independent_launches(launcher):
    host_s = kernel_s = 0.2
    # 9 streams: the host task takes a round-robin slot too, when its thread gets to it, so
    # with 8 two leaves would share a stream unless the host thread happened to select first.
    with launcher(streams=9, policy="round-robin"):
        runtime = get_runtime()
        tasks, deps, priority = blocking_graph(host_blocker, 8, host_s, kernel_s)
        t0 = time.perf_counter()
        out = GraphLauncher(runtime, tasks, deps, priority, set(tasks), host={"blocker"}).run()
        wall = time.perf_counter() - t0
    assert out["blocker"] == host_s
    assert [out[("leaf", i)].get()[0] for i in range(8)] == [float(i) for i in range(8)]
    # Serial would take host_s + kernel_s; overlapped, about the longer of the two.
    assert wall < 0.75 * (host_s + kernel_s), f"{wall:.3f} s"


@pytest.mark.parametrize("threads", [2, 3])
def test_at_most_host_threads_host_tasks_run_at_once(launcher, threads):
    """``gpustreams.host-threads`` host tasks run together (they meet at a barrier of that
    many), and no more (each holds its task's device memory meanwhile): a further thread
    would take the next task while they wait for each other."""
    meet = threading.Barrier(threads, timeout=TIMEOUT)
    running, most, lock = [0], [0], threading.Lock()

    @host_task
    def together(i):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        meet.wait()
        with lock:
            running[0] -= 1
        return i

    with launcher(streams=2, **{"host-threads": threads}):
        parts = [delayed(together)(i) for i in range(4 * threads)]
        got = dask.compute(*parts, scheduler="gpustreams")
    assert got == tuple(range(4 * threads)) and most[0] == threads


def test_host_tasks_waiting_for_a_thread_are_bounded_by_launch_ahead(launcher):
    """Chunks made on the device for a host task each, slower than their producers: once
    the host tasks waiting for the one thread hold over ``launch-ahead`` of inputs, the
    launcher waits for one to end, so a few chunks are alive at once, not one per chunk
    launched. Exact."""
    n, chunks, lock = 1 << 17, 32, threading.Lock()  # 1 MiB chunks
    alive, most = [0], [0]

    def make(i):
        with lock:
            alive[0] += 1
            most[0] = max(most[0], alive[0])
        return leaf(float(i), n, 0.0)

    @host_task
    def consume(x):
        total = float(x.get().sum())
        time.sleep(0.005)  # the host work the task stands for (a write to disk)
        with lock:
            alive[0] -= 1
        return total

    with launcher(streams=2, **{"launch-ahead": "2 MiB", "host-threads": 1}):
        parts = [delayed(consume)(delayed(make)(i)) for i in range(chunks)]
        got = dask.compute(*parts, scheduler="gpustreams")
    assert got == tuple(float(i * n) for i in range(chunks))
    assert most[0] <= 8, f"{most[0]} chunks of {chunks} alive at once"


def test_host_tasks_waiting_for_a_thread_are_bounded_to_a_round(launcher):
    """A tree of host tasks on host values (no device bytes for launch-ahead to count): a
    round's width of them waits for the one thread at most, so the sums, ready later and
    more urgent, run before the leaves still to come, and a few leaves' values are alive at
    once, not every leaf's (the thread takes its queue in the order it came). Exact."""
    leaves, lock = 64, threading.Lock()
    alive, most = [0], [0]

    @host_task
    def make(i):
        time.sleep(0.001)  # the host work the task stands for (a read from disk)
        with lock:
            alive[0] += 1
            most[0] = max(most[0], alive[0])
        return np.full(4, float(i))

    @host_task
    def add(a, b):
        time.sleep(0.001)
        with lock:
            alive[0] -= 1
        return a + b

    with launcher(streams=2, **{"host-threads": 1}):
        level = [delayed(make)(i) for i in range(leaves)]
        while len(level) > 1:
            level = [delayed(add)(a, b) for a, b in zip(level[::2], level[1::2], strict=True)]
        (got,) = dask.compute(level[0], scheduler="gpustreams")
    np.testing.assert_array_equal(got, np.full(4, float(sum(range(leaves)))))
    assert most[0] <= 12, f"{most[0]} leaves of {leaves} alive at once"


def test_host_task_is_learned_after_two_slow_calls_in_a_row(launcher, caplog):
    """An unmarked blocking function runs twice on the launching thread, then on host threads."""
    host_s = kernel_s = 0.2
    groups = {"blocker": "sleeper"}
    caplog.set_level("INFO", logger="dask_gpustreams.runtime.hosttasks")
    with launcher(streams=9, policy="round-robin"):  # a slot for each task, as above
        runtime = get_runtime()
        walls = []
        for _ in range(3):
            tasks, deps, priority = blocking_graph(host_blocker, 8, host_s, kernel_s)
            t0 = time.perf_counter()
            GraphLauncher(
                runtime, tasks, deps, priority, set(tasks), group_of=lambda k: groups.get(k, k)
            ).run()
            walls.append(time.perf_counter() - t0)
        assert "sleeper" in runtime.host_tasks
    assert walls[2] < 0.75 * walls[1], walls
    # Said once, for the sleeper. A leaf's call too may take over the threshold on a loaded
    # host (7.1 ms on a 2-core machine running another suite): its group is then learned
    # too, but only for a call that the message says took longer than the threshold.
    marked = [r.getMessage() for r in caplog.records if "block the host" in r.getMessage()]
    sleeper = [m for m in marked if m.startswith("gpustreams: tasks of group 'sleeper'")]
    assert len(sleeper) == 1, marked
    took = [float(re.search(r"the last took ([\d.]+) ms", m)[1]) for m in marked]
    assert all(ms > runtime.host_tasks.threshold_s * 1e3 for ms in took), marked


def test_a_group_slow_once_between_fast_calls_stays_on_the_launcher(launcher):
    """Slow, fast, slow: no two slow calls in a row, so the group is never moved. The
    launcher reports the fast call (the group is suspected), which clears the suspicion."""
    calls = iter([0.02, 0.0, 0.02])

    def sometimes_slow(_):
        seconds = next(calls)
        time.sleep(seconds)
        return seconds

    with launcher(streams=2):
        runtime = get_runtime()
        for _ in range(3):
            tasks = {"step": sometimes_slow}
            GraphLauncher(
                runtime, tasks, {"step": ()}, {"step": 0}, {"step"}, group_of=lambda k: "g"
            ).run()
        assert ("g" in runtime.host_tasks, runtime.host_tasks.suspecting()) == (False, True)


class RaisingPosttask(Callback):
    def _posttask(self, key, result, dsk, state, worker):
        raise RuntimeError(f"posttask of {key} failed")


def test_an_error_while_host_tasks_finish_together_does_not_hang(launcher):
    """Four host tasks end at once (a barrier), so their outcomes share one wake-up; the
    first one's callback raises and the launcher waits for the others: it must see them."""

    def one_compute(errors: list) -> None:
        barrier = threading.Barrier(4)

        @dask_gpustreams.host_task
        def meet(i):
            barrier.wait()
            return i

        dsk = {f"meet-{i}": (meet, i) for i in range(4)}
        with pytest.raises(RuntimeError, match="posttask of meet-") as e:
            launcher_get(dsk, list(dsk), callbacks=[RaisingPosttask()])
        errors.append(e.value)

    with launcher(streams=4, **{"host-threads": 4}):
        for _ in range(20):
            errors: list = []
            thread = threading.Thread(target=one_compute, args=(errors,), daemon=True)
            thread.start()
            thread.join(30)
            assert (thread.is_alive(), len(errors)) == (False, 1)


def test_a_failed_compute_waiting_for_a_running_host_task_says_so(launcher, monkeypatch):
    """A failed compute waits for its host tasks still running; one that waits for the
    caller would hang it, so the wait logs a warning that says what it waits for. Here the
    host task returns only once that warning is logged."""
    started = threading.Event()
    monkeypatch.setattr(GraphLauncher, "warn_after", 0.01)

    def broken():
        started.wait(timeout=TIMEOUT)
        raise LookupError("host side")

    with StillRunningWarning() as warning:

        @host_task
        def waits_for_the_warning():
            started.set()
            return warning.seen.wait(timeout=TIMEOUT)

        with launcher(streams=2):
            dsk = {"waits": (waits_for_the_warning,), "broken": (broken,)}
            with pytest.raises(LookupError, match="host side"):
                launcher_get(dsk, list(dsk))
    assert warning.seen.is_set()
    assert "the 1 host task(s) still running on the launcher's host threads" in warning.message


def test_download_in_graph_is_a_host_task(launcher):
    A = np.arange(4 * 64.0)
    with launcher(streams=4):
        x = da.from_array(A, chunks=64).map_blocks(sim.asarray, meta=META)
        y = x.map_blocks(lambda b: combine(b, b, 0.01), meta=META).map_blocks(
            sim.asnumpy, meta=np.array(())
        )
        np.testing.assert_array_equal(y.compute(scheduler="gpustreams"), 2 * A)


def test_host_tasks_release_what_they_held_once_done(launcher, by_key):
    """A host task's held uploads go once its event is seen complete, not when its stream
    next records: a chain of 8 host tasks, each on a stream of its own, has at most two
    uploads alive at once (its own and its producer's, whose event may not have completed
    when that finished), not one per stream the chain has run on."""
    pool = sim.get_default_memory_pool()
    used: list[int] = []

    @host_task
    def upload_and_download(previous, i):
        """A pipeline's host task: upload a chunk (held until the task's event completes),
        scale it on the task's stream, download it; notes the pool's used bytes then."""
        x = to_device(np.full(CHUNK, float(i)))
        used.append(pool.used_bytes())
        return sim.asnumpy(x * 2.0) + previous

    step = np.zeros(CHUNK)
    for i in range(8):
        by_key[f"step-{i}"] = i
        step = delayed(upload_and_download)(step, i, dask_key_name=f"step-{i}")
    base = pool.used_bytes()
    with launcher(streams=8, policy="test-placement"):
        got = step.compute(scheduler="gpustreams")
    np.testing.assert_array_equal(got, np.full(CHUNK, 2.0 * sum(range(8))))
    assert len(used) == 8
    assert max(used) - base <= 2 * CHUNK * 8, [(u - base) / (CHUNK * 8) for u in used]


# --- Dask semantics --------------------------------------------------------------------------


def test_persist_gives_complete_chunks(launcher, rng):
    A = np.arange(256.0)
    with launcher(streams=4):
        x = da.from_array(A, chunks=64).map_blocks(
            lambda b: combine(sim.asarray(b), sim.asarray(b), 0.02), meta=META
        )
        persisted = x.persist(scheduler="gpustreams")
        chunks = [persisted.__dask_graph__()[k] for k in persisted.__dask_keys__()]
        views = np.concatenate([c._view.copy() for c in chunks])
    np.testing.assert_array_equal(views, 2 * A)


def nested(value):
    inner = delayed(leaf)(value, 4, 0.01)
    return delayed(download)(inner).compute(scheduler="gpustreams") + 1


def test_nested_compute_inside_a_task(launcher):
    with launcher(streams=2):
        got = dask.compute(*[delayed(nested)(float(i)) for i in range(3)], scheduler="gpustreams")
    assert [g.tolist() for g in got] == [[i + 1.0] * 4 for i in range(3)]


def add_a_nested_result(x):
    """``x`` plus a value computed by a nested compute (key ``inner``), read by a slow
    kernel on this task's stream after the task has returned."""
    (y,) = dask.compute(
        delayed(leaf)(1.0, x.size, 0.0, dask_key_name="inner"), scheduler="gpustreams"
    )
    out = sim.empty(x.shape)
    sim.launch(slow_add, out, x, y, 0.05)
    return out


def test_a_nested_computes_result_is_held_until_the_task_reading_it_is_done(
    on_the_launcher, launcher, by_key
):
    """The nested result comes from stream 1 and its last reference goes when the outer
    task (stream 0) returns, before its kernel reads it; a task launched next on stream 1
    allocates a block of its size. Held as the task's inputs are, the nested result is
    not handed out meanwhile (its poison would be read). Exact, 3 times."""
    by_key.update({"outer": 0, "inner": 1, "fast": 1})
    x = sim.asarray(np.full(CHUNK, 2.0))  # data: the outer and the fast task launch together
    with launcher(streams=2, policy="test-placement", **{"shared-blocks": 0}):
        for _ in range(3):
            outer = delayed(add_a_nested_result)(x, dask_key_name="outer")
            fast = delayed(leaf)(7.0, CHUNK, 0.0, dask_key_name="fast")
            got_outer, got_fast = dask.compute(
                delayed(download)(outer, dask_key_name="get-outer"),
                delayed(download)(fast, dask_key_name="get-fast"),
                scheduler="gpustreams",
            )
            np.testing.assert_array_equal(got_outer, np.full(CHUNK, 3.0))
            np.testing.assert_array_equal(got_fast, np.full(CHUNK, 7.0))


class Seen(Callback):
    def __init__(self):
        super().__init__()
        self.started, self.pre, self.post, self.finished = [], [], [], []

    def _start(self, dsk):
        self.started.append(len(dsk))

    def _pretask(self, key, dsk, state):
        self.pre.append(key)

    def _posttask(self, key, result, dsk, state, worker_id):
        self.post.append(key)

    def _finish(self, dsk, state, errored):
        self.finished.append(errored)


def test_callbacks_see_every_task_once(launcher, rng):
    with launcher(streams=4):
        tr, expected = tree_workload(rng)
        graph = dict(tr.__dask_graph__())
        with Seen() as seen:
            np.testing.assert_array_equal(tr.compute(scheduler="gpustreams"), expected)
    assert seen.started and seen.finished == [False]
    assert sorted(map(str, seen.pre)) == sorted(map(str, graph))
    assert sorted(map(str, seen.post)) == sorted(map(str, graph))


def test_nested_compute_does_not_reach_callbacks(launcher):
    with launcher(streams=2), Seen() as seen:
        delayed(nested)(1.0, dask_key_name="outer").compute(scheduler="gpustreams")
    assert seen.pre == ["outer"] and len(seen.started) == 1


def test_progress_bar_reaches_100_percent(launcher, rng):
    out = io.StringIO()
    with launcher(streams=4), ProgressBar(out=out, minimum=0):
        tr, expected = tree_workload(rng)
        np.testing.assert_array_equal(tr.compute(scheduler="gpustreams"), expected)
    assert "100% Completed" in out.getvalue()


def explode(x):
    raise LookupError("task 7 failed on the host")


def test_exception_in_a_wide_graph_is_raised_and_the_rest_drains(launcher):
    with launcher(streams=4), Seen() as seen:
        leaves = [delayed(leaf)(float(i), 16, 0.01) for i in range(16)]
        leaves[7] = delayed(explode)(leaves[7])
        total = delayed(lambda *xs: sum(x.get().sum() for x in xs))(*leaves)
        with pytest.raises(LookupError, match="task 7 failed on the host"):
            total.compute(scheduler="gpustreams")
        assert seen.finished == [True]
        assert get_runtime().collect() == 0  # nothing left in flight
        # The runtime keeps working.
        np.testing.assert_array_equal(
            delayed(download)(delayed(leaf)(5.0, 4, 0.0)).compute(scheduler="gpustreams"), [5] * 4
        )


@pytest.mark.parametrize("where", ["launching thread", "host thread", "rerun"])
def test_a_failed_computes_values_are_freed_once_its_error_is_handled(launcher, where):
    """No reference cycle keeps the graph's device values after the exception is handled:
    with the garbage collector off, the pool's used bytes are back where they were; the
    failed task run by the launching thread, or by a host thread (``host_task``; before,
    the error held its own host thread's frame, and with it the task's inputs and the
    launcher's results: 8 chunks stayed until a collection), then again on the calling
    thread (``rerun_exceptions_locally``)."""
    pool = sim.get_default_memory_pool()
    leaves = [delayed(leaf)(float(i), CHUNK, 0.0) for i in range(8)]
    fails = explode if where == "launching thread" else dask_gpustreams.host_task(explode)
    leaves[7] = delayed(fails)(leaves[7])
    total = delayed(lambda *xs: sum(x.get().sum() for x in xs))(*leaves)
    with launcher(streams=4):
        get_runtime().collect()
        base = pool.used_bytes()
        gc.disable()
        try:
            rerun = dask.config.set(rerun_exceptions_locally=where == "rerun")
            with rerun, pytest.raises(LookupError, match="task 7 failed on the host"):
                total.compute(scheduler="gpustreams")
            get_runtime().collect()
            left = pool.used_bytes() - base
        finally:
            gc.enable()
    assert left == 0, f"{left / (CHUNK * 8):.1f} chunks still used"


#: Dask's ``rerun_exceptions_locally`` asked for through its config, or as the compute's
#: argument: ``(config, compute keyword arguments)``.
RERUN_ASKED = {
    "config": ({"rerun_exceptions_locally": True}, {}),
    "argument": ({}, {"rerun_exceptions_locally": True}),
}


@pytest.mark.parametrize("route", ["gpustreams", "enabled"])
@pytest.mark.parametrize("asked", list(RERUN_ASKED))
def test_a_host_task_that_failed_on_a_host_thread_runs_again_on_the_calling_thread(
    launcher, gpustreams, route, asked
):
    """With Dask's ``rerun_exceptions_locally``, a host task that raised on a host thread runs
    again on the calling thread, on the same input read once its kernel is complete, and
    that run's exception is raised, as on Dask's threads (``pdb.pm()`` stops there): by name
    and through ``gpustreams.enabled``."""
    runs = []

    @host_task
    def reads_and_raises(x):
        runs.append((threading.get_ident(), x._view.copy().tolist()))  # off the streams
        raise LookupError(len(runs), threading.get_ident())

    caller = threading.get_ident()
    task = delayed(reads_and_raises)(delayed(leaf)(2.0, 4, 0.02))
    config, kwargs = RERUN_ASKED[asked]
    settings = launcher(streams=2) if route == "gpustreams" else gpustreams(streams=2)
    scheduler = "gpustreams" if route == "gpustreams" else None
    with settings, dask.config.set(config):
        with pytest.raises(LookupError) as e:
            task.compute(scheduler=scheduler, **kwargs)
        assert get_runtime().collect() == 0
    assert [thread == caller for thread, _ in runs] == [False, True]
    assert [read for _, read in runs] == [[2.0] * 4] * 2
    assert e.value.args == (2, caller)


@pytest.mark.parametrize(
    "config, kwargs",
    [({}, {}), ({"rerun_exceptions_locally": True}, {"rerun_exceptions_locally": False})],
    ids=["default", "off-by-argument"],
)
def test_without_rerun_exceptions_locally_a_host_tasks_error_comes_from_its_thread(
    launcher, config, kwargs
):
    """Off (Dask's default, or the compute's argument over Dask's config), a host task runs
    once, and the error raised is the one from its host thread."""
    runs = []

    @host_task
    def raises():
        runs.append(threading.get_ident())
        raise LookupError(len(runs), threading.get_ident())

    with launcher(streams=2), dask.config.set(config), pytest.raises(LookupError) as e:
        delayed(raises)().compute(scheduler="gpustreams", **kwargs)
    (host_thread,) = runs
    assert host_thread != threading.get_ident()
    assert e.value.args == (1, host_thread)


def test_a_host_task_whose_rerun_returns_still_fails_the_compute(launcher):
    """A host task that fails only off the calling thread: its rerun returns, and the compute
    raises the host thread's error (Dask's threads hand the exception object on as the
    task's value)."""
    caller = threading.get_ident()

    @host_task
    def fails_off_the_caller(x):
        if threading.get_ident() != caller:
            raise LookupError("on a host thread")
        return x + 1

    total = delayed(repr)(delayed(fails_off_the_caller)(1))
    rerun = dask.config.set(rerun_exceptions_locally=True)
    with launcher(streams=2), rerun, pytest.raises(LookupError, match="on a host thread"):
        total.compute(scheduler="gpustreams")


def test_the_rerun_of_a_host_task_whose_input_failed_does_not_call_it(launcher):
    """The rerun waits on the host for the task's inputs, as its host thread did: an input's
    kernel failure is raised from there again, and the task never reads that input."""
    calls = []

    @host_task
    def reads(x):
        calls.append(threading.get_ident())
        return x.get()

    task = delayed(reads)(delayed(failing)(4, dask_key_name="bad-input"))
    rerun = dask.config.set(rerun_exceptions_locally=True)
    with launcher(streams=2), rerun, pytest.raises(KernelError, match="task 'bad-input'"):
        task.compute(scheduler="gpustreams")
    assert calls == []


def test_a_host_task_run_inline_by_a_nested_compute_is_not_run_again_there(launcher):
    """A nested compute in a host task runs its own host tasks inline, on that host thread,
    its calling thread: a failed one is not run again there. The outer task's rerun on the
    calling thread computes it again: on a host thread, then rerun on the calling thread."""
    runs = []

    @host_task
    def inner():
        runs.append(threading.get_ident())
        raise LookupError(len(runs))

    @host_task
    def outer():
        return delayed(inner)().compute(scheduler="gpustreams")

    rerun = dask.config.set(rerun_exceptions_locally=True)
    with launcher(streams=2), rerun, pytest.raises(LookupError) as e:
        delayed(outer)().compute(scheduler="gpustreams")
    assert [thread == threading.get_ident() for thread in runs] == [False, False, True]
    assert e.value.args == (3,)


def test_kernel_failures_of_both_runs_of_a_host_task_stay_with_its_compute(launcher):
    """Each run of a host task (on its host thread, then on the calling thread) launches a
    failing kernel, one on each stream, and raises: the failed compute drains both, so the
    next computes on those streams give their values, as on Dask's threads
    (``test_kernel_error_of_a_task_rerun_locally_does_not_reach_the_next_compute``)."""

    @host_task
    def fails_then_raises():
        failing(4)
        raise LookupError("after a failing kernel")

    task = delayed(fails_then_raises)(dask_key_name="rerun-failure")
    with launcher(streams=2, policy="round-robin"):
        rerun = dask.config.set(rerun_exceptions_locally=True)
        with rerun, pytest.raises(LookupError, match="after a failing kernel"):
            task.compute(scheduler="gpustreams")
        for value in (3.0, 5.0):  # on each stream
            got = delayed(download)(delayed(leaf)(value, 4, 0)).compute(scheduler="gpustreams")
            np.testing.assert_array_equal(got, [value] * 4)
        assert get_runtime().collect() == 0


def test_kernel_error_names_its_key(launcher):
    with launcher(streams=2):
        x = delayed(failing)(4, dask_key_name="bad-producer")
        y = delayed(combine)(x, x, 0.0, dask_key_name="consumer")
        with pytest.raises(KernelError, match=r"launched by task 'bad-producer' failed") as e:
            y.compute(scheduler="gpustreams")
        assert e.value.key == "bad-producer"
        assert get_runtime().collect() == 0
        np.testing.assert_array_equal(
            delayed(download)(delayed(leaf)(1.0, 4, 0.0)).compute(scheduler="gpustreams"), [1] * 4
        )


@pytest.mark.parametrize("check", [False, True])
def test_a_compute_after_two_kernel_failures_on_two_streams_is_exact(launcher, by_key, check):
    """The first graph fails on both streams; the second, on both, must not see those errors."""
    by_key.update({"bad-0": 0, "bad-1": 1, "sum": 0, "a": 0, "b": 1, "c": 1})
    bad = {
        "bad-0": lambda v: failing(4),
        "bad-1": lambda v: failing(4),
        "sum": lambda v: combine(v["bad-0"], v["bad-1"], 0.0),
    }
    bad_deps = {"bad-0": (), "bad-1": (), "sum": ("bad-0", "bad-1")}
    clean = {
        "a": lambda v: leaf(1.0, 4, 0.01),
        "b": lambda v: leaf(2.0, 4, 0.0),
        "c": lambda v: combine(v["a"], v["b"], 0.0),
    }
    clean_deps = {"a": (), "b": (), "c": ("a", "b")}
    with launcher(streams=2, policy="test-placement"):
        runtime = get_runtime()
        with pytest.raises(KernelError, match=r"launched by task 'bad-[01]' failed"):
            GraphLauncher(
                runtime, bad, bad_deps, {"bad-0": 0, "bad-1": 1, "sum": 2}, {"sum"}, check=check
            ).run()
        out = GraphLauncher(
            runtime, clean, clean_deps, {"a": 0, "b": 1, "c": 2}, {"c"}, check=check
        ).run()
        with sim.get_device().task(None):
            np.testing.assert_array_equal(out["c"].get(), [3.0] * 4)
        for slot in runtime.pool.slots:
            slot.stream.synchronize()  # nothing left in error on either stream


def test_the_events_of_a_drained_graph_are_reused_without_a_query(launcher, monkeypatch):
    """A graph whose streams drained gives its events back as done: the next graph's tasks
    take them with no event query (one a task, 0.3-3 us on a busy H200)."""

    def doubled(value):
        x = delayed(leaf)(value, 64, 0.001)
        for _ in range(10):
            x = delayed(combine)(x, x, 0.001)
        return delayed(download)(x)

    with launcher(streams=4):
        assert doubled(1.0).compute(scheduler="gpustreams").tolist() == [2.0**10] * 64
        events = get_runtime().events
        released = len(events)
        asked = []
        query = SimBackend.done
        monkeypatch.setattr(
            SimBackend,
            "done",
            lambda self, event: asked.append(sys._getframe(1).f_code.co_name) or query(self, event),
        )
        assert doubled(2.0).compute(scheduler="gpustreams").tolist() == [2.0**11] * 64
        reused = len(events)
    assert released >= 12  # the graph's tasks
    assert ("acquire" in asked, reused) == (False, released)  # all reused, none asked


def test_the_events_of_a_graph_still_running_are_asked_before_reuse(launcher):
    """A graph returns once its wanted keys are done; a task it did not want may still run,
    and its event is handed out again only once a query says it is done."""
    dsk = {"slow": (leaf, 1.0, 64, 0.5), "fast": (leaf, 2.0, 64, 0.0)}
    with launcher(streams=4):
        assert launcher_get(dsk, ["fast"])[0].get().tolist() == [2.0] * 64
        events = get_runtime().events
        taken = [events.acquire() for _ in range(len(events))]
        assert all(event.done for event in taken)  # the slow task's is not, for 0.5 s
        get_runtime().pool.synchronize()


def test_concurrent_computes_from_threads_are_exact(launcher):
    """Two launchers share the runtime's pool; each result is its own and complete."""
    results: dict = {}
    with launcher(streams=4):

        def work(i):
            x = delayed(leaf)(float(i), 64, 0.005)
            for _ in range(10):
                x = delayed(combine)(x, x, 0.001)
            results[i] = delayed(download)(x).compute(scheduler="gpustreams")

        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert {i: r.tolist() for i, r in results.items()} == {
        i: [float(i) * 2**10] * 64 for i in range(4)
    }


def test_tall_skinny_qr_is_bitwise_plain_dask(launcher):
    """``da.linalg.qr`` (tsqr: block QRs, a QR of the stacked R's, matmuls) through the
    launcher on 8 streams with random kernel delays equals plain Dask's bit for bit."""
    rng = np.random.default_rng(5)
    host = rng.random((16 * 256, 32)).astype(np.float32)
    x = da.from_array(host, chunks=(256, 32)).map_blocks(sim.asarray).persist(scheduler="sync")
    q, r = da.linalg.qr(x)
    want = [sim.asnumpy(v) for v in dask.compute(q, r, scheduler="sync")]
    device = sim.get_device()
    device.kernel_delay = (0.0, 0.002)
    try:
        with launcher(streams=8, policy="auto"):
            for _ in range(5):
                got = [sim.asnumpy(v) for v in dask.compute(q, r, scheduler="gpustreams")]
                assert all(np.array_equal(g, w) for g, w in zip(got, want, strict=True))
    finally:
        device.kernel_delay = (0.0, 0.0)


# --- found in review: nested host tasks, library-state isolation, drains, callbacks -----------


@dask_gpustreams.host_task
def outer_with_nested_compute(i):
    inner = delayed(dask_gpustreams.to_host)(delayed(leaf)(float(i), 4, 0.0))
    return inner.compute(scheduler="gpustreams") + 1


def test_nested_computes_in_more_host_tasks_than_host_threads(launcher):
    """Each outer host task's nested compute has a host task of its own: with every host
    thread taken by outer tasks, those run inline instead of waiting for a free thread."""
    n = 2 * get_runtime().config.host_threads
    with launcher(streams=2):
        got = dask.compute(
            *[delayed(outer_with_nested_compute)(i) for i in range(n)], scheduler="gpustreams"
        )
    assert [g.tolist() for g in got] == [[i + 1.0] * 4 for i in range(n)]


def test_library_state_is_isolated_on_threads_of_a_later_multi_stream_runtime(
    launcher, monkeypatch
):
    """A thread that ran one-stream graphs is still isolated for a later multi-stream one
    (the isolation is per thread and device: a fresh thread here)."""
    calls = []
    monkeypatch.setattr(
        SimBackend, "isolate_thread", lambda self: calls.append(self) or (lambda: None)
    )

    def computes():
        for streams in (1, 4):
            with launcher(streams=streams):
                delayed(leaf)(1.0, 4, 0.0).compute(scheduler="gpustreams")
                calls.append(streams)

    thread = threading.Thread(target=computes)
    thread.start()
    thread.join()
    assert len(calls) == 3 and calls[0] == 1 and calls[2] == 4  # isolated once, for 4 streams


def failing_on_host():
    return failing(4)


def test_a_host_tasks_kernel_failure_is_drained_by_the_compute_that_raised(launcher):
    with launcher(streams=2):
        bad = delayed(dask_gpustreams.host_task(failing_on_host))(dask_key_name="H")
        with pytest.raises(LookupError, match="task 7 failed on the host"):
            dask.compute(bad, delayed(explode)(delayed(leaf)(1.0, 4, 0.02)), scheduler="gpustreams")
        np.testing.assert_array_equal(
            delayed(download)(delayed(leaf)(2.0, 4, 0.0)).compute(scheduler="gpustreams"), [2] * 4
        )


class Replace(Callback):
    """Replaces a key's task by a value in ``_start``, as ``dask.cache.Cache`` does."""

    def __init__(self, key, value):
        super().__init__()
        self.key, self.value = key, value

    def _start(self, dsk):
        if self.key in dsk:
            dsk[self.key] = DataNode(self.key, self.value)


def test_callbacks_may_change_the_graph_in_start(launcher):
    calls = []

    def expensive(x):
        calls.append(x)
        return x * 10

    y = delayed(expensive)(1, dask_key_name="expensive") + 1
    with launcher(streams=2), Replace("expensive", 100):
        assert y.compute(scheduler="gpustreams") == 101
    assert calls == []


def test_callbacks_passed_to_compute_are_used(launcher, rng):
    tr, expected = tree_workload(rng)
    seen = Seen()
    with launcher(streams=2):
        np.testing.assert_array_equal(
            tr.compute(scheduler="gpustreams", callbacks=[seen]), expected
        )
    assert seen.finished == [False] and len(seen.pre) == len(seen.post) > 0


def test_a_host_task_that_cannot_start_raises_instead_of_hanging(launcher):
    with launcher(streams=2):
        runtime = get_runtime()
        executor = runtime.host_executor()
        executor.shutdown()  # as after concurrent.futures' exit handler
        with pytest.raises(RuntimeError, match="after shutdown"):
            delayed(dask_gpustreams.host_task(lambda: 1))().compute(scheduler="gpustreams")


def test_the_callers_thread_is_isolated_only_while_the_launcher_runs():
    """Library state the launcher changes in the caller's thread (CuPy's FFT plan cache)
    is put back after the compute, also after a failing one."""
    from concurrent.futures import ThreadPoolExecutor
    from unittest import mock

    calls = []

    def isolate_thread(self):
        calls.append(("isolate", threading.get_ident()))
        return lambda: calls.append(("restore", threading.get_ident()))

    def computes():  # in a fresh thread: no earlier task has isolated it for good
        calls.append(("thread", threading.get_ident()))
        assert dask.compute(delayed(sim.asarray)(np.ones(3)), scheduler="gpustreams")
        with pytest.raises(ZeroDivisionError):
            dask.compute(delayed(lambda: 1 / 0)(), scheduler="gpustreams")

    with (
        mock.patch.object(SimBackend, "isolate_thread", isolate_thread),
        dask.config.set({"gpustreams.backend": "sim", "gpustreams.streams": 4}),
        ThreadPoolExecutor(1) as fresh,
    ):
        fresh.submit(computes).result()  # raises what the thread raised
    (_, me), *rest = calls
    assert rest == [("isolate", me), ("restore", me)] * 2


def add_one_in_place(x):
    """``x`` + 1, in place, returned (as a tiled gemm accumulates into its tile)."""
    sim.launch(slow_add, x, x, ONE, 0.0)
    return x


def test_a_given_value_updated_in_place_is_updated_once_when_the_graph_runs_again(launcher):
    """``acc`` adds 1 in place to the given ``g`` (a persisted tile) and returns it, in the
    first round; the sum's retry then runs out of memory. Running the graph again would add 1
    to what the first run left (2, where plain sync leaves 1): the retry's error is raised,
    and ``g`` is 1."""

    def graph(g):
        return {
            "g": g,
            "acc": (add_one_in_place, "g"),
            "a": (leaf, 1.0, CHUNK, 0.002),
            "b": (leaf, 2.0, CHUNK, 0.002),
            "c": (leaf, 4.0, CHUNK, 0.002),
            "ab": (combine, "a", "b", 0.002),
            "abc": (combine, "ab", "c", 0.002),
            "out": (download, "abc"),
        }

    g_sync, g = sim.asarray(np.zeros(CHUNK)), sim.asarray(np.zeros(CHUNK))
    with device_limit(3):
        acc, out = dask.get(graph(g_sync), ["acc", "out"])
        assert float(acc.get()[0]) == 1.0 and float(out[0]) == 7.0
        with (
            launcher(streams=4, policy="round-robin"),
            pytest.raises(sim.OutOfMemoryError),
        ):
            launcher_get(graph(g), ["acc", "out"])
    np.testing.assert_array_equal(g.get(), np.ones(CHUNK))


def test_the_run_one_task_at_a_time_starts_without_the_first_runs_cached_blocks(launcher):
    """Found by benchmarks/fuzz_oom_rerun.py (seed 1, graph 8). On 8 streams the first
    round launches ``n0`` (2 chunks) and ``n1``; ``n2``'s retry finds the device (3 chunks)
    full and the graph runs again one task at a time. Plain sync, from a settled pool, fits:
    ``n1``, ``n2``, ``n3``, then ``n0`` once ``n2``'s block is freed. The run again must start
    so too: ``n0``'s freed 2-chunk block of the first run, left cached, is split by ``n1`` and
    ``n2``, and with ``n3`` in one half it cannot be freed for ``n0``."""
    n0 = delayed(chunks_of)(0.0, 2, dask_key_name="n0")
    n1 = delayed(chunks_of)(1.0, 1, dask_key_name="n1")
    n2 = delayed(summed)(1, n1, dask_key_name="n2")
    n3 = delayed(summed)(1, n2, dask_key_name="n3")
    graph = delayed(download_all)(n0, n3, dask_key_name="out")
    with device_limit(3):
        expected = graph.compute(scheduler="sync")
        with launcher(streams=8, policy="round-robin"):
            got = graph.compute(scheduler="gpustreams")
    assert [float(x[0]) for x in expected] == [0.0, 1.0]
    assert all(np.array_equal(g, w) for g, w in zip(got, expected, strict=True))


FUZZ_OOM = """
import sys
from benchmarks.fuzz_oom_rerun import main
sys.exit(main(["--seed", "3", "--graphs", "12"]))
"""


def test_random_graphs_under_plain_syncs_peak_complete_as_on_plain_sync(run_python):
    """``benchmarks/fuzz_oom_rerun`` on 12 random graphs (host tasks and failing tasks among
    them), the sim pool capped at plain sync's peak: the launcher gives sync's results or
    error, each key heard once, no leak; some graphs run again one task at a time."""
    out = run_python(FUZZ_OOM, timeout=120)
    assert "'FAIL': 0" in out, out
    again = int(re.search(r"runs again (\d+)", out).group(1))
    assert again > 0, out
