"""Where CuPy's pool grows under plain sync and the launcher: by size class, and how much was free.

The launcher holds more than plain sync on matmul, qr and delayed (the pool's
``total_bytes``; used bytes are within 1.04x on matmul and qr). This runs
``bench_workloads`` (the other arguments go to it) with its tracking allocator wrapped
once more: each allocation that makes the pool grow is logged with its size, its class
(``--classes``, MiB bounds), the bytes grown and the bytes the pool had free at the
time (free in some stream's arena, or in a split block, but not for this request). Mode
``launcher-classes`` also allocates each class between two bounds while a stream of its
own, one per current stream, is current (CuPy keys its arenas by that stream), as the
launcher does for small blocks: a test of keeping size classes apart. Run::

    python -m benchmarks.probes.probe_pool_growth --backend cupy --workloads qr,matmul \\
        --modes sync,launcher,launcher-classes --samples 2 --rounds 1 --warmup 1
"""

from __future__ import annotations

import argparse
import collections
import functools
import sys
import threading
from typing import Any

from benchmarks import bench_workloads as bw

MIB = 1 << 20


class Growth:
    """The log of pool growth per (workload, mode), and the class routing of one mode."""

    def __init__(self, bounds: list[int]) -> None:
        self.bounds = bounds
        self.where: tuple[str, str] = ("", "")
        self.sample = 0
        self.classes_on = False
        self.events: dict[tuple[str, str], list[tuple]] = collections.defaultdict(list)
        self.counts: dict[tuple[str, str], collections.Counter] = collections.defaultdict(
            collections.Counter
        )
        self._standing: dict[tuple[int, int], Any] = {}
        self._lock = threading.Lock()

    def size_class(self, size: int) -> int:
        return sum(size >= b for b in self.bounds)

    def label(self, c: int) -> str:
        edges = [0, *self.bounds]
        lo = f"{edges[c] // MIB}" if c else "0"
        return f">={lo}" if c == len(self.bounds) else f"{lo}-{edges[c + 1] // MIB}"

    def standing(self, cls: int, stream_ptr: int) -> Any:
        import cupy

        key = (cls, stream_ptr)
        stream = self._standing.get(key)
        if stream is None:
            with self._lock:
                stream = self._standing.setdefault(key, cupy.cuda.Stream(non_blocking=True))
        return stream

    def wrap(self, pool: Any, malloc: Any) -> Any:
        import cupy

        current = cupy.cuda.get_current_stream

        @functools.wraps(malloc)
        def traced(size: int) -> Any:
            cls = self.size_class(size)
            before, free = pool.total_bytes(), pool.free_bytes()
            ptr = current().ptr
            if self.classes_on and 0 < cls < len(self.bounds) and ptr:
                with self.standing(cls, ptr):
                    memory = malloc(size)
            else:
                memory = malloc(size)
            grown = pool.total_bytes() - before
            self.counts[self.where][cls] += 1
            if grown:
                self.events[self.where].append((self.sample, cls, size, grown, free))
            return memory

        return traced

    def report(self) -> None:
        n = len(self.bounds) + 1
        print("\n== pool growth by size class (MiB); free = pool free_bytes when it grew ==")
        head = " ".join(f"{'alloc ' + self.label(c):>12} {'grown':>8}" for c in range(n))
        print(f"{'workload':12} {'mode':18} {head} {'warm MiB':>9} {'later':>7} {'free@grow':>9}")
        for (wl, mode), events in sorted(self.events.items()):
            counts = self.counts[(wl, mode)]
            cells = []
            for c in range(n):
                grown = sum(e[3] for e in events if e[1] == c) / MIB
                cells.append(f"{counts[c]:>12} {grown:8.0f}")
            warm = sum(e[3] for e in events if e[0] == 0) / MIB
            later = sum(e[3] for e in events if e[0] > 0) / MIB
            free = max((e[4] for e in events), default=0) / MIB
            name, mode = wl or "(first)", mode or "(set-up)"
            print(f"{name:12} {mode:18} {' '.join(cells)} {warm:9.0f} {later:7.0f} {free:9.0f}")
        print("\n== MiB the pool grew in each run of a round (the first: after its cold start) ==")
        for (wl, mode), events in sorted(self.events.items()):
            runs = collections.Counter()
            for e in events:
                runs[e[0]] += e[3]
            grown = " ".join(f"{runs[i] / MIB:.0f}" for i in range(max(runs, default=-1) + 1))
            print(f"{wl or '(first)':12} {mode or '(set-up)':18} {grown}")
        print("(alloc: allocations of that class over the mode's runs; grown: MiB the pool grew")
        print(" for them; warm: grown in each round's first run (cold pool), later: after it;")
        print(" free@grow: the most the pool had free at a growth)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.probes.probe_pool_growth")
    p.add_argument("--classes", default="1,16", help="MiB bounds of the size classes")
    p.add_argument("--backend", default="cupy", help="cupy only: CuPy's pool is traced")
    args, rest = p.parse_known_args(argv)
    if args.backend != "cupy":
        p.error(f"--backend {args.backend!r} is invalid: this probe traces CuPy's pool (cupy)")
    try:
        bounds = sorted(int(float(b) * MIB) for b in args.classes.split(","))
    except ValueError:
        p.error(f"--classes {args.classes!r} is invalid: it needs MiB numbers like 1,16")
    growth = Growth(bounds)
    bw.DIAGNOSTIC_MODES["launcher-classes"] = {}
    track, reset, measure = bw.PoolPeaks.track, bw.PoolPeaks.reset, bw.Runner.measure

    def traced_track(self: bw.PoolPeaks, malloc: Any) -> Any:
        return growth.wrap(self.pool, track(self, malloc))

    def counted_reset(self: bw.PoolPeaks, free: bool) -> None:
        growth.sample = 0 if free else growth.sample + 1
        reset(self, free)

    def routed_measure(self: bw.Runner, row: dict, wl: Any, *more: Any) -> None:
        growth.where = (row["workload"], row["mode"])
        growth.classes_on = row["mode"] == "launcher-classes"
        try:
            measure(self, row, wl, *more)
        finally:  # what follows (the next workload's inputs and reference) is apart
            growth.classes_on = False
            growth.where = (row["workload"], "(after the modes)")

    bw.PoolPeaks.track, bw.PoolPeaks.reset = traced_track, counted_reset
    bw.Runner.measure = routed_measure
    print(f"size classes (MiB bounds): {args.classes}", flush=True)
    rc = bw.main(["--backend", "cupy", *rest])
    growth.report()
    return rc


if __name__ == "__main__":
    sys.exit(main())
