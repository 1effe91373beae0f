"""Could a stream's progress be read from host memory instead of by event queries?

The launcher asks the device 2.6-2.9 event queries a task (``probe_launch_loop``), taken
to cost 1.5-3 us each on a busy H200 (at dfec613 this probe measured 0.17 us a query, and
2.85 us a counter write: ``benchmarks/results/h200-counters-dfec613/``). A stream memory
operation (``cuStreamWriteValue32``, called through ``ctypes`` on ``libcuda``) writes a
task's number into mapped pinned host memory once the stream's earlier work is complete;
reading it is a host load. This measures, on one GPU:

1. **Order**: a spin kernel of random length, then a write of ``i`` on the same stream;
   the host reads the counter at once (it must not show ``i`` yet for kernels that long),
   then polls until it shows ``i``, and at that moment queries an event recorded between
   the kernel and the write, which must be complete. Counts violations of either.
2. **Cost**, host us a call, on a device kept busy: an event record, an event query, a
   stream's wait on an event, a counter write, a counter read.

    python -m benchmarks.probes.probe_stream_counters --rounds 200
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import numpy as np

MAPPED = 0x02  # cudaHostAllocMapped
PORTABLE = 0x01  # cudaHostAllocPortable


def write_value_function():
    """``cuStreamWriteValue32`` of the driver (its ``_v2`` where there is one)."""
    libcuda = ctypes.CDLL("libcuda.so.1")
    for name in ("cuStreamWriteValue32_v2", "cuStreamWriteValue32"):
        f = getattr(libcuda, name, None)
        if f is not None:
            f.argtypes = (ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint)
            f.restype = ctypes.c_int
            return name, f
    raise RuntimeError("libcuda has no cuStreamWriteValue32")


def main(argv: list[str] | None = None) -> int:
    import cupy

    from benchmarks import kernels
    from dask_gpustreams.backends import create_backend

    p = argparse.ArgumentParser(prog="python -m benchmarks.probes.probe_stream_counters")
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--calls", type=int, default=2000)
    args = p.parse_args(argv)
    name, write = write_value_function()
    host = cupy.cuda.runtime.hostAlloc(4096, MAPPED | PORTABLE)
    counters = np.ctypeslib.as_array((ctypes.c_uint32 * 1024).from_address(host))
    counters[:] = 0
    stream = cupy.cuda.Stream(non_blocking=False)
    spin, spin_ms = kernels.calibrate_spin(create_backend("cupy"), 1.0, 1)
    x = cupy.zeros(spin.size, cupy.uint32)
    print(f"{name}; spin kernel {spin_ms:.3f} ms alone; {args.rounds} rounds")

    rng = np.random.default_rng(0)
    early = late = 0
    lags = []
    for i in range(1, args.rounds + 1):
        with stream:
            for _ in range(int(rng.integers(1, 4))):
                spin(i, x)
            before = cupy.cuda.Event(disable_timing=True)
            before.record(stream)
        status = write(stream.ptr, host, i, 0)
        if status != 0:
            print(f"FAILED: {name} returned CUresult {status}")
            return 1
        if counters[0] == i:
            early += 1  # shown before a kernel of at least a millisecond could end
        t0 = time.perf_counter()
        while counters[0] != i:
            pass
        lags.append(time.perf_counter() - t0)
        if not before.done:
            late += 1  # the counter moved while work before it was not complete
    stream.synchronize()
    print(
        f"order: shown before its kernels ended {early} of {args.rounds}; shown while an "
        f"event before it was incomplete {late}; host wait {statistics.median(lags) * 1e3:.2f} "
        "ms median"
    )

    def busy() -> None:
        with stream:
            for _ in range(4):
                spin(0, x)

    event = cupy.cuda.Event(disable_timing=True)
    other = cupy.cuda.Stream(non_blocking=False)
    calls = {
        "event record": lambda: event.record(stream),
        "event query": lambda: event.done,
        "stream wait": lambda: other.wait_event(event),
        "counter write": lambda: write(stream.ptr, host + 4, 7, 0),
        "counter read": lambda: counters[1],
    }
    print(f"{'call':<14} {'us a call':>10}  (median of 5 batches of {args.calls}, device busy)")
    for label, call in calls.items():
        batches = []
        for _ in range(5):
            busy()
            event.record(stream)
            t0 = time.perf_counter()
            for _ in range(args.calls):
                call()
            batches.append((time.perf_counter() - t0) / args.calls * 1e6)
            cupy.cuda.runtime.deviceSynchronize()
        print(f"{label:<14} {statistics.median(batches):10.2f}")
    cupy.cuda.runtime.freeHost(host)
    return 1 if early or late else 0


if __name__ == "__main__":
    raise SystemExit(main())
