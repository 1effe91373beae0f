"""A graph that plain sync completes on a sim pool capped at its peak: does the launcher?

``--chains`` chains of ``--length`` steps after a head (2 MiB sim arrays, each task one
new array), their ends summed pairwise. Dask's synchronous scheduler runs it first and
its peak of pool bytes used (after each allocation) becomes the capacity, plus
``--margin`` blocks; then it runs again under that capacity, and the launcher
(``scheduler="gpustreams"``, ``--streams`` streams) after it, in this fresh process
from a settled pool (garbage collected, free blocks freed)::

    python -m benchmarks.probes.probe_oom_repro --chains 4 --length 0 --streams 4

Exit status 0: the launcher's result is exact; 1: it is not, or it raised.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

import dask
import numpy as np
from dask import delayed

import dask_gpustreams  # noqa: F401
from dask_gpustreams import sim

N = 1 << 18  # float64: 2 MiB


def fill(out, value, delay):
    time.sleep(delay)
    out.fill(value)


def scale(out, x, delay):
    time.sleep(delay)
    np.multiply(x, 2.0, out=out)


def add(out, a, b, delay):
    time.sleep(delay)
    np.add(a, b, out=out)


def head(i, delay):
    out = sim.empty(N)
    sim.launch(fill, out, float(i), delay)
    return out


def step(x, delay):
    out = sim.empty(N)
    sim.launch(scale, out, x, delay)
    return out


def join(a, b, delay):
    out = sim.empty(N)
    sim.launch(add, out, a, b, delay)
    return out


def graph(chains, length, delay):
    ends = []
    for i in range(chains):
        x = delayed(head)(i, delay, dask_key_name=f"head-{i}")
        for j in range(length):
            x = delayed(step)(x, delay, dask_key_name=f"step-{i}-{j}")
        ends.append(x)
    level = 0
    while len(ends) > 1:
        pairs = zip(ends[0::2], ends[1::2], strict=False)
        joined = [
            delayed(join)(a, b, delay, dask_key_name=f"join-{level}-{k}")
            for k, (a, b) in enumerate(pairs)
        ]
        ends = joined + ends[len(joined) * 2 :]
        level += 1
    return ends[0]


def expected(chains, length):
    return float(sum(i * 2.0**length for i in range(chains)))


def settled_pool():
    gc.collect()
    pool = sim.get_default_memory_pool()
    pool.free_all_blocks()
    return pool


def peak_of(run):
    pool = settled_pool()
    base = pool.used_bytes()
    peak = [base]
    malloc = pool.malloc

    def tracked(*args):
        m = malloc(*args)
        peak[0] = max(peak[0], pool.used_bytes())
        return m

    pool.malloc = tracked
    try:
        out = run()
    finally:
        del pool.malloc
    return peak[0] - base, base, out


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--chains", type=int, default=8)
    p.add_argument("--length", type=int, default=3)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--delay", type=float, default=0.001)
    p.add_argument("--margin", type=int, default=0, help="extra blocks of 2 MiB")
    p.add_argument("--policy", default="auto")
    a = p.parse_args(argv)
    g = graph(a.chains, a.length, a.delay)
    want = expected(a.chains, a.length)
    peak, base, got = peak_of(lambda: g.compute(scheduler="sync").get())
    assert np.all(got == want), got
    cap = peak + a.margin * N * 8
    pool = settled_pool()
    base = pool.used_bytes()
    pool.set_capacity(base + cap)
    try:
        peak_sync2, _, got = peak_of(lambda: g.compute(scheduler="sync").get())
        sync_ok = bool(np.all(got == want))
        pool2 = settled_pool()
        pool2.set_capacity(pool2.used_bytes() + cap)
        config = {
            "gpustreams.enabled": False,
            "gpustreams.backend": "sim",
            "gpustreams.streams": a.streams,
            "gpustreams.policy": a.policy,
        }
        try:
            with dask.config.set(config):
                got = g.compute(scheduler="gpustreams").get()
            outcome = "ok" if np.all(got == want) else "WRONG"
        except sim.OutOfMemoryError as e:
            outcome = f"OutOfMemoryError: {e}"
        except Exception as e:  # any other failure is a result here too
            outcome = f"{type(e).__name__}: {e}"
    finally:
        settled_pool().set_capacity(None)
    print(
        f"chains={a.chains} length={a.length} streams={a.streams} policy={a.policy} "
        f"sync peak={peak >> 20} MiB ({peak // (N * 8)} blocks) cap={cap >> 20} MiB "
        f"sync under cap: {'ok' if sync_ok else 'WRONG'} (peak {peak_sync2 >> 20} MiB); "
        f"launcher: {outcome}"
    )
    return 0 if outcome == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
