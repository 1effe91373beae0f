"""Where the copy pipeline's time goes: the chunk pipeline against dask.array's concatenation.

Answered (H200, 7a25ed2; ``docs/guide.md``, "Copy/compute overlap"): computing the 64 chunks
took 1571 ms with the plugin off and 167 ms with every result pinned, while Dask's final
concatenation of the 4 GiB result took 1.1-1.2 s in every mode: it caps the end-to-end ratio.

Runs ``bench_copy``'s pipeline per mode as ``persist`` (every chunk computed,
results kept apart) and then ``np.concatenate`` of those chunks, which is what
``compute`` adds; prints the median of each beside ``compute`` itself::

    python -m benchmarks.probes.probe_copy --chunks 64 --chunk-mib 64
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import dask
import numpy as np

from benchmarks import bench_copy
from dask_gpustreams.backends import gpu_visible


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--chunks", type=int, default=64)
    p.add_argument("--chunk-mib", type=float, default=64.0)
    p.add_argument("--samples", type=int, default=5)
    a = p.parse_args(argv)
    backend = "cupy" if gpu_visible()[0] else "sim"
    n = int(a.chunk_mib * 2**20) // 4
    host = np.random.default_rng(0).integers(0, 1000, size=(a.chunks, n)).astype(np.float32)
    ops = bench_copy.CupyOps() if backend == "cupy" else bench_copy.SimOps(20.0)
    if backend == "cupy":
        bench_copy.calibrate_cupy(ops, n)
    expected = host + np.float32(ops.iters)
    x = bench_copy.pipeline(ops, host)
    on = {"gpustreams.enabled": True, "gpustreams.backend": backend, "gpustreams.streams": 8}
    modes = {
        "off": {},
        "on": on,
        "on-small": {**on, "gpustreams.pinned-pool-size": 8 * host[0].nbytes},
    }
    print(f"{'mode':8} {'compute ms':>10} {'persist ms':>10} {'concat ms':>10}  correct")
    for mode, cfg in modes.items():
        walls = {"compute": [], "persist": [], "concat": []}
        ok = True
        with dask.config.set(cfg):
            for rep in range(a.samples + 1):
                t0 = time.perf_counter()
                full = x.compute()
                t1 = time.perf_counter()
                chunks = dask.compute(*x.to_delayed().ravel())
                t2 = time.perf_counter()
                joined = np.concatenate(chunks)
                t3 = time.perf_counter()
                ok &= np.array_equal(full, expected) and np.array_equal(joined, expected)
                if rep:
                    walls["compute"].append(t1 - t0)
                    walls["persist"].append(t2 - t1)
                    walls["concat"].append(t3 - t2)
                del full, chunks, joined
        med = {k: statistics.median(v) * 1e3 for k, v in walls.items()}
        print(
            f"{mode:8} {med['compute']:10.1f} {med['persist']:10.1f} {med['concat']:10.1f}  "
            f"{'yes' if ok else 'FAILED'}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
