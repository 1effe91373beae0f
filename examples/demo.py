"""Independent GPU work runs concurrently once Dask tasks run on a pool of streams.

Builds four DAG shapes (linear, diamond, chainlink, tangled; W wide, D deep)
of ``dask.delayed`` tasks whose kernel spins for a set time, runs each with
the plugin on 1 stream and on N streams, checks every result and prints the
wall times. Uses the GPU through CuPy when one is visible, else the simulated
stream device (``dask_gpustreams.sim``), where kernels sleep on stream threads.

    python examples/demo.py [--streams 8] [--kernel-ms 20] [--width 4] [--depth 6]
                            [--scheduler gpustreams|threads]

``--scheduler gpustreams`` (the default) runs each graph on the stream launcher;
``threads`` runs it on Dask's threads with ``gpustreams.enabled`` (``dask.threaded.get``:
by name, ``scheduler="threads"`` would run the launcher too), each task through the runtime.
"""

from __future__ import annotations

import argparse
import random
import time

import dask
import dask.threaded
import numpy as np

import dask_gpustreams
from dask_gpustreams import StreamsConfig
from dask_gpustreams.backends import gpu_visible


def sim_kernel(ms: float):
    from dask_gpustreams import sim

    def node(*inputs):
        out = sim.empty(4)

        def body(o, *xs):
            time.sleep(ms / 1e3)
            o[...] = sum(xs) + 1.0

        sim.launch(body, out, *inputs)
        return out

    return node, sim.asnumpy


def cupy_kernel(ms: float):
    import cupy

    spin = cupy.RawKernel(
        r"""extern "C" __global__ void spin(long long cycles) {
            long long start = clock64(); while (clock64() - start < cycles) { } }""",
        "spin",
    )
    cycles = int(ms * cupy.cuda.Device().attributes["ClockRate"])

    def node(*inputs):
        spin((1,), (32,), (cycles,))
        return sum(inputs, cupy.ones(4)) if inputs else cupy.ones(4)

    return node, cupy.asnumpy


def shape(name: str, width: int, depth: int) -> dict[tuple, list[tuple]]:
    """Dependencies of each node (layer, index) of a wide DAG shape."""
    rng = random.Random(0)
    deps: dict[tuple, list[tuple]] = {}
    for d in range(depth):
        if name == "diamond" and d % 2 == 1:
            deps[(d, 0)] = [(d - 1, i) for i in range(width)]  # fan-in
            continue
        for i in range(width):
            if d == 0:
                deps[(d, i)] = []
            elif name == "linear":
                deps[(d, i)] = [(d - 1, i)]
            elif name == "diamond":
                deps[(d, i)] = [(d - 1, 0)]  # fan-out
            elif name == "chainlink":
                deps[(d, i)] = [(d - 1, i), (d - 1, (i + 1) % width)]
            else:  # tangled: two random nodes of the two previous layers
                previous = [n for n in deps if n[0] in (d - 1, d - 2)]
                deps[(d, i)] = rng.sample(previous, 2)
    return deps


def build(deps, node):
    values = {}
    for n, ds in deps.items():
        values[n] = dask.delayed(node, pure=False)(*(values[d] for d in ds))
    sinks = set(deps) - {d for ds in deps.values() for d in ds}
    return [values[s] for s in sorted(sinks)], sorted(sinks)


def expected(deps, sinks):
    value = {}
    for n, ds in deps.items():
        value[n] = sum(value[d] for d in ds) + 1.0
    return [value[s] for s in sinks]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--kernel-ms", type=float, default=20.0)
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--scheduler", choices=("gpustreams", "threads"), default="gpustreams")
    args = parser.parse_args()
    try:
        StreamsConfig(streams=args.streams)  # the library's range and message
    except ValueError as e:
        parser.error(str(e))
    for flag, value in (("--width", args.width), ("--depth", args.depth)):
        if value < 1:
            parser.error(f"{flag} {value}: a shape needs at least 1")
    if args.kernel_ms <= 0:
        parser.error(f"--kernel-ms {args.kernel_ms:g}: the kernels need a duration above 0")

    backend = "cupy" if gpu_visible()[0] else "sim"
    make = cupy_kernel if backend == "cupy" else sim_kernel
    node, to_numpy = make(args.kernel_ms)
    print(
        f"dask-gpustreams {dask_gpustreams.__version__}: {backend} backend, "
        f"{args.kernel_ms:g} ms kernels, {args.width} x {args.depth} DAGs, "
        f"scheduler={args.scheduler!r}"
    )
    many = f"{args.streams} stream" + ("s" if args.streams != 1 else "")
    print(f"{'shape':10} {'tasks':>5} {'1 stream':>10} {many:>11} {'speedup':>8}")
    for name in ("linear", "diamond", "chainlink", "tangled"):
        deps = shape(name, args.width, args.depth)
        outputs, sinks = build(deps, node)
        want = expected(deps, sinks)
        walls = []
        scheduler = dask.threaded.get if args.scheduler == "threads" else "gpustreams"
        for streams in (1, args.streams):
            cfg = {
                "gpustreams.enabled": args.scheduler == "threads",
                "gpustreams.backend": backend,
                "gpustreams.streams": streams,
            }
            with dask.config.set(cfg):
                dask.compute(*outputs, scheduler=scheduler)  # warm-up: streams, kernels
                t0 = time.perf_counter()
                got = dask.compute(*outputs, scheduler=scheduler)
                walls.append(time.perf_counter() - t0)
            for g, w in zip(got, want, strict=True):
                np.testing.assert_array_equal(to_numpy(g), np.full(4, w))
        print(
            f"{name:10} {len(deps):5d} {walls[0] * 1e3:8.0f} ms {walls[1] * 1e3:8.0f} ms "
            f"{walls[0] / walls[1]:7.1f}x"
        )
    print("all results exact")


if __name__ == "__main__":
    main()
