"""One mode over one Dagger shape, compute after compute, for a sampling profiler.

``probe_dagger_host`` and ``probe_tile_costs`` time the parts of a tile task that they
wrap; a sampling profiler (``py-spy record --native``) sees the rest without changing it.
This runs ``--modes`` in turn (``plain-sync``: ``dask.get``; ``launcher``; ``ideal``: the
hand launch on as many streams) over ``--shape`` for ``--seconds`` after a warm-up turn,
checks every result and prints per mode the computes' median wall, how much CuPy's pool
grew and the garbage collector's time, then the groups the launcher learned as host tasks
(``bench_shapes`` takes modes in turn too).

    py-spy record --native --format raw -o launcher.txt -- \\
        python -m benchmarks.probes.probe_dagger_loop --backend cupy --modes launcher
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import dask

import dask_gpustreams
from benchmarks import bench_shapes, kernels
from benchmarks.probes.probe_dagger_host import OFF, launcher_config, run_graph
from benchmarks.shapes import DAGGER
from benchmarks.workloads import IdealLauncher, gemm_workload, ideal_plan
from dask_gpustreams.backends import create_backend, resolve_backend
from dask_gpustreams.runtime.runtime import live_runtimes

MODES = ("plain-sync", "launcher", "ideal")


class GcClock:
    """Host seconds the garbage collector took, and its collections, since the last take;
    it listens while open (``with GcClock() as clock``). :attr:`oldest`: the oldest
    generation collected since the last take (-1: none)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.collections = 0
        self.oldest = -1
        self._t0 = 0.0

    def __enter__(self) -> GcClock:
        gc.callbacks.append(self._note)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._note)

    def _note(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t0
            self.collections += 1
            self.oldest = max(self.oldest, info["generation"])

    def take(self) -> tuple[float, int]:
        taken = self.seconds, self.collections
        self.seconds, self.collections, self.oldest = 0.0, 0, -1
        return taken


def pool_bytes(backend: str) -> int:
    """The device pool's size: CuPy's default pool, or the simulated device's."""
    if backend != "cupy":
        from dask_gpustreams import sim

        return sim.get_default_memory_pool().total_bytes()
    import cupy

    return cupy.get_default_memory_pool().total_bytes()


def launcher_settings(mode: str) -> dict[str, str]:
    """``'launcher:shared-blocks=1 MiB;policy=round-robin'`` -> its ``gpustreams.`` settings."""
    _, _, spec = mode.partition(":")
    pairs = (item.split("=", 1) for item in spec.split(";") if item)
    return {f"gpustreams.{key.strip()}": value.strip() for key, value in pairs}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.probes.probe_dagger_loop")
    p.add_argument("--backend", default="auto", choices=("auto", "cupy", "sim"))
    p.add_argument(
        "--modes",
        default="launcher",
        help=f"in turn, of {','.join(MODES)}; 'launcher:KEY=VALUE;...' is the launcher "
        "with those settings (e.g. 'launcher:shared-blocks=1 MiB')",
    )
    p.add_argument("--shape", default="chainlink", choices=DAGGER)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--seconds", type=float, default=10.0)
    args = p.parse_args(argv)
    modes = args.modes.split(",")
    for mode in modes:
        if mode.partition(":")[0] not in MODES:
            p.error(f"mode {mode!r} is invalid: allowed values are {' | '.join(MODES)}")
    backend = resolve_backend(args.backend)
    shape_args = bench_shapes.parse_args(["--backend", backend, "--families", "dagger"])
    bench_shapes.set_defaults(shape_args, backend)
    gemm_ms = bench_shapes.calibrate(shape_args, backend)["gemm_ms"]
    shape = bench_shapes.make_shape(shape_args, "dagger", args.shape)
    wl = gemm_workload(shape, backend, shape_args.matrix, gemm_ms)
    runs = {"plain-sync": lambda: run_graph(wl, OFF, dask.get)}
    if "ideal" in modes:  # its streams only where it runs
        ideal = IdealLauncher(create_backend(backend), args.streams)
        plan = ideal_plan(wl, args.streams, "layers")
        runs["ideal"] = lambda: ideal.run(wl, plan)
    for mode in modes:
        if mode.startswith("launcher"):
            config = launcher_config(backend, args.streams, **launcher_settings(mode))
            runs[mode] = lambda config=config: run_graph(wl, config, dask_gpustreams.get)
    walls: dict[str, list[float]] = {m: [] for m in modes}
    grown = dict.fromkeys(modes, 0)
    gc_seconds = dict.fromkeys(modes, 0.0)
    end = None
    with GcClock() as clock:
        while end is None or time.perf_counter() < end:
            for mode in modes:
                kernels.device_synchronize(backend)
                before = pool_bytes(backend)
                clock.take()
                t0 = time.perf_counter()
                results = runs[mode]()
                kernels.device_synchronize(backend)
                wall = (time.perf_counter() - t0) * 1e3
                problem = wl.check(results)
                del results
                if problem is not None:
                    print(f"{args.shape} {mode}: FAILED: {problem}")
                    return 1
                if end is not None:  # the first turn warms up
                    walls[mode].append(wall)
                    grown[mode] += pool_bytes(backend) - before
                    gc_seconds[mode] += clock.take()[0]
            end = end or time.perf_counter() + args.seconds
    groups = sorted({str(g) for r in live_runtimes() for g in r.host_tasks.groups()})
    for mode in modes:
        w = walls[mode]
        median = statistics.median(w)
        print(
            f"{args.shape} {mode} (in turn with {len(modes) - 1} other): {len(w)} computes of "
            f"{shape.n_tasks} tasks, median {median:.2f} ms [{min(w):.2f}-{max(w):.2f}] "
            f"({median * 1e3 / shape.n_tasks:.1f} us a task), pool grown "
            f"{grown[mode] / 2**20:.0f} MiB, gc {gc_seconds[mode] * 1e3 / len(w):.2f} ms a compute"
        )
    print(f"tile {gemm_ms:.4f} ms; host-task groups learned at the end: {groups or 'none'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
