"""The launcher's large blocks shared by the pool's streams (``gpustreams.shared-blocks``).

On the simulated device, whose pool keeps one arena per stream as CuPy's does and
poisons a block handed out again on the stream that takes it.
"""

from __future__ import annotations

import gc
import threading

import dask
import numpy as np
import pytest
from dask import delayed

from dask_gpustreams import sim
from dask_gpustreams.runtime import get_runtime
from dask_gpustreams.runtime.registry import EventRegistry
from dask_gpustreams.runtime.sharedblocks import SharedBlocks
from tests.test_launcher import CHUNK, device_limit, settled_pool
from tests.test_local_scheduler import download, leaf, slow_scale

SHARED = "128 KiB"  # below CHUNK's 256 KiB
#: No small blocks apart and no large tasks: placement and arenas are the test's alone.
ONLY_SHARED = {"small-blocks": 0, "large-tasks": 0}


def through_temporary(x, first_delay, second_delay):
    """``2 * x`` through a temporary that goes back to the pool as the task returns, while
    the kernel reading it may still wait to run."""
    tmp = sim.empty(x.shape)
    sim.launch(slow_scale, tmp, x, 1.0, first_delay)
    out = sim.empty(x.shape)
    sim.launch(slow_scale, out, tmp, 2.0, second_delay)
    return out


def twice_into(out, x):
    out[: x.size] = x
    out[x.size :] = x


def concatenated(x):
    """``x`` twice, in a new block of twice its size."""
    out = sim.empty(2 * x.size)
    sim.launch(twice_into, out, x)
    return out


def grown_by(compute) -> int:
    """Bytes the pool grew by while ``compute()`` ran (its garbage collected)."""
    pool = sim.get_default_memory_pool()
    before = pool.total_bytes()
    compute()
    gc.collect()
    return pool.total_bytes() - before


@pytest.mark.parametrize("shared", [SHARED, 0])
def test_a_compute_on_other_streams_reuses_the_blocks_of_the_one_before(
    on_the_launcher,
    by_key,
    launcher,
    shared,
):
    """Four chains on streams 0-3, then four more on streams 4-7: with the blocks shared,
    the second compute takes the first one's blocks and the pool does not grow; with an
    arena per stream (the control) it grows as much again. Exact."""
    pool = sim.get_default_memory_pool()
    pool.free_all_blocks()
    grown = []
    with launcher(streams=8, policy="test-placement", **{"shared-blocks": shared}, **ONLY_SHARED):
        for run, streams in enumerate(((0, 1, 2, 3), (4, 5, 6, 7))):
            outs = []
            for i, stream in enumerate(streams):
                names = [f"{part}-{run}-{i}" for part in ("leaf", "double", "get")]
                x = delayed(leaf)(float(i), CHUNK, 0.001, dask_key_name=names[0])
                y = delayed(through_temporary)(x, 0.001, 0.002, dask_key_name=names[1])
                outs.append(delayed(download)(y, dask_key_name=names[2]))
                by_key.update(dict.fromkeys(names, stream))
            got: list = []
            grown.append(
                grown_by(
                    lambda outs=outs, got=got: got.extend(
                        dask.compute(*outs, scheduler="gpustreams")
                    )
                )
            )
            assert [g.tolist() for g in got] == [[2.0 * i] * CHUNK for i in range(4)]
    assert grown[0] >= 4 * CHUNK * 8, grown
    if shared:
        assert grown[1] == 0, grown
    else:
        assert grown[1] >= grown[0] // 2, grown


def test_a_block_freed_on_a_busy_stream_is_not_handed_to_another(
    on_the_launcher,
    by_key,
    launcher,
):
    """A task on stream 0 frees a temporary that its slow kernel has yet to read; a task
    launched next on stream 1 allocates a block of that size. It must get another block:
    handed that one, its poison would be read by stream 0's kernel. Exact, 3 times."""
    by_key.update({"slow": 0, "fast": 1})
    source = delayed(np.arange)(CHUNK, dtype="float64", dask_key_name="source")
    with launcher(streams=2, policy="test-placement", **{"shared-blocks": SHARED}, **ONLY_SHARED):
        x = dask.persist(delayed(sim.asarray)(source), scheduler="sync")[0]
        sim.get_device().synchronize()
        for _ in range(3):
            slow = delayed(through_temporary)(x, 0.0, 0.05, dask_key_name="slow")
            fast = delayed(leaf)(7.0, CHUNK, 0.0, dask_key_name="fast")
            got_slow, got_fast = dask.compute(
                delayed(download)(slow, dask_key_name="get-slow"),
                delayed(download)(fast, dask_key_name="get-fast"),
                scheduler="gpustreams",
            )
            np.testing.assert_array_equal(got_slow, 2.0 * np.arange(CHUNK))
            np.testing.assert_array_equal(got_fast, np.full(CHUNK, 7.0))


def chain_held(length: int) -> tuple[int, np.ndarray]:
    """Bytes the pool grew by over a chain of ``length`` tasks with a temporary each, on
    one stream, and its result."""
    x = delayed(leaf)(1.0, CHUNK, 0.0)
    for _ in range(length):
        x = delayed(through_temporary)(x, 0.001, 0.0)
    got: list = []
    grown = grown_by(lambda: got.append(delayed(download)(x).compute(scheduler="gpustreams")))
    return grown, got[0]


def test_a_stream_reuses_its_own_freed_blocks_at_once(on_the_launcher, launcher):
    """On one stream, blocks freed go to the next allocations of their size in stream order,
    as CuPy's own arena would, not after the stream's work is seen complete: the chain
    of 30 tasks, run ahead of its slow kernels, grows the pool by about as much as with an
    arena per stream (28-29 chunks; about 55 if each waited to be seen complete)."""
    sim.get_default_memory_pool().free_all_blocks()
    held = {}
    for shared in (SHARED, 0):
        with launcher(streams=1, **{"shared-blocks": shared}, **ONLY_SHARED):
            held[shared], got = chain_held(30)
            get_runtime().close(timeout=30)
        np.testing.assert_array_equal(got, np.full(CHUNK, 2.0**30))
    assert held[SHARED] <= 1.25 * held[0], held


def test_blocks_go_back_to_the_pool_at_a_computes_end_and_when_freed_after(
    on_the_launcher,
    launcher,
):
    """The temporaries of a compute go back to the pool at its end, and persisted results
    freed later, their streams idle, at once: ``free_all_blocks`` then leaves only the
    arrays alive."""
    pool = settled_pool()
    leaves = [delayed(leaf)(float(i), CHUNK, 0.001) for i in range(8)]
    doubled = [delayed(through_temporary)(x, 0.001, 0.001) for x in leaves]
    alive = pool.used_bytes()
    with launcher(streams=4, **{"shared-blocks": SHARED}, **ONLY_SHARED):
        kept = dask.compute(*dask.persist(*doubled, scheduler="gpustreams"), scheduler="sync")
        assert [k.get().tolist() for k in kept] == [[2.0 * i] * CHUNK for i in range(8)]
        gc.collect()
        pool.free_all_blocks()
        assert pool.total_bytes() == pool.used_bytes() == alive + 8 * CHUNK * 8
        del kept
        gc.collect()
        pool.free_all_blocks()
        assert pool.total_bytes() == pool.used_bytes() == alive


def busy(inputs):
    """A small result written after 0.2 s: work that keeps its stream busy."""
    out = sim.empty(4)
    sim.launch(slow_scale, out, np.zeros(4), 1.0, 0.2)
    return out


def test_a_block_freed_while_its_stream_runs_other_work_goes_back_at_the_close(
    on_the_launcher, launcher
):
    """A result freed after its compute, while its stream runs a task of another route
    (as a distributed worker's outside stream blocks), stays cached for that stream; the
    runtime's close gives it back to the pool, as it does every block."""
    pool = settled_pool()
    with launcher(streams=1, **{"shared-blocks": SHARED}, **ONLY_SHARED):
        runtime = get_runtime()
        alive = pool.used_bytes()
        (x,) = dask.compute(delayed(leaf)(1.0, CHUNK, 0.0), scheduler="gpustreams")
        assert x.get().tolist() == [1.0] * CHUNK
        runtime.run("busy", busy, {}, EventRegistry())
        del x
        gc.collect()
        assert pool.used_bytes() >= alive + CHUNK * 8  # cached: its stream is busy
        runtime.close(timeout=30)
    gc.collect()
    assert pool.used_bytes() <= alive + 4 * 8


@pytest.mark.parametrize("shared", [SHARED, 0])
def test_a_retry_out_of_memory_gets_back_the_blocks_of_its_own_stream(
    on_the_launcher, launcher, shared
):
    """On one stream, room for 3 chunks: a task that needs 2 fails while the block of the
    slow task before it is cached, its stream's last event not yet seen complete; the
    retry, after a wait for every stream, gets it back and runs. Exact."""
    a = delayed(leaf)(1.0, CHUNK, 0.0)
    b = delayed(through_temporary)(a, 0.0, 0.3)
    c = delayed(concatenated)(b)
    config = {"shared-blocks": shared, **ONLY_SHARED}
    with device_limit(3), launcher(streams=1, **config):
        got = delayed(download)(c).compute(scheduler="gpustreams")
    np.testing.assert_array_equal(got, np.full(2 * CHUNK, 2.0))


@pytest.mark.parametrize("shared", [SHARED, 0])
def test_a_full_device_with_shared_blocks_still_runs_the_chain(on_the_launcher, launcher, shared):
    """With room for 12 chunks, a chain run ahead of its slow kernels fits, blocks shared
    or not: a full device first gets the blocks of idle streams back."""
    x = delayed(leaf)(1.0, CHUNK, 0.0)
    for _ in range(40):
        x = delayed(through_temporary)(x, 0.0005, 0.0)
    with (
        device_limit(12),
        launcher(streams=4, policy="round-robin", **{"shared-blocks": shared}, **ONLY_SHARED),
    ):
        got = delayed(download)(x).compute(scheduler="gpustreams")
    np.testing.assert_array_equal(got, np.full(CHUNK, 2.0**40))


def test_whether_a_stream_reached_an_event_is_never_waited_for_under_its_lock(launcher):
    """A block may be freed by a finalizer while its stream's lock is held (the pool
    releases inputs under it): asking then answers False at once, and True once the
    stream is idle."""
    with launcher(streams=1):
        pool = get_runtime().pool
        slot = pool.slots[0]
        mark = pool.next_seq(slot)
        answers = []
        with slot.lock:
            thread = threading.Thread(target=lambda: answers.append(pool.reached(slot, mark, True)))
            thread.start()
            thread.join()
        answers.append(pool.reached(slot, mark, True))
    assert answers == [False, True]


class Slot:
    def __init__(self, stream):
        self.stream = stream


class CountingPool:
    """Two streams whose work completes when the test says: ``done[slot]`` events."""

    def __init__(self):
        self.slots = [Slot("a"), Slot("b")]
        self.recorded = {s: 0 for s in self.slots}
        self.done = {s: 0 for s in self.slots}

    def next_seq(self, slot):
        return self.recorded[slot] + 1

    def reached(self, slot, seq, query):
        return self.done[slot] >= seq

    def wait_all(self):
        self.done.update(self.recorded)


class LoggedSource:
    """Blocks numbered in order; fails on a block given back twice or while lent."""

    def __init__(self):
        self.free: dict[int, list[int]] = {}  # size -> blocks given back
        self.lent: set[int] = set()
        self.made = 0

    def stream_key(self, stream):
        return stream

    def take(self, nbytes, allocate):
        free = self.free.get(nbytes)
        if free:
            return free.pop(), True
        self.made += 1
        return self.made, False

    def lend(self, base, nbytes, owner, reused):
        assert base not in self.lent
        self.lent.add(base)
        return [base, owner]

    def give_back(self, base):
        assert all(base not in blocks for blocks in self.free.values())
        self.free.setdefault(self.size_of[base], []).append(base)

    def close(self):
        pass


def test_blocks_are_never_lost_or_given_back_twice_on_streams_that_never_idle(rng):
    """Random allocations, frees and completions on two streams whose last work is never
    seen complete: after every step each block is lent or cached, once, and what is cached
    by size is exactly the blocks freed and neither reused nor given back (none kept stale
    on a stream that never drains, as a long-lived worker's)."""
    pool, source = CountingPool(), LoggedSource()
    source.size_of = {}
    shared = SharedBlocks(512, pool, lambda: source)
    held: list[list] = []
    for step in range(3000):
        slot = pool.slots[rng.integers(2)]
        action = rng.integers(4)
        if action == 0 or not held:
            size = 512 * int(rng.integers(1, 4))
            held.append(shared.malloc(size, slot.stream, None))
            source.size_of[held[-1][0]] = size
        elif action == 1:
            base = held.pop(rng.integers(len(held)))[0]
            source.lent.discard(base)
        elif action == 2:
            pool.recorded[slot] += 1
            pool.done[slot] = pool.recorded[slot] - 1  # the last one always still runs
        elif step % 10 == 0:
            shared.begin()
            shared.end()
        # Private state, read as the invariant it keeps: cached blocks, in free order and
        # by size.
        cached = [e[2] for q in shared._in_order.values() for e in q if e[2] is not None]
        by_size = [e[2] for sizes in shared._by_size.values() for q in sizes.values() for e in q]
        assert sorted(cached) == sorted(by_size)
        given_back = [b for blocks in source.free.values() for b in blocks]
        lent = [memory[0] for memory in held]
        assert sorted([*cached, *given_back, *lent]) == list(range(1, source.made + 1))
    assert source.made < 100 and sum(map(len, source.free.values())) > 0  # reused, given back
