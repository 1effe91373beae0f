"""Where task per key loses to the plugin off on a cluster: in the tasks, or between them?

At 37fb352 on the H200 (``results/h200-verify-37fb352``, ``h200-second-37fb352``), the
plugin with blocks off ran 7 of 17 workload runs slower than the plugin off (0.87-0.98x:
transpose, std, stencil, fft, rechunk, delayed, qr), 200-300 us more a task on some, and
the same workload went either way from call to call. This probe runs
workloads of ``bench_workloads`` on ``bench_cluster``'s cluster (one worker), each mode in
turn, and splits each compute's wall with the worker's task stream into ``in_tasks``
(the sum of the tasks' compute spans, in the worker's thread: the call, the plugin's
wrapper, the runtime's run) and ``between`` (the sum of the gaps between one task's end
and the next one's start: the worker's event loop, the scheduler, the hooks), medians of
``--reps`` computes after a warm-up. The task groups whose compute spans differ most
between the first two modes follow. ``--profile`` adds a cProfile of the worker process
over each mode's computes (every thread on Python 3.12; its event loop before).

    python -m benchmarks.probes.probe_cluster_gaps --backend cupy --workloads rechunk,fft
    python -m benchmarks.probes.probe_cluster_gaps --backend sim --workloads delayed
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

from dask.utils import key_split
from distributed import Client, get_task_stream, wait

from benchmarks import bench_cluster, bench_workloads
from benchmarks.probe_distributed import _profile_start, _profile_stop
from dask_gpustreams import StreamsPlugin


def spans(records: list[dict]) -> list[tuple[str, float, float]]:
    """``(group, start, stop)`` of each compute span in ``records``, in start order."""
    out = [
        (key_split(r["key"]), s["start"], s["stop"])
        for r in records
        for s in r["startstops"]
        if s["action"] == "compute"
    ]
    return sorted(out, key=lambda s: s[1])


def measure(client: Client, collections: tuple, backend: str, reps: int) -> dict:
    """Medians over ``reps`` computes (after one) of wall, in-task and between-task ms."""
    fields: dict[str, list[float]] = defaultdict(list)
    groups: dict[str, list[float]] = defaultdict(list)
    for rep in range(reps + 1):
        with get_task_stream(client) as ts:
            t0 = time.perf_counter()
            futures = client.compute(list(collections))
            wait(futures)
            client.run(bench_cluster._synchronize, backend)
            wall = time.perf_counter() - t0
        del futures
        if rep == 0:
            continue
        got = spans(ts.data)
        fields["wall"].append(wall * 1e3)
        fields["in_tasks"].append(sum(stop - start for _, start, stop in got) * 1e3)
        fields["between"].append(
            sum(max(0.0, b[1] - a[2]) for a, b in zip(got, got[1:], strict=False)) * 1e3
        )
        fields["tasks"].append(len(got))
        for group, start, stop in got:
            groups[group].append((stop - start) * 1e6)
    out = {k: statistics.median(v) for k, v in fields.items()}
    out["groups"] = {g: (len(v) // reps, statistics.median(v)) for g, v in groups.items()}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="cupy", choices=("cupy", "sim"))
    p.add_argument("--workloads", default="rechunk,fft,stencil,delayed")
    p.add_argument("--modes", default="off,on-noblocks,on")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--set", action="append", default=["rechunk.n=4096"], metavar="W.K=V")
    p.add_argument("--profile", action="store_true")
    a = p.parse_args(argv)
    modes = a.modes.split(",")
    overrides = dict(bench_workloads.parse_set(s) for s in a.set)
    sizes = bench_workloads.sizes_for(a.backend, False, overrides)
    cluster, described = bench_cluster.make_cluster(a.backend)
    client = Client(cluster)
    arrays = bench_cluster.ClusterInputs(bench_workloads.make_arrays(a.backend), client)
    plugin_backend = arrays.arrays.plugin
    print(f"{described}; medians of {a.reps} computes after a warm-up, ms")
    print(f"{'workload':<13} {'mode':<12} {'tasks':>6} {'wall':>9} {'in_tasks':>9} {'between':>9}")
    for name in a.workloads.split(","):
        wl = bench_workloads.WORKLOADS[name]
        collections = wl.build(arrays, sizes[name])
        rows = {}
        for mode in modes:
            if mode != "off":
                blocks = "off" if mode == "on-noblocks" else "auto"
                client.register_plugin(StreamsPlugin(backend=plugin_backend, blocks=blocks))
            profiled = a.profile
            if profiled:
                client.run(_profile_start)
            try:
                rows[mode] = r = measure(client, collections, a.backend, a.reps)
            finally:
                stats = client.run(_profile_stop) if profiled else None
                if mode != "off":
                    client.unregister_worker_plugin(StreamsPlugin.name)
            print(
                f"{name:<13} {mode:<12} {r['tasks']:>6.0f} {r['wall']:>9.1f} "
                f"{r['in_tasks']:>9.1f} {r['between']:>9.1f}",
                flush=True,
            )
            if stats:
                print(next(iter(stats.values())))
        if len(modes) > 1:
            first, second = (rows[m]["groups"] for m in modes[:2])
            diffs = sorted(
                ((second[g][1] - first[g][1], g) for g in first.keys() & second.keys()),
                reverse=True,
            )
            for diff, g in diffs[:5]:
                print(
                    f"    {g:<40} x{first[g][0]:<5} compute us {first[g][1]:8.1f} "
                    f"-> {second[g][1]:8.1f} ({diff:+.1f})"
                )
        arrays.persisted.clear()
    client.close()
    cluster.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
