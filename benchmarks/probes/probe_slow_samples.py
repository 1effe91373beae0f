"""Which computes of a workload come out slow, and what else happened in them.

``bench_workloads``' matmul has had samples 80-100 ms slower than the others in every
mode, plain sync too, since at least 7f91e56 (docs/measurements/launcher.md: "Their cause is not
known"). This runs one workload as ``bench_workloads`` does (``--modes`` in turn, each
turn from a cold pool: a warm-up, then ``--samples`` computes; ``--rounds`` turns each),
checks every result, and prints each compute's wall with what could explain a slow one:
the garbage collector's time and the oldest generation it collected (-1: none), how much
the device pool grew, and on CuPy the GPU's SM clock (least and median), its power (most)
and its clock-event reasons (NVML, sampled by a thread every ``--every-ms``). Then, per
mode, the slow computes (over ``--slow`` times the mode's median) against the others.

    python -m benchmarks.probes.probe_slow_samples --backend cupy --workload matmul \\
        --modes sync,launcher --samples 4 --rounds 4
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from typing import Any

import dask

from benchmarks import bench_workloads as bw
from benchmarks.probes.probe_dagger_loop import GcClock, pool_bytes

MIB = 1 << 20


class GpuClock:
    """NVML's SM clock (MHz), power (W) and clock-event reasons of device 0, sampled by a
    thread while a compute runs (:meth:`start`, :meth:`stop`); nothing without NVML."""

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self._nvml: Any = None
        self._handle: Any = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            if hasattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons"):
                self._reasons = pynvml.nvmlDeviceGetCurrentClocksEventReasons
            else:  # its name before NVML 12.2
                self._reasons = pynvml.nvmlDeviceGetCurrentClocksThrottleReasons
            self._nvml = pynvml
            self._sample()
        except Exception:  # no NVML (the sim, a machine without a driver), or no readings
            self._nvml = None
        self._samples: list[tuple[int, float, int]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> tuple[int, float, int]:
        nvml, handle = self._nvml, self._handle
        return (
            nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM),
            nvml.nvmlDeviceGetPowerUsage(handle) / 1e3,
            self._reasons(handle),
        )

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self._samples.append(self._sample())

    def start(self) -> None:
        if self._nvml is None:
            return
        self._samples = [self._sample()]
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="gpu-clock", daemon=True)
        self._thread.start()

    def stop(self) -> dict:
        """What was sampled since :meth:`start`: empty without NVML."""
        if self._thread is None:
            return {}
        self._stop.set()
        self._thread.join()
        self._thread = None
        samples = self._samples + [self._sample()]
        clocks = [s[0] for s in samples]
        reasons = 0
        for s in samples:
            reasons |= s[2]
        return {
            "sm_min": min(clocks),
            "sm_median": statistics.median(clocks),
            "power_max": max(s[1] for s in samples),
            "reasons": reasons,
        }


def free_pool(backend: str) -> None:
    """Free the cached blocks of the device pool (CuPy's default pool, or the sim's)."""
    if backend == "cupy":
        import cupy

        cupy.get_default_memory_pool().free_all_blocks()
    else:
        from dask_gpustreams import sim

        sim.get_default_memory_pool().free_all_blocks()


def run(args: argparse.Namespace) -> int:
    arrays = bw.make_arrays(args.backend)
    wl = bw.WORKLOADS[args.workload]
    sizes = bw.sizes_for(args.backend, quick=args.quick)
    collections = wl.build(arrays, sizes[wl.name])
    with dask.config.set(bw.OFF):
        ref = dask.compute(*collections, scheduler="sync")
    arrays.synchronize()
    gpu = GpuClock(args.every_ms / 1e3)
    rows: list[dict] = []
    failed = 0
    with dask.config.set({"gpustreams.backend": arrays.plugin}), GcClock() as gc_clock:
        for rnd in range(args.rounds):
            for mode in args.modes:
                config, kw = bw.mode_settings(mode)
                free_pool(args.backend)  # each turn from a cold pool, as in bench_workloads
                for i in range(1 + args.samples):
                    arrays.synchronize()
                    before = pool_bytes(args.backend)
                    gc_clock.take()
                    gpu.start()
                    t0 = time.perf_counter()
                    with dask.config.set(config):
                        results = dask.compute(*collections, **kw)
                    arrays.synchronize()
                    wall = (time.perf_counter() - t0) * 1e3
                    clock = gpu.stop()
                    oldest = gc_clock.oldest
                    gc_s, _ = gc_clock.take()
                    grown = (pool_bytes(args.backend) - before) / MIB
                    bad = [
                        p
                        for got, want in zip(results, ref, strict=True)
                        if (p := bw.problem(arrays, got, want, wl.tol)) is not None
                    ]
                    del results
                    failed += bool(bad)
                    row = {"round": rnd, "mode": mode, "i": i, "wall": wall, "gc_ms": gc_s * 1e3}
                    row["gen"] = oldest
                    row.update(grown=grown, ok=not bad, **clock)
                    if i:  # the turn's first compute is its warm-up, as in bench_workloads
                        rows.append(row)
                    print(line(row, warm_up=not i), flush=True)
    print(summary(rows, args.modes, args.slow))
    return 1 if failed else 0


def line(row: dict, warm_up: bool) -> str:
    clock = (
        f"sm {row['sm_min']:5d}/{row['sm_median']:6.0f} MHz  power {row['power_max']:5.0f} W  "
        f"reasons {row['reasons']:#06x}"
        if "sm_min" in row
        else "no NVML"
    )
    which = "warm-up" if warm_up else f"#{row['i']}"
    return (
        f"round {row['round']} {row['mode']:10s} {which:8s}"
        f"{row['wall']:9.1f} ms  gc {row['gc_ms']:6.1f} ms (gen {row['gen']:2d})  "
        f"grew {row['grown']:7.0f} MiB  "
        f"{clock}  {'ok' if row['ok'] else 'WRONG'}"
    )


def summary(rows: list[dict], modes: list[str], slow: float) -> str:
    """Per mode: the slow computes (over ``slow`` x the median) against the others."""
    out = [f"-- computes over {slow} x their mode's median, against the others (medians) --"]
    for mode in modes:
        walls = [r["wall"] for r in rows if r["mode"] == mode]
        if not walls:
            continue
        cut = slow * statistics.median(walls)
        for label, part in (
            ("slow", [r for r in rows if r["mode"] == mode and r["wall"] > cut]),
            ("other", [r for r in rows if r["mode"] == mode and r["wall"] <= cut]),
        ):
            if not part:
                out.append(f"{mode:10s} {label:5s}    0 computes")
                continue
            med = {k: statistics.median(r[k] for r in part) for k in ("wall", "gc_ms", "grown")}
            clock = (
                f"  sm min {statistics.median(r['sm_min'] for r in part):6.0f} MHz"
                if "sm_min" in part[0]
                else ""
            )
            out.append(
                f"{mode:10s} {label:5s} {len(part):4d} computes  wall {med['wall']:8.1f} ms  "
                f"gc {med['gc_ms']:6.1f} ms  grew {med['grown']:6.0f} MiB{clock}"
            )
    return "\n".join(out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=("cupy", "sim"), default="sim")
    p.add_argument("--workload", choices=sorted(bw.WORKLOADS), default="matmul")
    p.add_argument("--modes", type=lambda text: text.split(","), default=["sync", "launcher"])
    p.add_argument("--samples", type=int, default=4, help="timed computes a turn")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--slow", type=float, default=1.2, help="slow: over this x the median")
    p.add_argument("--every-ms", type=float, default=5.0, help="NVML sampling interval")
    p.add_argument("--quick", action="store_true", help="bench_workloads' quick sizes")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
