"""Where does the launcher lose against the hand launch on the wide shapes: host or device?

``bench_shapes`` put the launcher at 92/93/86/90% of ``ideal`` with 2 ms kernels and
77/86/75/74% with 0.5 ms ones on the H200 (fd179e7). This probe runs each wide shape under
``ideal:layers`` and the launcher (``scheduler="gpustreams"``, 8 streams, ``auto``), and
splits a launcher compute, with the task timeline on, into:

- ``prep``: from the call to the first task's launch (graph conversion, ``dask.order``, the
  launch plan);
- ``launch``: from the first task's launch to the last one's (host);
- ``tail``: from the last launch to the call's return (the wait for the outputs);
- ``span``: device time from the first task's start to the last task's end;
- ``host-bound``: the tasks whose device start came less than 50 us after their launch
  returned on the host (their stream had nothing queued: the device waited for the host),
  with the launch and device clocks aligned at the first task.

The ideal's host loop is timed too (``ideal host``). Walls are medians of ``--reps``, with
the timeline off; the split is the median of as many runs with it on. ``--profile`` adds a
cProfile of the launcher at the first kernel length, sorted by own time. ``--prep`` instead
times, on the host alone, the three steps before a first launch for each shape's graph:
Dask's conversion of its tuple tasks (``convert_legacy_graph``), ``dask.order`` (which the
launcher skips since 0c426a9 where every ready task fits a round) and the launch plan.
``--steps`` instead marks, with the timeline and callbacks off (as ``bench_shapes`` runs
the launcher), when each step of a launcher compute ends, in ms from the call (medians of
``--reps`` after a warm-up): the conversion, ``acquire_runtime``, the launch plan, the
launcher's allocator entered, ``order_after_caller``, ``isolate_thread``, the first and
last kernel calls, the final ``synchronize`` and the return; and the ideal's first and last
kernel calls and return, for the same graph.

    python -m benchmarks.probes.probe_shape_lag --backend cupy --kernel-ms 0.5,2
    python -m benchmarks.probes.probe_shape_lag --backend sim --prep
    python -m benchmarks.probes.probe_shape_lag --backend cupy --kernel-ms 2 --steps
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import statistics
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any
from unittest import mock

import dask
from dask._task_spec import DataNode, convert_legacy_graph
from dask.callbacks import Callback
from dask.order import order

import dask_gpustreams
from benchmarks import bench_shapes, kernels
from benchmarks.report import profile_text
from dask_gpustreams.diagnostics import clear_timeline, timeline
from dask_gpustreams.integrations import launcher as local_launcher
from dask_gpustreams.integrations.launcher import launch_plan
from dask_gpustreams.runtime import StreamRuntime, acquire_runtime
from dask_gpustreams.runtime.launcher import GraphLauncher

HOST_BOUND_MS = 0.05


class LaunchTimes(Callback):
    """Each task's launch end on the host (the launcher's posttask), in order."""

    def __init__(self) -> None:
        super().__init__()
        self.done: dict = {}

    def _posttask(self, key, result, dsk, state, worker_id) -> None:
        self.done[key] = time.perf_counter()


def timed(backend: str, go) -> tuple[float, object]:
    kernels.device_synchronize(backend)
    t0 = time.perf_counter()
    out = go()
    kernels.device_synchronize(backend)
    return (time.perf_counter() - t0) * 1e3, out


def split(backend: str, wl, config: dict) -> dict:
    """One launcher compute with the timeline on, split as in the module's docstring."""
    dsk, keys = wl.graph(object())
    clear_timeline()
    times = LaunchTimes()
    with dask.config.set({**config, "gpustreams.timeline": True}), times:
        kernels.device_synchronize(backend)
        t0 = time.perf_counter()
        out = dask_gpustreams.get(dsk, keys)
        t1 = time.perf_counter()
        kernels.device_synchronize(backend)
    problem = wl.check(out)
    records = {r["key"]: r for r in timeline()}
    launched = sorted(times.done.items(), key=lambda kv: kv[1])
    first_key, first_host = launched[0]
    anchor = records[first_key]["start_ms"]
    bound = 0
    for key, host in launched[1:]:
        lag = (records[key]["start_ms"] - anchor) - (host - first_host) * 1e3
        bound += lag < HOST_BOUND_MS
    return {
        "prep": (first_host - t0) * 1e3,
        "launch": (launched[-1][1] - first_host) * 1e3,
        "tail": (t1 - launched[-1][1]) * 1e3,
        "span": max(r["end_ms"] for r in records.values())
        - min(r["start_ms"] for r in records.values()),
        "host-bound": bound,
        "problem": problem,
    }


def prep_times(args: argparse.Namespace) -> int:
    """Medians of ``--reps`` host timings (ms) of the steps before a first launch, by shape."""
    sargs = bench_shapes.parse_args(["--families", "wide", "--schedulers", "threaded"])
    bench_shapes.set_defaults(sargs, args.backend)
    loads = bench_shapes.Workloads(sargs, args.backend, bench_shapes.calibrate(sargs, args.backend))
    config = bench_shapes.gpustreams_config(args.backend, 8, "auto")
    print(
        f"{'shape':<10} {'tasks':>6} {'convert':>8} {'order':>7} {'plan':>6}  "
        f"ms, median of {args.reps}"
    )
    with dask.config.set(config):
        runtime = acquire_runtime()
        try:
            for name in args.shapes.split(","):
                wl = loads.get("threaded", "wide", name)
                times: dict[str, list[float]] = {"convert": [], "order": [], "plan": []}
                for _ in range(args.reps):
                    dsk, _keys = wl.graph(object())
                    t0 = time.perf_counter()
                    graph = convert_legacy_graph(dsk)
                    t1 = time.perf_counter()
                    order(graph)
                    t2 = time.perf_counter()
                    launch_plan([n for n in graph.values() if not isinstance(n, DataNode)], runtime)
                    t3 = time.perf_counter()
                    for k, v in zip(times, (t1 - t0, t2 - t1, t3 - t2), strict=True):
                        times[k].append(v * 1e3)
                med = {k: statistics.median(v) for k, v in times.items()}
                print(
                    f"{name:<10} {wl.shape.n_tasks:6} {med['convert']:8.2f} {med['order']:7.2f} "
                    f"{med['plan']:6.2f}"
                )
        finally:
            runtime.release()
    return 0


@contextlib.contextmanager
def step_marks(marks: dict[str, float]) -> Iterator[None]:
    """Inside, the steps of a launcher compute put the time they end at in ``marks``
    (only the first time each ends, except the final ``synchronize``)."""

    def ends(owner, name: str, label: str):
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            out = original(*args, **kwargs)
            marks.setdefault(label, time.perf_counter())
            return out

        return mock.patch.object(owner, name, wrapper)

    def launch_all(launcher, meter):  # entered once the allocator is
        marks.setdefault("allocator", time.perf_counter())
        return original_launch_all(launcher, meter)

    def synchronize(runtime, *args, **kwargs):
        marks["synchronize"] = time.perf_counter()
        out = original_synchronize(runtime, *args, **kwargs)
        marks["synchronized"] = time.perf_counter()
        return out

    original_launch_all, original_synchronize = GraphLauncher._launch_all, StreamRuntime.synchronize
    with contextlib.ExitStack() as stack:
        for owner, name, label in (
            (local_launcher, "convert_legacy_graph", "converted"),
            (local_launcher, "acquire_runtime", "acquired"),
            (local_launcher, "launch_plan", "planned"),
            (StreamRuntime, "order_after_caller", "ordered after caller"),
            (StreamRuntime, "isolate_thread", "isolated"),
        ):
            stack.enter_context(ends(owner, name, label))
        stack.enter_context(mock.patch.object(GraphLauncher, "_launch_all", launch_all))
        stack.enter_context(mock.patch.object(StreamRuntime, "synchronize", synchronize))
        yield


class KernelCalls:
    """``kernel`` that notes the time of its first and last call in ``marks``."""

    def __init__(self, kernel, marks: dict[str, float]):
        self.kernel, self.marks = kernel, marks

    def __getattr__(self, name: str):
        return getattr(self.kernel, name)

    def __call__(self, *args):
        now = time.perf_counter()
        self.marks.setdefault("first kernel", now)
        self.marks["last kernel"] = now
        return self.kernel(*args)


def launcher_config(backend: str) -> dict:
    """The launcher's settings here: 8 streams, ``auto``, the plugin switch off."""
    return {**bench_shapes.gpustreams_config(backend, 8, "auto"), "gpustreams.enabled": False}


def wide_loads(backend: str, ms: str) -> tuple[bench_shapes.Workloads, object]:
    """The wide shapes with ``ms`` kernels (calibrated), and the ideal's launcher on 8 streams."""
    sargs = bench_shapes.parse_args(
        ["--families", "wide", "--schedulers", "threaded", "--kernel-ms", ms]
    )
    bench_shapes.set_defaults(sargs, backend)
    loads = bench_shapes.Workloads(sargs, backend, bench_shapes.calibrate(sargs, backend))
    return loads, bench_shapes.Runner(sargs, backend, "/tmp", None).launcher(8)


def wide_parser(doc: str) -> argparse.ArgumentParser:
    """The options of a probe of the wide shapes against the ideal, one process at a time:
    ``--backend``, ``--kernel-ms`` (0.5), ``--shapes`` (all four), ``--reps`` (6)."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--backend", default="cupy")
    p.add_argument("--kernel-ms", default="0.5")
    p.add_argument("--shapes", default="linear,diamond,chainlink,tangled")
    p.add_argument("--reps", type=int, default=6)
    return p


def walls_against_ideal(
    wl: Any,
    ideal: Any,
    config: dict,
    backend: str,
    reps: int,
    before: Callable[[str], object] | None = None,
) -> tuple[dict[str, list[float]], list[str]]:
    """Walls (ms) of ``reps`` runs of the launcher and of ``ideal:layers`` on ``wl``, in turn,
    after a warm-up of each, and the problems of the results that were wrong.
    ``before(mode)`` is called before each run."""
    plan = bench_shapes.ideal_plan(wl, 8, "layers")
    walls: dict[str, list[float]] = {"launcher": [], "ideal": []}
    problems = []
    for i in range(reps + 1):
        for mode in walls:
            if before is not None:
                before(mode)
            dsk, keys = wl.graph(object())
            kernels.device_synchronize(backend)
            t0 = time.perf_counter()
            with dask.config.set(config):
                out = dask_gpustreams.get(dsk, keys) if mode == "launcher" else ideal.run(wl, plan)
            kernels.device_synchronize(backend)
            if i:
                walls[mode].append((time.perf_counter() - t0) * 1e3)
            problem = wl.check(out)
            if problem:
                problems.append(f"{mode}: {problem}")
    return walls, problems


def step_times(args: argparse.Namespace) -> int:
    """``--steps``: medians of when each step of a launcher compute and of the ideal ends."""
    config = launcher_config(args.backend)
    for ms in args.kernel_ms.split(","):
        loads, ideal = wide_loads(args.backend, ms)
        for name in args.shapes.split(","):
            wl = loads.get("threaded", "wide", name)
            plan = bench_shapes.ideal_plan(wl, 8, "layers")
            kernel = wl.kernel
            rows: dict[str, list[dict[str, float]]] = {"launcher": [], "ideal": []}
            problems = set()
            try:
                for i in range(args.reps + 1):
                    for mode in rows:
                        marks: dict[str, float] = {}
                        wl.kernel = KernelCalls(kernel, marks)
                        dsk, keys = wl.graph(object())
                        kernels.device_synchronize(args.backend)
                        with dask.config.set(config), step_marks(marks):
                            t0 = time.perf_counter()
                            if mode == "launcher":
                                out = dask_gpustreams.get(dsk, keys)
                            else:
                                out = ideal.run(wl, plan)
                            kernels.device_synchronize(args.backend)
                            marks["returned"] = time.perf_counter()
                        problems.add(wl.check(out))
                        if i:  # the first round warms up
                            rows[mode].append({k: (v - t0) * 1e3 for k, v in marks.items()})
            finally:
                wl.kernel = kernel
            problems.discard(None)
            print(
                f"\n== {name}, {ms} ms kernels, 8 streams: ms from the call, medians of "
                f"{args.reps}; " + ("ok" if not problems else f"WRONG: {sorted(problems)}")
            )
            for mode, runs in rows.items():
                steps = sorted(runs[0], key=lambda k: statistics.median(r[k] for r in runs))
                print(
                    f"{mode:<9} "
                    + "  ".join(f"{k} {statistics.median(r[k] for r in runs):.2f}" for k in steps),
                    flush=True,
                )
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="cupy")
    p.add_argument("--kernel-ms", default="0.5,2")
    p.add_argument("--shapes", default="linear,diamond,chainlink,tangled")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--prep", action="store_true", help="time the host steps before a launch")
    p.add_argument("--steps", action="store_true", help="when each step of a compute ends")
    args = p.parse_args(argv)
    if args.prep:
        return prep_times(args)
    if args.steps:
        return step_times(args)
    config = launcher_config(args.backend)
    for ms in args.kernel_ms.split(","):
        loads, ideal = wide_loads(args.backend, ms)
        print(
            f"\n== {ms} ms kernels, 8 streams: medians of {args.reps}, ms ==\n"
            f"{'shape':<10} {'ideal':>7} {'ideal host':>10} {'launcher':>9} {'share':>6} "
            f"{'prep':>6} {'launch':>7} {'tail':>6} {'span':>7} {'host-bound':>10}  check"
        )
        for name in args.shapes.split(","):
            wl = loads.get("threaded", "wide", name)
            plan = bench_shapes.ideal_plan(wl, 8, "layers")
            launcher_walls, ideal_walls, ideal_host, splits = [], [], [], []
            problems = set()
            for i in range(args.reps + 1):
                wall, out = timed(args.backend, partial(ideal.run, wl, plan))
                problems.add(wl.check(out))
                t0 = time.perf_counter()
                ideal.run(wl, plan)
                ideal_host.append((time.perf_counter() - t0) * 1e3)  # launch + its own sync
                dsk, keys = wl.graph(object())
                with dask.config.set(config):
                    lwall, out = timed(args.backend, partial(dask_gpustreams.get, dsk, keys))
                problems.add(wl.check(out))
                s = split(args.backend, wl, config)
                problems.add(s.pop("problem"))
                if i:  # the first round warms up
                    ideal_walls.append(wall)
                    launcher_walls.append(lwall)
                    splits.append(s)
            med = {k: statistics.median(s[k] for s in splits) for k in splits[0]}
            iw, lw = statistics.median(ideal_walls), statistics.median(launcher_walls)
            problems.discard(None)
            print(
                f"{name:<10} {iw:7.2f} {statistics.median(ideal_host):10.2f} {lw:9.2f} "
                f"{iw / lw:6.0%} {med['prep']:6.2f} {med['launch']:7.2f} {med['tail']:6.2f} "
                f"{med['span']:7.2f} {med['host-bound']:6.0f}/{wl.shape.n_tasks - 1}  "
                + ("ok" if not problems else f"WRONG: {sorted(problems)}"),
                flush=True,
            )
        if args.profile:
            wl = loads.get("threaded", "wide", args.shapes.split(",")[0])
            profile = cProfile.Profile()
            with dask.config.set(config):
                for _ in range(5):
                    dsk, keys = wl.graph(object())
                    profile.enable()
                    dask_gpustreams.get(dsk, keys)
                    kernels.device_synchronize(args.backend)
                    profile.disable()
            print("\n".join(profile_text(profile, 25).splitlines()[:50]))
            args.profile = False
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
