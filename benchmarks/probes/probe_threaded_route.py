"""What does the plugin cost on Dask's threaded scheduler (``gpustreams.enabled`` with
Dask's threads asked for as such, ``scheduler=dask.threaded.get``; by name, ``"threads"``
runs the launcher since cade98a), per compute and per task, against plain threads?

Asked after the H200 run at 13ddc43 (``benchmarks/results/h200-lean-13ddc43/local/``),
where that route was 0.68x plain threads on the delayed workload and 0.84x on tiny-tasks.
It times ``width`` chains of ``depth`` one-kernel tasks (``x + 1`` on a small device
array) under both, for a few graph sizes, and prints the medians and the plugin's extra
time per compute (the one-task graph) and per task (the slope). Every result is checked.
Not answered yet: on the sim (CPU, at d22aac0, ``--backend sim``) the one-task graph took
1.0 ms more and 8 chains of 50 tasks 117 us more per task; the sim's stream threads want the
GIL too, so the H200 run is the one to read.

``--scheduler sync`` times the same route on Dask's synchronous scheduler (``bench_overhead``
put it 77 us a task over plain sync on chains at 0c426a9, where the launcher's per-task path,
much the same calls, was 7 us under it), and ``--profile`` adds a cProfile of one enabled
compute of the largest graph on the synchronous scheduler (whose tasks run in the calling
thread, which cProfile sees).

    python -m benchmarks.probes.probe_threaded_route --backend cupy
    python -m benchmarks.probes.probe_threaded_route --backend cupy --scheduler sync --profile
    python -m benchmarks.probes.probe_threaded_route --backend sim --quick
"""

from __future__ import annotations

import argparse
import cProfile
import statistics
import time

import dask
import dask.local
import dask.threaded
import numpy as np
from dask import delayed

from benchmarks import bench_workloads as bw
from benchmarks.report import profile_text

#: (width, depth) of the graphs timed, and the quick ones.
SIZES = ((1, 1), (1, 10), (8, 10), (8, 50))
QUICK_SIZES = ((1, 1), (2, 4))


def inc(x):
    return x + 1


def chains(arrays: bw.NumpyArrays, width: int, depth: int) -> list:
    """``width`` chains of ``depth`` ``inc`` tasks from one device array of zeros."""
    source = delayed(arrays.upload)(np.zeros(16))
    outs = []
    for j in range(width):
        y = source
        for i in range(depth):
            y = delayed(inc)(y, dask_key_name=f"inc-{j}-{i}")
        outs.append(y)
    return outs


#: ``--scheduler``: Dask's threads or its synchronous scheduler, as such (by name,
#: ``gpustreams.enabled`` runs the launcher for either).
SCHEDULERS = {"threads": dask.threaded.get, "sync": dask.local.get_sync}


def median_ms(
    arrays: bw.NumpyArrays, graph: list, depth: int, enabled: bool, reps: int, scheduler: str
) -> float:
    """Median wall (ms) of ``reps`` computes on ``scheduler``, after one warm-up; each
    result checked (every chain ends at ``depth``)."""
    config = {"gpustreams.enabled": enabled, "gpustreams.backend": arrays.plugin}
    walls = []
    with dask.config.set(config):
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            results = dask.compute(*graph, scheduler=SCHEDULERS[scheduler])
            walls.append(time.perf_counter() - t0)
            for r in results:
                value = np.asarray(arrays.download(r))
                if not np.all(value == depth):
                    raise AssertionError(f"wrong result: {value[:3]} for depth {depth}")
    return statistics.median(walls[1:]) * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="cupy", choices=("cupy", "sim"))
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--quick", action="store_true", help="tiny graphs (seconds on the sim)")
    p.add_argument("--scheduler", default="threads", choices=("threads", "sync"))
    p.add_argument("--profile", action="store_true")
    args = p.parse_args(argv)
    arrays = bw.make_arrays(args.backend)
    print(
        f"{args.scheduler}: {'tasks':>6} {'width':>6} {'depth':>6} {'plain ms':>11} "
        f"{'enabled ms':>11} "
        f"{'extra ms':>9} {'extra us/task':>14}"
    )
    for width, depth in QUICK_SIZES if args.quick else SIZES:
        graph = chains(arrays, width, depth)
        off = median_ms(arrays, graph, depth, False, args.reps, args.scheduler)
        on = median_ms(arrays, graph, depth, True, args.reps, args.scheduler)
        tasks = width * depth
        print(
            f"{'':{len(args.scheduler) + 1}} {tasks:6} {width:6} {depth:6} {off:11.2f} "
            f"{on:11.2f} {on - off:9.2f} "
            f"{(on - off) / tasks * 1e3:14.1f}"
        )
    if args.profile:
        profile = cProfile.Profile()
        config = {"gpustreams.enabled": True, "gpustreams.backend": arrays.plugin}
        with dask.config.set(config):
            dask.compute(*graph, scheduler=dask.local.get_sync)
            profile.enable()
            dask.compute(*graph, scheduler=dask.local.get_sync)
            profile.disable()
        text = profile_text(profile, 25, "dask_gpustreams")
        print(f"cProfile, enabled, scheduler sync, {tasks} tasks\n{text}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
