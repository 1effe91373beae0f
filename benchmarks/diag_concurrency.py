"""Where does concurrency go? The same 4 x 6 chains of spin kernels, five ways."""

import sys
import time

import cupy
import dask

import dask_gpustreams
from dask_gpustreams import StreamsConfig, get_runtime
from dask_gpustreams.runtime import EventRegistry

MS = 5.0
spin = cupy.RawKernel(
    r"""extern "C" __global__ void spin(long long cycles) {
        long long start = clock64(); while (clock64() - start < cycles) { } }""",
    "spin",
)
cycles = int(MS * cupy.cuda.Device().attributes["ClockRate"])


def node(*inputs):
    spin((1,), (32,), (cycles,))
    return cupy.ones(4)


def timed(fn, label):
    fn()
    t0 = time.perf_counter()
    fn()
    cupy.cuda.Device().synchronize()
    print(f"{label:40} {(time.perf_counter() - t0) * 1e3:7.1f} ms", flush=True)


def hand(non_blocking):
    streams = [cupy.cuda.Stream(non_blocking=non_blocking) for _ in range(4)]

    def run():
        for _ in range(6):
            for s in streams:
                with s:
                    node()
        for s in streams:
            s.synchronize()

    return run


def runtime_direct(policy):
    rt = get_runtime(StreamsConfig(backend="cupy", streams=8, policy=policy))

    def run():
        reg = EventRegistry()
        for i in range(4):
            prev = None
            for d in range(6):
                key = f"n-{i}-{d}"
                inputs = {prev: reg_values[prev]} if prev else {}
                reg_values[key] = rt.run(key, lambda inp: node(*inp.values()), inputs, reg)
                prev = key
        rt.synchronize(list(reg_values), reg)

    reg_values = {}
    return run


def via_dask(policy, scheduler="threads"):
    outs = []
    for _ in range(4):
        v = None
        for _ in range(6):
            v = dask.delayed(node, pure=False)(*([v] if v is not None else []))
        outs.append(v)
    cfg = {"gpustreams.enabled": True, "gpustreams.backend": "cupy", "gpustreams.policy": policy}

    def run():
        with dask.config.set(cfg):
            dask.compute(*outs, scheduler=scheduler)

    return run


print("serial bound", 24 * MS, "ms; 4-wide bound", 6 * MS, "ms")
timed(hand(False), "hand, 4 blocking streams")
timed(hand(True), "hand, 4 non-blocking streams")
for p in ("round-robin", "affinity", "auto"):
    timed(runtime_direct(p), f"runtime.run direct, {p}")
for p in ("round-robin", "affinity", "auto"):
    timed(via_dask(p), f"dask threaded, {p}")
timed(via_dask("auto", "sync"), "dask sync scheduler, auto")
print(dask_gpustreams.__version__, file=sys.stderr)
