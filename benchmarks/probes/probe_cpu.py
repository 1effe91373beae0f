"""Does the launcher's share of ``ideal`` at 0.5 ms follow the process's host speed, and its CPUs?

With 0.5 ms kernels on 8 streams, the device runs a task every 62 us: the launcher keeps
up only if its host cost per task is below that. ``bench_shapes`` gave 82-94% of ``ideal``
in some processes and 60-78% in others, with either library; in one poor process every
path of ``linear`` had a stream of its own (h200-kept-a5915f6, placement-2), so placement
alone does not explain it. This probe prints, for one process: the CPUs it may run on and
those its main thread was seen on; three host timings (a Python loop, a CuPy launch of
``x += 1`` on a pool-like stream, an event record and query); and the launcher's share of
``ideal`` on the wide shapes (medians of ``--reps``, timeline off). Run it in several
processes, pinned (``taskset -c``) or not, to see what the poor ones share::

    for i in 1 2 3 4; do python -m benchmarks.probes.probe_cpu --backend cupy; done
"""

from __future__ import annotations

import os
import statistics
import time

import dask

from benchmarks.probes.probe_shape_lag import (
    launcher_config,
    walls_against_ideal,
    wide_loads,
    wide_parser,
)
from benchmarks.report import host_loop_ns
from dask_gpustreams.runtime import acquire_runtime


def current_cpu() -> int:
    """The CPU the calling thread runs on now (``/proc/thread-self/stat``, field 39)."""
    with open("/proc/thread-self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[36])


def cupy_us(n: int = 2000) -> tuple[float, float]:
    """us per ``x += 1`` launched on a stream, and per event record and query on it."""
    import cupy

    stream = cupy.cuda.Stream()
    x = cupy.zeros(16, dtype=cupy.float32)
    with stream:
        x += 1
        stream.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            x += 1
        launch = (time.perf_counter() - t0) / n * 1e6
    stream.synchronize()
    event = cupy.cuda.Event(block=False, disable_timing=True)
    t0 = time.perf_counter()
    for _ in range(n):
        event.record(stream)
        event.done  # noqa: B018 (the query is what is timed)
    return launch, (time.perf_counter() - t0) / n * 1e6


def main(argv: list[str] | None = None) -> int:
    args = wide_parser(__doc__).parse_args(argv)
    seen = {current_cpu()}
    loads, ideal = wide_loads(args.backend, args.kernel_ms)
    config = launcher_config(args.backend)
    host = f"python {host_loop_ns():5.1f} ns"
    if args.backend == "cupy":
        launch, event = cupy_us()
        host += f"  launch {launch:5.2f} us  event {event:5.2f} us"
    failed = False
    with dask.config.set(config):
        runtime = acquire_runtime()
    shares = []
    try:
        for name in args.shapes.split(","):
            wl = loads.get("threaded", "wide", name)
            walls, problems = walls_against_ideal(
                wl, ideal, config, args.backend, args.reps, lambda _: seen.add(current_cpu())
            )
            for problem in problems:
                print(f"{name} {problem}: WRONG")
                failed = True
            share = statistics.median(walls["ideal"]) / statistics.median(walls["launcher"])
            shares.append(f"{name} {share:4.0%}")
    finally:
        runtime.release()
    allowed = sorted(os.sched_getaffinity(0))
    cpus = f"{allowed[0]}-{allowed[-1]}" if len(allowed) > 1 else str(allowed[0])
    print(f"cpus {cpus:<6} seen {sorted(seen)}  {host}  |  {'  '.join(shares)}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
