"""Answered: CuPy's event record, stream wait and kernel launch release the GIL, and an event
query does not (H200 at 6308f80, benchmarks/results/h200-gil-6308f80/gil.txt; docs/cluster.md).

    python -m benchmarks.probes.probe_gil

Times 400 calls of each in one thread, alone and with a second thread busy in Python (a pure
loop; or bursts of about 200 us of Python with short sleeps, as an event loop), with the
default 5 ms switch interval and with 0.2 ms. A call that releases the GIL then waits for it.
"""

import statistics
import sys
import threading
import time


def busy_loop(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        x += 1


def bursty_loop(stop: threading.Event) -> None:
    while not stop.is_set():
        t = time.perf_counter()
        x = 0
        while time.perf_counter() - t < 200e-6:
            x += 1
        time.sleep(50e-6)


def calls() -> tuple[dict, object]:
    """name -> a call of CuPy (or Python) to time; and a stream to synchronize after each."""
    import cupy
    from cupy.cuda import runtime

    s = cupy.cuda.Stream(non_blocking=True)
    s2 = cupy.cuda.Stream(non_blocking=True)
    ev = cupy.cuda.Event(disable_timing=True)
    ev.record(s)
    s.synchronize()
    a = cupy.zeros(16)

    def stream_ctx():
        with s:
            pass

    return {
        "python no-op": lambda: len("x"),
        "eventQuery": lambda: runtime.eventQuery(ev.ptr),
        "eventRecord": lambda: runtime.eventRecord(ev.ptr, s.ptr),
        "streamWaitEvent": lambda: runtime.streamWaitEvent(s2.ptr, ev.ptr),
        "kernel a+=1": lambda: a.__iadd__(1),
        "with stream": stream_ctx,
        "cupy.empty(16)": lambda: cupy.empty(16),
    }, s


def bench(fn, stream, n: int = 400) -> tuple[float, float]:
    """Median and mean microseconds of ``n`` calls of ``fn``."""
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    stream.synchronize()
    return statistics.median(ts) * 1e6, statistics.mean(ts) * 1e6


def main() -> None:
    timed, stream = calls()
    for interval in (0.005, 0.0002):
        sys.setswitchinterval(interval)
        for label, other in (("alone", None), ("busy", busy_loop), ("bursty", bursty_loop)):
            stop = threading.Event()
            th = None
            if other is not None:
                th = threading.Thread(target=other, args=(stop,), daemon=True)
                th.start()
                time.sleep(0.01)
            for name, fn in timed.items():
                med, mean = bench(fn, stream)
                print(
                    f"switch {interval * 1e3:.1f} ms  {label:<6} {name:<16} "
                    f"median {med:8.1f} us  mean {mean:8.1f} us",
                    flush=True,
                )
            stop.set()
            if th is not None:
                th.join()


if __name__ == "__main__":
    main()
