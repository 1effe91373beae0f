"""What ranking ready tasks costs the launcher: ``dask.order`` against the depth-first order.

Builds each workload of ``bench_workloads`` at the H200's sizes on the host (NumPy chunks
that are never computed: only the graph is made), and times ``dask.order`` on the
optimized graph and :func:`~dask_gpustreams.runtime.ordering.depth_first` on its task
dependencies, per key, taking the fastest of ``--reps``. No device is used::

    python -m benchmarks.probes.probe_order_cost
    python -m benchmarks.probes.probe_order_cost --workloads stencil,rechunk --reps 5
"""

from __future__ import annotations

import argparse
import time

import dask
from dask._task_spec import Task
from dask.core import flatten
from dask.order import order

from benchmarks.bench_workloads import SIZES, WORKLOADS, NumpyArrays
from dask_gpustreams.runtime.ordering import depth_first


def fastest(function, reps: int) -> float:
    """The fastest of ``reps`` calls of ``function()``, in seconds."""
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.probes.probe_order_cost")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    arrays = NumpyArrays(plan=True)
    print(f"fastest of {args.reps}; graphs at the H200's sizes (bench_workloads SIZES['cupy'])")
    print(
        f"{'workload':<13} {'keys':>6} {'tasks':>6} {'dask.order us/key':>18} {'depth-first':>12}"
    )
    for name in args.workloads.split(","):
        expr = dask.base.collections_to_expr(
            WORKLOADS[name].build(arrays, SIZES["cupy"][name]), optimize_graph=True
        )
        graph = dict(expr.__dask_graph__())
        outputs = list(flatten(expr.__dask_keys__()))
        tasks = {k: v.dependencies for k, v in graph.items() if isinstance(v, Task)}
        dask_s = fastest(lambda graph=graph: order(graph), args.reps)
        depth_s = fastest(
            lambda tasks=tasks, outputs=outputs: depth_first(tasks, outputs), args.reps
        )
        n = len(graph)
        print(
            f"{name:<13} {n:>6} {len(tasks):>6} {dask_s / n * 1e6:>18.1f} "
            f"{depth_s / n * 1e6:>12.1f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
