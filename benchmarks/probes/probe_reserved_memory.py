"""Device memory of stream blocks against task per key on the sim: used, reserved and held.

``bench_cluster``'s *peak used* is the pool's ``used_bytes()``: live arrays, and also the
shared large blocks (``gpustreams.shared-blocks``) that a stream freed and keeps until its
work up to the free is known done, since the shared arena lends them; a block freed into a
stream's own arena (CuPy's pool, the sim's) is free there, though that stream's queued
kernels may still use it. *Reserved* counts both alike: live arrays, plus every block freed
while its stream still had work queued before the free, until that work has run (no other
stream may take it meanwhile, whichever allocator keeps it). *Held* is the pool's
``total_bytes()`` after the sample. Each is above the persisted inputs (the pool's used
bytes before the sample). No walls: this process's GIL is shared with the scheduler and
the client (``bench_cluster`` times the modes).

One worker of one thread in this process (``LocalCluster(processes=False)``), inputs
persisted there as ``bench_cluster`` does; modes as ``bench_cluster``'s (``off``, ``on``,
``on-noblocks``, ``MODE:KEY=VALUE``); ``--large-streams N`` sets ``Auto.large_streams``
(the streams large tasks run on) for the whole process. Sim only::

    python -m benchmarks.probes.probe_reserved_memory --workloads elementwise \\
        --set elementwise.n=8192 --set elementwise.chunk=2048 \\
        --modes off,on,on:shared-blocks=0,on-noblocks
"""

from __future__ import annotations

import argparse
import collections
import gc
import sys
import threading
import time
from typing import Any

import dask
from distributed import Client, LocalCluster

from benchmarks import bench_workloads
from benchmarks.bench_cluster import ClusterInputs, split_mode
from benchmarks.bench_workloads import WORKLOADS, sizes_for
from dask_gpustreams import StreamsPlugin, sim
from dask_gpustreams.backends import sim as sim_backend
from dask_gpustreams.runtime.policies.affinity import Auto
from dask_gpustreams.runtime.sharedblocks import SharedBlocks
from dask_gpustreams.sim import _device, _memory

MIB = 1 << 20


class Reserved:
    """Patches the sim's streams, pool and the shared blocks to track reserved bytes
    (see the module's docstring); :meth:`restore` puts them back."""

    def __init__(self) -> None:
        self.lock = threading.RLock()  # a finalizer's free may come while this thread holds it
        self.queued: collections.Counter = collections.Counter()  # stream id -> ops enqueued
        self.ran: collections.Counter = collections.Counter()  # stream id -> ops run
        self.arena_stream: dict[int, Any] = {}  # id(arena) -> the stream id it serves
        self.freed: dict[int, tuple] = {}  # id(chunk) -> (chunk, stream id, ops queued then)
        self.shared: dict[int, tuple] = {}  # id(base) -> (stream id, ops queued then, size)
        self.peak_used = self.peak_reserved = 0
        self._saved: list[tuple[Any, str, Any]] = []

    def _patch(self, owner: Any, name: str, make: Any) -> None:
        old = vars(owner)[name]
        self._saved.append((owner, name, old))
        setattr(owner, name, make(old))

    def install(self) -> None:
        probe = self

        def enqueue(old):
            def wrapped(stream, op):
                sid = stream.id

                def counted(s, op=op):
                    try:
                        op(s)
                    finally:
                        with probe.lock:
                            probe.ran[sid] += 1

                with probe.lock:
                    probe.queued[sid] += 1
                old(stream, counted)

            return wrapped

        def malloc(old):
            def wrapped(pool, nbytes, stream):
                got = old(pool, nbytes, stream)
                with probe.lock:
                    probe.arena_stream[id(got[0].arena)] = stream
                    probe.freed.pop(id(got[0]), None)
                used = pool.used_bytes()
                probe.peak_used = max(probe.peak_used, used)
                probe.peak_reserved = max(probe.peak_reserved, used + probe._pending_delta())
                return got

            return wrapped

        def free(old):
            def wrapped(pool, chunk):
                sid = probe.arena_stream.get(id(chunk.arena))
                if sid is not None:
                    with probe.lock:
                        probe.freed[id(chunk)] = (chunk, chunk.nbytes, sid, probe.queued[sid])
                old(pool, chunk)

            return wrapped

        def freed_on(old):
            def wrapped(blocks, slot, size, base):
                sid = slot.stream.id
                with probe.lock:
                    probe.shared[id(base)] = (sid, probe.queued[sid], size)
                old(blocks, slot, size, base)

            return wrapped

        def same_stream(old):
            def wrapped(blocks, slot, size):
                entry = old(blocks, slot, size)
                if entry is not None:
                    with probe.lock:
                        probe.shared.pop(id(entry[2]), None)
                return entry

            return wrapped

        def give_back(old):
            def wrapped(arena, base):
                with probe.lock:
                    probe.shared.pop(id(base), None)
                old(arena, base)

            return wrapped

        self._patch(_device.Stream, "enqueue", enqueue)
        self._patch(_memory.MemoryPool, "malloc", malloc)
        self._patch(_memory.MemoryPool, "free", free)
        self._patch(SharedBlocks, "_freed_on", freed_on)
        self._patch(SharedBlocks, "_same_stream", same_stream)
        self._patch(sim_backend._SharedArena, "give_back", give_back)

    def restore(self) -> None:
        while self._saved:
            owner, name, old = self._saved.pop()
            setattr(owner, name, old)

    def _pending_delta(self) -> int:
        """Free pool blocks whose stream has not run what was queued before their free, less
        the shared blocks counted as used whose stream has. A block merged with a free
        neighbour since is no longer counted (fewer bytes, never more)."""
        with self.lock:
            ran = self.ran
            pending = 0
            for key, (chunk, nbytes, sid, mark) in list(self.freed.items()):
                if chunk.in_use:
                    continue  # not filed yet: still in the pool's used bytes
                free = any(c is chunk for c in chunk.arena.by_size.get(nbytes, ()))
                if free and ran[sid] < mark:
                    pending += nbytes
                else:
                    del self.freed[key]  # reused, merged, or its stream got past the free
            done = sum(size for sid, mark, size in list(self.shared.values()) if ran[sid] >= mark)
        return pending - done

    def reset(self, used: int) -> None:
        self.peak_used = self.peak_reserved = used


def _wait_released(cluster: LocalCluster, timeout: float = 30.0) -> None:
    """Until the worker has let go of the persisted inputs (their futures were dropped)."""
    deadline = time.monotonic() + timeout
    while any(w.data for w in cluster.workers.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    gc.collect()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.probes.probe_reserved_memory")
    p.add_argument("--workloads", default="elementwise,transpose,pipeline")
    p.add_argument("--modes", default="off,on,on-noblocks")
    p.add_argument("--samples", type=int, default=3)
    p.add_argument("--large-streams", type=int, default=None)
    p.add_argument("--set", action="append", default=[], type=bench_workloads.parse_set)
    args = p.parse_args(argv)
    workloads = bench_workloads._list(args.workloads)
    modes = [(mode, *split_mode(mode)) for mode in bench_workloads._list(args.modes)]
    sizes = sizes_for("sim", False, dict(args.set))
    if args.large_streams is not None:
        Auto.large_streams = args.large_streams
        print(f"Auto.large_streams = {Auto.large_streams}", flush=True)
    probe = Reserved()
    probe.install()
    config = {
        "gpustreams.backend": "sim",
        "distributed.worker.memory.spill": False,
        "distributed.worker.memory.pause": False,
        "distributed.worker.memory.terminate": False,
    }
    try:
        with (
            dask.config.set(config),
            LocalCluster(
                n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None
            ) as cluster,
            Client(cluster) as client,
        ):
            pool = sim.get_default_memory_pool()
            for name in workloads:
                arrays = ClusterInputs(bench_workloads.SimArrays(), client)
                collections_ = WORKLOADS[name].build(arrays, sizes[name])
                print(f"{name} {sizes[name]}", flush=True)
                for mode, base, settings in modes:
                    if base != "off":
                        blocks = "off" if base == "on-noblocks" else "auto"
                        client.register_plugin(
                            StreamsPlugin(backend="sim", blocks=blocks, **settings)
                        )
                    try:
                        pool.free_all_blocks()
                        for i in range(1 + args.samples):  # a warm-up first
                            gc.collect()
                            inputs = pool.used_bytes()
                            probe.reset(inputs)
                            client.compute(list(collections_), sync=True)
                            if i:
                                print(
                                    f"  {mode:<28} used {(probe.peak_used - inputs) / MIB:7.1f}  "
                                    f"reserved {(probe.peak_reserved - inputs) / MIB:7.1f}  "
                                    f"held {(pool.total_bytes() - inputs) / MIB:7.1f} MiB "
                                    "above the inputs",
                                    flush=True,
                                )
                    finally:
                        if base != "off":
                            client.unregister_worker_plugin(StreamsPlugin.name)
                arrays.persisted.clear()
                _wait_released(cluster)
    finally:
        probe.restore()
    return 0


if __name__ == "__main__":
    sys.exit(main())
