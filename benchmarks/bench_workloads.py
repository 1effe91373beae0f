"""Ordinary ``dask.array`` and ``dask.delayed`` workloads under plain Dask and the plugin.

Run from the repository root (see ``benchmarks/README.md``)::

    python -m benchmarks.bench_workloads --backend cupy      # the H200 run, about 4 minutes
    python -m benchmarks.bench_workloads --backend sim --quick
    python -m benchmarks.bench_workloads --backend cupy --dry-run   # task counts, no run
    python -m benchmarks.bench_workloads --workloads rechunk --set rechunk.n=16384

Modes, all in one run, on the same persisted inputs, in turn, ``--rounds`` times (default 2),
each round with its warm-up and its share of ``--samples`` (the H200's host times drift:
plain sync's std took 260 to 438 ms within 5 samples at 71dc3df):

- ``threads``: plain Dask's default threaded scheduler (``gpustreams.enabled: False``);
- ``sync``: plain Dask, ``scheduler="sync"``;
- ``launcher``: the stream launcher, ``scheduler="gpustreams"`` (SKIPPED where this
  ``dask_gpustreams`` does not register it);
- ``enabled-threads``: the plugin by config, ``gpustreams.enabled: True``, on Dask's
  threads asked for as such, ``scheduler=dask.threaded.get`` (with no scheduler named, or
  ``"threads"`` by name, ``gpustreams.enabled`` runs the launcher);
- ``enabled-sync``: the plugin by config with ``scheduler="sync"`` by name: the launcher
  with every task on the calling thread, host tasks too.

Not in the default set: ``threads-1`` and ``enabled-1``, plain Dask's threaded scheduler
and the plugin by config, each with ``num_workers=1`` passed to the compute (one task at a
time, for a library that is not thread-safe: the launcher with every task on the calling
thread), compared with each other; and the diagnostic modes (:data:`DIAGNOSTIC_MODES`).

Backends: ``cupy`` (CuPy chunks), ``sim`` (chunks on the simulated device, uploaded with
``map_blocks(sim.asarray)``; the slicing stencil of ``numpy`` instead of ``ndimage``) and
``numpy`` (NumPy chunks, the plugin on the sim backend: a cheap check of the harness).
Speedups: against the better plain mode (``min(threads, sync)`` by median) and against
``threads``, as ratios of medians; ``paired`` is the median over rounds of each round's
ratio, which a host that drifts between rounds moves less (use more ``--rounds`` for it).
A workload that plain Dask cannot run on the sim is SKIPPED with the reason. Each sample
is timed between device syncs and checked against plain Dask's ``sync`` result, computed
once: exactly, or with ``allclose`` where a floating reduction, matmul or FFT may sum in
another order. Peak device memory per mode: ``peak_held`` (the pool's ``total_bytes()`` after each
sample, the pool's blocks freed before the mode's first warm-up run only, so the timed
runs find it warm as repeated computes do; the pool does not shrink during a run) and
``peak_used`` (the largest ``used_bytes()`` seen by a tracking allocator, on during the
timed runs). Each run starts after a full garbage collection, outside its time: on
the H200 garbage collections of 85-130 ms within a matmul compute
and fell into random samples of every mode (``probes/probe_slow_samples``,
``h200-slow-bb8d33a``); the collections a run's own allocations start stay in its
time. Importing ``bench_shapes`` sets ``CUDA_DEVICE_MAX_CONNECTIONS=32`` unless
set, before CuPy starts.

Outputs in ``--out`` (default ``benchmarks/results/workloads-<backend>-<timestamp>/``,
never overwritten): ``results.json``, ``results.csv``, ``table.txt``, ``speedup.png`` and
``rows.jsonl`` (written as rows complete).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import gc
import json
import logging
import math
import operator
import os
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import dask
import dask.array as da
import dask.base
import dask.threaded
import numpy as np
from dask._task_spec import Task

import dask_gpustreams  # noqa: F401  (registers gpustreams.* and the launcher, where it exists)
from benchmarks import bench_shapes, kernels, report
from dask_gpustreams import sim
from dask_gpustreams.backends import resolve_backend

MODES = ("threads", "sync", "launcher", "enabled-threads", "enabled-sync")
#: Modes for finding where the launcher loses (not in the default set): one stream, so the
#: launcher's host path without concurrency on the device; the round-robin policy; less
#: of the graph launched ahead of the device (its memory against its speed); for its
#: memory, 2 streams, no large tasks (every task on any stream), no small-block arenas and
#: no shared large blocks (an arena per stream); 1, 2 (the default) or 4 host threads (host
#: tasks at once, each holding its device memory); and each launch order, whichever is the
#: default.
DIAGNOSTIC_MODES = {
    "launcher-1": {"gpustreams.streams": 1},
    "launcher-rr": {"gpustreams.policy": "round-robin"},
    "launcher-ahead192": {"gpustreams.launch-ahead": "192 MiB"},
    "launcher-ahead128": {"gpustreams.launch-ahead": "128 MiB"},
    "launcher-ahead64": {"gpustreams.launch-ahead": "64 MiB"},
    "launcher-2": {"gpustreams.streams": 2},
    "launcher-nolarge": {"gpustreams.large-tasks": 0},
    "launcher-nosmall": {"gpustreams.small-blocks": 0},
    "launcher-noshared": {"gpustreams.shared-blocks": 0},
    "launcher-shared1": {"gpustreams.shared-blocks": "1 MiB"},
    "launcher-host1": {"gpustreams.host-threads": 1},
    "launcher-host2": {"gpustreams.host-threads": 2},
    "launcher-host4": {"gpustreams.host-threads": 4},
    "launcher-depth-first": {"gpustreams.launch-order": "depth-first"},
    "launcher-dask-order": {"gpustreams.launch-order": "dask"},
}
#: One thread asked for with ``num_workers=1``: plain Dask, and the plugin by config.
ONE_THREAD_MODES = ("threads-1", "enabled-1")
BACKENDS = ("auto", "cupy", "sim", "numpy")
F4 = np.float32
OFF = {"gpustreams.enabled": False}
CSV_FIELDS = (
    "workload",
    "mode",
    "backend",
    "n_tasks",
    "samples",
    "wall_median_ms",
    "wall_min_ms",
    "wall_max_ms",
    "wall_iqr_ms",
    "peak_held",
    "peak_used",
    "base_bytes",
    "speedup_vs_best",
    "paired_vs_best",
    "speedup_vs_threads",
    "check",
    "status",
    "error",
)


# --- backends -------------------------------------------------------------------------------------


class PoolPeaks:
    """Peaks of a memory pool over one sample: bytes held, and bytes used (tracked on malloc)."""

    def __init__(self, pool: Any):
        self.pool = pool
        self.base = self.peak_used = 0
        self._lock = threading.Lock()

    def track(self, malloc: Callable) -> Callable:
        """``malloc`` that records the pool's ``used_bytes()`` after each allocation.

        It wraps ``malloc`` (``functools.wraps``), so the launcher still knows it draws
        from the pool (``Backend.launch_allocator``).
        """

        @functools.wraps(malloc)
        def tracked(*args: Any) -> Any:
            memory = malloc(*args)
            used = self.pool.used_bytes()
            with self._lock:
                self.peak_used = max(self.peak_used, used)
            return memory

        return tracked

    def reset(self, free: bool) -> None:
        """Start a sample's peak; ``free``: first drop the pool's cached blocks (cold pool)."""
        if free:
            self.pool.free_all_blocks()
        self.base = self.peak_used = self.pool.used_bytes()

    def read(self) -> dict:
        return {
            "peak_held": self.pool.total_bytes(),
            "peak_used": self.peak_used,
            "base_bytes": self.base,
        }


class NumpyArrays:
    """``--backend numpy``: NumPy chunks on the host, the plugin on the sim backend.

    ``plan``: inputs are zero-stride views (for counting tasks at any size, no run).
    """

    name = "numpy"
    plugin = "sim"
    xp: Any = np
    upload = staticmethod(np.asarray)
    download = staticmethod(np.asarray)

    def __init__(self, plan: bool = False):
        self.plan = plan

    def meta(self, ndim: int) -> Any:
        return np.empty((0,) * ndim, F4)

    def host_block(self, shape: tuple, seed: tuple) -> np.ndarray:
        """Uniform ``[0, 1)`` float32 host data of ``seed``."""
        if self.plan:
            return np.broadcast_to(F4(0.5), shape)
        return np.random.default_rng(seed).random(shape, dtype=F4)

    def block(self, shape: tuple, seed: tuple) -> Any:
        """A device array of :meth:`host_block`'s kind."""
        return self.host_block(shape, seed)

    def blocks(self, count: int, shape: tuple, seed: int) -> list:
        return [self.block(shape, (seed, i)) for i in range(count)]

    def random(self, shape: tuple, chunks: Any, seed: int) -> da.Array:
        """A persisted array of :meth:`block` chunks (plugin off), its data on the device."""
        x = da.map_blocks(
            partial(_fill, self.block, seed),
            chunks=da.core.normalize_chunks(chunks, shape, dtype=F4),
            dtype=F4,
            meta=self.meta(len(shape)),
        )
        with dask.config.set(OFF):
            x = x.persist(scheduler="sync")
        self.synchronize()
        return x

    def stencil(self, x: da.Array) -> da.Array:
        """A 5-point Laplacian by slicing, on tiles with a one-element halo."""
        return x.map_overlap(
            _laplacian, depth=1, boundary="reflect", trim=False, chunks=x.chunks, meta=x._meta
        )

    def comparable(self, x: Any) -> tuple[Any, Any]:
        """``(module, array)`` to check ``x`` with."""
        return np, np.asarray(x)

    def synchronize(self) -> None:
        kernels.device_synchronize("sim")

    def memory(self) -> contextlib.AbstractContextManager[PoolPeaks | None]:
        """Peak tracking of the device pool while the context is open (None: no device)."""
        return contextlib.nullcontext(None)


class SimArrays(NumpyArrays):
    """``--backend sim``: chunks on the simulated device (``map_blocks(sim.asarray)``)."""

    name = "sim"
    upload = staticmethod(sim.asarray)
    download = staticmethod(sim.asnumpy)

    def meta(self, ndim: int) -> Any:
        return sim.empty((0,) * ndim, F4)

    def block(self, shape: tuple, seed: tuple) -> Any:
        return sim.asarray(self.host_block(shape, seed))

    def comparable(self, x: Any) -> tuple[Any, Any]:
        return np, sim.asnumpy(x)

    @contextlib.contextmanager
    def memory(self) -> Iterator[PoolPeaks]:
        pool = sim.get_default_memory_pool()
        peaks = PoolPeaks(pool)
        pool.malloc = peaks.track(pool.malloc)  # this instance only, removed below
        try:
            yield peaks
        finally:
            del pool.malloc


class CupyArrays(NumpyArrays):
    """``--backend cupy``: CuPy chunks; ``cupyx.scipy.ndimage`` for the stencil."""

    name = "cupy"
    plugin = "cupy"

    def __init__(self, allocator: str = "pool") -> None:
        import cupy

        super().__init__()
        self.xp = cupy
        #: ``pool``: CuPy's default pool (an arena per stream); ``async``: a
        #: ``cupy.cuda.MemoryAsyncPool`` (``cudaMallocAsync``: blocks reused across streams
        #: in stream order) that keeps what it freed (release threshold at its maximum: at
        #: CUDA's default of 0 each sync hands the memory back, and plain sync took 1.9x as
        #: long on elementwise on the H200), for every mode alike.
        self.allocator = allocator
        self.upload = cupy.asarray
        self.download = cupy.asnumpy

    def meta(self, ndim: int) -> Any:
        return self.xp.empty((0,) * ndim, F4)

    def block(self, shape: tuple, seed: tuple) -> Any:
        return self._state(seed).random_sample(shape, dtype=F4)

    def blocks(self, count: int, shape: tuple, seed: int) -> list:
        state = self._state((seed,))
        return [state.random_sample(shape, dtype=F4) for _ in range(count)]

    def _state(self, seed: tuple) -> Any:
        return self.xp.random.RandomState(int(np.random.SeedSequence(seed).generate_state(1)[0]))

    def stencil(self, x: da.Array) -> da.Array:
        from cupyx.scipy import ndimage

        return x.map_overlap(
            partial(ndimage.uniform_filter, size=5), depth=2, boundary="reflect", meta=x._meta
        )

    def comparable(self, x: Any) -> tuple[Any, Any]:
        return self.xp.get_array_module(x), x

    def synchronize(self) -> None:
        self.xp.cuda.Device().synchronize()

    @contextlib.contextmanager
    def memory(self) -> Iterator[PoolPeaks]:
        cupy = self.xp
        runtime = cupy.cuda.runtime
        pool, mempool, threshold = cupy.get_default_memory_pool(), None, None
        if self.allocator == "async":
            pool = cupy.cuda.MemoryAsyncPool()
            mempool = runtime.deviceGetMemPool(cupy.cuda.Device().id)
            attribute = runtime.cudaMemPoolAttrReleaseThreshold
            threshold = runtime.memPoolGetAttribute(mempool, attribute)
            runtime.memPoolSetAttribute(mempool, attribute, 2**64 - 1)
        peaks = PoolPeaks(pool)
        previous = cupy.cuda.get_allocator()
        cupy.cuda.set_allocator(peaks.track(pool.malloc))
        try:
            yield peaks
        finally:
            cupy.cuda.set_allocator(previous)
            if mempool is not None:
                runtime.memPoolSetAttribute(mempool, attribute, threshold)


def _fill(make: Callable, seed: int, block_info: dict | None = None) -> Any:
    info = block_info[None]
    return make(tuple(info["chunk-shape"]), (seed, *info["chunk-location"]))


def _laplacian(b: Any) -> Any:
    c = b[1:-1, 1:-1]
    return c * 4 - b[:-2, 1:-1] - b[2:, 1:-1] - b[1:-1, :-2] - b[1:-1, 2:]


def _tile_fft(xp: Any, b: Any) -> Any:
    return xp.real(xp.fft.ifft2(xp.fft.fft2(b)))


def sim_has_ops() -> bool:
    """Whether ``sim.SimArray`` has NumPy's operators (``sim.asarray(np.ones(3)) + 1``)."""
    try:
        sim.asarray(np.ones(3)) + 1  # noqa: B018
    except TypeError:
        return False
    return True


def make_arrays(backend: str, allocator: str = "pool") -> NumpyArrays:
    if backend == "cupy":
        return CupyArrays(allocator)
    return SimArrays() if backend == "sim" else NumpyArrays()


# --- workloads ------------------------------------------------------------------------------------


def elementwise(a: NumpyArrays, p: dict) -> tuple:
    x = a.random((p["n"], p["n"]), p["chunk"], seed=1)
    return ((da.sin(x) ** 2 + x * 0.5).sum(axis=1),)


def transpose(a: NumpyArrays, p: dict) -> tuple:
    x = a.random((p["n"], p["n"]), p["chunk"], seed=2)
    return ((x + x.T).mean(axis=0),)


def value_range(a: NumpyArrays, p: dict) -> tuple:
    """Each computed chunk of ``y`` feeds two reductions (its max and its min): the shape
    where a launch order that finishes one reduction first holds all of ``y``."""
    y = a.random((p["n"], p["n"]), p["chunk"], seed=13) * 2 + 1
    return (y.max(axis=0) - y.min(axis=0),)


def std(a: NumpyArrays, p: dict) -> tuple:
    x = a.random((p["n"], p["n"]), p["chunk"], seed=3)
    return (((x * 2 + 1) ** 2 - x).std(axis=0),)


def matmul(a: NumpyArrays, p: dict) -> tuple:
    x = a.random((p["n"], p["n"]), p["chunk"], seed=4)
    y = a.random((p["n"], p["n"]), p["chunk"], seed=5)
    return (x @ y,)


def stencil(a: NumpyArrays, p: dict) -> tuple:
    return (a.stencil(a.random((p["n"], p["n"]), p["chunk"], seed=6)),)


def small_chunks(a: NumpyArrays, p: dict) -> tuple:
    y = a.random((p["n"], p["n"]), p["chunk"], seed=7)
    for _ in range(p["ops"]):
        y = da.sqrt(y * 1.5 + 0.25)
    return (y,)


def fft(a: NumpyArrays, p: dict) -> tuple:
    x = a.random((p["n"], p["n"]), p["chunk"], seed=8)
    return (x.map_blocks(partial(_tile_fft, a.xp), dtype=F4, meta=x._meta),)


def rechunk(a: NumpyArrays, p: dict) -> tuple:
    x = a.random((p["n"], p["n"]), p["chunk"], seed=9)
    return ((x.rechunk(p["to"]) * 3 + 1).sum(axis=0),)


def qr(a: NumpyArrays, p: dict) -> tuple:
    x = a.random((p["rows"] * p["chunks"], p["cols"]), (p["rows"], p["cols"]), seed=10)
    return da.linalg.qr(x)


def tiny_tasks(a: NumpyArrays, p: dict) -> tuple:
    level = [
        dask.delayed(b, name=f"tiny-leaf-{i}")
        for i, b in enumerate(a.blocks(p["leaves"], (p["size"],), seed=11))
    ]
    depth = 0
    while len(level) > 1:
        pairs = zip(level[::2], level[1::2], strict=False)
        nxt = [
            dask.delayed(operator.add)(x, y, dask_key_name=f"tiny-add-{depth}-{i}")
            for i, (x, y) in enumerate(pairs)
        ]
        level = nxt + level[2 * len(nxt) :]
        depth += 1
    return (level[0],)


def pipeline(a: NumpyArrays, p: dict) -> tuple:
    host = a.host_block((p["n"], p["n"]), (12,))
    x = da.from_array(host, chunks=p["chunk"], name=f"workloads-host-{p['n']}-{p['chunk']}")
    y = x.map_blocks(a.upload, dtype=F4, meta=a.meta(2))
    z = da.sqrt(y) * 2 + 1
    return (z.map_blocks(a.download, dtype=F4, meta=np.empty((0, 0), F4)),)


def delayed_pipeline(a: NumpyArrays, p: dict) -> tuple:
    xp = a.xp
    out = []
    for i, b in enumerate(a.blocks(p["items"], (p["m"], p["m"]), seed=13)):
        x = dask.delayed(b, name=f"pipe-in-{i}")
        t = dask.delayed(xp.tanh)(x, dask_key_name=f"pipe-tanh-{i}")
        m = dask.delayed(xp.matmul)(t, t, dask_key_name=f"pipe-matmul-{i}")
        out.append(dask.delayed(xp.sum)(m, axis=0, dask_key_name=f"pipe-sum-{i}"))
    return (dask.delayed(xp.stack)(out, dask_key_name="pipe-stack"),)


@dataclass(frozen=True)
class Workload:
    """A named builder ``(arrays, size) -> collections`` and how its results are checked.

    ``tol``: None for exact equality, else ``(rtol, atol)`` of
    ``|result - ref| <= rtol * |ref| + atol * max|ref|``.
    """

    name: str
    build: Callable[[NumpyArrays, dict], tuple]
    what: str
    tol: tuple[float, float] | None = None

    def check_name(self) -> str:
        return "exact" if self.tol is None else f"allclose {self.tol[0]:.0e}/{self.tol[1]:.0e}"


REDUCE = (1e-5, 1e-6)
#: cuBLAS is bitwise reproducible only while one stream is active ("If multiple concurrent
#: streams are active, the library may optimize total performance by picking different
#: internal implementations", cuBLAS docs, Results reproducibility). On the H200 at 9d48fa7
#: one launcher run on 8 streams of 12 differed from plain sync by 4.5e-5 * max|q| and
#: 1e-7 * max|r|, with the same residual |QR - A| / |A| (4.37e-7) and orthogonality
#: (2.63e-6) as plain: float32 Q is that sensitive for this input. A wrong value (a race,
#: a reused block) differs by the order of max|q|.
QR_TOL = (1e-4, 1e-3)
WORKLOADS = {
    w.name: w
    for w in (
        Workload("elementwise", elementwise, "(sin(x)**2 + x*0.5).sum(axis=1)", REDUCE),
        Workload("transpose", transpose, "(x + x.T).mean(axis=0)", REDUCE),
        Workload("std", std, "((x*2+1)**2 - x).std(axis=0)", REDUCE),
        Workload("range", value_range, "y = x*2+1; y.max(axis=0) - y.min(axis=0)"),
        Workload("matmul", matmul, "x @ y, fp32 tiles", (1e-4, 1e-6)),
        Workload("stencil", stencil, "map_overlap stencil (GPU: ndimage.uniform_filter 5)"),
        Workload("small-chunks", small_chunks, "sqrt(y*1.5+0.25) chained, small chunks"),
        Workload("fft", fft, "map_blocks(real(ifft2(fft2(tile))))", REDUCE),
        Workload("rechunk", rechunk, "(x.rechunk(to)*3+1).sum(axis=0)", REDUCE),
        Workload("qr", qr, "da.linalg.qr, tall-skinny (q and r)", QR_TOL),
        Workload("tiny-tasks", tiny_tasks, "delayed binary tree of tiny adds"),
        Workload("pipeline", pipeline, "from_array(numpy) -> upload -> sqrt*2+1 -> download"),
        Workload("delayed", delayed_pipeline, "delayed tanh, matmul, sum; stack", (1e-4, 1e-6)),
    )
}

#: Sizes by backend: ``cupy`` (an H200: all modes in about 4 minutes), ``sim`` (also
#: ``numpy``) and ``--quick`` (any backend, seconds on the sim).
SIZES: dict[str, dict[str, dict]] = {
    "cupy": {
        "elementwise": {"n": 32768, "chunk": 4096},  # 64 chunks of 64 MiB
        "transpose": {"n": 16384, "chunk": 2048},
        "std": {"n": 8192, "chunk": 512},  # 256 chunks of 512^2
        "range": {"n": 16384, "chunk": 1024},  # 256 chunks of 4 MiB
        "matmul": {"n": 16384, "chunk": 2048},
        "stencil": {"n": 16384, "chunk": 1024},  # 256 tiles
        "small-chunks": {"n": 2048, "chunk": 128, "ops": 8},
        "fft": {"n": 16384, "chunk": 1024},  # 256 tiles of 1024^2
        "rechunk": {"n": 8192, "chunk": 1024, "to": 128},  # n=16384: 22k tasks, 15-19 s a run
        "qr": {"rows": 32768, "chunks": 32, "cols": 256},
        "tiny-tasks": {"leaves": 4096, "size": 1024},
        "pipeline": {"n": 8192, "chunk": 1024},
        "delayed": {"items": 64, "m": 2048},
    },
    "sim": {
        "elementwise": {"n": 2048, "chunk": 256},
        "transpose": {"n": 2048, "chunk": 256},
        "std": {"n": 2048, "chunk": 128},
        "range": {"n": 2048, "chunk": 128},
        "matmul": {"n": 1024, "chunk": 256},
        "stencil": {"n": 2048, "chunk": 128},
        "small-chunks": {"n": 1024, "chunk": 32, "ops": 8},
        "fft": {"n": 2048, "chunk": 128},
        "rechunk": {"n": 1024, "chunk": 256, "to": 32},
        "qr": {"rows": 4096, "chunks": 16, "cols": 32},
        "tiny-tasks": {"leaves": 1024, "size": 64},
        "pipeline": {"n": 2048, "chunk": 256},
        "delayed": {"items": 32, "m": 128},
    },
    "quick": {
        "elementwise": {"n": 128, "chunk": 32},
        "transpose": {"n": 128, "chunk": 32},
        "std": {"n": 128, "chunk": 32},
        "range": {"n": 128, "chunk": 32},
        "matmul": {"n": 96, "chunk": 32},
        "stencil": {"n": 96, "chunk": 32},
        "small-chunks": {"n": 32, "chunk": 8, "ops": 4},
        "fft": {"n": 128, "chunk": 32},
        "rechunk": {"n": 128, "chunk": 64, "to": 16},
        "qr": {"rows": 64, "chunks": 4, "cols": 8},
        "tiny-tasks": {"leaves": 32, "size": 16},
        "pipeline": {"n": 128, "chunk": 32},
        "delayed": {"items": 4, "m": 32},
    },
}


def sizes_for(backend: str, quick: bool, overrides: dict | None = None) -> dict[str, dict]:
    """The sizes of ``backend`` (or ``--quick``), with ``{(name, key): value}`` overrides."""
    table = SIZES["quick" if quick else ("cupy" if backend == "cupy" else "sim")]
    sizes = {name: dict(p) for name, p in table.items()}
    for (name, key), value in (overrides or {}).items():
        sizes[name][key] = value
    return sizes


def parse_set(item: str) -> tuple[tuple[str, str], int]:
    """``NAME.KEY=INT`` of ``--set`` as ``((name, key), value)``."""
    target, _, value = item.partition("=")
    name, _, key = target.partition(".")
    if key not in SIZES["quick"].get(name, {}) or not value.isdigit():
        allowed = ", ".join(f"{n}.{k}" for n, p in SIZES["quick"].items() for k in p)
        raise argparse.ArgumentTypeError(
            f"{item!r} is not NAME.KEY=INT with NAME.KEY one of {allowed}"
        )
    return (name, key), int(value)


def count_tasks(collections: tuple) -> tuple[int, int]:
    """Tasks and keys (tasks, aliases, data) of the optimized graph the schedulers run."""
    graph = dask.base.collections_to_expr(collections, optimize_graph=True).__dask_graph__()
    return sum(isinstance(v, Task) for v in graph.values()), len(graph)


# --- modes and checks -----------------------------------------------------------------------------


def mode_settings(mode: str) -> tuple[dict, dict]:
    """``(config, compute keywords)`` of ``mode`` (the backend is set for the whole run)."""
    if mode == "sync":
        return OFF, {"scheduler": "sync"}
    if mode == "launcher":
        return OFF, {"scheduler": "gpustreams"}
    if mode in DIAGNOSTIC_MODES:
        return dict(OFF, **DIAGNOSTIC_MODES[mode]), {"scheduler": "gpustreams"}
    if mode == "enabled-threads":  # Dask's threads as such: by name, enabled runs the launcher
        return {"gpustreams.enabled": True}, {"scheduler": dask.threaded.get}
    if mode == "enabled-sync":
        return {"gpustreams.enabled": True}, {"scheduler": "sync"}
    if mode == "threads-1":
        return OFF, {"num_workers": 1}
    if mode == "enabled-1":
        return {"gpustreams.enabled": True}, {"num_workers": 1}
    return OFF, {}


def launcher_problem() -> str | None:
    """Why ``scheduler="gpustreams"`` cannot run here, or None."""
    if "gpustreams" not in dask.base.named_schedulers:
        return "scheduler='gpustreams' is not registered by this dask_gpustreams"
    return None


def problem(arrays: NumpyArrays, result: Any, ref: Any, tol: tuple | None) -> str | None:
    """What is wrong with ``result`` against ``ref``, or None."""
    xp, got = arrays.comparable(result)
    _, want = arrays.comparable(ref)
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"{got.dtype}{list(got.shape)}, expected {want.dtype}{list(want.shape)}"
    if bool(xp.isnan(got).any()):
        return f"{int(xp.isnan(got).sum())} NaN of {got.size}"
    if tol is None:
        if bool(xp.array_equal(got, want)):
            return None
        return f"{int((got != want).sum())} of {got.size} differ, {_maxdiff(xp, got, want)}"
    rtol, atol = tol
    scale = float(xp.abs(want).max()) if want.size else 0.0
    if bool(xp.allclose(got, want, rtol=rtol, atol=atol * scale)):
        return None
    return f"not allclose(rtol={rtol:g}, atol={atol:g}*{scale:.3g}): {_maxdiff(xp, got, want)}"


def _maxdiff(xp: Any, got: Any, want: Any) -> str:
    return f"max |diff| {float(xp.abs(got.astype(np.float64) - want.astype(np.float64)).max()):.3g}"


# --- measuring ------------------------------------------------------------------------------------


class Runner:
    """Runs each workload's modes on the same inputs, appending rows as they complete."""

    def __init__(self, args: argparse.Namespace, arrays: NumpyArrays, sizes: dict, out: str):
        self.args = args
        self.arrays = arrays
        self.sizes = sizes
        self.out = out
        self.rows: list[dict] = []
        self.t0 = time.monotonic()
        self.launcher = launcher_problem()

    def row(self, wl: Workload, mode: str) -> dict:
        return {
            "workload": wl.name,
            "what": wl.what,
            "mode": mode,
            "backend": self.arrays.name,
            "size": self.sizes[wl.name],
            "check": wl.check_name(),
            "n_tasks": None,
            "n_keys": None,
            "samples": 0,
            "walls_ms": [],
            "status": "SKIPPED",
            "error": "",
        }

    def run(self, wl: Workload, peaks: PoolPeaks | None, skip: str | None) -> None:
        rows = [self.row(wl, mode) for mode in self.args.modes]
        if skip is not None:
            for r in rows:
                self._done(dict(r, error=skip))
            return
        try:
            collections = wl.build(self.arrays, self.sizes[wl.name])
            tasks, keys = count_tasks(collections)
            with dask.config.set(OFF):
                ref = dask.compute(*collections, scheduler="sync")
            self.arrays.synchronize()
            for j, out in enumerate(ref):
                xp, host = self.arrays.comparable(out)
                if bool(xp.isnan(host).any()):
                    raise ValueError(f"the reference's output {j} has NaN")
        except Exception as e:
            traceback.print_exc()
            # On the sim, plain Dask failing means the device lacks an operation.
            status = "SKIPPED" if self.arrays.name == "sim" else "ERROR"
            for r in rows:
                self._done(dict(r, status=status, error=f"reference: {type(e).__name__}: {e}"))
            return
        measured = []
        for r in rows:
            r.update(n_tasks=tasks, n_keys=keys, status="ok", memory=[])
            if r["mode"].startswith("launcher") and self.launcher is not None:
                self._done(dict(r, status="SKIPPED", error=self.launcher))
            else:
                measured.append(r)
        self.interleave(measured, lambda r, n: self.measure(r, wl, collections, ref, peaks, n))

    def interleave(self, rows: list[dict], measure: Callable[[dict, int], None]) -> None:
        """``measure(row, samples)`` for each row in turn, ``--rounds`` times, then summaries.

        ``--samples`` are shared out over the rounds, so that drift and the order of the
        modes weigh on all of them alike. Each row keeps its walls per round
        (``round_walls_ms``), for speedups paired by round (:func:`derive`).
        """
        for share in report.round_shares(self.args.samples, self.args.rounds):
            for r in rows:
                if r["status"] == "ok":
                    before = len(r["walls_ms"])
                    measure(r, share)
                    r.setdefault("round_walls_ms", []).append(r["walls_ms"][before:])
        for r in rows:
            self._summarize(r)

    def measure(
        self,
        row: dict,
        wl: Workload,
        collections: tuple,
        ref: tuple,
        peaks: PoolPeaks | None,
        samples: int,
    ) -> None:
        """One round of ``row``'s mode: warm-ups, then ``samples`` samples, each between
        device syncs and checked against ``ref``."""
        args = self.args
        config, kw = mode_settings(row["mode"])
        walls, memory = row["walls_ms"], row["memory"]
        try:
            for i in range(args.warmup + samples):
                self.arrays.synchronize()
                if peaks is not None:
                    # Cold pool before a mode's first run of a round only: the timed runs
                    # find it warm, as a user's repeated computes do (a cold pool's
                    # cudaMalloc calls would serialize the device, per stream arena).
                    peaks.reset(free=i == 0)
                gc.collect()  # garbage of earlier runs is not this run's (see the docstring)
                t0 = time.perf_counter()
                with dask.config.set(config):
                    results = dask.compute(*collections, **kw)
                self.arrays.synchronize()
                wall = (time.perf_counter() - t0) * 1e3
                mem = peaks.read() if peaks is not None else None  # before the check allocates
                bad = [
                    (j, p)
                    for j, (got, want) in enumerate(zip(results, ref, strict=True))
                    if (p := problem(self.arrays, got, want, wl.tol)) is not None
                ]
                del results
                if bad:
                    j, p = bad[0]
                    row["status"], row["error"] = "FAILED", f"run {i}, output {j}: {p}"
                    break
                if i >= args.warmup:
                    walls.append(wall)
                    if mem is not None:
                        memory.append(mem)
        except Exception as e:  # a broken mode must not end the whole run
            row["status"], row["error"] = "ERROR", f"{type(e).__name__}: {e}"
            traceback.print_exc()

    def _summarize(self, row: dict) -> None:
        walls, memory = row["walls_ms"], row["memory"]
        row["samples"] = len(walls)
        row.update(report.summarize(walls))
        for key in ("peak_held", "peak_used", "base_bytes"):
            row[key] = max((m[key] for m in memory), default=None)
        self._done(row)

    def _done(self, row: dict) -> None:
        self.rows.append(row)
        with open(os.path.join(self.out, "rows.jsonl"), "a") as f:
            f.write(json.dumps(row, default=str) + "\n")
        med = row.get("wall_median_ms")
        threads = next(
            (
                r.get("wall_median_ms")
                for r in self.rows
                if r["workload"] == row["workload"] and r["mode"] == "threads"
            ),
            None,
        )
        print(
            f"[{time.monotonic() - self.t0:6.1f}s] {row['workload']:<13} {row['mode']:<16} "
            + (f"tasks {row['n_tasks']:<6} " if row["n_tasks"] is not None else "")
            + (f"median {med:9.2f} ms  " if med else "")
            + (f"x{threads / med:5.2f} vs threads  " if med and threads else "")
            + (f"used {_mib(row.get('peak_used'))} MiB  " if row.get("peak_used") else "")
            + row["status"]
            + (f" ({row['error']})" if row["error"] else ""),
            flush=True,
        )


# --- derived metrics, table, figure ---------------------------------------------------------------


def derive(rows: list[dict]) -> dict[str, dict]:
    """Speedups against the best plain mode (``min(threads, sync)``) and ``threads``.

    ``paired_vs_best``: the median over rounds of the best plain mode's median in a round
    over this mode's in the same round. The modes of one round run within seconds of
    each other, so a host that drifts between rounds moves both sides of each ratio.
    Returns, per mode, the geometric means over the workloads that have both.
    """
    plain: dict[str, dict[str, dict]] = {}
    for r in rows:
        if r["status"] == "ok" and r["mode"] in ("threads", "sync"):
            plain.setdefault(r["workload"], {})[r["mode"]] = r
    for r in rows:
        med = r.get("wall_median_ms") if r["status"] == "ok" else None
        base = plain.get(r["workload"], {})
        best = min(base.values(), key=lambda b: b["wall_median_ms"]) if base else None
        r["speedup_vs_best"] = best["wall_median_ms"] / med if med and best else None
        threads = base.get("threads")
        r["speedup_vs_threads"] = threads["wall_median_ms"] / med if med and threads else None
        r["paired_vs_best"] = _paired(best, r) if med and best else None
    means = {}
    for mode in dict.fromkeys(r["mode"] for r in rows):
        mine = [r for r in rows if r["mode"] == mode]
        means[mode] = {
            key: _geomean([r[key] for r in mine if r[key]])
            for key in ("speedup_vs_best", "speedup_vs_threads", "paired_vs_best")
        }
        means[mode]["workloads"] = sum(1 for r in mine if r["speedup_vs_best"])
    return means


def _paired(base: dict, row: dict) -> float | None:
    """Median over rounds of ``base``'s median wall over ``row``'s (None: rounds differ)."""
    ours, theirs = row.get("round_walls_ms", []), base.get("round_walls_ms", [])
    if not ours or len(ours) != len(theirs) or not all(ours) or not all(theirs):
        return None
    return statistics.median(
        statistics.median(b) / statistics.median(m) for b, m in zip(theirs, ours, strict=True)
    )


def _geomean(values: list[float]) -> float | None:
    return math.exp(statistics.fmean(math.log(v) for v in values)) if values else None


def _mib(v: int | None) -> str:
    return "-" if v is None else f"{v / 2**20:.0f}" if v >= 10 * 2**20 else f"{v / 2**20:.2f}"


def _num(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def table(rows: list[dict], means: dict[str, dict], meta: dict) -> str:
    """The printed table: one line per workload and mode, then the geometric means."""
    out = [
        f"== workloads · backend {meta['backend']} (plugin backend {meta['plugin_backend']}) · "
        f"median of {meta['samples']} after {meta['warmup']} warm-up · speedup = plain median / "
        "median (best = min(threads, sync)); paired: the median over rounds of that ratio in "
        "each round · memory in MiB: peak held / peak used / base (inputs and the reference) ==",
        f"{'workload':<13} {'tasks':>6} {'mode':<16} {'median ms':>10} {'[min - max]':>21} "
        f"{'IQR':>7} {'held':>6} {'used':>6} {'base':>6} {'vs best':>7} {'paired':>6} "
        f"{'vs thr':>7}  {'check':<20} status",
    ]
    for r in rows:
        spread = f"[{_num(r.get('wall_min_ms'), '.1f')} - {_num(r.get('wall_max_ms'), '.1f')}]"
        out.append(
            f"{r['workload']:<13} {_num(r['n_tasks'], 'd'):>6} {r['mode']:<16} "
            f"{_num(r.get('wall_median_ms'), '.1f'):>10} {spread:>21} "
            f"{_num(r.get('wall_iqr_ms'), '.1f'):>7} {_mib(r.get('peak_held')):>6} "
            f"{_mib(r.get('peak_used')):>6} {_mib(r.get('base_bytes')):>6} "
            f"{_num(r.get('speedup_vs_best'), '.2f'):>7} "
            f"{_num(r.get('paired_vs_best'), '.2f'):>6} "
            f"{_num(r.get('speedup_vs_threads'), '.2f'):>7}  {r['check']:<20} "
            + (r["status"] if not r["error"] else f"{r['status']}: {r['error']}")
        )
    out.append("\n-- geometric mean of the speedups over the workloads --")
    out.append(f"{'mode':<16} {'vs best':>7} {'paired':>6} {'vs threads':>10} {'workloads':>9}")
    for mode, m in means.items():
        out.append(
            f"{mode:<16} {_num(m['speedup_vs_best'], '.2f'):>7} "
            f"{_num(m['paired_vs_best'], '.2f'):>6} "
            f"{_num(m['speedup_vs_threads'], '.2f'):>10} {m['workloads']:>9}"
        )
    return "\n".join(out)


def plot_speedup(rows: list[dict], path: str, title: str) -> bool:
    """Per workload, a bar per mode of its speedup over ``threads`` (log scale)."""
    from matplotlib.figure import Figure  # renders with Agg, no pyplot
    from matplotlib.ticker import FuncFormatter

    names = list(dict.fromkeys(r["workload"] for r in rows))
    modes = [m for m in dict.fromkeys(r["mode"] for r in rows) if m != "threads"]
    if not any(r.get("speedup_vs_threads") for r in rows) or not modes:
        return False
    fig = Figure(figsize=(max(6.0, 0.9 * len(names) + 2), 4.2), layout="constrained")
    ax = fig.subplots()
    width = 0.8 / len(modes)
    for j, mode in enumerate(modes):
        for i, name in enumerate(names):
            r = next((r for r in rows if (r["workload"], r["mode"]) == (name, mode)), None)
            if r is None:
                continue
            x = i + (j - (len(modes) - 1) / 2) * width
            if r.get("speedup_vs_threads"):
                bar = ax.bar(x, r["speedup_vs_threads"], width, color=f"C{j}", label=mode)
                ax.bar_label(bar, fmt="%.2f", fontsize="xx-small")
            else:
                ax.text(x, 1, r["status"][:4], rotation=90, ha="center", fontsize="x-small")
    ax.axhline(1.0, color="black", ls="--", lw=1, label="threads")
    ax.set_yscale("log")
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
    ax.set_ylabel("speedup over threads (median wall)")
    ax.grid(axis="y", alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    ax.legend(unique.values(), unique.keys(), fontsize="small")
    ax.set_title(title, fontsize="medium")
    fig.savefig(path, dpi=110)
    return True


def write_outputs(rows: list[dict], meta: dict, out: str) -> None:
    """results.json, results.csv, table.txt and speedup.png of ``rows``; print the table."""
    means = derive(rows)
    meta["geomean"] = means
    report.write_json(os.path.join(out, "results.json"), meta, rows)
    report.write_csv(os.path.join(out, "results.csv"), rows, CSV_FIELDS)
    text = table(rows, means, meta)
    with open(os.path.join(out, "table.txt"), "w") as f:
        f.write(text + "\n")
    print(text)
    title = f"Ordinary workloads · {meta['backend']} · {meta.get('device', '')}"
    plot_speedup(rows, os.path.join(out, "speedup.png"), title)
    bad = [r for r in rows if r["status"] in ("FAILED", "ERROR")]
    print(f"\n{len(rows)} rows, {len(bad)} failed; {meta['elapsed_s']:.0f} s; results in {out}")


# --- main -----------------------------------------------------------------------------------------


def _list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    """``--samples``, ``--warmup`` and ``--rounds``, as :meth:`Runner.interleave` reads them."""
    p.add_argument("--samples", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1, help="warm-up runs per mode and round")
    p.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="rounds of all modes in turn (at most --samples); --samples are shared out",
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_workloads",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--backend", default="auto", choices=BACKENDS)
    p.add_argument("--workloads", type=_list, default=list(WORKLOADS))
    p.add_argument("--modes", type=_list, default=list(MODES))
    add_sampling_arguments(p)
    p.add_argument("--quick", action="store_true", help="tiny sizes (seconds on the sim)")
    p.add_argument(
        "--set",
        type=parse_set,
        action="append",
        default=[],
        metavar="NAME.KEY=INT",
        help="override a size, e.g. rechunk.n=16384 (repeatable)",
    )
    p.add_argument(
        "--allocator",
        default="pool",
        choices=("pool", "async"),
        help="cupy: the device allocator of every mode (async: cupy.cuda.MemoryAsyncPool)",
    )
    p.add_argument("--out", default=None)
    p.add_argument("--dry-run", action="store_true", help="print sizes and task counts only")
    args = p.parse_args(argv)
    for name, values, allowed in (
        ("workloads", args.workloads, list(WORKLOADS)),
        ("modes", args.modes, MODES + ONE_THREAD_MODES + tuple(DIAGNOSTIC_MODES)),
    ):
        bad = [v for v in values if v not in allowed]
        if bad:
            p.error(f"--{name} {','.join(bad)} is invalid: allowed values are {','.join(allowed)}")
    if args.samples < 1 or args.warmup < 0 or args.rounds < 1:
        p.error(
            f"--samples {args.samples} and --rounds {args.rounds} must be >= 1 and "
            f"--warmup {args.warmup} >= 0"
        )
    return args


def dry_run(args: argparse.Namespace, backend: str) -> int:
    """Sizes and task counts of each workload at ``backend``'s sizes (zero-stride host inputs)."""
    sizes = sizes_for(backend, args.quick, dict(args.set))
    arrays = NumpyArrays(plan=True)
    print(f"sizes of {'--quick' if args.quick else backend}:")
    for name in args.workloads:
        tasks, keys = count_tasks(WORKLOADS[name].build(arrays, sizes[name]))
        print(f"  {name:<13} tasks {tasks:>6}  keys {keys:>6}  {sizes[name]}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    backend = resolve_backend("auto") if args.backend == "auto" else args.backend
    if args.dry_run:
        return dry_run(args, backend)
    if backend == "cupy":
        resolve_backend("cupy")  # raises, naming the reason, without a usable GPU
    sizes = sizes_for(backend, args.quick, dict(args.set))
    arrays = make_arrays(backend, args.allocator)
    # The runtime's decisions (e.g. a task group learned as host work) go to the log.
    logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("dask_gpustreams").setLevel(logging.INFO)
    out = bench_shapes.out_dir(args, f"workloads-{backend}")
    print(f"backend {backend} (plugin backend {arrays.plugin}); writing to {out}", flush=True)
    started = time.monotonic()
    command = sys.argv[1:] if argv is None else argv
    meta = {
        "argv": [sys.executable, "-m", "benchmarks.bench_workloads", *command],
        "args": vars(args),
        "backend": backend,
        "plugin_backend": arrays.plugin,
        "samples": args.samples,
        "warmup": args.warmup,
        "sizes": {name: sizes[name] for name in args.workloads},
        "started": datetime.datetime.now().isoformat(),
        "threads": os.cpu_count(),
        **bench_shapes.environment(arrays.plugin),
    }
    runner = Runner(args, arrays, sizes, out)
    meta["launcher"] = runner.launcher or "registered"
    skip = None
    if backend == "sim" and not sim_has_ops():
        skip = "sim.SimArray has no operators (sim.asarray(np.ones(3)) + 1 fails): --backend numpy"
    try:
        with dask.config.set({"gpustreams.backend": arrays.plugin}), arrays.memory() as peaks:
            meta["gpustreams"] = dask.config.get("gpustreams")
            for name in args.workloads:
                runner.run(WORKLOADS[name], peaks, skip)
    finally:
        meta["elapsed_s"] = time.monotonic() - started
        write_outputs(runner.rows, meta, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
