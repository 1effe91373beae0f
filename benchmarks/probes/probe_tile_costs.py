"""What a Dagger gemm tile (0.08 ms) costs the host, call by call and task by task.

Dagger's tiles are the one family where the launcher is host-bound against plain sync
(``probe_dagger_host``: 77-92 us a task against plain sync's 61, while its no-op tasks
cost less than plain sync's). Two parts, on one GPU (``--backend cupy``):

1. **Calls** (CuPy only): the host time of one tile's ``cublas.gemm`` (accumulating into
   ``C``) and of one ``cupy.matmul`` (a new tile): on the legacy default stream, as plain
   Dask runs them; on one pool stream; taking 8 pool streams in turn; and in turn under the
   launcher's allocator (``launch_allocator``). Then an event's record, a stream's wait
   for it and its query, on a busy device. Calls go in batches of ``--batch``, with a
   device sync between batches that is not timed (the device must not fall so far behind
   that a launch blocks).
2. **Tasks**: each Dagger shape under plain sync and the launcher (default, 1 stream,
   ``round-robin``, no allocator), modes in turn for ``--rounds`` rounds, with the tile
   kernel timed where it is called: per task, the host time until the last task is
   launched, the kernel calls' share of it, and the rest (the scheduler's or the
   launcher's own); a new tile's call and an accumulation's apart (us a call); and how
   much the device's memory pool grew during the run. Every result is checked.

    python -m benchmarks.probes.probe_tile_costs --backend cupy --rounds 7
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

import dask_gpustreams
from benchmarks import bench_shapes, kernels
from benchmarks.probes.probe_dagger_host import OFF, HostMarks, launcher_config, run_graph
from benchmarks.workloads import IdealLauncher, gemm_workload
from dask_gpustreams.backends import create_backend, resolve_backend
from dask_gpustreams.config import StreamsConfig


class TimedKernel:
    """The tile kernel, adding each call's host time to :attr:`seconds`: a new tile's
    (``a @ b``) at index 0, an accumulation's (``c += a @ b``) at index 1."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.seconds = [0.0, 0.0]
        self.calls = [0, 0]

    def reset(self) -> None:
        self.seconds = [0.0, 0.0]
        self.calls = [0, 0]

    def __call__(self, *args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self.kernel(*args)
        finally:
            kind = len(args) > 2
            self.seconds[kind] += time.perf_counter() - t0
            self.calls[kind] += 1


def pool_bytes(backend: str) -> int:
    """What the device's default memory pool holds (CuPy's or the sim's)."""
    if backend == "cupy":
        import cupy

        return cupy.get_default_memory_pool().total_bytes()
    from dask_gpustreams import sim

    return sim.get_default_memory_pool().total_bytes()


def per_call_us(call: Callable[[int], Any], calls: int, batch: int) -> float:
    """Median over batches of the host time of one ``call(i)``, in us (syncs not timed)."""
    import cupy

    times = []
    i = 0
    while i < calls:
        cupy.cuda.runtime.deviceSynchronize()
        t0 = time.perf_counter()
        for _ in range(batch):
            call(i)
            i += 1
        times.append((time.perf_counter() - t0) / batch * 1e6)
    cupy.cuda.runtime.deviceSynchronize()
    return statistics.median(times)


def call_costs(tile: int, calls: int, batch: int) -> None:
    """Part 1: per-call host time of a tile's CuPy calls on the default and pool streams."""
    import cupy
    import cupy.cublas

    backend = create_backend("cupy")
    streams = [backend.create_stream() for _ in range(8)]
    rng = cupy.random.default_rng(0)
    a, b = (rng.standard_normal((tile, tile), dtype=cupy.float32) for _ in range(2))
    outs = [cupy.zeros((tile, tile), cupy.float32) for _ in range(8)]
    config = StreamsConfig()

    def gemm(i: int) -> None:
        cupy.cublas.gemm("N", "N", a, b, out=outs[i % 8], alpha=1.0, beta=1.0)

    def matmul(i: int) -> None:
        cupy.matmul(a, b)

    def on(stream_of: Callable[[int], Any], fn: Callable[[int], None]) -> Callable[[int], None]:
        def call(i: int) -> None:
            with stream_of(i):
                fn(i)

        return call

    def turn(i: int) -> Any:
        return streams[i % 8]

    def one(i: int) -> Any:
        return streams[0]

    rows: list[tuple[str, float]] = []
    for name, fn in (("gemm, into C", gemm), ("matmul, new tile", matmul)):
        rows.append((f"{name}: legacy default stream", per_call_us(fn, calls, batch)))
        rows.append((f"{name}: one pool stream", per_call_us(on(one, fn), calls, batch)))
        rows.append((f"{name}: 8 pool streams in turn", per_call_us(on(turn, fn), calls, batch)))
        with backend.launch_allocator(streams, config.small_blocks, config.large_tasks):
            rows.append(
                (f"{name}: 8 in turn, launch allocator", per_call_us(on(turn, fn), calls, batch))
            )
    events = [backend.create_event() for _ in range(calls)]

    def busy(i: int) -> None:  # keeps the device busy under the event calls
        with streams[i % 8]:
            gemm(i)

    def record(i: int) -> None:
        busy(i)
        backend.record(events[i], streams[i % 8])

    def record_wait(i: int) -> None:
        record(i)
        backend.wait_event(streams[(i + 1) % 8], events[i])

    def record_query(i: int) -> None:
        record(i)
        backend.done(events[i])

    base = per_call_us(busy, calls, batch)
    for name, fn in (("event record", record), ("+ wait", record_wait), ("+ query", record_query)):
        net = per_call_us(fn, calls, batch) - base
        rows.append((f"{name} (busy device; net of the gemm)", net))
    print(f"\n== Calls: {tile}^2 float32 tiles, median us a call over batches of {batch}")
    for name, us in rows:
        print(f"  {name:<52} {us:8.2f}")


def task_costs(backend: str, shapes: str, streams: int, rounds: int) -> bool:
    """Part 2: per task, host time, the kernel calls' share, and the rest; False if wrong."""
    shape_args = bench_shapes.parse_args(["--backend", backend, "--families", "dagger"])
    bench_shapes.set_defaults(shape_args, backend)
    gemm_ms = bench_shapes.calibrate(shape_args, backend)["gemm_ms"]
    marks = HostMarks(IdealLauncher(create_backend(backend), streams))
    modes: dict[str, tuple[dict, Callable]] = {
        "plain sync": (OFF, marks.plain_sync),
        "launcher": (launcher_config(backend, streams), dask_gpustreams.get),
        "launcher, 1 stream": (launcher_config(backend, 1), dask_gpustreams.get),
        "launcher, round-robin": (
            launcher_config(backend, streams, **{"gpustreams.policy": "round-robin"}),
            dask_gpustreams.get,
        ),
        "launcher, no allocator": (
            launcher_config(
                backend, streams, **{"gpustreams.small-blocks": 0, "gpustreams.large-tasks": 0}
            ),
            dask_gpustreams.get,
        ),
    }
    print(
        f"\n== Tasks: {backend}, {streams} streams, tile gemm {gemm_ms:.4f} ms alone, "
        f"{rounds} rounds"
    )
    print(
        f"{'shape':<10} {'mode':<24} {'tasks':>6} {'wall ms':>8} {'host us/task':>13} "
        f"{'kernel us':>10} {'rest us':>8} {'new us':>7} {'acc us':>7} {'grown MiB':>10}"
    )
    ok = True
    for name in shapes.split(","):
        shape = bench_shapes.make_shape(shape_args, "dagger", name)
        wl = gemm_workload(shape, backend, shape_args.matrix, gemm_ms)
        timed = TimedKernel(wl.kernel)
        wl = dataclasses.replace(wl, kernel=timed)
        got: dict[str, list[tuple[float, ...]]] = {label: [] for label in modes}
        for k in range(rounds + 1):  # round 0 warms up
            for label, (cfg, get) in modes.items():
                kernels.device_synchronize(backend)
                marks.last = None
                timed.reset()
                held = pool_bytes(backend)
                t0 = time.perf_counter()
                results = run_graph(wl, cfg, get)
                kernels.device_synchronize(backend)
                t1 = time.perf_counter()
                grown = (pool_bytes(backend) - held) / 2**20
                problem = wl.check(results)
                if problem is not None:
                    print(f"{name} {label}: FAILED: {problem}")
                    ok = False
                if k and marks.last is not None:
                    n = shape.n_tasks
                    host = (marks.last - t0) / n * 1e6
                    kernel = sum(timed.seconds) / n * 1e6
                    new, acc = (
                        t / max(c, 1) * 1e6 for t, c in zip(timed.seconds, timed.calls, strict=True)
                    )
                    got[label].append(((t1 - t0) * 1e3, host, kernel, new, acc, grown))
        for label, samples in got.items():
            wall, host, kernel, new, acc, grown = (
                statistics.median(s[i] for s in samples) for i in range(6)
            )
            print(
                f"{name:<10} {label:<24} {shape.n_tasks:>6} {wall:8.2f} {host:13.1f} "
                f"{kernel:10.1f} {host - kernel:8.1f} {new:7.1f} {acc:7.1f} {grown:10.1f}",
                flush=True,
            )
    return ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.probes.probe_tile_costs")
    p.add_argument("--backend", default="auto", choices=("auto", "cupy", "sim"))
    p.add_argument("--shapes", default="linear,diamond,chainlink,tangled")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tile", type=int, default=1024, help="part 1's tile edge (Dagger's: 1024)")
    p.add_argument("--calls", type=int, default=2048)
    p.add_argument("--batch", type=int, default=64)
    args = p.parse_args(argv)
    backend = resolve_backend(args.backend)
    if backend == "cupy":
        call_costs(args.tile, args.calls, args.batch)
    else:
        print("== Calls: skipped (CuPy only)")
    return 0 if task_costs(backend, args.shapes, args.streams, args.rounds) else 1


if __name__ == "__main__":
    raise SystemExit(main())
