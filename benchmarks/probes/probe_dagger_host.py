"""Where does the launcher lose on Dagger's gemm tiles (0.08 ms), against plain sync and the ideal?

For each Dagger shape, modes in turn for ``--rounds`` rounds: plain Dask's synchronous
scheduler, the launcher (default settings), the launcher without its allocator
(``small-blocks`` and ``large-tasks`` 0), the launcher on one stream, the launcher that
never waits for its launch-ahead (16 GiB), and the hand launch
(``ideal:layers``) on the same streams. It also prints the host time to launch every task,
per task: until the launcher's final sync starts, the ideal's stream syncs, or plain sync's
last task returns. Then a cProfile of plain sync and of the launcher on ``linear``. Every
result is checked against the reference.

    python -m benchmarks.probes.probe_dagger_host --backend cupy --rounds 5
"""

from __future__ import annotations

import argparse
import cProfile
import statistics
import time

import dask
from dask.callbacks import Callback

import dask_gpustreams
from benchmarks import bench_shapes, kernels, report
from benchmarks.workloads import IdealLauncher, gemm_workload, ideal_plan
from dask_gpustreams.backends import create_backend, resolve_backend
from dask_gpustreams.runtime.runtime import StreamRuntime

OFF = {"gpustreams.enabled": False}


def launcher_config(backend: str, streams: int, **extra: object) -> dict:
    return {**OFF, "gpustreams.backend": backend, "gpustreams.streams": streams, **extra}


class HostMarks:
    """The time each launch ends: when the launcher or the ideal starts its final sync."""

    def __init__(self, ideal: IdealLauncher) -> None:
        self.last: float | None = None
        sync = StreamRuntime.synchronize
        stream_sync = ideal.backend.synchronize_stream

        def runtime_sync(runtime, *args, **kwargs):
            self.last = self.last or time.perf_counter()
            return sync(runtime, *args, **kwargs)

        def ideal_sync(stream):
            self.last = self.last or time.perf_counter()
            return stream_sync(stream)

        StreamRuntime.synchronize = runtime_sync
        ideal.backend.synchronize_stream = ideal_sync

    def plain_sync(self, dsk, keys):
        """``dask.get``, marking the end of each task: the last one's is plain sync's."""

        def posttask(key, result, dsk, state, worker_id):
            self.last = time.perf_counter()

        with Callback(posttask=posttask):
            return dask.get(dsk, keys)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.probes.probe_dagger_host")
    p.add_argument("--backend", default="auto", choices=("auto", "cupy", "sim"))
    p.add_argument("--shapes", default="linear,diamond,chainlink,tangled")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    backend = resolve_backend(args.backend)
    shape_args = bench_shapes.parse_args(["--backend", backend, "--families", "dagger"])
    bench_shapes.set_defaults(shape_args, backend)
    gemm_ms = bench_shapes.calibrate(shape_args, backend)["gemm_ms"]
    ideal = IdealLauncher(create_backend(backend), args.streams)
    marks = HostMarks(ideal)
    n = args.streams
    modes = {
        "plain sync": (OFF, marks.plain_sync),
        "launcher": (launcher_config(backend, n), dask_gpustreams.get),
        "launcher, no allocator": (
            launcher_config(
                backend, n, **{"gpustreams.small-blocks": 0, "gpustreams.large-tasks": 0}
            ),
            dask_gpustreams.get,
        ),
        "launcher, 1 stream": (launcher_config(backend, 1), dask_gpustreams.get),
        "launcher, ahead 16 GiB": (
            launcher_config(backend, n, **{"gpustreams.launch-ahead": "16 GiB"}),
            dask_gpustreams.get,
        ),
    }
    print(f"backend {backend}, {n} streams, tile gemm {gemm_ms:.4f} ms alone; {args.rounds} rounds")
    print(
        f"{'shape':<10} {'mode':<24} {'tasks':>6} {'wall ms':>8} {'range':>14} {'host us/task':>13}"
    )
    failed = False
    for name in args.shapes.split(","):
        shape = bench_shapes.make_shape(shape_args, "dagger", name)
        wl = gemm_workload(shape, backend, shape_args.matrix, gemm_ms)
        plan = ideal_plan(wl, n, "layers")
        runs = {
            **{
                label: (lambda cfg=cfg, get=get, wl=wl: run_graph(wl, cfg, get))
                for label, (cfg, get) in modes.items()
            },
            "ideal:layers": lambda wl=wl, plan=plan: ideal.run(wl, plan),
        }
        walls: dict[str, list[float]] = {label: [] for label in runs}
        hosts: dict[str, list[float]] = {label: [] for label in runs}
        for k in range(args.rounds + 1):  # round 0 warms up
            for label, go in runs.items():
                kernels.device_synchronize(backend)
                marks.last = None
                t0 = time.perf_counter()
                results = go()
                kernels.device_synchronize(backend)
                t1 = time.perf_counter()
                problem = wl.check(results)
                if problem is not None:
                    print(f"{name} {label}: FAILED: {problem}")
                    failed = True
                if k:
                    walls[label].append((t1 - t0) * 1e3)
                    if marks.last is not None:
                        hosts[label].append((marks.last - t0) / shape.n_tasks * 1e6)
        for label in runs:
            w = walls[label]
            host = f"{statistics.median(hosts[label]):13.1f}" if hosts[label] else f"{'-':>13}"
            print(
                f"{name:<10} {label:<24} {shape.n_tasks:>6} {statistics.median(w):8.2f} "
                f"{min(w):6.2f}-{max(w):<7.2f} {host}",
                flush=True,
            )
    shape = bench_shapes.make_shape(shape_args, "dagger", "linear")
    wl = gemm_workload(shape, backend, shape_args.matrix, gemm_ms)
    for label in ("plain sync", "launcher"):
        cfg, get = modes[label]
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(3):
            run_graph(wl, cfg, get)
        prof.disable()
        kernels.device_synchronize(backend)
        print(f"\ncProfile, {label} on linear ({shape.n_tasks} tasks) x 3:")
        print(report.profile_text(prof, 30))
    return 1 if failed else 0


def run_graph(wl, config: dict, get):
    """``wl``'s graph, with a fresh token, through ``get`` under ``config`` (also used by
    ``probe_tile_costs``)."""
    dsk, keys = wl.graph(next(bench_shapes._tokens))
    with dask.config.set(config):
        return get(dsk, keys)


if __name__ == "__main__":
    raise SystemExit(main())
