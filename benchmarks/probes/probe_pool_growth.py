"""Where CuPy's pool grows under plain sync and the launcher: by size class, and how much was free.

The launcher holds more than plain sync on matmul, qr and delayed (the pool's
``total_bytes``; used bytes are within 1.04x on matmul and qr). This runs
``bench_workloads`` (every argument but ``--classes`` goes to it) with its tracking
allocator wrapped once more: each allocation that makes the pool grow is logged with its
size, its class (``--classes``, MiB bounds), the bytes grown and the bytes the pool had
free just before (in some stream's arena, or in a split block, but not for this
request). Allocations are serialized while logged (one lock), so the walls are not
benchmark walls. Mode ``launcher-classes`` also allocates each class between two bounds
while a stream of its own, one per current stream, is current (CuPy keys its arenas by
that stream), as the launcher does for small blocks: a test of keeping size classes
apart (only on CuPy's default pool: ``MemoryAsyncPool`` frees a block on the stream it
was allocated on, which must be the one that uses it). Run::

    python -m benchmarks.probes.probe_pool_growth --workloads qr,matmul \\
        --modes sync,launcher,launcher-classes --samples 2 --rounds 1 --warmup 1
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import math
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from benchmarks import bench_workloads as bw

MIB = 1 << 20
SETUP = "(set-up)"


class Growth:
    """The log of pool growth per (workload, mode), by round and run, and the class routing
    of mode ``launcher-classes``.

    ``current_stream()`` returns the current stream's handle (0: the legacy default
    stream); ``make_stream()`` a stream that never runs work.
    """

    def __init__(
        self, bounds: list[int], current_stream: Callable[[], int], make_stream: Callable[[], Any]
    ) -> None:
        self.bounds = bounds
        self._current_stream = current_stream
        self._make_stream = make_stream
        self.where: tuple[str, str] = ("", SETUP)
        self.round = self.run = 0
        self.classes_on = False
        #: (workload, mode) -> (round, run, size class, size, bytes grown, bytes free before)
        self.events: dict[tuple[str, str], list[tuple]] = collections.defaultdict(list)
        self.counts: dict[tuple[str, str], collections.Counter] = collections.defaultdict(
            collections.Counter
        )
        #: (workload, mode) -> the runs of each of its rounds
        self.runs: dict[tuple[str, str], list[int]] = collections.defaultdict(list)
        self._standing: dict[tuple[int, int], Any] = {}
        self._lock = threading.Lock()

    def start(self, workload: str, mode: str) -> None:
        """What follows is ``mode``'s (``SETUP``: the workload's inputs and reference)."""
        self.where = (workload, mode)
        self.round = self.run = 0

    def next_run(self, cold: bool) -> None:
        """A run starts; ``cold``: the first of a round, on a pool freed of cached blocks."""
        runs = self.runs[self.where]
        if cold or not runs:
            runs.append(0)
            self.round, self.run = len(runs) - 1, 0
        else:
            self.run += 1
        runs[self.round] = self.run + 1

    def size_class(self, size: int) -> int:
        return sum(size >= b for b in self.bounds)

    def label(self, c: int) -> str:
        edges = [0, *self.bounds]
        if c == len(self.bounds):
            return f">={edges[c] / MIB:g}"
        return f"{edges[c] / MIB:g}-{edges[c + 1] / MIB:g}"

    def _standing_for(self, cls: int, stream: int) -> Any:
        key = (cls, stream)
        standing = self._standing.get(key)
        if standing is None:
            standing = self._standing[key] = self._make_stream()
        return standing

    def wrap(self, pool: Any, malloc: Callable, routable: bool) -> Callable:
        """``malloc`` that logs the pool's growth; ``routable``: ``launcher-classes`` may
        route (the pool is CuPy's default one)."""

        @functools.wraps(malloc)
        def traced(size: int) -> Any:
            cls = self.size_class(size)
            with self._lock:  # another thread's growth would land in this call's window
                before, free = pool.total_bytes(), pool.free_bytes()
                stream = self._current_stream()
                route = self.classes_on and 0 < cls < len(self.bounds) and stream
                if route and not routable:
                    raise ValueError(
                        "launcher-classes needs CuPy's default pool, not --allocator async"
                    )
                if route:
                    with self._standing_for(cls, stream):
                        memory = malloc(size)
                else:
                    memory = malloc(size)
                grown = pool.total_bytes() - before
                self.counts[self.where][cls] += 1
                if grown > 0:
                    self.events[self.where].append((self.round, self.run, cls, size, grown, free))
            return memory

        return traced

    def report(self) -> None:
        n = len(self.bounds) + 1
        where = sorted(self.counts.keys() | self.events.keys())
        print("\n== pool growth by size class (MiB); free = pool free_bytes just before it grew ==")
        head = " ".join(f"{'alloc ' + self.label(c):>12} {'grown':>8}" for c in range(n))
        print(f"{'workload':12} {'mode':18} {head} {'cold MiB':>9} {'later':>7} {'free@grow':>9}")
        for key in where:
            events, counts = self.events.get(key, []), self.counts[key]
            cells = []
            for c in range(n):
                grown = sum(e[4] for e in events if e[2] == c) / MIB
                cells.append(f"{counts[c]:>12} {grown:8.0f}")
            cold = sum(e[4] for e in events if e[1] == 0) / MIB
            later = sum(e[4] for e in events if e[1] > 0) / MIB
            free = max((e[5] for e in events), default=0) / MIB
            print(f"{key[0]:12} {key[1]:18} {' '.join(cells)} {cold:9.0f} {later:7.0f} {free:9.0f}")
        print("(alloc: allocations of that class over the mode's runs; grown: MiB the pool grew")
        print(" for them; cold: grown in each round's first run (after the pool's cached blocks")
        print(" were freed), later: after it; free@grow: the most the pool had free at a growth)")
        print("\n== MiB the pool grew in each run, round by round (run 1: after a cold pool) ==")
        for key in where:
            if key[1] == SETUP:
                continue
            for r, count in enumerate(self.runs.get(key, [])):
                grown = collections.Counter()
                for e in self.events.get(key, []):
                    if e[0] == r:
                        grown[e[1]] += e[4]
                cells = " ".join(f"{grown[i] / MIB:.0f}" for i in range(count))
                print(f"{key[0]:12} {key[1]:18} round {r + 1}: {cells}")


def parse_bounds(text: str) -> list[int]:
    """``--classes``: MiB bounds, finite, positive and distinct, in bytes, sorted."""
    try:
        values = [float(b) for b in text.split(",")]
    except ValueError:
        values = []
    if not values or not all(math.isfinite(v) and v > 0 for v in values):
        raise ValueError(f"--classes {text!r} is invalid: it needs positive MiB numbers like 1,16")
    bounds = sorted({int(v * MIB) for v in values})
    if len(bounds) != len(values):
        raise ValueError(f"--classes {text!r} is invalid: its bounds must differ")
    return bounds


@contextlib.contextmanager
def traced_bench(growth: Growth) -> Iterator[None]:
    """``bench_workloads`` with its allocator wrapped by ``growth`` and its runs named."""
    import cupy

    track, reset = bw.PoolPeaks.track, bw.PoolPeaks.reset
    run, measure = bw.Runner.run, bw.Runner.measure

    def traced_track(self: bw.PoolPeaks, malloc: Any) -> Any:
        routable = self.pool is cupy.get_default_memory_pool()
        return growth.wrap(self.pool, track(self, malloc), routable)

    def counted_reset(self: bw.PoolPeaks, free: bool) -> None:
        growth.next_run(cold=free)
        reset(self, free)

    def named_run(self: bw.Runner, wl: Any, *more: Any) -> None:
        growth.start(wl.name, SETUP)
        run(self, wl, *more)

    def routed_measure(self: bw.Runner, row: dict, wl: Any, *more: Any) -> None:
        growth.start(row["workload"], row["mode"])
        growth.classes_on = row["mode"] == "launcher-classes"
        try:
            measure(self, row, wl, *more)
        finally:
            growth.classes_on = False
            growth.start(row["workload"], SETUP)

    bw.DIAGNOSTIC_MODES["launcher-classes"] = {}
    bw.PoolPeaks.track, bw.PoolPeaks.reset = traced_track, counted_reset
    bw.Runner.run, bw.Runner.measure = named_run, routed_measure
    try:
        yield
    finally:
        bw.PoolPeaks.track, bw.PoolPeaks.reset = track, reset
        bw.Runner.run, bw.Runner.measure = run, measure
        del bw.DIAGNOSTIC_MODES["launcher-classes"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.probes.probe_pool_growth",
        description="Every other argument goes to bench_workloads (its --backend is cupy).",
    )
    p.add_argument("--classes", default="1,16", help="MiB bounds of the size classes")
    p.add_argument("--backend", default="cupy", help="cupy only: CuPy's pool is traced")
    args, rest = p.parse_known_args(argv)
    if args.backend != "cupy":
        p.error(f"--backend {args.backend!r} is invalid: this probe traces CuPy's pool (cupy)")
    try:
        bounds = parse_bounds(args.classes)
    except ValueError as e:
        p.error(str(e))
    try:
        import cupy
    except ImportError as e:
        p.error(f"this probe traces CuPy's pool, and CuPy cannot be imported: {e}")

    def make_stream() -> Any:
        return cupy.cuda.Stream(non_blocking=True)

    growth = Growth(bounds, lambda: cupy.cuda.get_current_stream().ptr, make_stream)
    print(f"size classes (MiB bounds): {','.join(f'{b / MIB:g}' for b in bounds)}", flush=True)
    with traced_bench(growth):
        rc = bw.main(["--backend", "cupy", *rest])
    growth.report()
    return rc


if __name__ == "__main__":
    sys.exit(main())
