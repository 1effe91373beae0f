"""The four-shape benchmark: Dask with and without GPU streams, against a hand-launched ideal.

Run from the repository root (see ``benchmarks/README.md``)::

    python -m benchmarks.bench_shapes                      # everything, GPU if present
    python -m benchmarks.bench_shapes --backend sim --kernel-ms 20 --depth 6 --samples 3
    python -m benchmarks.bench_shapes --dry-run            # the plan and a time estimate

Modes, all measured in one run, on the same graphs and kernels:

- ``serial``: the plugin off, Dask as users run it today (legacy default stream);
- ``ptds-sync``: the plugin off, ``CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1``, each
  task synchronizes its thread's stream before returning (in a subprocess,
  since CuPy reads the variable at import; on sim: a stream per thread);
- ``gpustreams``: the plugin on, for each policy and stream count;
- ``ideal``: the same DAG launched by hand from one thread onto the same number
  of streams with event waits, no Dask, for several simple stream assignments.

On the distributed scheduler ``--dist-workers 1,2`` runs every distributed
configuration on a cluster of one worker, then of two (dask-cuda: one GPU, then
two); rows of N > 1 workers are labelled ``distributed-xN`` and a scaling table
compares each with one worker. ``--protocol ucx`` passes a protocol to the cluster.

Every sample's outputs are checked against a reference; a wrong result marks
the row FAILED. Each timed run starts after a full garbage collection, outside its time,
as in ``bench_workloads`` (since bbee4ef): on an H100 one launcher sample of wide
diamond at 0.5 ms kernels ran 21-27 ms longer than its others, in the last round of
each of four processes (``h100-pending-d-2e992b7``, ``h100-shapes-2e992b7``), which took
that row's paired ratio over two rounds from 4.2 to 3.3; on the sim, the full
collections that the earlier runs' garbage starts (18-30 ms here) fell inside timed
runs of every mode. Results
go to ``--out`` (default ``benchmarks/results/<backend>-<timestamp>/``, never
overwritten): ``results.json``, ``results.csv``, ``table.txt``,
``saturation_<scheduler>.png``, ``wall_<scheduler>.png``, ``timeline_<policy>.png`` and
Chrome traces.
"""

from __future__ import annotations

import os

# Streams 16 and 32 need 32 hardware connections, which CUDA reads when the context
# is created: set before anything imports CuPy. An explicit value in the environment wins.
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")

import argparse
import contextlib
import datetime
import gc
import itertools
import json
import statistics
import subprocess
import sys
import time
import traceback
from typing import Any

import dask
import dask.threaded
import numpy as np

import dask_gpustreams
from benchmarks import kernels, report
from benchmarks.report import environment, out_dir  # bench_shapes.out_dir, .environment too
from benchmarks.shapes import WIDE, dagger_shape, wide_shape
from benchmarks.workloads import (
    IDEAL_ASSIGNMENTS,
    IdealLauncher,
    Workload,
    gemm_workload,
    ideal_plan,
    spin_workload,
)
from dask_gpustreams.backends import create_backend, resolve_backend
from dask_gpustreams.config import BLOCKS
from dask_gpustreams.diagnostics import (
    clear_timeline,
    plot_gantt,
    saturation,
    timeline,
    to_chrome_trace,
)
from dask_gpustreams.runtime.policies import policy_names

MODES = ("serial", "serial-sync", "ptds-sync", "gpustreams", "launcher", "ideal")
SCHEDULERS = ("threaded", "distributed")
FAMILIES = ("wide", "dagger")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_tokens = itertools.count()


def _list(kind: Any = str):
    def parse(text: str) -> list:
        return [kind(x) for x in text.split(",") if x.strip()]

    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_shapes",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--backend", default="auto", choices=("auto", "cupy", "sim"))
    p.add_argument("--families", type=_list(), default=list(FAMILIES), help="wide,dagger")
    p.add_argument("--shapes", type=_list(), default=list(WIDE), help="shapes of each family")
    p.add_argument("--modes", type=_list(), default=list(MODES))
    p.add_argument("--schedulers", type=_list(), default=list(SCHEDULERS))
    p.add_argument("--policies", type=_list(), default=None, help="default: all registered")
    p.add_argument("--streams", type=_list(int), default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--dist-streams", type=_list(int), default=[8], help="distributed scheduler")
    p.add_argument("--dist-policies", type=_list(), default=None, help="default: --policies")
    p.add_argument(
        "--dist-workers",
        type=_list(int),
        default=[1],
        help="distributed: worker counts, a cluster each, in order (dask-cuda: one per GPU); "
        "rows of N > 1 are labelled distributed-xN",
    )
    p.add_argument(
        "--protocol", default=None, help="distributed: the cluster's protocol (tcp, ucx, ...)"
    )
    p.add_argument(
        "--dist-blocks",
        type=_list(),
        default=["auto"],
        help="distributed gpustreams rows: gpustreams.blocks (auto,off: both, side by side; "
        "rows with off are labelled <policy>/blocks=off)",
    )
    p.add_argument(
        "--dagger-streams",
        type=_list(int),
        default=[1, 2, 8, 32],
        help="threaded scheduler, Dagger's gemm shapes",
    )
    p.add_argument(
        "--ideal",
        type=_list(),
        default=["layers", "chains"],
        help=f"hand-launch assignments: {','.join(IDEAL_ASSIGNMENTS)}",
    )
    p.add_argument("--width", type=int, default=8)
    p.add_argument("--depth", type=int, default=16)
    p.add_argument("--seed", type=int, default=0, help="tangled's random dependencies")
    p.add_argument("--kernel-ms", type=float, default=2.0, help="busy kernel, threaded")
    p.add_argument("--dist-kernel-ms", type=float, default=8.0, help="busy kernel, distributed")
    p.add_argument(
        "--blocks",
        type=int,
        default=None,
        help="busy-kernel blocks of 256 threads (default ceil(SMs/32))",
    )
    p.add_argument("--matrix", type=int, default=None, help="gemm shapes (default 4096; sim 256)")
    p.add_argument("--tile", type=int, default=None, help="gemm tile (default 1024; sim 64)")
    p.add_argument("--chain-len", type=int, default=4, help="Dagger's CHAIN_LEN")
    p.add_argument("--threads", type=int, default=8, help="Dask threads (and ptds threads)")
    p.add_argument(
        "--chunksizes",
        type=_list(int),
        default=[1],
        help="threaded gpustreams rows: dask's chunksize (ready tasks handed to a thread at once)",
    )
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--samples", type=int, default=7)
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="threaded: rounds of all modes of a shape in turn (at most --samples), "
        "--samples shared out over them, warm-ups in the first; ratios paired by round",
    )
    p.add_argument(
        "--cluster",
        default="auto",
        choices=("auto", "cuda", "local"),
        help="distributed: LocalCUDACluster (dask-cuda) or in-process LocalCluster",
    )
    p.add_argument("--gantt-policies", type=_list(), default=["auto"])
    p.add_argument("--gantt-streams", type=int, default=8)
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="start no new configuration after this many seconds",
    )
    p.add_argument("--out", default=None)
    p.add_argument("--dry-run", action="store_true", help="print the plan and an estimate")
    p.add_argument(
        "--render",
        default=None,
        metavar="DIR",
        help="only redo table, CSV and figures of an earlier run's directory",
    )
    p.add_argument("--ptds-child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.policies = args.policies or ["auto"] + [p for p in policy_names() if p != "auto"]
    args.dist_policies = args.dist_policies or args.policies
    for name, values, allowed in (
        ("families", args.families, FAMILIES),
        ("shapes", args.shapes, WIDE),
        ("modes", args.modes, MODES),
        ("schedulers", args.schedulers, SCHEDULERS),
        ("policies", args.policies + args.dist_policies + args.gantt_policies, policy_names()),
        ("ideal", args.ideal, IDEAL_ASSIGNMENTS),
        ("dist-blocks", args.dist_blocks, BLOCKS),
    ):
        bad = [v for v in values if v not in allowed]
        if bad:
            p.error(f"--{name} {','.join(bad)} is invalid: allowed values are {','.join(allowed)}")
    if not args.dist_workers or min(args.dist_workers) < 1:
        p.error("--dist-workers needs worker counts >= 1")
    if args.rounds < 1 or args.samples < 1:
        p.error(f"--rounds {args.rounds} and --samples {args.samples} must be ints >= 1")
    return args


# --- groups of configurations -------------------------------------------------------------------


def groups(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(scheduler, family) pairs in run order: the targets' configurations first."""
    order = [
        ("threaded", "wide"),
        ("distributed", "wide"),
        ("threaded", "dagger"),
        ("distributed", "dagger"),
    ]
    return [(s, f) for s, f in order if s in args.schedulers and f in args.families]


def stream_counts(args: argparse.Namespace, scheduler: str, family: str) -> list[int]:
    if scheduler == "distributed":
        return args.dist_streams
    return args.dagger_streams if family == "dagger" else args.streams


def group_policies(args: argparse.Namespace, scheduler: str) -> list[str]:
    return args.dist_policies if scheduler == "distributed" else args.policies


def spin_target(args: argparse.Namespace, scheduler: str) -> float:
    return args.dist_kernel_ms if scheduler == "distributed" else args.kernel_ms


def make_shape(args: argparse.Namespace, family: str, name: str):
    if family == "wide":
        return wide_shape(name, args.width, args.depth, args.seed)
    return dagger_shape(name, args.matrix // args.tile, args.chain_len)


class Workloads:
    """Builds each (scheduler, family, shape) workload once, from the calibration."""

    def __init__(self, args: argparse.Namespace, backend: str, calibration: dict):
        self.args = args
        self.backend = backend
        self.calibration = calibration
        self._cache: dict[tuple, Workload] = {}

    def get(self, scheduler: str, family: str, name: str) -> Workload:
        if family == "wide":
            target = spin_target(self.args, scheduler)
            key = (family, name, target)
            if key not in self._cache:
                c = self.calibration["spin"][str(target)]
                spin = kernels.Spin(self.backend, c["blocks"], c["iters"], c["seconds"])
                shape = make_shape(self.args, family, name)
                self._cache[key] = spin_workload(shape, self.backend, spin, c["kernel_ms"])
        else:
            key = (family, name)
            if key not in self._cache:
                shape = make_shape(self.args, family, name)
                self._cache[key] = gemm_workload(
                    shape, self.backend, self.args.matrix, self.calibration["gemm_ms"]
                )
        return self._cache[key]


def calibrate(args: argparse.Namespace, backend_name: str) -> dict:
    """Busy-kernel lengths per target duration, and the isolated tile-gemm time."""
    backend = create_backend(backend_name)
    blocks = args.blocks or kernels.default_blocks(backend_name)
    out: dict = {"blocks": blocks, "spin": {}}
    if "wide" in args.families:
        for target in sorted({spin_target(args, s) for s in args.schedulers}):
            spin, ms = kernels.calibrate_spin(backend, target, blocks)
            out["spin"][str(target)] = {
                "blocks": spin.blocks,
                "iters": spin.iters,
                "seconds": spin.seconds,
                "kernel_ms": ms,
                "target_ms": target,
            }
            print(
                f"busy kernel: target {target} ms -> {ms:.3f} ms alone "
                f"({spin.blocks} x {kernels.BLOCK} threads, iters={spin.iters})"
            )
    if "dagger" in args.families:
        tile = args.tile
        gemm = kernels.TileGemm(backend_name)
        a = kernels.to_device(backend_name, np.ones((tile, tile), np.float32))
        out["gemm_ms"] = kernels.time_isolated(backend, lambda: gemm(a, a))
        print(f"tile gemm: {tile}^2 float32 -> {out['gemm_ms']:.4f} ms alone")
    return out


# --- measuring ------------------------------------------------------------------------------------


class Runner:
    """Runs configurations in order, within the time budget, appending rows."""

    def __init__(self, args: argparse.Namespace, backend: str, out: str, deadline: float | None):
        self.args = args
        self.backend = backend
        self.out = out
        self.deadline = deadline
        self.rows: list[dict] = []
        self.t0 = time.monotonic()
        self._launchers: dict[int, IdealLauncher] = {}
        #: Inside :meth:`rounds`: the rows to measure, and rows to report again after them.
        self._pending: list[tuple[dict, Workload, Any]] | None = None
        self._aliases: list[tuple[dict, dict]] = []

    def launcher(self, n_streams: int) -> IdealLauncher:
        """The hand launcher onto ``n_streams`` streams (created once per count)."""
        if n_streams not in self._launchers:
            device = create_backend(self.backend)
            self._launchers[n_streams] = IdealLauncher(device, n_streams)
        return self._launchers[n_streams]

    def row(
        self,
        scheduler: str,
        wl: Workload,
        mode: str,
        policy: str,
        streams: int,
        workers: int | None = None,
    ) -> dict:
        return {
            "scheduler": scheduler,
            "workers": workers,
            "family": wl.shape.family,
            "shape": wl.shape.name,
            "mode": mode,
            "policy": policy,
            "streams": streams,
            "n_tasks": wl.shape.n_tasks,
            "critical_path": wl.shape.critical_path,
            "kernel_ms": wl.kernel_ms,
            "samples": 0,
            "walls_ms": [],
            "status": "SKIPPED",
            "error": "",
        }

    def measure(self, row: dict, wl: Workload, prepare: Any) -> dict:
        """Warm-ups then samples of ``prepare(i)()``, each timed between device syncs, checked.

        Inside :meth:`rounds` the row is only noted, and measured when the rounds run.
        """
        if self._pending is not None:
            self._pending.append((row, wl, prepare))
            return row
        if self.deadline is not None and time.monotonic() > self.deadline:
            row["error"] = "time budget spent"
            return self._done(row)
        self._sample(row, wl, prepare, self.args.warmup, self.args.samples)
        row.update(report.summarize(row["walls_ms"]))
        return self._done(row)

    def _sample(
        self, row: dict, wl: Workload, prepare: Any, warmup: int, samples: int, where: str = ""
    ) -> None:
        """Run ``warmup`` then ``samples`` timed runs; add their walls to ``row``, check each.

        ``where`` starts a failure's message (e.g. its round)."""
        walls = row["walls_ms"]
        try:
            for i in range(warmup + samples):
                go = prepare(next(_tokens))
                kernels.device_synchronize(self.backend)
                gc.collect()  # garbage of earlier runs is not this run's (the docstring)
                t0 = time.perf_counter()
                results = go()
                kernels.device_synchronize(self.backend)
                wall = (time.perf_counter() - t0) * 1e3
                problem = wl.check(results)
                del results
                if problem is not None:
                    row["status"], row["error"] = "FAILED", f"{where}run {i}: {problem}"
                    break
                if i >= warmup:
                    walls.append(wall)
            else:
                if row["status"] == "SKIPPED":
                    row["status"] = "ok"
        except Exception as e:  # a broken configuration must not end the whole run
            row["status"], row["error"] = "ERROR", f"{type(e).__name__}: {e}"
            traceback.print_exc()
        row["samples"] = len(walls)

    def alias(self, row: dict, **changes: Any) -> None:
        """Report ``row`` once more with ``changes`` (the same run under another name)."""
        if self._pending is not None:
            self._aliases.append((row, changes))
        else:
            self.rows.append(dict(row, **changes))

    @contextlib.contextmanager
    def rounds(self, n: int):
        """Measure the rows noted inside in turn, ``n`` times, sharing ``--samples`` out.

        Drift of the host (its clock, other jobs) then weighs on every mode alike;
        each row keeps its walls per round (``round_walls_ms``) for ratios paired by
        round (:func:`paired_table`). Warm-ups run in the first round only.
        """
        if n <= 1:
            yield
            return
        self._pending, self._aliases = [], []
        try:
            yield
            entries, aliases = self._pending, self._aliases
        finally:
            self._pending = None
        for k, share in enumerate(report.round_shares(self.args.samples, n)):
            for row, wl, prepare in entries:
                if self.deadline is not None and time.monotonic() > self.deadline:
                    row["error"] = row["error"] or "time budget spent"
                    continue
                if row["status"] in ("FAILED", "ERROR"):
                    continue
                before = len(row["walls_ms"])
                warmup = self.args.warmup if k == 0 else 0
                self._sample(row, wl, prepare, warmup, share, f"round {k}, ")
                row.setdefault("round_walls_ms", []).append(row["walls_ms"][before:])
        for row, _, _ in entries:
            row.update(report.summarize(row["walls_ms"]))
            self._done(row)
        for row, changes in aliases:
            self.rows.append(dict(row, **changes))

    def skip(self, row: dict, why: str) -> dict:
        row["error"] = why
        return self._done(row)

    def _done(self, row: dict) -> dict:
        self.rows.append(row)
        with open(os.path.join(self.out, "rows.jsonl"), "a") as f:
            f.write(json.dumps(row, default=str) + "\n")
        med = row.get("wall_median_ms")
        sat = row["kernel_ms"] * row["n_tasks"] / med if med else None
        policy = f":{row['policy']}" if row["policy"] else ""
        print(
            f"[{time.monotonic() - self.t0:6.0f}s] {row['scheduler']:<11} {row['family']:<6} "
            f"{row['shape']:<9} {row['mode'] + policy:<26} n={row['streams']:<3} "
            + (f"median {med:9.2f} ms  sat {sat:5.2f}  " if med else "")
            + row["status"]
            + (f" ({row['error']})" if row["error"] else ""),
            flush=True,
        )
        return row


def threaded_prepare(
    wl: Workload, config: dict, threads: int, sync_after: bool = False, get: Any = None
):
    """A run of ``wl`` on Dask's threaded scheduler, or on ``get`` (e.g. the launcher)."""

    def prepare(token: int):
        dsk, keys = wl.graph(token, sync_after=sync_after)

        def go():
            with dask.config.set(config):
                if get is not None:
                    return get(dsk, keys)
                return dask.threaded.get(dsk, keys, num_workers=threads)

        return go

    return prepare


def gpustreams_config(backend: str, streams: int, policy: str, timeline: bool = False) -> dict:
    return {
        "gpustreams.enabled": True,
        "gpustreams.backend": backend,
        "gpustreams.streams": streams,
        "gpustreams.policy": policy,
        "gpustreams.timeline": timeline,
    }


OFF = {"gpustreams.enabled": False}


def dist_label(workers: int) -> str:
    """The ``scheduler`` of rows measured on ``workers`` workers."""
    return "distributed" if workers == 1 else f"distributed-x{workers}"


class Distributed:
    """``workers`` workers (default one) with ``threads`` threads each: LocalCUDACluster (one
    per GPU) if possible, else in-process."""

    def __init__(self, args: argparse.Namespace, backend: str, workers: int = 1):
        import distributed

        self.args = args
        self.backend = backend
        self.workers = workers
        self.label = dist_label(workers)
        self.cluster = None
        protocol = getattr(args, "protocol", None)
        extra = {} if protocol is None else {"protocol": protocol}
        shown = "" if protocol is None else f", protocol={protocol!r}"
        if args.cluster in ("auto", "cuda") and backend == "cupy":
            try:
                from dask_cuda import LocalCUDACluster

                self.cluster = LocalCUDACluster(
                    n_workers=workers,
                    threads_per_worker=args.threads,
                    dashboard_address=None,
                    **extra,
                )
                self.kind = (
                    f"LocalCUDACluster(n_workers={workers}, "
                    f"threads_per_worker={args.threads}{shown})"
                )
            except Exception as e:
                if args.cluster == "cuda":
                    raise
                print(
                    f"distributed: dask-cuda unavailable ({type(e).__name__}: {e}); "
                    "using LocalCluster(processes=False)"
                )
        if self.cluster is None:
            self.cluster = distributed.LocalCluster(
                n_workers=workers,
                threads_per_worker=args.threads,
                processes=False,
                dashboard_address=None,
                **extra,
            )
            self.kind = (
                f"LocalCluster(n_workers={workers}, threads_per_worker={args.threads}, "
                f"processes=False{shown})"
            )
        self.client = distributed.Client(self.cluster)
        self._sources: dict[int, dict] = {}
        self.plugin_name: str | None = None
        print(f"distributed: {self.kind}")

    def close(self) -> None:
        self.client.close()
        self.cluster.close()

    def sources(self, wl: Workload) -> dict:
        if id(wl) not in self._sources:
            keys = list(wl.sources)
            futures = self.client.scatter([wl.sources[k] for k in keys], hash=False)
            self._sources[id(wl)] = dict(zip(keys, futures, strict=True))
        return self._sources[id(wl)]

    def prepare(self, wl: Workload, sync_after: bool = False):
        sources = self.sources(wl)

        def prepare(token: int):
            dsk, keys = wl.graph(token, sources=sources, sync_after=sync_after)
            return lambda: self.client.get(dsk, keys)

        return prepare

    def use_streams(
        self,
        streams: int | None,
        policy: str = "auto",
        timeline: bool = False,
        blocks: str = "auto",
    ):
        """Register the plugin (``streams``, ``policy``, ``blocks``); ``None``: unregister it."""
        if self.plugin_name is not None:  # the plugin is idempotent: replace it explicitly
            self.client.unregister_worker_plugin(self.plugin_name)
            self.plugin_name = None
        if streams is None:
            return
        from dask_gpustreams.integrations.distributed import StreamsPlugin

        plugin = StreamsPlugin(
            backend=self.backend, streams=streams, policy=policy, timeline=timeline, blocks=blocks
        )
        self.client.register_plugin(plugin)
        self.plugin_name = plugin.name


def plugin_problem() -> str | None:
    """Why the distributed plugin cannot be used, or None."""
    try:
        from dask_gpustreams.integrations.distributed import StreamsPlugin  # noqa: F401
    except ImportError as e:
        return f"dask_gpustreams.integrations.distributed.StreamsPlugin is not importable ({e})"
    return None


# --- the modes ------------------------------------------------------------------------------------


def run_group(
    runner: Runner,
    loads: Workloads,
    scheduler: str,
    family: str,
    dist: Distributed | None,
    modes: list[str],
) -> None:
    args = runner.args
    backend = runner.backend
    streams = stream_counts(args, scheduler, family)
    policies = group_policies(args, scheduler)
    row_scheduler = scheduler if dist is None else dist.label  # distributed-xN for N workers
    workers = None if dist is None else dist.workers

    def new_row(wl: Workload, mode: str, policy: str, n: int) -> dict:
        return runner.row(row_scheduler, wl, mode, policy, n, workers)

    def measure_modes(wl: Workload) -> None:
        """Every mode of ``modes`` on ``wl`` (measured now, or noted inside rounds)."""
        if dist is not None:
            dist.use_streams(None)
        if "serial" in modes:
            row = new_row(wl, "serial", "", 1)
            prep = threaded_prepare(wl, OFF, args.threads) if dist is None else dist.prepare(wl)
            runner.measure(row, wl, prep)
        if "serial-sync" in modes and dist is None:
            row = new_row(wl, "serial-sync", "", 1)
            runner.measure(row, wl, threaded_prepare(wl, OFF, 1, get=dask.get))
        if "ptds-sync" in modes:  # only in the child process, where PTDS is on
            row = new_row(wl, "ptds-sync", "", args.threads)
            prep = (
                threaded_prepare(wl, OFF, args.threads, sync_after=True)
                if dist is None
                else dist.prepare(wl, sync_after=True)
            )
            runner.measure(row, wl, prep)
        if "gpustreams" in modes:
            problem = plugin_problem() if dist is not None else None
            for n in streams:
                # With one stream every policy picks it: measure once, report for all.
                for policy in policies[:1] if n == 1 else policies:
                    row = new_row(wl, "gpustreams", policy, n)
                    if problem is not None:
                        runner.skip(row, problem)
                        continue
                    if dist is None:
                        config = gpustreams_config(backend, n, policy)
                        runner.measure(row, wl, threaded_prepare(wl, config, args.threads))
                        for chunksize in (c for c in args.chunksizes if c != 1):
                            label = f"{policy}/chunksize={chunksize}"
                            tuned = new_row(wl, "gpustreams", label, n)
                            chunked = {**config, "chunksize": chunksize}
                            runner.measure(tuned, wl, threaded_prepare(wl, chunked, args.threads))
                    else:
                        for blocks in args.dist_blocks:
                            if blocks != "auto":
                                label = f"{policy}/blocks={blocks}"
                                if blocks == args.dist_blocks[0]:
                                    row["policy"] = label
                                else:
                                    row = new_row(wl, "gpustreams", label, n)
                            elif blocks != args.dist_blocks[0]:
                                row = new_row(wl, "gpustreams", policy, n)
                            try:
                                dist.use_streams(n, policy, blocks=blocks)
                            except Exception as e:
                                runner.skip(row, f"plugin registration failed: {e!r}")
                                continue
                            runner.measure(row, wl, dist.prepare(wl))
                    if n == 1:
                        for other in policies[1:]:
                            runner.alias(row, policy=other, note=f"same run as {policies[0]}")
            if dist is not None:
                dist.use_streams(None)
        if "launcher" in modes and dist is None:
            for n in streams:
                for policy in policies[:1] if n == 1 else policies:
                    row = new_row(wl, "launcher", policy, n)
                    config = {**gpustreams_config(backend, n, policy), "gpustreams.enabled": False}
                    prep = threaded_prepare(wl, config, 1, get=dask_gpustreams.get)
                    runner.measure(row, wl, prep)
        # The hand launch runs on this process's device: measured with the first cluster only.
        if "ideal" in modes and (dist is None or dist.workers == args.dist_workers[0]):
            run_ideal(runner, wl, row_scheduler, streams, workers)

    for name in args.shapes:
        wl = loads.get(scheduler, family, name)
        print(
            f"-- {row_scheduler} · {wl.shape.describe()} · kernel {wl.kernel_ms:.3f} ms", flush=True
        )
        # On the threaded scheduler the modes take turns; a cluster is set up per mode.
        with runner.rounds(args.rounds if dist is None else 1):
            measure_modes(wl)


def run_ideal(
    runner: Runner, wl: Workload, scheduler: str, streams: list[int], workers: int | None = None
) -> None:
    for n in streams:
        launcher = runner.launcher(n)
        for assignment in runner.args.ideal[:1] if n == 1 else runner.args.ideal:
            plan = ideal_plan(wl, n, assignment)
            row = runner.row(scheduler, wl, "ideal", assignment, n, workers)
            runner.measure(row, wl, lambda token, p=plan, go=launcher.run: lambda: go(wl, p))
            if n == 1:
                for other in runner.args.ideal[1:]:
                    runner.alias(row, policy=other, note="same run (1 stream)")


def run_gantt(runner: Runner, loads: Workloads) -> None:
    """One recorded run per wide shape and ``--gantt-policies``: PNG (4 panels) and traces."""
    args = runner.args
    n = args.gantt_streams
    for policy in args.gantt_policies:
        panels = []
        for name in args.shapes:
            wl = loads.get("threaded", "wide", name)
            config = gpustreams_config(runner.backend, n, policy, timeline=True)
            prep = threaded_prepare(wl, config, args.threads)
            try:
                prep(next(_tokens))()  # warm-up: creates the timed pool
                clear_timeline()
                results = prep(next(_tokens))()
                problem = wl.check(results)
                records = [r for r in timeline() if r["pool"] == f"{policy}/{n}"]
            except Exception as e:
                print(f"timeline {policy} {name}: {type(e).__name__}: {e}")
                continue
            sat = saturation(records, wl.kernel_ms) if records else float("nan")
            panels.append((name, records, sat, problem))
            to_chrome_trace(records, os.path.join(runner.out, f"trace_{policy}_{name}.json"))
            print(
                f"timeline {policy}/{n} {name}: {len(records)} tasks, saturation {sat:.2f}"
                + (f", WRONG RESULT: {problem}" if problem else "")
            )
        clear_timeline()
        if not panels:
            continue
        from matplotlib.figure import Figure

        fig = Figure(figsize=(12, 3.2 * len(panels)), layout="constrained")
        axes = fig.subplots(len(panels), 1, squeeze=False).ravel()
        for ax, (name, records, sat, _) in zip(axes, panels, strict=True):
            plot_gantt(
                records,
                ax=ax,
                title=f"wide {name} · {policy} · {n} streams · "
                f"saturation {sat:.2f} (threaded, {len(records)} tasks)",
            )
            leg = ax.get_legend()
            if leg is not None:
                leg.remove()
        fig.savefig(os.path.join(runner.out, f"timeline_{policy}.png"), dpi=100)


# --- the ptds-sync child process ---------------------------------


def run_ptds_child(runner: Runner, calibration: dict) -> None:
    """Run every ptds-sync configuration in a subprocess with PTDS on; merge its rows."""
    spec = {
        "argv": sys.argv[1:],
        "backend": runner.backend,
        "calibration": calibration,
        "out": runner.out,
        "budget_s": None
        if runner.deadline is None
        else max(1.0, runner.deadline - time.monotonic()),
    }
    path = os.path.join(runner.out, "ptds_spec.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    env = dict(os.environ, CUPY_CUDA_PER_THREAD_DEFAULT_STREAM="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    print("-- ptds-sync: subprocess with CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1", flush=True)
    cmd = [sys.executable, "-m", "benchmarks.bench_shapes", "--ptds-child", path]
    proc = subprocess.run(cmd, env=env, cwd=REPO)
    rows_path = os.path.join(runner.out, "ptds_rows.json")
    if proc.returncode != 0 or not os.path.exists(rows_path):
        print(f"ptds-sync subprocess failed (exit {proc.returncode})")
        return
    with open(rows_path) as f:
        runner.rows.extend(json.load(f))


def ptds_child(spec_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    args = parse_args(spec["argv"])
    set_defaults(args, spec["backend"])
    budget = spec["budget_s"]
    runner = Runner(
        args, spec["backend"], spec["out"], None if budget is None else time.monotonic() + budget
    )
    loads = Workloads(args, spec["backend"], spec["calibration"])
    for scheduler, family in groups(args):
        for workers in args.dist_workers if scheduler == "distributed" else [None]:
            if runner.deadline is not None and time.monotonic() > runner.deadline:
                break
            dist = None if workers is None else Distributed(args, spec["backend"], workers)
            try:
                run_group(runner, loads, scheduler, family, dist, ["ptds-sync"])
            finally:
                if dist is not None:
                    dist.close()
    with open(os.path.join(spec["out"], "ptds_rows.json"), "w") as f:
        json.dump(runner.rows, f, default=str)
    return 0


# --- main ------------------------------------------------------------


def set_defaults(args: argparse.Namespace, backend: str) -> None:
    if args.matrix is None:
        args.matrix = 4096 if backend == "cupy" else 256
    if args.tile is None:
        args.tile = 1024 if backend == "cupy" else 64
    if args.matrix % args.tile:
        raise SystemExit(f"--matrix {args.matrix} is not a multiple of --tile {args.tile}")


def estimate(args: argparse.Namespace, backend: str) -> float:
    """A rough lower bound of the run's seconds (device time, plus a host cost per task)."""
    total = 0.0
    runs = args.warmup + args.samples
    host = {"threaded": 0.1, "distributed": 0.6}  # ms per task, rough
    gemm_ms = 0.04 if backend == "cupy" else 0.05
    for scheduler, family in groups(args):
        ns = stream_counts(args, scheduler, family)
        pols = group_policies(args, scheduler)
        for name in args.shapes:
            shape = make_shape(args, family, name)
            k = spin_target(args, scheduler) if family == "wide" else gemm_ms
            work, crit = shape.n_tasks * k, shape.critical_path * k
            par = max(len(layer) for layer in shape.layers)
            h = host[scheduler] * shape.n_tasks

            def wall(n, h=h, work=work, crit=crit, par=par):
                return max(work / min(n, par), crit, h)

            configs = []
            if "serial" in args.modes:
                configs.append(max(work, h))
            if "ptds-sync" in args.modes:
                configs.append(wall(args.threads) * 1.5)
            if "gpustreams" in args.modes:
                configs += [wall(n) for n in ns for _ in (pols[:1] if n == 1 else pols)]
            if "ideal" in args.modes:
                configs += [
                    max(work / min(n, par), crit)
                    for n in ns
                    for _ in (args.ideal[:1] if n == 1 else args.ideal)
                ]
            repeat = len(args.dist_workers) if scheduler == "distributed" else 1
            total += runs * sum(configs) / 1e3 * repeat
    if "ptds-sync" in args.modes:
        total += 5.0  # subprocess start
    if "gpustreams" in args.modes and "threaded" in args.schedulers and "wide" in args.families:
        total += len(args.gantt_policies) * len(args.shapes) * 2 * args.kernel_ms * 145 / 8 / 1e3
    return total


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.ptds_child:
        return ptds_child(args.ptds_child)
    if args.render:
        return render(args.render, args.gantt_streams)
    backend = resolve_backend(args.backend)
    set_defaults(args, backend)
    print(
        f"backend {backend}; CUDA_DEVICE_MAX_CONNECTIONS="
        f"{os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS')}; estimated >= "
        f"{estimate(args, backend):.0f} s"
    )
    for scheduler, family in groups(args):
        print(
            f"  {scheduler} · {family}: streams {stream_counts(args, scheduler, family)}, "
            f"policies {group_policies(args, scheduler)}, shapes {args.shapes}"
            + (f", workers {args.dist_workers}" if scheduler == "distributed" else "")
        )
    if args.dry_run:
        return 0
    out = out_dir(args, backend)
    print(f"writing to {out}", flush=True)
    started = time.monotonic()
    deadline = None if args.budget_s is None else started + args.budget_s
    meta = {
        "argv": sys.argv,
        "args": vars(args),
        "backend": backend,
        "started": datetime.datetime.now().isoformat(),
        **environment(backend),
    }
    print(f"host: {meta['host_loop_ns']} ns a loop iteration in this process (report.host_loop_ns)")
    calibration = calibrate(args, backend)
    meta["calibration"] = calibration
    runner = Runner(args, backend, out, deadline)
    loads = Workloads(args, backend, calibration)
    local_modes = [m for m in args.modes if m != "ptds-sync"]
    ptds_done = "ptds-sync" not in args.modes
    try:
        for scheduler, family in groups(args):
            for workers in args.dist_workers if scheduler == "distributed" else [None]:
                if deadline is not None and time.monotonic() > deadline:
                    print(f"{scheduler} · {family}: skipped, time budget spent")
                    continue
                dist = None
                if workers is not None:
                    try:
                        dist = Distributed(args, backend, workers)
                    except Exception as e:
                        print(f"distributed scheduler skipped: cannot start a cluster ({e!r})")
                        continue
                    meta.setdefault("clusters", [])
                    if dist.kind not in meta["clusters"]:
                        meta["clusters"].append(dist.kind)
                    meta["cluster"] = " then ".join(meta["clusters"])
                try:
                    run_group(runner, loads, scheduler, family, dist, local_modes)
                finally:
                    if dist is not None:
                        dist.close()
            if (scheduler, family) == ("threaded", "wide") and "gpustreams" in args.modes:
                run_gantt(runner, loads)
            if not ptds_done:
                run_ptds_child(runner, calibration)
                ptds_done = True
    finally:
        meta["elapsed_s"] = time.monotonic() - started
        finish(runner, meta, out)
    return 0


def finish(runner: Runner, meta: dict, out: str) -> None:
    write_outputs(runner.rows, meta, out, runner.args.gantt_streams)


def write_outputs(rows: list[dict], meta: dict, out: str, headline_streams: int) -> None:
    """results.json, results.csv, table.txt and the figures of ``rows``; print the table."""
    report.derive(rows)
    paired = paired_table(rows)  # before results.json: it adds paired_vs_plain_best
    report.write_json(os.path.join(out, "results.json"), meta, rows)
    report.write_csv(os.path.join(out, "results.csv"), rows)
    text = report.table(rows, headline_streams=headline_streams)
    with open(os.path.join(out, "table.txt"), "w") as f:
        f.write(text + "\n")
    if paired:
        text += "\n" + paired
        with open(os.path.join(out, "table.txt"), "a") as f:
            f.write(paired + "\n")
    scaling = scaling_table(rows)
    if scaling:
        text += "\n" + scaling
        with open(os.path.join(out, "table.txt"), "a") as f:
            f.write(scaling + "\n")
    print(text)
    for scheduler in dict.fromkeys(r["scheduler"] for r in rows):
        try:
            path = os.path.join(out, f"saturation_{scheduler}.png")
            report.plot_saturation(rows, scheduler, path)
            path = os.path.join(out, f"wall_{scheduler}.png")
            report.plot_wall(rows, scheduler, path, headline_streams)
        except ImportError as e:
            print(f"figures skipped: {e}")
            break
    failed = [r for r in rows if r["status"] in ("FAILED", "ERROR")]
    elapsed = meta.get("elapsed_s")
    print(
        f"\n{len(rows)} rows, {len(failed)} failed"
        + (f"; {elapsed:.0f} s" if elapsed is not None else "")
        + f"; results in {out}"
    )


def paired_table(rows: list[dict]) -> str:
    """Rows measured in rounds (``--rounds``) against plain Dask's best of the same shape in
    the same rounds: the median over rounds of its median over the row's (2.0: twice as
    fast), so that drift between rounds moves both sides. ``ptds-sync`` rows are left out:
    its child process measures them at another time. Empty without such rows."""
    plain = ("serial", "serial-sync")
    out = []
    for r in rows:
        walls = r.get("round_walls_ms")
        if r["mode"] in (*plain, "ptds-sync") or not walls or r["status"] != "ok" or r.get("note"):
            continue
        bases = [
            b
            for b in rows
            if b["mode"] in plain
            and b["status"] == "ok"
            and len(b.get("round_walls_ms") or ()) == len(walls)
            and (b["scheduler"], b["family"], b["shape"])
            == (r["scheduler"], r["family"], r["shape"])
        ]
        if not bases or not all(walls):
            continue
        ratios = [
            min(statistics.median(b["round_walls_ms"][k]) for b in bases)
            / statistics.median(walls[k])
            for k in range(len(walls))
        ]
        r["paired_vs_plain_best"] = statistics.median(ratios)
        out.append(
            f"{r['family']:<6} {r['shape']:<10} {report._label(r):<30} {r['streams']:>3} "
            f"{r['paired_vs_plain_best']:8.2f} {min(ratios):6.2f}-{max(ratios):.2f}"
        )
    if not out:
        return ""
    head = [
        "\n== paired by round: plain Dask's best mode (serial, serial-sync) of the round over "
        "the row's median; median over rounds, then the range ==",
        f"{'family':<6} {'shape':<10} {'mode:policy':<30} {'n':>3} {'paired':>8} range",
    ]
    return "\n".join(head + out)


def scaling_table(rows: list[dict]) -> str:
    """Distributed rows on N > 1 workers against the same configuration on the first count:
    median wall of the first over theirs (2.0: twice as fast). Empty without such rows."""
    dist = [r for r in rows if r.get("workers") and r["scheduler"].startswith("distributed")]
    counts = list(dict.fromkeys(r["workers"] for r in dist))
    if len(counts) < 2:
        return ""

    def key(r: dict) -> tuple:
        return (r["family"], r["shape"], r["mode"], r["policy"], r["streams"])

    first = {
        key(r): r
        for r in dist
        if r["workers"] == counts[0] and r["status"] == "ok" and r.get("wall_median_ms")
    }
    out = [
        f"\n== distributed scaling: median wall on {counts[0]} worker(s) / on N workers "
        "(same shape, mode, policy, streams) ==",
        f"{'shape':<10} {'mode:policy':<30} {'n':>3} {'N':>3} {'median ms':>10} "
        f"{f'at {counts[0]}w':>10} {'scaling':>8}  status",
    ]
    for r in dist:
        if r["workers"] == counts[0]:
            continue
        base = first.get(key(r))
        med = r.get("wall_median_ms") if r["status"] == "ok" else None
        b = base["wall_median_ms"] if base else None
        out.append(
            f"{r['shape']:<10} {report._label(r):<30} {r['streams']:>3} {r['workers']:>3} "
            f"{report._num(med, '.1f'):>10} {report._num(b, '.1f'):>10} "
            f"{report._num(b / med if b and med else None, '.2f'):>8}  {report._status(r)}"
        )
    return "\n".join(out)


def render(out: str, headline_streams: int) -> int:
    """Redo the outputs of a run directory from results.json, or from rows.jsonl if the
    run was cut short (rows of a ptds-sync child that did not finish are in rows.jsonl too)."""
    path = os.path.join(out, "results.json")
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
        meta, rows = data["meta"], data["rows"]
    else:
        with open(os.path.join(out, "rows.jsonl")) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        meta = {"note": "rendered from rows.jsonl of an unfinished run"}
    write_outputs(rows, meta, out, headline_streams)
    return 0


if __name__ == "__main__":
    sys.exit(main())
