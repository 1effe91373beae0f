"""Answered in part: the cluster plugin (blocks off) against plugin-off depends on the order of
the modes (H200 at 9d48fa7, benchmarks/results/h200-misc/cluster-cost-9d48fa7.txt: plugin-off's
elementwise took 167 ms before a plugin round and 210 after), hence bench_cluster's --rounds;
the worker thread's time per task was higher with the plugin (942-1099 against 587-787 us).

    OUT=/tmp python -m benchmarks.probes.probe_cluster_cost elementwise,transpose 6

Alternates the modes (off, on-inert, on-1-stream, on-noblocks) twice per workload on one
LocalCUDACluster worker, and per mode reports: median wall, tasks, the worker thread's mean
compute time per task (task stream), the device allocations (cudaMalloc, counted by a CuPy
memory hook in the worker's thread) and pool bytes during the timed samples, and the worker's
statistical profile (thread and event loop) leaves for the last round. ``on-1-stream`` is the
plugin on one stream: its host path without concurrency on the device or per-stream memory
arenas; ``on-inert`` the plugin set up but wrapping no task (:class:`InertPlugin`). With
``CPROFILE=1``, the last round of each plugin mode also prints a cProfile started in the
worker's task thread, over the timed samples (its cost inflates those samples' walls). On
Python 3.12 cProfile sees every thread of the worker (sys.monitoring), its event loop too:
the H200 run at bdec711 (benchmarks/results/h200-cluster-bdec711/) showed mostly the loop.
"""

import collections
import json
import os
import statistics
import sys
import time

import dask
from distributed import Client, get_task_stream, wait

from benchmarks import bench_cluster, bench_workloads
from benchmarks.bench_workloads import WORKLOADS, sizes_for
from dask_gpustreams import StreamsPlugin

OUT = os.environ.get("OUT", "/tmp")
BACKEND = os.environ.get("BACKEND", "cupy")


def leaves(tree, n=25):
    """Flatten distributed's profile tree into (count, 'file:line func') of the deepest frames."""
    counts = collections.Counter()

    def walk(node, ident):
        kids = node.get("children", {})
        own = node["count"] - sum(c["count"] for c in kids.values())
        if own > 0:
            counts[ident] += own
        for c in kids.values():
            d = c.get("description", {})
            fname = d.get("filename", "?").split("site-packages/")[-1]
            walk(c, f"{fname}:{d.get('line_number', '?')} {d.get('name', '?')}")

    walk(tree, "root")
    total = tree.get("count", 0) or 1
    return total, [(c, f"{100 * c / total:5.1f}%", k) for k, c in counts.most_common(n)]


def _count_allocations() -> None:
    """In the worker's (only) task thread: count the pool's device allocations from now on."""
    import cupy
    from cupy.cuda import memory_hook

    class Count(memory_hook.MemoryHook):
        name = "count"
        allocations = 0
        alloc_bytes = 0

        def alloc_preprocess(self, device_id, mem_size):
            Count.allocations += 1
            Count.alloc_bytes += mem_size

    if getattr(cupy, "_probe_count", None) is None:
        cupy._probe_count = Count
        Count().__enter__()  # left on: thread-local, this thread runs every task


def _allocations() -> tuple[int, int, int]:
    import cupy

    count = cupy._probe_count
    return count.allocations, count.alloc_bytes, cupy.get_default_memory_pool().total_bytes()


def _profile_start() -> None:
    """In the worker's (only) task thread: cProfile it from now on (``CPROFILE=1``)."""
    import cProfile
    import threading

    # Kept by the thread: this module is __main__ here, so its functions reach the worker
    # by value, each with globals of its own.
    threading.current_thread().probe_profile = profile = cProfile.Profile()
    profile.enable()


def _profile_stop(top: int = 22) -> str:
    """In the worker's task thread: stop the profile; its top functions by own time."""
    import io
    import pstats
    import threading

    profile = threading.current_thread().probe_profile
    profile.disable()
    out = io.StringIO()
    stats = pstats.Stats(profile, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    return out.getvalue()


class InertPlugin(StreamsPlugin):
    """The plugin set up on the worker (egress, collector, metrics, scheduler plugins), but
    no task wrapped: the cost of what it installs, apart from running tasks on streams."""

    def transition(self, key, start, finish, **kwargs):
        return None


#: mode -> (plugin class, overrides), or None: plugin off.
MODES = {
    "off": None,
    "on-inert": (InertPlugin, {"streams": 1}),
    "on-1-stream": (StreamsPlugin, {"streams": 1}),
    "on-noblocks": (StreamsPlugin, {}),
    "on-rr": (StreamsPlugin, {"policy": "round-robin"}),
}


def main():
    names = (
        sys.argv[1].split(",")
        if len(sys.argv) > 1
        else ["elementwise", "transpose", "small-chunks"]
    )
    samples = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    dask.config.set(
        {"distributed.worker.profile.interval": "1ms", "distributed.worker.profile.cycle": "100ms"}
    )
    cluster, desc = bench_cluster.make_cluster(BACKEND, 1)
    client = Client(cluster)
    print(desc, flush=True)
    modes = {m: MODES[m] for m in os.environ.get("MODES", ",".join(MODES)).split(",")}
    if os.environ.get("SWITCH"):  # the workers' GIL switch interval, in seconds
        client.run(sys.setswitchinterval, float(os.environ["SWITCH"]))
        print("worker switch interval", client.run(sys.getswitchinterval), flush=True)
    arrays = bench_cluster.ClusterInputs(bench_workloads.make_arrays(BACKEND), client)
    sizes = sizes_for(BACKEND, BACKEND == "sim")
    by_name = WORKLOADS if isinstance(WORKLOADS, dict) else {w.name: w for w in WORKLOADS}
    report = {}
    for name in names:
        wl = by_name[name]
        cols = wl.build(arrays, sizes[name])
        ref = client.compute(list(cols), sync=True)
        for rnd in range(2):
            for mode, plugin in modes.items():
                if plugin is not None:
                    cls, overrides = plugin
                    client.register_plugin(cls(backend=BACKEND, blocks="off", **overrides))
                if BACKEND == "cupy":
                    client.submit(_count_allocations, pure=False).result()
                profiled = os.environ.get("CPROFILE") == "1" and rnd == 1 and plugin is not None
                walls, comp, ntask = [], [], 0
                t_start = time.time()
                for i in range(samples + 1):
                    if i == 1 and BACKEND == "cupy":
                        before = client.run(_allocations)
                    if i == 1 and profiled:
                        client.submit(_profile_start, pure=False).result()
                    with get_task_stream(client) as ts:
                        t0 = time.perf_counter()
                        fs = client.compute(list(cols))
                        wait(fs)
                        client.run(bench_cluster._synchronize, BACKEND)
                        w = (time.perf_counter() - t0) * 1e3
                    got = client.gather(fs)
                    del fs
                    for j, (g, r) in enumerate(zip(got, ref, strict=True)):
                        p = bench_workloads.problem(arrays.arrays, g, r, wl.tol)
                        if p:
                            print(f"  WRONG {name} {mode} output {j}: {p}", flush=True)
                    if i:
                        walls.append(w)
                        c = [
                            s["stop"] - s["start"]
                            for r in ts.data
                            for s in r["startstops"]
                            if s["action"] == "compute"
                        ]
                        comp.extend(c)
                        ntask = len(c)
                t_stop = time.time()
                if profiled:
                    print(f"--- cProfile of the worker thread: {name} {mode}", flush=True)
                    print(client.submit(_profile_stop, pure=False).result(), flush=True)
                allocs = ""
                if BACKEND == "cupy":
                    after = client.run(_allocations)
                    (n0, b0, _), (n1, b1, held) = (
                        next(iter(before.values())),
                        next(iter(after.values())),
                    )
                    allocs = (
                        f"  cudaMalloc {n1 - n0} ({(b1 - b0) / 2**20:.0f} MiB) over {samples}"
                        f" samples, pool {held / 2**20:.0f} MiB"
                    )
                prof_thr = client.profile(start=t_start, stop=t_stop)
                prof_loop = client.profile(start=t_start, stop=t_stop, server=True)
                if plugin is not None:
                    client.unregister_worker_plugin(StreamsPlugin.name)
                med = statistics.median(walls)
                mc = statistics.mean(comp) * 1e6
                print(
                    f"{name:<13} round {rnd} {mode:<12} tasks {ntask:<5} median {med:8.2f} ms "
                    f"[{min(walls):.1f}-{max(walls):.1f}]  per task {1e3 * med / ntask:7.1f} us  "
                    f"compute mean {mc:7.1f} us  thread-sum {mc * ntask / 1e3:7.1f} ms{allocs}",
                    flush=True,
                )
                key = f"{name}/{rnd}/{mode}"
                tt, lt = leaves(prof_thr), leaves(prof_loop)
                report[key] = {
                    "walls": walls,
                    "compute_us": mc,
                    "tasks": ntask,
                    "thread": tt,
                    "loop": lt,
                }
                if rnd == 1:
                    for label, (tot, rows) in (("worker thread", tt), ("event loop", lt)):
                        print(f"   {label} samples {tot}:")
                        for r in rows[:14]:
                            print("     ", *r)
        arrays.persisted.clear()
    with open(os.path.join(OUT, "probe_cluster_cost.json"), "w") as f:
        json.dump(report, f, default=str)
    client.close()
    cluster.close()


if __name__ == "__main__":
    main()
