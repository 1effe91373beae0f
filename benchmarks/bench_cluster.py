"""The workload suite of ``bench_workloads`` on a one-worker cluster: plugin off against on.

Run from the repository root (see ``benchmarks/README.md``)::

    python -m benchmarks.bench_cluster --backend cupy     # LocalCUDACluster, dask-cuda defaults
    python -m benchmarks.bench_cluster --backend sim --quick
    python -m benchmarks.bench_cluster --backend cupy --workers 1,2  # one GPU, then two

With ``--backend cupy`` the cluster is ``dask_cuda.LocalCUDACluster(n_workers=N)`` with
dask-cuda's defaults (one worker per GPU, one thread per worker), or, without dask-cuda, a
``LocalCluster(n_workers=N, threads_per_worker=1)``; with ``sim`` always the latter (worker
processes, each with its own simulated device). ``--workers`` lists the worker counts N
(default 1), each run on a cluster of its own, one after the other; ``--protocol`` (e.g.
``ucx``, which needs ``distributed-ucxx``) is passed to the cluster. Inputs are persisted on
the workers once per workload, plugin off; with several workers they are spread over them,
so the graphs cross workers (``matmul``'s ``x @ y`` and ``stencil``'s ``map_overlap`` read
chunks of every worker). Modes, in one run:

- ``off``: plain distributed (no plugin);
- ``on``: ``client.register_plugin(StreamsPlugin(backend=..., blocks="auto"))`` (stream
  blocks, ``docs/cluster.md``), removed after the mode;
- ``on-noblocks``: the same with ``blocks="off"``: one task per key;
- ``MODE:KEY=VALUE[:KEY=VALUE...]``, ``MODE`` one of ``on`` and ``on-noblocks``: that mode with
  the plugin's settings ``KEY`` (a ``gpustreams.*`` key but ``blocks`` and ``backend``) set,
  e.g. ``on:launch-ahead=64MiB``, so that settings compare in one run; each row of the plugin
  on has the settings it ran with (``plugin``).

The modes run in turn, ``--rounds`` times (default 2: off, on, on-noblocks, off, on, ...),
each round with its warm-up and its share of ``--samples``, so that drift and the order of
the modes weigh on all of them alike: on the H200 at 9d48fa7 (``probe_cluster_cost``),
plugin-off's elementwise median was 167 ms in its first round and 210 ms in its second,
after a plugin round, when the plugin took 207 and 208 ms.

Each sample is timed from ``client.compute`` until its results are in the worker's memory
(``wait``) and the worker's device is idle (``client.run`` of a device sync: with the
plugin, a result is in memory once its work is enqueued), in both modes alike; then
gathered, untimed, and checked against the plugin-off result (``bench_workloads``'
checks). Peak device memory per worker and sample: the CuPy pool's (on the sim, the
simulated device's pool's) ``total_bytes()`` after the sample (``peak_held``) and the
largest ``used_bytes()`` seen by a tracking allocator (``peak_used``); the worker's pool
blocks are freed before the first run of each mode in each round.

Outputs in ``--out`` (default ``benchmarks/results/cluster-<backend>-<timestamp>/``):
``results.json``, ``results.csv``, ``table.txt`` and ``rows.jsonl``. Each row has its
``workers``; ``x off`` compares with plugin-off at the same worker count, ``x 1w`` with the same
mode on the first worker count listed (``speedup_vs_first``).
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
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


def _pool_reset(backend: str, free: bool) -> None:
    """On a worker: start a sample's peak (a tracking allocator, installed once)."""
    if backend == "cupy":
        import cupy

        pool, owner = cupy.get_default_memory_pool(), cupy
    else:
        from dask_gpustreams import sim

        pool, owner = sim.get_default_memory_pool(), sim
    if free:
        pool.free_all_blocks()
    peaks = getattr(owner, "_bench_peaks", None)
    if peaks is None:
        peaks = owner._bench_peaks = bench_workloads.PoolPeaks(pool)
        if backend == "cupy":
            cupy.cuda.set_allocator(peaks.track(pool.malloc))
        else:  # the sim's pool has no allocator hook: this instance's malloc
            pool.malloc = peaks.track(pool.malloc)
    peaks.reset(free=False)


def _pool_read(backend: str) -> dict:
    if backend == "cupy":
        import cupy as owner
    else:
        from dask_gpustreams import sim as owner
    return owner._bench_peaks.read()


def make_cluster(backend: str, workers: int = 1, protocol: str | None = None) -> tuple[Any, str]:
    """The cluster of ``workers`` workers (one per GPU with dask-cuda) and its description."""
    extra = {} if protocol is None else {"protocol": protocol}
    shown = "" if protocol is None else f", protocol={protocol!r}"
    if backend == "cupy":
        try:
            from dask_cuda import LocalCUDACluster
        except ImportError:
            pass
        else:
            return LocalCUDACluster(n_workers=workers, dashboard_address=None, **extra), (
                f"LocalCUDACluster(n_workers={workers}{shown}), dask-cuda defaults"
            )
    cluster = LocalCluster(n_workers=workers, threads_per_worker=1, dashboard_address=None, **extra)
    return cluster, f"LocalCluster(n_workers={workers}, threads_per_worker=1{shown})"


class ClusterRunner(bench_workloads.Runner):
    """``bench_workloads.Runner`` whose modes are the plugin off and on, on ``client``."""

    def __init__(
        self,
        args: argparse.Namespace,
        arrays: Any,
        sizes: dict,
        out: str,
        client: Any,
        workers: int = 1,
    ):
        super().__init__(args, arrays, sizes, out)
        self.client = client
        self.workers = workers
        self.launcher = None
        self.track_memory = arrays.arrays.name in ("cupy", "sim")

    def row(self, wl: Workload, mode: str) -> dict:
        return dict(super().row(wl, mode), workers=self.workers)

    def _done(self, row: dict) -> None:
        self.rows.append(row)
        with open(os.path.join(self.out, "rows.jsonl"), "a") as f:
            f.write(json.dumps(row, default=str) + "\n")
        med = row.get("wall_median_ms")
        print(
            f"[{time.monotonic() - self.t0:6.1f}s] {row['workload']:<13} {row['mode']:<12} "
            f"workers {row['workers']:<2} "
            + (f"tasks {row['n_tasks']:<6} " if row["n_tasks"] is not None else "")
            + (f"median {med:9.2f} ms  " if med else "")
            + (
                f"used {bench_workloads._mib(row.get('peak_used'))} MiB  "
                if row.get("peak_used")
                else ""
            )
            + row["status"]
            + (f" ({row['error']})" if row["error"] else ""),
            flush=True,
        )

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
            r.update(n_tasks=tasks, n_keys=keys, status="ok", walls_ms=[], memory=[])
        self.interleave(rows, lambda r, n: self.measure(r, wl, collections, ref, n))
        self.arrays.persisted.clear()  # the inputs go once their futures are dropped

    def measure(self, row: dict, wl: Workload, collections: tuple, ref: list, samples: int) -> None:
        """One round of ``row``'s mode: register the plugin, warm up, then ``samples`` samples."""
        args, client = self.args, self.client
        walls, memory = row["walls_ms"], row["memory"]
        base, settings = split_mode(row["mode"])
        registered = False
        try:
            if base != "off":
                blocks = "off" if base == "on-noblocks" else "auto"
                plugin = StreamsPlugin(backend=self.arrays.arrays.plugin, blocks=blocks, **settings)
                row["plugin"] = plugin.overrides
                client.register_plugin(plugin)
                registered = True
            for i in range(args.warmup + samples):
                if self.track_memory:
                    client.run(_pool_reset, self.arrays.arrays.name, i == 0)
                t0 = time.perf_counter()
                futures = client.compute(list(collections))
                wait(futures)
                client.run(_synchronize, self.arrays.arrays.name)
                wall = (time.perf_counter() - t0) * 1e3
                results = client.gather(futures)  # checked, not timed
                del futures
                sample_memory = None
                if self.track_memory:  # the largest of the workers'
                    peaks = list(client.run(_pool_read, self.arrays.arrays.name).values())
                    sample_memory = {k: max(p[k] for p in peaks) for k in peaks[0]}
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
                    if sample_memory is not None:
                        memory.append(sample_memory)
        except Exception as e:
            row["status"], row["error"] = "ERROR", f"{type(e).__name__}: {e}"
            traceback.print_exc()
        finally:
            if registered:
                client.unregister_worker_plugin(StreamsPlugin.name)


def derive(rows: list[dict]) -> dict:
    """Plugin on / off per workload and worker count, the same mode against the first worker
    count, and their geometric means (``summary["by_workers"]`` per worker count)."""
    counts = list(dict.fromkeys(r.get("workers", 1) for r in rows))
    medians = {
        (r["workload"], r["mode"], r.get("workers", 1)): r["wall_median_ms"]
        for r in rows
        if r["status"] == "ok" and r.get("wall_median_ms")
    }
    ratios: dict[int, list[float]] = {n: [] for n in counts}
    scaling: dict[int, dict[str, list[float]]] = {n: {} for n in counts}
    for r in rows:
        n = r.get("workers", 1)
        med = medians.get((r["workload"], r["mode"], n))
        base = medians.get((r["workload"], "off", n))
        first = medians.get((r["workload"], r["mode"], counts[0])) if counts else None
        r["speedup_vs_off"] = base / med if med and base else None
        r["speedup_vs_first"] = first / med if med and first and n != counts[0] else None
        if r["mode"] == "on" and r["speedup_vs_off"]:
            ratios[n].append(r["speedup_vs_off"])
        if r["speedup_vs_first"]:
            scaling[n].setdefault(r["mode"], []).append(r["speedup_vs_first"])
    geo = bench_workloads._geomean
    by_workers = {
        n: {
            "geomean_on_vs_off": geo(ratios[n]),
            "min_on_vs_off": min(ratios[n], default=None),
            "workloads": len(ratios[n]),
            "geomean_vs_first": {m: geo(v) for m, v in scaling[n].items()},
        }
        for n in counts
    }
    first = by_workers.get(counts[0], {}) if counts else {}
    return {
        "geomean_on_vs_off": first.get("geomean_on_vs_off"),
        "min_on_vs_off": first.get("min_on_vs_off"),
        "workloads": first.get("workloads", 0),
        "by_workers": by_workers,
    }


def table(rows: list[dict], summary: dict, meta: dict) -> str:
    mib = bench_workloads._mib
    w = max([11, *(len(r["mode"]) for r in rows)])
    out = [
        f"== workloads on {meta['cluster']} · backend {meta['backend']} · median of "
        f"{meta['samples']} in {meta.get('rounds', 1)} rounds, each after {meta['warmup']} "
        "warm-up · speedup = off median / median · "
        "memory per worker in MiB: peak held / peak used",
        f"{'workload':<13} {'mode':<{w}} {'w':>2} {'tasks':>6} {'median ms':>10} {'IQR':>7} "
        f"{'x off':>6} {'x 1w':>6} {'held':>7} {'used':>7}  status",
    ]
    num = bench_workloads._num
    for r in rows:
        out.append(
            f"{r['workload']:<13} {r['mode']:<{w}} {r.get('workers', 1):>2} "
            f"{r['n_tasks'] or '-':>6} "
            f"{num(r.get('wall_median_ms'), '.2f'):>10} "
            f"{num(r.get('wall_iqr_ms'), '.2f'):>7} "
            f"{num(r.get('speedup_vs_off'), '.2f'):>6} "
            f"{num(r.get('speedup_vs_first'), '.2f'):>6} "
            f"{mib(r.get('peak_held')):>7} {mib(r.get('peak_used')):>7}  {r['status']}"
            + (f" ({r['error']})" if r["error"] else "")
        )
    by_workers = summary.get("by_workers") or {1: summary}
    first = next(iter(by_workers), None)
    for n, s in by_workers.items():
        g, m = s["geomean_on_vs_off"], s["min_on_vs_off"]
        out.append(
            f"{n} worker(s): plugin on / off over {s['workloads']} workloads: geometric mean "
            f"{num(g, '.3f')}x, lowest {num(m, '.3f')}x"
        )
        for mode, v in (s.get("geomean_vs_first") or {}).items():
            out.append(
                f"{n} worker(s) / {first} worker(s), mode {mode}: geometric mean {num(v, '.3f')}x"
            )
    return "\n".join(out)


def split_mode(mode: str) -> tuple[str, dict[str, str]]:
    """``MODE:KEY=VALUE...`` as ``(MODE, {key: value})``: keys as ``StreamsPlugin``'s, values
    as Dask reads environment variables (a Python literal, else the string)."""
    base, *pairs = mode.split(":")
    settings = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key or not value:
            raise ValueError(f"mode {mode!r}: {pair!r} is not KEY=VALUE")
        try:  # as Dask reads DASK_* environment variables
            settings[key.replace("-", "_")] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            settings[key.replace("-", "_")] = value
    if settings and base not in ("on", "on-noblocks"):
        raise ValueError(f"mode {mode!r}: settings need the mode on or on-noblocks")
    if base not in MODES:
        raise ValueError(f"mode {mode!r}: unknown mode {base!r}; choose from {', '.join(MODES)}")
    if "blocks" in settings or "backend" in settings:
        raise ValueError(
            f"mode {mode!r}: blocks is the mode's (on: auto, on-noblocks: off), "
            "backend the benchmark's (--backend)"
        )
    if settings:
        StreamsPlugin(**settings)  # a bad key or value: its error, now
    return base, settings


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--backend", default="cupy", choices=("cupy", "sim"))
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument(
        "--workers",
        default="1",
        help="worker counts, one cluster each, in order (1,2: one GPU, then two)",
    )
    p.add_argument("--protocol", default=None, help="the cluster's protocol (tcp, ucx, ...)")
    bench_workloads.add_sampling_arguments(p)
    p.add_argument("--quick", action="store_true", help="tiny sizes (seconds on the sim)")
    p.add_argument("--set", action="append", default=[], type=bench_workloads.parse_set)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    args.workloads = bench_workloads._list(args.workloads)
    args.modes = bench_workloads._list(args.modes)
    try:
        args.workers = [int(n) for n in bench_workloads._list(args.workers)]
    except ValueError:
        p.error(f"--workers {args.workers!r} is not a list of ints")
    if args.rounds < 1 or args.samples < 1:
        p.error(f"--rounds {args.rounds} and --samples {args.samples} must be >= 1")
    if not args.workers or min(args.workers) < 1:
        p.error("--workers needs worker counts >= 1")
    bad = [c for c in args.workloads if c not in WORKLOADS]
    if bad:
        p.error(f"unknown workloads {bad}; choose from {', '.join(WORKLOADS)}")
    for mode in args.modes:
        try:
            split_mode(mode)
        except (ValueError, TypeError) as e:
            p.error(str(e))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = sizes_for(args.backend, args.quick, dict(args.set))
    base = bench_workloads.make_arrays(args.backend)
    out = bench_shapes.out_dir(args, f"cluster-{args.backend}")
    print(f"workers {args.workers}; writing to {out}", flush=True)
    started = time.monotonic()
    command = sys.argv[1:] if argv is None else argv
    meta = {
        "argv": [sys.executable, "-m", "benchmarks.bench_cluster", *command],
        "args": vars(args),
        "backend": args.backend,
        "cluster": None,
        "clusters": [],
        "samples": args.samples,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "sizes": {name: sizes[name] for name in args.workloads},
        "started": datetime.datetime.now().isoformat(),
        **bench_shapes.environment(base.plugin),
    }
    rows: list[dict] = []
    try:
        for n in args.workers:
            cluster, described = make_cluster(args.backend, n, args.protocol)
            print(described, flush=True)
            meta["clusters"].append(described)
            meta["cluster"] = " then ".join(meta["clusters"])
            with (
                cluster,
                Client(cluster) as client,
                dask.config.set({"gpustreams.enabled": False}),
            ):
                arrays = ClusterInputs(base, client)
                runner = ClusterRunner(args, arrays, sizes, out, client, workers=n)
                runner.rows = rows  # one list for every worker count
                for name in args.workloads:
                    runner.run(WORKLOADS[name], None, None)
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
