"""Does the launcher fail, or slow down, where plain Dask's device memory just fits?

The launcher's CuPy pool holds more than plain sync's (free blocks in one arena per stream,
and up to ``gpustreams.launch-ahead`` of outputs whose kernels have not completed). CuPy frees
every arena's free blocks and retries when ``cudaMalloc`` fails, so the free blocks alone
should cost a device sync, not an error. This probe checks it on the device: per workload
it measures what plain sync needs on top of the inputs (its pool's peak ``total_bytes()``
less the bytes in use before the run), fills the rest of the device with a ballast
(``cudaMalloc`` outside the pool) so that ``--headroom`` times that need is left, and
runs plain sync, plain threads (Dask's default) and the launcher there, in turn, each
result checked against plain sync's without the ballast, kept on the host (small device
arrays kept alive pin the larger blocks CuPy split for them, as a first version's reference
did). Rows without a ballast are the baseline. A run that fails is reported with its error,
not retried.

    python -m benchmarks.probes.probe_memory_pressure --workloads elementwise,matmul,qr,delayed

CuPy only: the simulated device has no capacity.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import dask

from benchmarks import bench_workloads as bw

MODES = {
    "sync": {"scheduler": "sync"},
    "threads": {"scheduler": "threads"},
    "launcher": {"scheduler": "gpustreams"},
}
MIB = 2**20


def run_mode(
    arrays: bw.CupyArrays, wl: bw.Workload, collections: tuple, ref: tuple, mode: str, reps: int
) -> dict:
    """One warm-up and ``reps`` timed computes of ``mode``: median ms, pool peak, errors."""
    pool = arrays.xp.get_default_memory_pool()
    walls, problems = [], []
    for i in range(reps + 1):
        t0 = time.perf_counter()
        try:
            with dask.config.set(bw.OFF):
                out = dask.compute(*collections, **MODES[mode])
            arrays.synchronize()
        except Exception as e:  # reported: whether the launcher fails here is the question
            return {"status": f"FAILED {type(e).__name__}: {str(e)[:120]}", "held": None}
        if i:
            walls.append(time.perf_counter() - t0)
        problems += [
            p
            for o, r in zip(out, ref, strict=True)
            if (p := bw.problem(arrays, arrays.xp.asnumpy(o), r, wl.tol))
        ]
        del out
    status = "WRONG " + problems[0] if problems else "ok"
    return {"status": status, "ms": statistics.median(walls) * 1e3, "held": pool.total_bytes()}


def need_of_sync(arrays: bw.CupyArrays, collections: tuple) -> int:
    """Bytes plain sync's pool holds at its peak beyond those in use before it runs."""
    pool = arrays.xp.get_default_memory_pool()
    pool.free_all_blocks()
    before = pool.used_bytes()
    with dask.config.set(bw.OFF):
        out = dask.compute(*collections, scheduler="sync")
    arrays.synchronize()
    del out
    return pool.total_bytes() - before


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="elementwise,matmul,qr,delayed,fft")
    p.add_argument("--headroom", type=float, default=1.10, help="free memory / sync's need")
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    if args.headroom < 1.0:
        p.error(f"--headroom={args.headroom} is invalid: plain sync itself needs 1.0")
    arrays = bw.make_arrays("cupy")
    cupy = arrays.xp
    runtime = cupy.cuda.runtime
    pool = cupy.get_default_memory_pool()
    sizes = bw.sizes_for("cupy", False, {})
    print(
        f"{'workload':<12} {'ballast':>8} {'mode':<9} {'median ms':>10} {'held MiB':>9} "
        f"{'need MiB':>9}  status"
    )
    for name in args.workloads.split(","):
        wl = bw.WORKLOADS[name]
        collections = wl.build(arrays, sizes[name])
        with dask.config.set(bw.OFF):
            # On the host: a device reference's small blocks would pin larger cached ones.
            ref = tuple(cupy.asnumpy(r) for r in dask.compute(*collections, scheduler="sync"))
        arrays.synchronize()
        need = need_of_sync(arrays, collections)
        for ballasted in (False, True):
            pool.free_all_blocks()
            ballast: Any = None
            if ballasted:
                free = runtime.memGetInfo()[0]
                ballast = runtime.malloc(max(0, free - int(args.headroom * need)))
            try:
                for mode in MODES:
                    pool.free_all_blocks()
                    r = run_mode(arrays, wl, collections, ref, mode, args.reps)
                    ms = f"{r['ms']:10.1f}" if "ms" in r else f"{'-':>10}"
                    held = f"{r['held'] / MIB:9.0f}" if r["held"] is not None else f"{'-':>9}"
                    label = f"{args.headroom:.2f}x" if ballasted else "none"
                    print(
                        f"{name:<12} {label:>8} {mode:<9} {ms} {held} {need / MIB:9.0f}  "
                        f"{r['status']}",
                        flush=True,
                    )
            finally:
                if ballast is not None:
                    runtime.free(ballast)
        del ref, collections
        pool.free_all_blocks()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
