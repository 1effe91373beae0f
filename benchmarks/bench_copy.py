"""Copy/compute overlap of an existing dask.array pipeline: upload, kernel, download per chunk.

The pipeline is what users write today::

    da.from_array(host, chunks=...).map_blocks(cupy.asarray).map_blocks(kernel)
      .map_blocks(cupy.asnumpy)

and is run unchanged with the plugin off (Dask's threaded scheduler) and on
(``gpustreams.enabled``, which now runs it on the stream launcher, as ``docs/launcher.md``
says; the H200 runs cited in the docs ran it on the threaded scheduler. ``on``: the
default settings, ``pinned-pool-size: auto``; ``on-small``: a pinned pool of 8 chunks, so
most downloads are staged through it into pageable memory), beside
``ideal``: the same work written by hand on three streams (upload, compute,
download) with a ring of pinned buffers, no Dask. The ideal overlap bound, the
largest of total upload, total download and total compute time measured in
isolation, is printed beside each mode. Every sample is checked exactly; a wrong result
marks the mode FAILED (exit 1).

Outputs in ``--out`` (default ``benchmarks/results/copy-<backend>-<timestamp>/``, never
overwritten): ``results.json`` (meta; one row per mode with every sample, median, min, max
and IQR), ``results.csv`` and ``copy.png``. Runs before the suite (``h200-copy*/``) wrote
the same rows as ``copy.json`` and ``copy.csv``::

    python -m benchmarks.bench_copy                       # GPU if visible, else sim
    python -m benchmarks.bench_copy --backend sim --chunks 16 --chunk-mib 4
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

import dask
import dask.array as da
import numpy as np

import dask_gpustreams
from benchmarks import copy_kernels, report
from dask_gpustreams.backends import gpu_visible, host_device_count


@dataclass
class Row:
    mode: str
    median_ms: float
    min_ms: float
    max_ms: float
    gbps: float
    bound_ms: float
    of_bound: float
    speedup_vs_off: float = float("nan")
    of_ideal: float = float("nan")
    correct: bool = True
    iqr_ms: float = 0.0
    walls_ms: list[float] = field(default_factory=list)
    status: str = "ok"


class CupyOps:
    """Upload, kernel and download with CuPy."""

    name = "cupy"

    def __init__(self) -> None:
        import cupy

        self.xp = cupy
        self.upload, self.download = cupy.asarray, cupy.asnumpy
        copy_kernels.compile_add_loop(1)
        self.kernel = copy_kernels.add_loop

    @property
    def iters(self) -> int:
        return copy_kernels.iters()

    @iters.setter
    def iters(self, value: int) -> None:
        copy_kernels.compile_add_loop(value)

    def timed(self, fn, repeat: int = 5) -> float:
        """Median device time of ``fn()`` on the current stream, in ms."""
        cupy = self.xp
        times = []
        for _ in range(repeat):
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, end))
        return statistics.median(times)

    def ideal(self, host: np.ndarray, out: np.ndarray, ring: int = 4) -> None:
        """Three streams, a ring of pinned in/out buffers, event waits between them."""
        cupy = self.xp
        streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(3)]
        n = host.shape[1]
        pin_in = [cupy.cuda.alloc_pinned_memory(n * 4) for _ in range(ring)]
        pin_out = [cupy.cuda.alloc_pinned_memory(n * 4) for _ in range(ring)]
        pin_in = [np.frombuffer(p, np.float32, n) for p in pin_in]
        pin_out = [np.frombuffer(p, np.float32, n) for p in pin_out]
        freed = [None] * ring  # event after which the ring slot may be reused
        live = [None] * ring  # device arrays of the slot, held until its download is done
        pending = []
        up, comp, down = streams
        for i in range(host.shape[0]):
            slot = i % ring
            if freed[slot] is not None:
                freed[slot].synchronize()
                j = pending.pop(0)
                out[j] = pin_out[j % ring]
            np.copyto(pin_in[slot], host[i])
            with up:
                dev = cupy.empty(n, np.float32)
                dev.set(pin_in[slot], stream=up)
                e_up = up.record()
            comp.wait_event(e_up)
            with comp:
                res = self.kernel(dev)
                e_comp = comp.record()
            down.wait_event(e_comp)
            res.get(stream=down, out=pin_out[slot], blocking=False)
            freed[slot] = down.record()
            live[slot] = (dev, res)
            pending.append(i)
        for j in pending:
            freed[j % ring].synchronize()
            out[j] = pin_out[j % ring]
        for s in streams:
            s.synchronize()


class SimOps:
    """The same on the simulated device: the kernel sleeps ``kernel_ms`` then adds ``iters``."""

    name = "sim"

    def __init__(self, kernel_ms: float) -> None:
        from dask_gpustreams import sim

        self.sim = sim
        self.upload, self.download = sim.asarray, sim.asnumpy
        self.kernel_ms = kernel_ms
        self.iters = 3

    def kernel(self, x):
        sim = self.sim
        out = sim.empty(x.shape, x.dtype)
        iters, seconds = self.iters, self.kernel_ms / 1e3

        def add_loop(o, v):
            time.sleep(seconds)
            np.add(v, np.float32(iters), out=o)

        sim.launch(add_loop, out, x)
        return out

    def ideal(self, host: np.ndarray, out: np.ndarray) -> None:
        sim = self.sim
        device = sim.get_device()
        up, comp, down = (device.create_stream() for _ in range(3))
        results = []
        for i in range(host.shape[0]):
            with up:
                dev = sim.asarray(host[i])
                e_up = up.record()
            comp.wait_event(e_up)
            with comp:
                res = self.kernel(dev)
                e_comp = comp.record()
            down.wait_event(e_comp)
            results.append((dev, res))  # held until the streams are done with them
        down.synchronize()
        for i, (_, res) in enumerate(results):
            out[i] = res._view


def pipeline(ops, host: np.ndarray):
    meta = np.empty((0, 0), np.float32)
    x = da.from_array(host, chunks=(1, host.shape[1]))
    return (
        x.map_blocks(ops.upload, meta=meta)
        .map_blocks(ops.kernel, meta=meta)
        .map_blocks(ops.download, meta=meta)
    )


def measure(run, expected, samples: int, warmup: int) -> tuple[list[float], bool]:
    ok = True
    for _ in range(warmup):
        ok &= np.array_equal(run(), expected)
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        result = run()
        times.append((time.perf_counter() - t0) * 1e3)
        ok &= np.array_equal(result, expected)
    return times, ok


def calibrate_cupy(ops: CupyOps, n: int) -> dict[str, float]:
    """Isolated per-chunk upload, download and kernel times; kernel iterations set to match."""
    cupy = ops.xp
    pinned = np.frombuffer(cupy.cuda.alloc_pinned_memory(n * 4), np.float32, n)
    pinned[:] = 1
    dev = cupy.empty(n, np.float32)
    t_up = ops.timed(lambda: dev.set(pinned))
    t_down = ops.timed(lambda: dev.get(out=pinned, blocking=False))
    ops.iters = 16
    while ops.timed(lambda: ops.kernel(dev)) < t_up and ops.iters < 1 << 20:
        ops.iters *= 2
    t_kernel = ops.timed(lambda: ops.kernel(dev))
    return {"upload_ms": t_up, "download_ms": t_down, "kernel_ms": t_kernel}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=["auto", "cupy", "sim"], default="auto")
    parser.add_argument("--chunks", type=int, default=64)
    parser.add_argument("--chunk-mib", type=float, default=64.0)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--samples", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--sim-kernel-ms", type=float, default=20.0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    # A hardware queue for each compute stream and both copy streams, set before CUDA starts
    # (the driver reads it once; gpu_visible below already starts CUDA, before the runtime).
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", str(args.streams + 2))
    backend = args.backend
    if backend == "auto":
        backend = "cupy" if gpu_visible()[0] else "sim"
    out_dir = args.out or Path("benchmarks/results") / (
        f"copy-{backend}-{datetime.now():%Y%m%d-%H%M%S}"
    )
    if out_dir.exists() and any(out_dir.iterdir()):
        parser.error(f"--out {out_dir} is not empty: results are never overwritten")
    out_dir.mkdir(parents=True, exist_ok=True)
    n = int(args.chunk_mib * 2**20) // 4
    rng = np.random.default_rng(0)
    host = rng.integers(0, 1000, size=(args.chunks, n)).astype(np.float32)

    if backend == "cupy":
        ops = CupyOps()
        iso = calibrate_cupy(ops, n)
    else:
        ops = SimOps(args.sim_kernel_ms)
        iso = {"upload_ms": 0.0, "download_ms": 0.0, "kernel_ms": args.sim_kernel_ms}
    expected = host + np.float32(ops.iters)
    totals = {k: v * args.chunks for k, v in iso.items()}
    bound = max(totals.values())
    nbytes = 2 * host.nbytes  # up and down

    x = pipeline(ops, host)
    cfg_on = {
        "gpustreams.enabled": True,
        "gpustreams.backend": backend,
        "gpustreams.streams": args.streams,
    }
    # Room for 8 chunks: dask.array's compute holds every result until it
    # concatenates, so all but 8 downloads are staged into pageable memory.
    cfg_small = {**cfg_on, "gpustreams.pinned-pool-size": 8 * host[0].nbytes}

    def ideal():
        out = np.empty_like(host)  # a new result each time, as dask.array's compute makes
        ops.ideal(host, out)
        return out

    modes = [
        ("off", {}, x.compute),
        ("on", cfg_on, x.compute),
        ("on-small", cfg_small, x.compute),
        ("ideal", {}, ideal),
    ]
    rows = []
    for mode, cfg, run in modes:
        with dask.config.set(cfg):
            times, ok = measure(run, expected, args.samples, args.warmup)
        med = statistics.median(times)
        gbps = nbytes / med / 1e6
        row = Row(mode, med, min(times), max(times), gbps, bound, bound / med, correct=ok)
        row.iqr_ms = report.summarize(times)["wall_iqr_ms"]
        row.walls_ms = times
        row.status = "ok" if ok else "FAILED"
        rows.append(row)
    off = next(r for r in rows if r.mode == "off").median_ms
    ideal_ms = next(r for r in rows if r.mode == "ideal").median_ms
    for r in rows:
        r.speedup_vs_off = off / r.median_ms
        r.of_ideal = ideal_ms / r.median_ms

    header = (
        f"{'mode':8} {'median ms':>10} {'min':>8} {'max':>8} {'GB/s':>7} {'bound ms':>9} "
        f"{'of bound':>8} {'vs off':>7} {'of ideal':>8}  correct"
    )
    print(
        f"backend={backend} chunks={args.chunks} x {args.chunk_mib} MiB, streams={args.streams}, "
        f"CUDA_DEVICE_MAX_CONNECTIONS={os.environ['CUDA_DEVICE_MAX_CONNECTIONS']}, "
        f"isolated per chunk: " + ", ".join(f"{k}={v:.3f}" for k, v in iso.items())
    )
    print(header)
    for r in rows:
        print(
            f"{r.mode:8} {r.median_ms:10.1f} {r.min_ms:8.1f} {r.max_ms:8.1f} {r.gbps:7.1f} "
            f"{r.bound_ms:9.1f} {r.of_bound:8.2f} {r.speedup_vs_off:7.2f} {r.of_ideal:8.2f}  "
            f"{'yes' if r.correct else 'FAILED'}"
        )

    command = sys.argv[1:] if argv is None else argv
    meta = {
        "command": " ".join(
            [os.path.basename(sys.executable), "-m", "benchmarks.bench_copy", *command]
        ),
        "backend": backend,
        "chunks": args.chunks,
        "chunk_mib": args.chunk_mib,
        "streams": args.streams,
        "cuda_device_max_connections": os.environ["CUDA_DEVICE_MAX_CONNECTIONS"],
        "isolated_per_chunk_ms": iso,
        "totals_ms": totals,
        "bound_ms": bound,
        "kernel_iters": ops.iters,
        "pinned_pool_size_auto": dask_gpustreams.config.auto_pinned_pool_size(
            host_device_count(backend)
        ),
        "dask_gpustreams": dask_gpustreams.__version__,
        "dask": dask.__version__,
        "source_digest": report.source_digest(),
    }
    dicts = [asdict(r) for r in rows]
    report.write_json(str(out_dir / "results.json"), meta, dicts)
    report.write_csv(str(out_dir / "results.csv"), dicts, [f for f in dicts[0] if f != "walls_ms"])
    plot(rows, bound, out_dir / "copy.png", meta)
    print(f"wrote {out_dir}")
    return 0 if all(r.correct for r in rows) else 1


def plot(rows: list[Row], bound: float, path: Path, meta: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    names = [r.mode for r in rows]
    ax.bar(names, [r.median_ms for r in rows], color=["#999", "#2a7", "#8c6", "#36c"])
    ax.errorbar(
        names,
        [r.median_ms for r in rows],
        yerr=[[r.median_ms - r.min_ms for r in rows], [r.max_ms - r.median_ms for r in rows]],
        fmt="none",
        ecolor="black",
        capsize=3,
    )
    ax.axhline(bound, color="red", ls="--", label="overlap bound")
    ax.set_ylabel("wall time per pipeline (ms)")
    ax.set_title(
        f"upload/kernel/download, {meta['chunks']} x {meta['chunk_mib']:g} MiB ({meta['backend']})"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
