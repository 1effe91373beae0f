"""Where a wide shape's time goes on distributed with stream blocks, from the client's call.

``bench_shapes`` puts the plugin at 69-84% of ``ideal`` on the wide shapes at 8 ms and
33-62% at 2 ms on one ``LocalCUDACluster`` worker (2488533): some 40 ms a graph above the
hand launch. This probe runs each wide shape through ``client.get`` on an in-process
``LocalCluster`` (one worker, ``--threads`` threads, the plugin with ``--streams`` streams
and blocks ``auto``) and marks, in ms from the call (medians of ``--reps`` after a
warm-up): when the client hands the graph to its batched stream (``update-graph``), when
the scheduler materializes and orders it (distributed's ``_materialize_graph`` and
``dask.order.order``, each offloaded to a thread), when ``StreamBlocks.update_graph`` starts
and ends, when the
blocks and the other tasks (getters, tasks left out of blocks) start executing and reach
memory on the worker, when the blocks' launchers start, have launched every task (and
wait for the device: ``launched, wait``) and end, and when ``client.get``
has returned and the device is idle (in-process, a result arrives without a copy: with
the plugin off, ``client.get`` returns while its kernels are still queued; the runs in
``results/h200-lag-12492fd/`` marked the return itself). In-process, so every mark
reads one clock; ``--backend cupy`` uses the GPU from the same process. ``--off`` runs
the shapes with the plugin off (the tasks and the end are marked).

    python -m benchmarks.probes.probe_dist_lag --backend sim --kernel-ms 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from unittest import mock

import dask.order
import distributed
import distributed.scheduler
from distributed import WorkerPlugin

from benchmarks import bench_shapes, kernels
from dask_gpustreams.integrations.blocks import StreamBlock
from dask_gpustreams.integrations.distributed import StreamsPlugin
from dask_gpustreams.integrations.distributed.blocks import StreamBlocks
from dask_gpustreams.runtime.launcher import GraphLauncher
from dask_gpustreams.runtime.runtime import StreamRuntime

#: name -> times (perf_counter) of the run going on; read by the plugin below by module.
MARKS: dict[str, list[float]] = defaultdict(list)


def mark(name: str) -> None:
    MARKS[name].append(time.perf_counter())


def sent(owner, op: str, label: str):
    """``owner._send_to_scheduler`` marking ``label`` when it is handed a message ``op``."""
    original = owner._send_to_scheduler

    def wrapper(self, msg, *args, **kwargs):
        if msg.get("op") == op:
            mark(label)
        return original(self, msg, *args, **kwargs)

    return mock.patch.object(owner, "_send_to_scheduler", wrapper)


def spans(owner, name: str, label: str):
    """``owner.name`` marking ``label`` when called and ``label done`` when it returns."""
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        mark(label)
        try:
            return original(*args, **kwargs)
        finally:
            mark(f"{label} done")

    return mock.patch.object(owner, name, wrapper)


class Transitions(WorkerPlugin):
    """Marks blocks and other tasks (getters, tasks left out of blocks) that start
    executing or reach memory on the worker; a block is a task that runs a StreamBlock."""

    name = "probe-dist-lag"

    def setup(self, worker) -> None:
        self.tasks = worker.state.tasks
        self.kinds: dict = {}

    def transition(self, key, start, finish, **kwargs):
        if finish == "executing":
            node = getattr(self.tasks.get(key), "run_spec", None)
            func = getattr(getattr(node, "node", node), "func", None)
            self.kinds[key] = "block" if isinstance(func, StreamBlock) else "other"
        elif finish != "memory":
            return
        kind = self.kinds.pop(key, None) if finish == "memory" else self.kinds[key]
        if kind is not None:
            # By module, not by closure: the plugin is pickled to the (in-process) worker.
            sys.modules[__name__].mark(f"{kind} {finish}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="sim", choices=("sim", "cupy"))
    p.add_argument("--kernel-ms", default="2")
    p.add_argument("--shapes", default="linear,diamond,chainlink,tangled")
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--reps", type=int, default=6)
    p.add_argument(
        "--off",
        action="store_true",
        help="the plugin off: the client's send, materialize, order, the tasks and the end",
    )
    args = p.parse_args(argv)
    sargs = bench_shapes.parse_args(
        ["--families", "wide", "--schedulers", "threaded", "--kernel-ms", args.kernel_ms]
    )
    bench_shapes.set_defaults(sargs, args.backend)
    loads = bench_shapes.Workloads(sargs, args.backend, bench_shapes.calibrate(sargs, args.backend))
    cluster = distributed.LocalCluster(
        n_workers=1, threads_per_worker=args.threads, processes=False, dashboard_address=None
    )
    client = distributed.Client(cluster)
    failed = False
    try:
        if not args.off:
            client.register_plugin(StreamsPlugin(backend=args.backend, streams=args.streams))
        client.register_plugin(Transitions())
        with (
            sent(distributed.Client, "update-graph", "client sends graph"),
            spans(distributed.scheduler, "_materialize_graph", "materialize"),
            spans(dask.order, "order", "order"),
            spans(StreamBlocks, "update_graph", "update_graph"),
            spans(StreamBlock, "launch", "block launch"),
            spans(GraphLauncher, "run", "launcher"),
            spans(StreamRuntime, "synchronize", "launched, wait"),
        ):
            for name in args.shapes.split(","):
                wl = loads.get("threaded", "wide", name)
                keys = list(wl.sources)
                futures = client.scatter([wl.sources[k] for k in keys], hash=False)
                sources = dict(zip(keys, futures, strict=True))
                runs = []
                for rep in range(args.reps + 1):
                    dsk, out_keys = wl.graph(("lag", name, rep), sources=sources)
                    MARKS.clear()
                    t0 = time.perf_counter()
                    results = client.get(dsk, out_keys)
                    # In-process, a result arrives without a copy: with the plugin off, its
                    # kernels may still be queued on the legacy stream when get returns.
                    kernels.device_synchronize(args.backend)
                    t1 = time.perf_counter()
                    problem = wl.check(list(results))
                    if problem:
                        print(f"{name}: WRONG: {problem}")
                        failed = True
                    if rep:  # the first warms up
                        run = {k: [(t - t0) * 1e3 for t in v] for k, v in MARKS.items()}
                        run["returned"] = [(t1 - t0) * 1e3]
                        runs.append(run)
                print(
                    f"\n== {name}, {args.kernel_ms} ms kernels: ms from client.get, "
                    f"medians of {args.reps}"
                )
                labels = sorted(runs[-1], key=lambda k: runs[-1][k][0])
                for label in labels:
                    have = [r[label] for r in runs if label in r]
                    first = statistics.median(v[0] for v in have)
                    last = statistics.median(v[-1] for v in have)
                    print(f"  {label:<22} x{len(have[-1]):<4} first {first:8.2f}  last {last:8.2f}")
    finally:
        client.close()
        cluster.close()
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
