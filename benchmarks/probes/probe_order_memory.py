"""What each launch order holds: ``dask.order`` against the depth-first order, on the sim.

For graphs where one chunk feeds two reductions (``x.max() - x.min()``, ``x.mean()``
with ``x.std()``), for single trees (``x.sum()``) and for graphs where chunks are
shared more widely (a matmul, a stencil, a cumsum), runs the launcher
(``scheduler="gpustreams"``, 8 streams, small blocks off) with each
``gpustreams.launch-order`` and prints the device memory used at its peak (the
simulated pool's ``used_bytes`` after each allocation, ``bench_workloads.PoolPeaks``) and
the most launched intermediates not yet read by all their consumers. Then again
with the pool capped at ``--cap-mib``, as a device nearly full would be. Every
result is checked against Dask's synchronous scheduler::

    python -m benchmarks.probes.probe_order_memory
"""

from __future__ import annotations

import argparse
import warnings

import dask
import dask.array as da
import numpy as np
from dask.callbacks import Callback
from dask.core import flatten

from benchmarks.bench_workloads import PoolPeaks
from dask_gpustreams import sim

F4 = np.float32
ORDERS = ("dask", "depth-first")


def _fill(block_info=None):
    info = block_info[None]
    rng = np.random.default_rng(info["chunk-location"])
    return sim.asarray(rng.random(info["chunk-shape"], dtype=F4))


def chunks(n: int, c: int) -> da.Array:
    """An ``n*c`` square of sim chunks, rechunked to ``2c`` so no fusion hides them."""
    return da.map_blocks(
        _fill,
        chunks=da.core.normalize_chunks(c, (n * c, n * c)),
        dtype=F4,
        meta=sim.empty((0, 0), F4),
    ).rechunk(2 * c)


GRAPHS = {
    "x.max() - x.min()": lambda x: [x.max() - x.min()],
    "x.min(), x.max()": lambda x: [x.min(), x.max()],
    "x.mean(), x.std()": lambda x: [x.mean(), x.std()],
    "x.sum()": lambda x: [x.sum()],
    "(x @ x).sum()": lambda x: [(x @ x).sum()],
    "map_overlap sum": lambda x: [x.map_overlap(lambda b: b * 2, depth=1, boundary="none").sum()],
    "x.cumsum(0).sum()": lambda x: [x.cumsum(axis=0).sum()],
}


class Held(Callback):
    """The most launched intermediates whose consumers have not all launched."""

    def __init__(self, outputs) -> None:
        super().__init__()
        self.outputs = set(outputs)
        self.live = self.most = 0

    def _start_state(self, dsk, state):
        self.deps = state["dependencies"]
        self.readers = {}
        for deps in self.deps.values():
            for d in deps:
                if d in self.deps:
                    self.readers[d] = self.readers.get(d, 0) + 1

    def _pretask(self, key, dsk, state):
        for d in self.deps[key]:
            if d in self.readers:
                self.readers[d] -= 1
                if not self.readers[d] and d not in self.outputs:
                    self.live -= 1
        if key not in self.outputs:
            self.live += 1
        self.most = max(self.most, self.live)


def run(make, order: str, cap: int) -> str:
    """One compute of ``make()`` with ``order``, the pool capped at ``cap`` bytes (0: not)."""
    pool = sim.get_default_memory_pool()
    collections = make()
    outputs = [k for c in collections for k in flatten(c.__dask_keys__())]
    held = Held(outputs)
    peaks = PoolPeaks(pool)
    peaks.reset(free=True)
    pool.set_capacity(cap)
    pool.malloc = peaks.track(pool.malloc)  # this instance only, removed below
    config = {
        "gpustreams.backend": "sim",
        "gpustreams.streams": 8,
        "gpustreams.small-blocks": 0,
        "gpustreams.launch-order": order,
    }
    try:
        with dask.config.set(config), held:
            got = dask.compute(*collections, scheduler="gpustreams")
        want = dask.compute(*collections, scheduler="sync")
        same = all(np.allclose(g.get(), w.get()) for g, w in zip(got, want, strict=True))
        status = "ok" if same else "WRONG"
    except Exception as e:  # a run out of device memory is a result here
        status = type(e).__name__
    finally:
        del pool.malloc
        pool.set_capacity(0)
    return f"{peaks.peak_used / 2**20:7.1f} MiB {held.most:5d} {status:<17}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.probes.probe_order_memory")
    p.add_argument("--n", type=int, default=24, help="chunks a side before the rechunk")
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--cap-mib", type=int, default=32)
    args = p.parse_args(argv)
    warnings.simplefilter("ignore", da.PerformanceWarning)  # the matmul's chunks, as meant
    size = (args.n * args.chunk) ** 2 * 4 / 2**20
    print(f"x: {size:.0f} MiB of float32 sim chunks; peak used, most intermediates held, status")
    for cap in (0, args.cap_mib << 20):
        print(f"pool capped at {cap >> 20} MiB" if cap else "pool not capped")
        print(f"  {'graph':<20}" + "".join(f"{o:<36}" for o in ORDERS))
        for name, graph in GRAPHS.items():
            cells = [run(lambda g=graph: g(chunks(args.n, args.chunk)), o, cap) for o in ORDERS]
            print(f"  {name:<20}" + "".join(f"{c:<36}" for c in cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
