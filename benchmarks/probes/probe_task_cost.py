"""Why a task costs the worker thread more with the plugin on, task per key, on a cluster?

At a5b178d on the H200 (``results/h200-second-a5b178d/gaps.txt``), with blocks off one
worker thread spent more time in each task than with the plugin off: fft's ``tile_fft``
324 -> 509 us, delayed's ``tanh`` 875 -> 1,020 us, ``matmul`` 195 -> 269 us. Two guesses:
CuPy's own calls cost more on pool streams (per-stream plan caches and memory arenas), or
the runtime's CUDA calls (event record, stream wait), which release the GIL
(``probe_gil``), make the worker thread wait for the event loop to give it back.

This probe times the same calls in one thread, no scheduler, ``--tasks`` at a time:

- ``plain``: on the legacy default stream, as with the plugin off;
- ``streams``: on the runtime's pool streams in turn, no runtime (CuPy only);
- ``runtime``: through ``StreamRuntime.run``, each task's input the previous
  round's output of another stream, as a worker's tasks run;
- ``runtime-gil`` (CuPy only): the same, with the runtime's event record and stream wait
  made through the driver (``cuEventRecord``, ``cuStreamWaitEvent``) by ``ctypes.PyDLL``,
  which keeps the GIL: if the runtime's loss beside a busy thread is its GIL hand-offs,
  this mode does not have it (asked at 8f366ab; not run yet);

each ``alone`` and beside a ``bursty`` thread (200 us of Python, then a 50 us sleep, as a
worker's event loop under load). Host us a task: the median and the mean (a wait for the
GIL shows in the mean), over ``--rounds`` rounds with the modes in turn; the device is
synchronized (not timed) between rounds. Every mode's result is checked against plain's.

    python -m benchmarks.probes.probe_task_cost --backend cupy
    python -m benchmarks.probes.probe_task_cost --backend sim --tasks 32 --rounds 2
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import numpy as np

from benchmarks.probes.probe_gil import bursty_loop
from dask_gpustreams.config import StreamsConfig
from dask_gpustreams.runtime import EventRegistry, StreamRuntime, runtimes


def calls(backend: str) -> tuple[dict[str, Callable[[Any], Any]], Callable[[int], Any]]:
    """name -> a task function of one input; and ``make(seed)``, an input for it."""
    if backend == "cupy":
        import cupy as xp

        def make(seed: int) -> Any:
            return xp.random.default_rng(seed).random((1024, 1024), dtype=xp.float32)
    else:
        xp = np

        def make(seed: int) -> Any:
            return np.random.default_rng(seed).random((64, 64), dtype=np.float32)

    return {
        "tile_fft": lambda b: xp.real(xp.fft.ifft2(xp.fft.fft2(b))),
        "tanh": xp.tanh,
        "matmul": lambda b: xp.matmul(b, b),
        "sum": lambda b: xp.sum(b, axis=0),
    }, make


@contextmanager
def gil_kept(backend: Any) -> Iterator[None]:
    """``backend``'s event record and stream wait through the CUDA driver, GIL held."""
    import ctypes

    driver = ctypes.PyDLL("libcuda.so.1")  # PyDLL: the GIL is not released in its calls
    record, wait = driver.cuEventRecord, driver.cuStreamWaitEvent
    record.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    wait.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
    record.restype = wait.restype = ctypes.c_int

    def record_event(self: Any, event: Any, stream: Any) -> None:
        if rc := record(event.ptr, stream.ptr):
            raise RuntimeError(f"cuEventRecord returned {rc}")

    def wait_event(self: Any, stream: Any, event: Any) -> None:
        if rc := wait(stream.ptr, event.ptr, 0):
            raise RuntimeError(f"cuStreamWaitEvent returned {rc}")

    cls = type(backend)
    with (
        mock.patch.object(cls, "record", record_event),
        mock.patch.object(cls, "wait_event", wait_event),
    ):
        yield


def one_round(mode: str, fn: Callable, inputs: list, runtime: StreamRuntime) -> tuple:
    """Host seconds of each task of one round, and the outputs (device synchronized)."""
    n = len(inputs)
    times = [0.0] * n
    outs: list = [None] * n
    backend = runtime.backend
    if mode == "plain":
        for i, x in enumerate(inputs):
            t = time.perf_counter()
            outs[i] = fn(x)
            times[i] = time.perf_counter() - t
    elif mode == "streams":
        streams = [s for _, s in runtime.pool.streams()]
        for i, x in enumerate(inputs):
            t = time.perf_counter()
            with backend.use_stream(streams[i % len(streams)]):
                outs[i] = fn(x)
            times[i] = time.perf_counter() - t
    elif mode == "runtime-gil":
        with gil_kept(backend):
            return one_round("runtime", fn, inputs, runtime)
    else:
        registry = EventRegistry()
        producer = EventRegistry()  # the inputs, recorded on the pool as a worker's are
        for i, x in enumerate(inputs):
            runtime.run(("in", i), lambda v, x=x: x, {}, producer)
        for i, x in enumerate(inputs):
            key = ("in", i)
            t = time.perf_counter()
            outs[i] = runtime.run(("out", i), lambda v, key=key: fn(v[key]), {key: x}, registry)
            times[i] = time.perf_counter() - t
        runtime.synchronize(list(registry), registry)
        runtime.release_events(registry)
        runtime.release_events(producer)
    settle(runtime)
    return times, outs


def settle(runtime: StreamRuntime) -> None:
    """Wait for all work on the device: the pool's streams, then (CuPy) the whole device."""
    for _, stream in runtime.pool.streams():
        runtime.backend.synchronize_stream(stream)
    if runtime.backend_name == "cupy":
        import cupy

        cupy.cuda.Device().synchronize()


def check(name: str, got: list, ref: list) -> bool:
    """Whether ``got`` equals ``ref`` to float32 rounding, element by element."""
    for g, r in zip(got, ref, strict=True):
        g = g.get() if hasattr(g, "get") else np.asarray(g)
        r = r.get() if hasattr(r, "get") else np.asarray(r)
        if not np.allclose(g, r, rtol=1e-4, atol=1e-5):
            print(f"WRONG: {name}")
            return False
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cupy", choices=("cupy", "sim"))
    ap.add_argument("--tasks", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", default="tile_fft,tanh,matmul,sum")
    args = ap.parse_args(argv)
    runtime = runtimes.create(StreamsConfig(backend=args.backend))
    funcs, make = calls(args.backend)
    inputs = [make(i) for i in range(args.tasks)]
    modes = ["plain", "runtime"]
    if args.backend == "cupy":
        modes[1:1] = ["streams"]
        modes.append("runtime-gil")
    runtime.isolate_thread()  # as a worker thread is at its first task
    print(
        f"backend {args.backend}, {args.tasks} tasks a round, {args.rounds} rounds, "
        f"{runtime.n_streams} streams; host us a task, median / mean over every task"
    )
    print(f"{'call':10} {'load':7} {'mode':11} {'median':>8} {'mean':>8} {'vs plain':>9}")
    wrong = 0
    try:
        for name in args.calls.split(","):
            fn = funcs[name]
            for load in ("alone", "bursty"):
                stop = threading.Event()
                other = None
                if load == "bursty":
                    other = threading.Thread(target=bursty_loop, args=(stop,), daemon=True)
                    other.start()
                times: dict[str, list[float]] = {m: [] for m in modes}
                ref = None
                for r in range(args.rounds + 1):
                    for mode in modes:
                        t, outs = one_round(mode, fn, inputs, runtime)
                        if mode == "plain":
                            ref = outs
                        elif not check(f"{name} {load} {mode}", outs, ref):
                            wrong += 1
                        if r:  # the first round warms up (plans, pools, kernels)
                            times[mode] += t
                stop.set()
                if other is not None:
                    other.join()
                base = statistics.mean(times["plain"])
                for mode in modes:
                    med = statistics.median(times[mode]) * 1e6
                    mean = statistics.mean(times[mode]) * 1e6
                    print(
                        f"{name:10} {load:7} {mode:11} {med:8.1f} {mean:8.1f} "
                        f"{mean - base * 1e6:+9.1f}"
                    )
    finally:
        runtime.close()
    print(f"{wrong} wrong")
    return 1 if wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())
