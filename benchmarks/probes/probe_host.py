"""Where a threaded-scheduler run loses time against the hand launch (diagnostic probe).

Answered (H200, 3e07a1e to ca67efd; ``docs/guide.md``, "Host launch rate", "Start-up"): on
the threaded scheduler the host's launch rate bounds the wide shapes: 235-265 us per task with
the runtime, Python work under the GIL of 8 threads rather than CUDA calls (``--stubs``), and
neither one launch lock nor Dask's ``chunksize`` helps.

For each wide shape, runs the graph with the plugin on (timeline on) and logs,
per task, the host times of ``StreamRuntime.run`` (enter, exit) and the device
start and end of its kernel on one clock (a reference event synchronized at
the start). Prints: wall, time to the first launch, median host cost per
task, how many kernels started within 50 us of their launch (the stream was
waiting for the host), and when the last launch happened.

    python -m benchmarks.probes.probe_host --threads 8,4,2
    python -m benchmarks.probes.probe_host --stubs --shapes linear,tangled
    python -m benchmarks.probes.probe_host --launch-lock --chunksizes 1,8
    python -m benchmarks.probes.probe_host --startup --backend sim

``--launch-lock`` adds rows where every ``StreamRuntime.run`` holds one
process-wide lock: launches serialized per task, as ``chunksize`` serializes
them per batch, to see what the threads' contention costs.

The library methods it times or stubs (``StreamRuntime.run``, ``LocalSchedulerHook._start``,
``CupyBackend.done`` and ``create_event``) are patched with ``unittest.mock.patch.object``
inside each mode and restored when it ends, also on an exception.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import threading
import time
from unittest import mock

import dask
import dask.threaded

import dask_gpustreams  # noqa: F401
from benchmarks import bench_shapes as bs
from dask_gpustreams.runtime import runtime as rt

LOG: list = []
_orig_run = rt.StreamRuntime.run
LAUNCH_LOCK = threading.Lock()
LOCKED = [False]


def _logged_run(self, key, fn, inputs, registry, critical=None):
    t0 = time.perf_counter()
    if LOCKED[0]:
        with LAUNCH_LOCK:
            out = _orig_run(self, key, fn, inputs, registry, critical)
    else:
        out = _orig_run(self, key, fn, inputs, registry, critical)
    LOG.append((key, t0, time.perf_counter(), threading.get_ident()))
    return out


def probe(wl, threads: int, policy: str, streams: int, reps: int, chunksize: int = 1) -> dict:
    import cupy

    rows = []
    for rep in range(reps + 1):
        dsk, keys = wl.graph(("p", rep, threads, policy))
        cfg = bs.gpustreams_config("cupy", streams, policy, timeline=True)
        LOG.clear()
        with dask.config.set(cfg):
            runtime = rt.get_runtime()
            runtime.timeline.clear()
            cupy.cuda.runtime.deviceSynchronize()
            ref = cupy.cuda.Event()
            ref.record(cupy.cuda.Stream.null)
            ref.synchronize()
            h0 = time.perf_counter()
            results = dask.threaded.get(dsk, keys, num_workers=threads, chunksize=chunksize)
            wall = (time.perf_counter() - h0) * 1e3
        err = wl.check(list(results))
        if rep == 0:
            continue  # warm-up
        recs = {r.key: r for r in runtime.timeline}
        gstart = {k: cupy.cuda.get_elapsed_time(ref, r.start) for k, r in recs.items()}
        host = {k: ((a - h0) * 1e3, (b - h0) * 1e3) for k, a, b, _ in LOG}
        waiting = sum(1 for k, (a, b) in host.items() if k in gstart and gstart[k] - b < 0.05)
        rows.append(
            {
                "wall": wall,
                "first": min(a for a, _ in host.values()),
                "last": max(b for _, b in host.values()),
                "per_task_us": statistics.median((b - a) * 1e3 for a, b in host.values()),
                "host_waited": waiting,
                "gpu_first": min(gstart.values()),
                "error": err,
            }
        )
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "error"}
    med["errors"] = [r["error"] for r in rows if r["error"]]
    return med


def stub_calls(a) -> int:
    """Host cost per task at 8 threads with CUDA calls of the runtime replaced by no-ops.

    ``query``: event queries answer "not done" without calling CUDA (no input
    is released early); ``create``: events come from a list made beforehand.
    Shows what each kind of call costs under the GIL contention of 8 threads.
    """
    from benchmarks import kernels
    from benchmarks.shapes import wide_shape
    from benchmarks.workloads import spin_workload
    from dask_gpustreams.backends.cupy import CupyBackend

    spin = kernels.Spin("cupy", kernels.default_blocks("cupy"), 100, 0.0)
    real_done, real_create = CupyBackend.done, CupyBackend.create_event
    for name in a.shapes.split(","):
        wl = spin_workload(wide_shape(name, 8, 16, 0), "cupy", spin, 0.001)
        for stubs in ("", "query", "create", "query+create"):
            made = [real_create(None) for _ in range(40 * len(wl.shape.nodes))]
            done = (lambda self, e: False) if "query" in stubs else real_done
            create = real_create
            if "create" in stubs:
                create = lambda self, timing=False, _pop=made.pop: _pop()  # noqa: E731
            walls = []
            cfg = bs.gpustreams_config("cupy", a.streams, "auto")
            with (
                mock.patch.object(CupyBackend, "done", done),
                mock.patch.object(CupyBackend, "create_event", create),
            ):
                for rep in range(30):
                    dsk, keys = wl.graph(("stub", rep, stubs))
                    with dask.config.set(cfg):
                        t0 = time.perf_counter()
                        res = dask.threaded.get(dsk, keys, num_workers=8)
                        walls.append(time.perf_counter() - t0)
            err = wl.check(list(res))
            us = statistics.median(walls[2:]) / len(wl.shape.nodes) * 1e6
            print(
                f"{name:10} stubs={stubs or 'none':13} threads=8: {us:6.1f} us/task"
                + (f" ERR {err}" if err else ""),
                flush=True,
            )
    return 0


def profile_host(a) -> int:
    """Host cost per task (kernels of a few us) by scheduler and threads; cProfile of sync."""
    import cProfile
    import pstats

    from benchmarks import kernels
    from benchmarks.shapes import wide_shape
    from benchmarks.workloads import spin_workload

    spin = kernels.Spin("cupy", kernels.default_blocks("cupy"), 100, 0.0)
    for name in a.shapes.split(","):
        wl = spin_workload(wide_shape(name, 8, 16, 0), "cupy", spin, 0.001)
        for enabled in (False, True):
            cfg = bs.gpustreams_config("cupy", a.streams, "auto") if enabled else bs.OFF
            for threads in (0, 1, 2, 4, 8):
                walls = []
                for rep in range(12):
                    dsk, keys = wl.graph(("prof", rep, threads, enabled))
                    with dask.config.set(cfg):
                        t0 = time.perf_counter()
                        if threads:
                            res = dask.threaded.get(dsk, keys, num_workers=threads)
                        else:
                            res = dask.get(dsk, keys)
                        walls.append(time.perf_counter() - t0)
                err = wl.check(list(res))
                us = statistics.median(walls[2:]) / len(wl.shape.nodes) * 1e6
                print(
                    f"{name:10} plugin={'on ' if enabled else 'off'} threads={threads or 'sync'}: "
                    f"{us:6.1f} us/task" + (f" ERR {err}" if err else ""),
                    flush=True,
                )
    wl = spin_workload(wide_shape("linear", 8, 16, 0), "cupy", spin, 0.001)
    prof = cProfile.Profile()
    with dask.config.set(bs.gpustreams_config("cupy", a.streams, "auto")):
        for rep in range(30):
            dsk, keys = wl.graph(("cprof", rep))
            if rep == 2:
                prof.enable()
            dask.get(dsk, keys)
        prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(35)
    return 0


def startup(a) -> int:
    """Where the time before the first launch goes, on ``--backend`` (sim works without a GPU).

    Per shape, medians over 15 runs at 8 threads: from ``get`` to the plugin's
    start callback, the callback (wrapping every task), from there to the first
    ``StreamRuntime.run``, and ``dask.order`` timed alone on the same graph.
    """

    from dask_gpustreams.integrations import local

    marks: dict[str, float] = {}
    start = local.LocalSchedulerHook._start

    def timed_start(self, dsk):
        marks["start"] = time.perf_counter()
        start(self, dsk)
        marks["wrapped"] = time.perf_counter()

    def first_run(self, key, fn, inputs, registry, critical=None):
        marks.setdefault("first", time.perf_counter())
        return _orig_run(self, key, fn, inputs, registry, critical)

    with (
        mock.patch.object(local.LocalSchedulerHook, "_start", timed_start),  # looked up per compute
        mock.patch.object(rt.StreamRuntime, "run", first_run),
    ):
        return _startup(a, marks)


def _startup(a, marks: dict) -> int:
    from dask._task_spec import convert_legacy_graph
    from dask.order import order

    from benchmarks import kernels
    from benchmarks.shapes import wide_shape
    from benchmarks.workloads import spin_workload

    spin = kernels.Spin(a.backend, kernels.default_blocks(a.backend), 100, 0.0005)
    print(f"{'shape':10} to callback ms  wrapping ms  to first run ms  (dask.order alone ms)")
    for name in a.shapes.split(","):
        wl = spin_workload(wide_shape(name, 8, 16, 0), a.backend, spin, 0.0005)
        cfg = bs.gpustreams_config(a.backend, a.streams, "auto")
        rows = []
        for rep in range(18):
            dsk, keys = wl.graph(("startup", rep))
            marks.clear()
            with dask.config.set(cfg):
                t0 = time.perf_counter()
                dask.threaded.get(dsk, keys, num_workers=8)
            graph = convert_legacy_graph(dsk)
            o0 = time.perf_counter()
            order(graph)
            ordered = time.perf_counter() - o0
            rows.append(
                (
                    marks["start"] - t0,
                    marks["wrapped"] - marks["start"],
                    marks["first"] - marks["wrapped"],
                    ordered,
                )
            )
        med = [statistics.median(r[i] for r in rows[3:]) * 1e3 for i in range(4)]
        print(f"{name:10} {med[0]:14.2f} {med[1]:12.2f} {med[2]:16.2f} {med[3]:22.2f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", default="8")
    p.add_argument("--policies", default="auto")
    p.add_argument("--shapes", default="linear,diamond,chainlink,tangled")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--switch", default="", help="sys.setswitchinterval values to try")
    p.add_argument("--chunksizes", default="1", help="dask's chunksize: tasks per submission")
    p.add_argument("--profile", action="store_true", help="host cost per task with short kernels")
    p.add_argument("--stubs", action="store_true", help="host cost with CUDA calls stubbed")
    p.add_argument("--launch-lock", action="store_true", help="add rows with one lock per run")
    p.add_argument("--startup", action="store_true", help="time before the first launch")
    p.add_argument("--backend", default="cupy", choices=("cupy", "sim"), help="for --startup")
    a = p.parse_args(argv)
    if a.profile:
        return profile_host(a)
    if a.stubs:
        return stub_calls(a)
    if a.startup:
        return startup(a)
    args = bs.parse_args(["--backend", "cupy", "--schedulers", "threaded", "--families", "wide"])
    bs.set_defaults(args, "cupy")
    loads = bs.Workloads(args, "cupy", bs.calibrate(args, "cupy"))
    default_switch = sys.getswitchinterval()
    try:
        with mock.patch.object(rt.StreamRuntime, "run", _logged_run):
            return _host_rows(a, loads, default_switch)
    finally:
        sys.setswitchinterval(default_switch)
        LOCKED[0] = False


def _host_rows(a, loads, default_switch: float) -> int:
    switches = [None] + [float(s) for s in a.switch.split(",") if s]
    chunksizes = [int(c) for c in a.chunksizes.split(",")]
    locks = (False, True) if a.launch_lock else (False,)
    print(
        f"{'shape':10} {'policy':13} thr chunk lock switch   wall ms  first ms  last ms  "
        "host us/task  waited  gpu-first  sat"
    )
    for name in a.shapes.split(","):
        wl = loads.get("threaded", "wide", name)
        ideal_ms = wl.kernel_ms * len(wl.shape.nodes)
        for policy in a.policies.split(","):
            for threads in (int(t) for t in a.threads.split(",")):
                for sw, chunksize, locked in itertools.product(switches, chunksizes, locks):
                    sys.setswitchinterval(sw or default_switch)
                    LOCKED[0] = locked
                    m = probe(wl, threads, policy, a.streams, a.reps, chunksize)
                    print(
                        f"{name:10} {policy:13} {threads:3} {chunksize:5} "
                        f"{'yes' if locked else 'no':>4} "
                        f"{sw or default_switch:7.4f} "
                        f"{m['wall']:8.1f} {m['first']:9.2f} {m['last']:8.1f} "
                        f"{m['per_task_us']:13.0f} {m['host_waited']:7.0f} "
                        f"{m['gpu_first']:10.2f} {ideal_ms / m['wall']:5.2f}"
                        + (f"  ERR {m['errors'][0]}" if m["errors"] else ""),
                        flush=True,
                    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
