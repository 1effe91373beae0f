"""What does the plugin cost on Dask's threaded scheduler (``gpustreams.enabled`` with
``scheduler="threads"`` named), per compute and per task, against plain threads?

Asked after the H200 run at 13ddc43 (``benchmarks/results/h200-lean-13ddc43/local/``),
where that route was 0.68x plain threads on the delayed workload and 0.84x on tiny-tasks.
It times ``width`` chains of ``depth`` one-kernel tasks (``x + 1`` on a small device
array) under both, for a few graph sizes, and prints the medians and the plugin's extra
time per compute (the one-task graph) and per task (the slope). Every result is checked.
Not answered yet: on the sim (CPU, at d22aac0, ``--backend sim``) the one-task graph took
1.0 ms more and 8 chains of 50 tasks 117 us more per task; the sim's stream threads want the
GIL too, so the H200 run is the one to read.

    python -m benchmarks.probes.probe_threaded_route --backend cupy
    python -m benchmarks.probes.probe_threaded_route --backend sim --quick
"""

from __future__ import annotations

import argparse
import statistics
import time

import dask
import numpy as np
from dask import delayed

from benchmarks import bench_workloads as bw

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


def median_ms(arrays: bw.NumpyArrays, graph: list, depth: int, enabled: bool, reps: int) -> float:
    """Median wall (ms) of ``reps`` computes on Dask's threads, after one warm-up; each
    result checked (every chain ends at ``depth``)."""
    config = {"gpustreams.enabled": enabled, "gpustreams.backend": arrays.plugin}
    walls = []
    with dask.config.set(config):
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            results = dask.compute(*graph, scheduler="threads")
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
    args = p.parse_args(argv)
    arrays = bw.make_arrays(args.backend)
    print(
        f"{'tasks':>6} {'width':>6} {'depth':>6} {'threads ms':>11} {'enabled ms':>11} "
        f"{'extra ms':>9} {'extra us/task':>14}"
    )
    for width, depth in QUICK_SIZES if args.quick else SIZES:
        graph = chains(arrays, width, depth)
        off = median_ms(arrays, graph, depth, False, args.reps)
        on = median_ms(arrays, graph, depth, True, args.reps)
        tasks = width * depth
        print(
            f"{tasks:6} {width:6} {depth:6} {off:11.2f} {on:11.2f} {on - off:9.2f} "
            f"{(on - off) / tasks * 1e3:14.1f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
