"""What each launch order holds: ``dask.order`` against the depth-first order, on the sim.

For graphs where one chunk feeds two reductions (``x.max() - x.min()``, ``x.mean()``
with ``x.std()``), for single trees (``x.sum()``), for graphs where chunks are
shared more widely (a matmul, a stencil, a cumsum) and for one where the depth-first
order's early last reader holds more (:func:`expand_after_sum`), runs the launcher
(``scheduler="gpustreams"``, 8 streams, small blocks off) with each
``gpustreams.launch-order`` and prints the device memory used at its peak (the
simulated pool's ``used_bytes`` after each allocation, ``bench_workloads.PoolPeaks``) and
the most launched intermediates not yet read by all their consumers. Then again
with the pool capped at ``--cap-mib``, as a device nearly full would be. Every
result is checked against Dask's synchronous scheduler, computed before the peaks are
tracked; the sim's peaks depend on timing, hence ``--samples``::

    python -m benchmarks.probes.probe_order_memory
"""

from __future__ import annotations

import argparse
import statistics
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


@dask.delayed(pure=True)
def _load(i: int, seed: int):
    rng = np.random.default_rng((seed, i))
    return sim.asarray(rng.random((512, 512), dtype=F4))  # 1 MiB


@dask.delayed(pure=True)
def _total(parts):
    return sum(p.sum() for p in parts)


@dask.delayed(pure=True)
def _expand8(a):
    return a[:, :, None] * sim.asarray(np.arange(1, 9, dtype=F4))


@dask.delayed(pure=True)
def _combine(e, z):
    return (e + z[:, :, None]).sum(axis=2)


def expand_after_sum(n: int = 64) -> list:
    """``sum(x_i)`` and ``sum(combine(expand8(x_i), z_i))`` (delayed, 1 MiB each ``x_i``):
    ``expand8(x_i)`` is ``x_i``'s last reader once its sum has run, 8 times its size, and its
    consumer waits for ``z_i``, which the walk reaches with the second output."""
    xs = [_load(i, 0) for i in range(n)]
    zs = [_load(i, 1) for i in range(n)]
    return [
        _total([x.sum() for x in xs]),
        _total([_combine(_expand8(x), z) for x, z in zip(xs, zs, strict=True)]),
    ]


GRAPHS = {
    "x.max() - x.min()": lambda x: [x.max() - x.min()],
    "x.min(), x.max()": lambda x: [x.min(), x.max()],
    "x.mean(), x.std()": lambda x: [x.mean(), x.std()],
    "x.sum()": lambda x: [x.sum()],
    "(x @ x).sum()": lambda x: [(x @ x).sum()],
    "map_overlap sum": lambda x: [x.map_overlap(lambda b: b * 2, depth=1, boundary="none").sum()],
    "x.cumsum(0).sum()": lambda x: [x.cumsum(axis=0).sum()],
    "expand8 after sum": lambda x: expand_after_sum(),
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


def run(make, order: str, cap: int, samples: int) -> str:
    """``samples`` computes of ``make()`` with ``order``, the pool capped at ``cap`` bytes (0:
    not): the median and the largest peak used, the most intermediates held, the status."""
    pool = sim.get_default_memory_pool()
    collections = make()
    outputs = [k for c in collections for k in flatten(c.__dask_keys__())]
    want = dask.compute(*collections, scheduler="sync")  # before the peaks are tracked
    config = {
        "gpustreams.backend": "sim",
        "gpustreams.streams": 8,
        "gpustreams.small-blocks": 0,
        "gpustreams.launch-order": order,
    }
    used, most, statuses = [], 0, []
    for _ in range(samples):
        held = Held(outputs)
        peaks = PoolPeaks(pool)
        peaks.reset(free=True)
        pool.set_capacity(cap)
        pool.malloc = peaks.track(pool.malloc)  # this instance only, removed below
        try:
            with dask.config.set(config), held:
                got = dask.compute(*collections, scheduler="gpustreams")
            same = all(np.allclose(g.get(), w.get()) for g, w in zip(got, want, strict=True))
            statuses.append("ok" if same else "WRONG")
        except Exception as e:  # a run out of device memory is a result here
            statuses.append(type(e).__name__)
        finally:
            del pool.malloc
            pool.set_capacity(0)
        used.append(peaks.peak_used / 2**20)
        most = max(most, held.most)
    status = "ok" if set(statuses) == {"ok"} else "/".join(sorted(set(statuses) - {"ok"}))
    return f"{statistics.median(used):7.1f} ({max(used):7.1f}) MiB {most:5d} {status:<10}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.probes.probe_order_memory")
    p.add_argument("--n", type=int, default=24, help="chunks a side before the rechunk")
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--cap-mib", type=int, default=32)
    p.add_argument("--samples", type=int, default=3, help="computes per graph and order")
    args = p.parse_args(argv)
    warnings.simplefilter("ignore", da.PerformanceWarning)  # the matmul's chunks, as meant
    size = (args.n * args.chunk) ** 2 * 4 / 2**20
    print(
        f"x: {size:.0f} MiB of float32 sim chunks; peak used, median (largest) of"
        f" {args.samples}, most intermediates held, status"
    )
    for cap in (0, args.cap_mib << 20):
        print(f"pool capped at {cap >> 20} MiB" if cap else "pool not capped")
        print(f"  {'graph':<22}" + "".join(f"{o:<40}" for o in ORDERS))
        for name, graph in GRAPHS.items():
            make = lambda g=graph: g(chunks(args.n, args.chunk))  # noqa: E731
            cells = [run(make, o, cap, args.samples) for o in ORDERS]
            print(f"  {name:<22}" + "".join(f"{c:<40}" for c in cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
