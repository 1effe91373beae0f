"""How long a process takes to exit after a compute with the plugin on (issue 15's tests/gpu).

On the H200, ``pytest tests/gpu`` printed its summary and then did not exit for more than
25 s (rc 124 from ``timeout`` at bda1af9, fb64bbc, 57470ab, bf8671a and 0d54172). The
stacks printed 15 s after the session (``tests/gpu/conftest.py``) showed 9 threads inside
``weakref.finalize`` callbacks whose function is C code, and the main thread joining a
``ThreadPoolExecutor``'s 8 threads in ``concurrent.futures``' exit hook. This probe runs
one compute per child process, with the plugin on Dask's threaded scheduler (8 threads),
and prints the seconds from the end of the child's main to its exit, with and without
FFTs (the plugin gives each thread cuFFT plan caches of its own, per stream).

Answered: a single compute exits in 1.13 s with FFTs, 0.48 s without (H200, 5547e35), so
the cause lay in what the test session accumulates. A pytest plugin that logged each
``weakref.finalize`` after the session found it (``benchmarks/results/h200-exitdiag-69ddf50/``):
167 ends of CuPy ``PlanCache`` objects, one per (thread, stream), each a ``gc.collect()``,
248 s in all. 419ebfc replaced them (``backends/cufft_plans.py``).

``python -m benchmarks.probes.probe_exit --backend cupy``
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time

WORKLOADS = ("fft", "elementwise", "none")


def child(backend: str, workload: str) -> None:
    """One compute of ``workload`` with the plugin on, then the end of main, timestamped."""
    import dask
    import dask.array as da
    import numpy as np

    from benchmarks import kernels

    x = da.from_array(np.ones((4096, 4096)), chunks=1024).map_blocks(
        lambda t: kernels.to_device(backend, t)
    )
    if workload == "fft":
        import cupy

        y = x.map_blocks(lambda t: cupy.real(cupy.fft.ifft2(cupy.fft.fft2(t))))
    else:
        y = x * 2 + 1
    config = {"gpustreams.enabled": workload != "none", "gpustreams.backend": backend}
    with dask.config.set(config):
        y.sum().compute(scheduler="threads", num_workers=8)
    names = sorted(t.name for t in threading.enumerate() if t is not threading.main_thread())
    print(f"threads at the end of main: {len(names)}: {', '.join(names)}", flush=True)
    print(f"end of main {time.time():.6f}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="cupy", choices=("cupy", "sim"))
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is not None:
        child(args.backend, args.child)
        return 0
    for workload in args.workloads.split(","):
        if workload == "fft" and args.backend != "cupy":
            print("fft: skipped (CuPy only)")
            continue
        cmd = [sys.executable, "-m", "benchmarks.probes.probe_exit", "--backend", args.backend]
        try:
            done = subprocess.run(
                [*cmd, "--child", workload], capture_output=True, text=True, timeout=args.timeout
            )
        except subprocess.TimeoutExpired:
            print(f"{workload}: not exited after {args.timeout:.0f} s")
            continue
        exited = time.time()
        lines = done.stdout.splitlines()
        ends = [float(line.split()[-1]) for line in lines if line.startswith("end of main")]
        if done.returncode or not ends:
            print(f"{workload}: rc {done.returncode}\n{done.stderr[-2000:]}")
            continue
        threads = next((line for line in lines if line.startswith("threads")), "")
        print(f"{workload}: exit took {exited - ends[0]:.2f} s after main; {threads}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
