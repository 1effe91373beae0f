"""The workload suite of ``bench_workloads`` on a one-worker cluster: plugin off against on.

Run from the repository root (see ``benchmarks/README.md``)::

    python -m benchmarks.bench_cluster --backend cupy     # LocalCUDACluster, dask-cuda defaults
    python -m benchmarks.bench_cluster --backend sim --quick

With ``--backend cupy`` the cluster is ``dask_cuda.LocalCUDACluster(n_workers=1)`` with
dask-cuda's defaults (one thread per worker), or, without dask-cuda, a
``LocalCluster(n_workers=1, threads_per_worker=1)``; with ``sim`` always the latter.
Inputs are persisted on the worker once per workload, plugin off. Modes, in one run:

- ``off``: plain distributed (no plugin);
- ``on``: ``client.register_plugin(StreamsPlugin(backend=..., blocks="auto"))`` (stream
  blocks, ``docs/cluster.md``), removed after the mode;
- ``on-noblocks``: the same with ``blocks="off"``: one task per key.

Each sample is timed from ``client.compute`` until its results are in the worker's memory
(``wait``) and the worker's device is idle (``client.run`` of a device sync: with the
plugin, a result is in memory once its work is enqueued), in both modes alike; then
gathered, untimed, and checked against the plugin-off result (``bench_workloads``'
checks). Peak device memory per worker and sample: the CuPy pool's ``total_bytes()``
after the sample (``peak_held``) and the largest ``used_bytes()`` seen by a tracking
allocator (``peak_used``); the worker's pool blocks are freed before each mode's first
run only.

Outputs in ``--out`` (default ``benchmarks/results/cluster-<backend>-<timestamp>/``):
``results.json``, ``results.csv``, ``table.txt`` and ``rows.jsonl``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
import traceback
from functools import partial
from typing import Any

import dask
import dask.array as da
from distributed import Client, LocalCluster, wait

from benchmarks import bench_shapes, bench_workloads, report
from benchmarks.bench_workloads import WORKLOADS, Workload, problem, sizes_for
from dask_gpustreams import StreamsPlugin

MODES = ("off", "on", "on-noblocks")


class ClusterInputs:
    """Makes a ``bench_workloads`` arrays object persist its inputs on ``client``'s worker."""

    def __init__(self, arrays: bench_workloads.NumpyArrays, client: Client):
        self.arrays = arrays
        self.client = client
        self.persisted: list = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.arrays, name)

    def random(self, shape: tuple, chunks: Any, seed: int) -> Any:
        x = da.map_blocks(
            partial(bench_workloads._fill, self.arrays.block, seed),
            chunks=da.core.normalize_chunks(chunks, shape, dtype=bench_workloads.F4),
            dtype=bench_workloads.F4,
            meta=self.arrays.meta(len(shape)),
        )
        return self._persist(x)

    def blocks(self, count: int, shape: tuple, seed: int) -> list:
        make = dask.delayed(self.arrays.block, pure=True)
        return [self._persist(make(shape, (seed, i))) for i in range(count)]

    def _persist(self, x: Any) -> Any:
        x = self.client.persist(x)
        wait(x)
        self.persisted.append(x)
        return x


def _synchronize(backend: str) -> None:
    """On a worker: wait until its device is idle."""
    from benchmarks import kernels

    kernels.device_synchronize("cupy" if backend == "cupy" else "sim")


def _pool_reset(free: bool) -> None:
    """On a worker: start a sample's peak (a tracking allocator, installed once)."""
    import cupy

    pool = cupy.get_default_memory_pool()
    if free:
        pool.free_all_blocks()
    peaks = getattr(cupy, "_bench_peaks", None)
    if peaks is None:
        peaks = cupy._bench_peaks = bench_workloads.PoolPeaks(pool)
        cupy.cuda.set_allocator(peaks.track(pool.malloc))
    peaks.reset(free=False)


def _pool_read() -> dict:
    import cupy

    return cupy._bench_peaks.read()


def make_cluster(backend: str) -> tuple[Any, str]:
    """The cluster and its description."""
    if backend == "cupy":
        try:
            from dask_cuda import LocalCUDACluster
        except ImportError:
            pass
        else:
            return LocalCUDACluster(n_workers=1, dashboard_address=None), (
                "LocalCUDACluster(n_workers=1), dask-cuda defaults"
            )
    cluster = LocalCluster(n_workers=1, threads_per_worker=1, dashboard_address=None)
    return cluster, "LocalCluster(n_workers=1, threads_per_worker=1)"


class ClusterRunner(bench_workloads.Runner):
    """``bench_workloads.Runner`` whose modes are the plugin off and on, on ``client``."""

    def __init__(self, args: argparse.Namespace, arrays: Any, sizes: dict, out: str, client: Any):
        super().__init__(args, arrays, sizes, out)
        self.client = client
        self.launcher = None
        self.track_memory = arrays.arrays.name == "cupy"

    def run(self, wl: Workload, peaks: Any, skip: str | None) -> None:
        rows = [self.row(wl, mode) for mode in self.args.modes]
        try:
            collections = wl.build(self.arrays, self.sizes[wl.name])
            tasks, keys = bench_workloads.count_tasks(collections)
            ref = self.client.compute(list(collections), sync=True)
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
        for r in rows:
            r.update(n_tasks=tasks, n_keys=keys)
            self.measure(r, wl, collections, ref, None)
        self.arrays.persisted.clear()  # the inputs go once their futures are dropped

    def measure(self, row: dict, wl: Workload, collections: tuple, ref: list, peaks: Any) -> None:
        args, client = self.args, self.client
        walls: list[float] = []
        memory: list[dict] = []
        on = row["mode"] != "off"
        try:
            if on:
                blocks = "off" if row["mode"] == "on-noblocks" else "auto"
                plugin = StreamsPlugin(backend=self.arrays.arrays.plugin, blocks=blocks)
                client.register_plugin(plugin)
            for i in range(args.warmup + args.samples):
                if self.track_memory:
                    client.run(_pool_reset, i == 0)
                t0 = time.perf_counter()
                futures = client.compute(list(collections))
                wait(futures)
                client.run(_synchronize, self.arrays.arrays.name)
                wall = (time.perf_counter() - t0) * 1e3
                results = client.gather(futures)  # checked, not timed
                del futures
                if self.track_memory:
                    memory.append(next(iter(client.run(_pool_read).values())))
                bad = [
                    (j, p)
                    for j, (got, want) in enumerate(zip(results, ref, strict=True))
                    if (p := problem(self.arrays.arrays, got, want, wl.tol)) is not None
                ]
                del results
                if bad:
                    j, p = bad[0]
                    row["status"], row["error"] = "FAILED", f"run {i}, output {j}: {p}"
                    break
                if i >= args.warmup:
                    walls.append(wall)
                elif memory:
                    memory.pop()
            else:
                row["status"] = "ok"
        except Exception as e:
            row["status"], row["error"] = "ERROR", f"{type(e).__name__}: {e}"
            traceback.print_exc()
        finally:
            if on:
                client.unregister_worker_plugin(StreamsPlugin.name)
        row["walls_ms"] = walls
        row["samples"] = len(walls)
        row["memory"] = memory
        row.update(report.summarize(walls))
        for key in ("peak_held", "peak_used", "base_bytes"):
            row[key] = max((m[key] for m in memory), default=None)
        self._done(row)


def derive(rows: list[dict]) -> dict:
    """Plugin on / off per workload, and their geometric mean."""
    off = {
        r["workload"]: r["wall_median_ms"]
        for r in rows
        if r["mode"] == "off" and r["status"] == "ok"
    }
    ratios = []
    for r in rows:
        med = r.get("wall_median_ms") if r["status"] == "ok" else None
        base = off.get(r["workload"])
        r["speedup_vs_off"] = base / med if med and base else None
        if r["mode"] == "on" and r["speedup_vs_off"]:
            ratios.append(r["speedup_vs_off"])
    return {
        "geomean_on_vs_off": bench_workloads._geomean(ratios),
        "min_on_vs_off": min(ratios, default=None),
        "workloads": len(ratios),
    }


def table(rows: list[dict], summary: dict, meta: dict) -> str:
    mib = bench_workloads._mib
    out = [
        f"== workloads on {meta['cluster']} · backend {meta['backend']} · median of "
        f"{meta['samples']} after {meta['warmup']} warm-up · speedup = off median / median · "
        "memory per worker in MiB: peak held / peak used",
        f"{'workload':<13} {'mode':<4} {'tasks':>6} {'median ms':>10} {'IQR':>7} {'x off':>6} "
        f"{'held':>7} {'used':>7}  status",
    ]
    for r in rows:
        out.append(
            f"{r['workload']:<13} {r['mode']:<4} {r['n_tasks'] or '-':>6} "
            f"{bench_workloads._num(r.get('wall_median_ms'), '.2f'):>10} "
            f"{bench_workloads._num(r.get('wall_iqr_ms'), '.2f'):>7} "
            f"{bench_workloads._num(r.get('speedup_vs_off'), '.2f'):>6} "
            f"{mib(r.get('peak_held')):>7} {mib(r.get('peak_used')):>7}  {r['status']}"
            + (f" ({r['error']})" if r["error"] else "")
        )
    g, m = summary["geomean_on_vs_off"], summary["min_on_vs_off"]
    out.append(
        f"plugin on / off over {summary['workloads']} workloads: geometric mean "
        f"{bench_workloads._num(g, '.3f')}x, lowest {bench_workloads._num(m, '.3f')}x"
    )
    return "\n".join(out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--backend", default="cupy", choices=("cupy", "sim"))
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--samples", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="tiny sizes (seconds on the sim)")
    p.add_argument("--set", action="append", default=[], type=bench_workloads.parse_set)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    args.workloads = bench_workloads._list(args.workloads)
    args.modes = bench_workloads._list(args.modes)
    for what, chosen, allowed in (
        ("workloads", args.workloads, WORKLOADS),
        ("modes", args.modes, MODES),
    ):
        bad = [c for c in chosen if c not in allowed]
        if bad:
            p.error(f"unknown {what} {bad}; choose from {', '.join(allowed)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = sizes_for(args.backend, args.quick, dict(args.set))
    base = bench_workloads.make_arrays(args.backend)
    out = bench_shapes.out_dir(args, f"cluster-{args.backend}")
    cluster, described = make_cluster(args.backend)
    print(f"{described}; writing to {out}", flush=True)
    started = time.monotonic()
    command = sys.argv[1:] if argv is None else argv
    meta = {
        "argv": [sys.executable, "-m", "benchmarks.bench_cluster", *command],
        "args": vars(args),
        "backend": args.backend,
        "cluster": described,
        "samples": args.samples,
        "warmup": args.warmup,
        "sizes": {name: sizes[name] for name in args.workloads},
        "started": datetime.datetime.now().isoformat(),
        **bench_shapes.environment(base.plugin),
    }
    rows: list[dict] = []
    try:
        with cluster, Client(cluster) as client, dask.config.set({"gpustreams.enabled": False}):
            arrays = ClusterInputs(base, client)
            runner = ClusterRunner(args, arrays, sizes, out, client)
            for name in args.workloads:
                runner.run(WORKLOADS[name], None, None)
            rows = runner.rows
    finally:
        meta["elapsed_s"] = time.monotonic() - started
        summary = derive(rows)
        meta["summary"] = summary
        text = table(rows, summary, meta)
        print(text)
        report.write_json(os.path.join(out, "results.json"), meta, rows)
        report.write_csv(os.path.join(out, "results.csv"), rows, bench_workloads.CSV_FIELDS)
        with open(os.path.join(out, "table.txt"), "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
