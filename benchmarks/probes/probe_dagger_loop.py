"""One mode over one Dagger shape, compute after compute, for a sampling profiler.

``probe_dagger_host`` and ``probe_tile_costs`` time the parts of a tile task that they
wrap; a sampling profiler (``py-spy record --native``) sees the rest without changing it.
This runs ``--mode`` (``plain-sync``: ``dask.get``; ``launcher``; ``ideal``: the hand
launch on the same streams) over ``--shape`` for ``--seconds`` after a warm-up, checks
every result and prints the computes' median wall and host time a task.

    py-spy record --native --format raw -o launcher.txt -- \\
        python -m benchmarks.probes.probe_dagger_loop --backend cupy --mode launcher
"""

from __future__ import annotations

import argparse
import statistics
import time

import dask

import dask_gpustreams
from benchmarks import bench_shapes, kernels
from benchmarks.probes.probe_dagger_host import OFF, launcher_config, run_graph
from benchmarks.shapes import DAGGER
from benchmarks.workloads import IdealLauncher, gemm_workload, ideal_plan
from dask_gpustreams.backends import create_backend, resolve_backend

MODES = ("plain-sync", "launcher", "ideal")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.probes.probe_dagger_loop")
    p.add_argument("--backend", default="auto", choices=("auto", "cupy", "sim"))
    p.add_argument("--mode", default="launcher", choices=MODES)
    p.add_argument("--shape", default="chainlink", choices=DAGGER)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--seconds", type=float, default=10.0)
    args = p.parse_args(argv)
    backend = resolve_backend(args.backend)
    shape_args = bench_shapes.parse_args(["--backend", backend, "--families", "dagger"])
    bench_shapes.set_defaults(shape_args, backend)
    gemm_ms = bench_shapes.calibrate(shape_args, backend)["gemm_ms"]
    shape = bench_shapes.make_shape(shape_args, "dagger", args.shape)
    wl = gemm_workload(shape, backend, shape_args.matrix, gemm_ms)
    if args.mode == "ideal":
        ideal = IdealLauncher(create_backend(backend), args.streams)
        plan = ideal_plan(wl, args.streams, "layers")
        go = lambda: ideal.run(wl, plan)  # noqa: E731
    elif args.mode == "launcher":
        go = lambda: run_graph(wl, launcher_config(backend, args.streams), dask_gpustreams.get)  # noqa: E731
    else:
        go = lambda: run_graph(wl, OFF, dask.get)  # noqa: E731
    walls = []
    end = None
    while end is None or time.perf_counter() < end:
        kernels.device_synchronize(backend)
        t0 = time.perf_counter()
        results = go()
        kernels.device_synchronize(backend)
        walls.append((time.perf_counter() - t0) * 1e3)
        problem = wl.check(results)
        if problem is not None:
            print(f"{args.shape} {args.mode}: FAILED: {problem}")
            return 1
        end = end or time.perf_counter() + args.seconds  # the first compute warms up
    median = statistics.median(walls[1:])
    print(
        f"{args.shape} {args.mode}: {len(walls) - 1} computes of {shape.n_tasks} tasks, median "
        f"{median:.2f} ms ({median * 1e3 / shape.n_tasks:.1f} us a task), tile {gemm_ms:.4f} ms"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
