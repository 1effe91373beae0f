"""The launcher's own host cost a task, on a CPU, against a model of the device's calls.

``GraphLauncher`` runs Dagger's gemm graphs whose tasks return at once, on a backend
that does no work: its event records, stream waits and event queries spin for
``--record-us``, ``--wait-us`` and ``--query-us`` (the H200's, busy, from
``probe_tile_costs``), and an event is done once ``--lag`` more records were made after it
(the device ``lag`` tasks behind the host) or once synchronized. So what is timed is the
launch loop, the launch order and the device calls it makes, without a GPU and without the
sim's stream threads. Prints the median us a task by shape and policy, and the event
queries a task by the code that asked::

    python -m benchmarks.probes.probe_launch_loop --policies auto,round-robin
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections import Counter
from functools import partial
from typing import Any

import numpy as np
from dask.utils import key_split

from benchmarks import bench_shapes
from dask_gpustreams.config import StreamsConfig
from dask_gpustreams.runtime.launcher import GraphLauncher
from dask_gpustreams.runtime.ordering import depth_first
from dask_gpustreams.runtime.runtime import StreamRuntime


def spin(us: float) -> None:
    """Hold the host for ``us`` microseconds, as a driver call would."""
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


class ModelEvent:
    __slots__ = ("seq",)

    def __init__(self) -> None:
        self.seq: int | None = None


class ModelStream:
    """A stream that is its own context manager, as CuPy's is."""

    __slots__ = ("ptr",)

    def __init__(self) -> None:
        self.ptr = id(self)

    def __enter__(self) -> ModelStream:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class ModelBackend:
    """A backend that does no work: its calls cost what it is told, its device lags by
    ``lag`` records. Counts each query by the function that asked."""

    name = "model"
    device_id = 0
    upload_functions = ()
    download_functions = ()
    out_of_memory_errors = (MemoryError,)

    def __init__(self, record_us: float, wait_us: float, query_us: float, lag: int) -> None:
        self.costs = record_us, wait_us, query_us
        self.lag = lag
        self.recorded = 0
        self.synced = 0
        self.queries: Counter[str] = Counter()

    def create_stream(self, priority: int = 0) -> ModelStream:
        return ModelStream()

    def high_priority(self) -> int:
        return 0

    def create_event(self, timing: bool = False) -> ModelEvent:
        return ModelEvent()

    def record(self, event: ModelEvent, stream: ModelStream) -> None:
        spin(self.costs[0])
        self.recorded += 1
        event.seq = self.recorded

    def wait_event(self, stream: ModelStream, event: ModelEvent) -> None:
        spin(self.costs[1])

    def done(self, event: ModelEvent) -> bool:
        spin(self.costs[2])
        self.queries[sys._getframe(1).f_code.co_name] += 1
        seq = event.seq
        return seq is None or seq <= max(self.recorded - self.lag, self.synced)

    def synchronize_event(self, event: ModelEvent) -> None:
        self.synced = max(self.synced, event.seq or 0)

    def event_error(self, event: ModelEvent) -> None:
        self.synchronize_event(event)

    def event_state(self, event: ModelEvent) -> tuple[bool, None]:
        return self.done(event), None

    def synchronize_stream(self, stream: ModelStream) -> None:
        self.synced = self.recorded

    def destroy_stream(self, stream: ModelStream, timeout: float | None = None) -> None:
        pass

    def isolate_thread(self) -> Any:
        return lambda: None

    def use_stream(self, stream: ModelStream, key: Any = None) -> ModelStream:
        return stream

    def current_stream(self) -> None:
        return None

    def orders_before_pool(self, stream: Any) -> bool:
        return False

    def is_device_array(self, obj: Any) -> bool:
        return isinstance(obj, np.ndarray)

    def launch_allocator(
        self, streams: Any, small_blocks: int, large_tasks: int, shared: Any = None
    ) -> Any:
        return contextlib.nullcontext(None)

    def hardware_queues(self) -> None:
        return None

    def on_device(self) -> Any:
        return contextlib.nullcontext()


def tile(values: dict) -> np.ndarray:
    """A task that launches nothing and returns a new (small) output."""
    return np.empty(4, np.float32)


def run_shape(
    shape: bench_shapes.Shape, policy: str, backend: ModelBackend, reps: int
) -> tuple[float, dict[str, float]]:
    """Median us a task of ``reps`` launches of ``shape`` (after 3 warm-ups), and the
    queries a task of the timed ones by caller."""
    runtime = StreamRuntime(
        backend, StreamsConfig(policy=policy, pinned_pool_size="1 MiB", shared_blocks=0)
    )
    times = []
    n = len(shape.nodes)
    try:
        for r in range(reps + 3):
            if r == 3:
                backend.queries.clear()
            dependencies = {
                (node.key, r): [(a, r) for a in node.args if a not in shape.sources]
                for node in shape.nodes
            }
            outputs = [(k, r) for k in shape.outputs]
            launcher = GraphLauncher(
                runtime,
                dict.fromkeys(dependencies, tile),
                dependencies,
                partial(depth_first, dependencies, outputs),
                outputs,
                {},
                (),
                key_split,
            )
            t0 = time.perf_counter()
            launcher.run()
            times.append((time.perf_counter() - t0) / n * 1e6)
    finally:
        runtime.close()
    per_task = {k: v / (n * reps) for k, v in sorted(backend.queries.items())}
    return statistics.median(times[3:]), per_task


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.probes.probe_launch_loop")
    p.add_argument("--shapes", default="linear,diamond,chainlink,tangled")
    p.add_argument("--policies", default="auto,round-robin")
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--record-us", type=float, default=1.4)
    p.add_argument("--wait-us", type=float, default=2.1)
    p.add_argument("--query-us", type=float, default=3.0)
    p.add_argument("--lag", type=int, default=16, help="tasks the device runs behind")
    args = p.parse_args(argv)
    shape_args = bench_shapes.parse_args(["--backend", "sim", "--families", "dagger"])
    bench_shapes.set_defaults(shape_args, "sim")
    print(
        f"model device: record {args.record_us} us, wait {args.wait_us}, query "
        f"{args.query_us}, {args.lag} tasks behind; median of {args.reps} launches"
    )
    print(f"{'shape':<10} {'policy':<12} {'us/task':>8}  queries a task, by caller")
    for name in args.shapes.split(","):
        shape = bench_shapes.make_shape(shape_args, "dagger", name)
        for policy in args.policies.split(","):
            backend = ModelBackend(args.record_us, args.wait_us, args.query_us, args.lag)
            us, queries = run_shape(shape, policy, backend, args.reps)
            callers = ", ".join(f"{k} {v:.2f}" for k, v in queries.items())
            print(
                f"{name:<10} {policy:<12} {us:8.2f}  {sum(queries.values()):.2f} ({callers})",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
