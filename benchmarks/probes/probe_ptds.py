"""With CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1: is an input the caller made just before compute
(its kernel still running on the caller's per-thread stream) read only after it is written?

Answered (H200): no, at ca2bda0, on the launcher, the threaded route and plain Dask's threads
(each delayed task read the array early: 4 wrong of 8 on each); yes at d9a6461 on the launcher
and the threaded route (``StreamRuntime.order_after_caller``), plain Dask's threads still
wrong (``benchmarks/results/h200-final-d9a6461/ptds.txt``). ``da.from_array`` came out right
in every run.

    python -m benchmarks.probes.probe_ptds
"""

import os
import sys

os.environ.setdefault("CUPY_CUDA_PER_THREAD_DEFAULT_STREAM", "1")

import cupy  # noqa: E402
import dask  # noqa: E402
import dask.array as da  # noqa: E402
from dask import delayed  # noqa: E402

import dask_gpustreams  # noqa: E402,F401  (scheduler="gpustreams")

ROUTES = (
    ("launcher", {"scheduler": "gpustreams"}, {}),
    ("enabled-threads", {"scheduler": "threads"}, {"gpustreams.enabled": True}),
    ("plain-threads", {"scheduler": "threads"}, {"gpustreams.enabled": False}),
)


def main() -> None:
    sys.path.insert(0, "tests/gpu")
    from kernels import spin_fill

    ptds = cupy.cuda.get_current_stream() == cupy.cuda.Stream.ptds
    print("ptds", ptds, os.environ["CUPY_CUDA_PER_THREAD_DEFAULT_STREAM"])
    n = 1 << 20
    cfg = {"gpustreams.backend": "cupy", "gpustreams.streams": 8}
    for route, kw, extra in ROUTES:
        bad = 0
        for trial in range(4):
            big = spin_fill(n, 3.0, 200)  # written after 200 ms on this thread's stream
            with dask.config.set({**cfg, **extra}):
                x = da.from_array(big, chunks=n // 8, asarray=False)
                got = float((x * 1.0).sum().compute(**kw))
                big2 = spin_fill(n, 5.0, 200)
                got2 = float(dask.compute(delayed(lambda a: (a * 1.0).sum())(big2), **kw)[0])
            bad += (got != 3.0 * n) + (got2 != 5.0 * n)
            print(
                f"{route:<16} trial {trial}: from_array {got:.1f} (want {3.0 * n:.1f}), "
                f"delayed {got2:.1f} (want {5.0 * n:.1f})",
                flush=True,
            )
        print(f"{route}: {bad} wrong of 8", flush=True)


if __name__ == "__main__":
    main()
