"""Where does the launcher's host time go against plain sync: in its tasks, or between them?

Dask's local callbacks see each task start and end on the calling thread under both
``scheduler="sync"`` and the launcher (``scheduler="gpustreams"``). A compute's wall then
splits into: ``prep`` (from the call to the first task: graph conversion, ordering),
``in_tasks`` (from each task's start callback to its end callback: the task's call, with
CuPy's launches on the legacy stream or a pool stream, and the scheduler's work for that
task; for the launcher its stream choice, event waits and record), ``between`` (from one
task's end to the next one's start), ``tail`` (from the last task's end to ``compute``'s
return: the launcher's wait for its results) and ``device`` (from there to the device
being idle). Each field is the median over ``--reps`` computes, the two
schedulers alternating; the task groups whose time in tasks differs most follow. A
launcher's host task runs on a host thread while others launch: its time counts in
``in_tasks`` and may make ``between`` negative.

Asked after the H200 runs at fd179e7, where the launcher was 0.79-0.96x plain sync on
some workloads from call to call. Answered on the H200 at 0453abb
(``benchmarks/results/h200-diag-0453abb/gaps.txt``): in tasks, not between them; the
cProfile beside it found ``dask.order`` run by every fused task (fixed in 13ddc43).

    python -m benchmarks.probes.probe_task_gaps --backend cupy --workloads std,transpose,rechunk
    python -m benchmarks.probes.probe_task_gaps --backend sim --quick --workloads std
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Hashable

import dask
from dask.callbacks import Callback
from dask.utils import key_split

from benchmarks import bench_workloads as bw

SCHEDULERS = ("sync", "gpustreams")
FIELDS = ("wall", "prep", "in_tasks", "between", "tail", "device")


class TaskTimes(Callback):
    """Each task's start and end on the calling thread, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.spans: list[tuple[Hashable, float, float]] = []
        self._started: dict[Hashable, float] = {}

    def _pretask(self, key, dsk, state) -> None:
        self._started[key] = time.perf_counter()

    def _posttask(self, key, result, dsk, state, worker_id) -> None:
        self.spans.append((key, self._started.pop(key), time.perf_counter()))


def split(arrays: bw.NumpyArrays, collections: tuple, scheduler: str) -> tuple[dict, dict]:
    """One compute: its wall split into :data:`FIELDS` (ms, and ``n`` tasks), and the ms in
    tasks by task group."""
    arrays.synchronize()
    times = TaskTimes()
    t0 = time.perf_counter()
    with times, dask.config.set({"gpustreams.enabled": False}):
        dask.compute(*collections, scheduler=scheduler)
    returned = time.perf_counter()
    arrays.synchronize()
    idle = time.perf_counter()
    spans = sorted(times.spans, key=lambda s: s[1])
    in_tasks = sum(end - start for _, start, end in spans)
    by_group: dict[str, float] = defaultdict(float)
    for key, start, end in spans:
        by_group[key_split(key)] += (end - start) * 1e3
    first, last = spans[0][1], max(end for _, _, end in spans)
    fields = {
        "wall": idle - t0,
        "prep": first - t0,
        "in_tasks": in_tasks,
        "between": (last - first) - in_tasks,
        "tail": returned - last,
        "device": idle - returned,
    }
    return {"n": len(spans), **{k: v * 1e3 for k, v in fields.items()}}, dict(by_group)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.probes.probe_task_gaps")
    p.add_argument("--backend", default="cupy", choices=("cupy", "sim"))
    p.add_argument("--workloads", default="std,transpose,rechunk")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="tiny sizes (seconds on the sim)")
    args = p.parse_args(argv)
    arrays = bw.make_arrays(args.backend)
    sizes = bw.sizes_for(args.backend, args.quick, {})
    print(f"{'workload':<12} {'scheduler':<11} {'tasks':>6} " + " ".join(f"{f:>9}" for f in FIELDS))
    with dask.config.set({"gpustreams.backend": arrays.plugin}):
        for name in args.workloads.split(","):
            collections = bw.WORKLOADS[name].build(arrays, sizes[name])
            runs: dict[str, list] = {s: [] for s in SCHEDULERS}
            for scheduler in SCHEDULERS:  # warm-up: kernels compiled, pools grown
                split(arrays, collections, scheduler)
            for _ in range(args.reps):
                for scheduler in SCHEDULERS:
                    runs[scheduler].append(split(arrays, collections, scheduler))
            groups: dict[str, dict[str, float]] = {}
            for scheduler, results in runs.items():
                medians = [statistics.median(r[0][f] for r in results) for f in FIELDS]
                print(
                    f"{name:<12} {scheduler:<11} {results[0][0]['n']:>6} "
                    + " ".join(f"{m:>9.1f}" for m in medians)
                )
                names = set().union(*(r[1] for r in results))
                groups[scheduler] = {
                    g: statistics.median(r[1].get(g, 0.0) for r in results) for g in names
                }
            diffs = sorted(
                ((groups["gpustreams"].get(g, 0.0) - ms, g) for g, ms in groups["sync"].items()),
                reverse=True,
            )
            for diff, group in diffs[:3]:
                print(
                    f"    in tasks of {group}: sync {groups['sync'][group]:.1f} ms, launcher "
                    f"{groups['gpustreams'].get(group, 0.0):.1f} ms ({diff:+.1f})"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
