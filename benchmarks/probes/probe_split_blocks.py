"""Do small task outputs pin split blocks of CuPy's pool, one per stream, under the launcher?

On a nearly full H200 the launcher ran out of memory on elementwise with 1.5x plain sync's
need left, where plain sync passed, and CuPy's pool then held 320 MiB beyond its used bytes
that ``free_all_blocks()`` did not release (``benchmarks/results/h200-memory-ce2e6a9/``). The
reading to check: each task's small output (a row of sums) is carved out of a free 64 MiB
block of its own stream's arena, and a block split so cannot be freed while a part of it is
in use, so each stream pins one such block for as long as those outputs live.

This persists elementwise's small outputs (``(sin(x)**2 + x*0.5).sum(axis=1)``, 64 chunks
of 64 MiB, 8 result chunks of 16 KiB) under plain sync and under the launcher on 8, 2 and 1
streams, then frees every cached block and prints what the pool still holds beyond its used
bytes (``pinned``): blocks that ``free_all_blocks()`` cannot give back. Each result is
checked against plain sync's.

Since then the launcher allocates small requests apart (``gpustreams.small-blocks``, default
1 MiB); the mode ``apart off`` runs it without, as before.

Answered on the H200 at 42dd4fd (``benchmarks/results/h200-split-42dd4fd/``): yes. With
0.12 MiB of results alive the pool pinned 63.9 MiB under plain sync and the launcher on one
stream, 127.9 MiB on 2 streams and 383.9 MiB on 8. The simulated device's pool splits and
merges chunks as CuPy's does, so ``--backend sim`` shows the same on the CPU (with its
smaller chunks), for work on a fix without a GPU.

    python -m benchmarks.probes.probe_split_blocks
    python -m benchmarks.probes.probe_split_blocks --backend sim --small-blocks '64 KiB'
"""

from __future__ import annotations

import argparse

import dask
import numpy as np

from benchmarks import bench_workloads as bw
from dask_gpustreams import sim

MIB = 2**20
#: (label, scheduler, streams, small blocks apart): None is ``--small-blocks``, 0 off.
MODES = (
    ("sync", "sync", 8, None),
    ("launcher, 8 streams", "gpustreams", 8, None),
    ("launcher, 8, apart off", "gpustreams", 8, 0),
    ("launcher, 2 streams", "gpustreams", 2, None),
    ("launcher, 1 stream", "gpustreams", 1, None),
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="cupy", choices=("cupy", "sim"))
    p.add_argument(
        "--small-blocks",
        default="1 MiB",
        help="gpustreams.small-blocks of the launcher's modes but 'apart off' (the sim's "
        "chunks are 256 KiB: give it less, e.g. '64 KiB')",
    )
    args = p.parse_args(argv)
    arrays = bw.make_arrays(args.backend)
    sizes = bw.sizes_for(args.backend, False)["elementwise"]
    if args.backend == "cupy":
        import cupy

        pool = cupy.get_default_memory_pool()
    else:
        pool = sim.get_default_memory_pool()
    reference = None
    print(f"{'mode':<22} {'used MiB':>9} {'pinned MiB':>11}  check")
    for label, scheduler, streams, small in MODES:
        (y,) = bw.WORKLOADS["elementwise"].build(arrays, sizes)
        config = {
            "gpustreams.enabled": False,
            "gpustreams.streams": streams,
            "gpustreams.backend": args.backend,
            "gpustreams.small-blocks": args.small_blocks if small is None else small,
        }
        with dask.config.set(config):
            y.persist(scheduler=scheduler)  # a warm-up: every arena grown once
            arrays.synchronize()
            pool.free_all_blocks()
            base = pool.used_bytes()
            kept = y.persist(scheduler=scheduler)
            arrays.synchronize()
        pool.free_all_blocks()
        used, pinned = pool.used_bytes() - base, pool.total_bytes() - pool.used_bytes()
        value = np.asarray(arrays.download(kept.compute(scheduler="sync")))
        if reference is None:
            reference = value
        ok = np.allclose(value, reference, rtol=1e-5, atol=1e-6)
        print(f"{label:<22} {used / MIB:9.2f} {pinned / MIB:11.1f}  {'ok' if ok else 'WRONG'}")
        del kept
        pool.free_all_blocks()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
