"""Randomized check of the launcher's run-again-one-task-at-a-time path on a capped sim pool.

Random ``dask.delayed`` graphs of sim tasks (1- or 2-chunk outputs, random fan-in, host
tasks reading device inputs on the host, short random kernel delays), run by plain sync to
measure its peak of pool bytes; the pool is capped at that peak; the launcher (random
streams, policy, launch-order, host-threads) must then give sync's exact results, every key's
pretask/posttask heard once, no leak, no hang. Some graphs have one failing task (device
task raising ValueError, or a host task raising): the raised error must be that task's.

    python -m benchmarks.fuzz_oom_rerun --seed 1 --graphs 200
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import logging
import random
import sys
import threading
import time
import traceback

import dask
import numpy as np
from dask import delayed
from dask.callbacks import Callback

import dask_gpustreams  # noqa: F401
from benchmarks.probes.probe_oom_repro import peak_of, settled_pool
from dask_gpustreams import host_task, sim

#: Host tasks that ran out of device memory (a documented limitation: host tasks do not retry).
HOST_OOM: list = []
HOST_DEVICE_OUT = [True]
CHUNK = 1 << 15  # float64: 256 KiB
POLICIES = ("affinity", "auto", "critical-path", "round-robin", "least-loaded")


def k_fill(out, value, delay):
    time.sleep(delay)
    out.fill(value)


def k_sum(out, const, delay, *xs):
    time.sleep(delay)
    out.fill(const)
    for x in xs:
        n = min(out.size, x.size)
        out[:n] += x[:n]


def leaf(value, chunks, delay, fail):
    if fail:
        raise ValueError(f"failed: {fail}")
    out = sim.empty(chunks * CHUNK)
    sim.launch(k_fill, out, float(value), delay)
    return out


def combine(chunks, delay, fail, *inputs):
    if fail:
        raise ValueError(f"failed: {fail}")
    const = 1.0 + sum(float(x) for x in inputs if not isinstance(x, sim.SimArray))
    xs = [x for x in inputs if isinstance(x, sim.SimArray)]
    out = sim.empty(chunks * CHUNK)
    sim.launch(k_sum, out, const, delay, *xs)
    return out


@host_task
def host_read(device_out, fail, *inputs):
    """Reads its device inputs on the host; a float, or a 1-chunk device array of it."""
    if fail:
        raise ValueError(f"failed: {fail}")
    total = 0.0
    for x in inputs:
        total += float(x.get()[:8].sum()) if isinstance(x, sim.SimArray) else float(x)
    total = float(total % 997)
    if device_out:
        try:
            return sim.asarray(np.full(CHUNK, total))
        except sim.OutOfMemoryError:
            HOST_OOM.append(threading.current_thread().name)
            raise
    return total


def download_all(*xs):
    return [x.get() if isinstance(x, sim.SimArray) else x for x in xs]


def make_graph(rng: random.Random, fail_kind: str | None):
    n = rng.randint(3, 12)
    nodes = []  # (kind, delayed)
    kinds = []
    placed = set()
    fail_at = rng.randrange(n) if fail_kind else None
    if fail_kind == "host":
        # the failing node must be a host node that has a device input: pick later
        fail_at = None
    for i in range(n):
        delay = rng.choice((0.0, 0.0, 0.0005, 0.002))
        chunks = rng.choice((1, 1, 2))
        name = f"n{i}"
        if i < 2 or rng.random() < 0.25:
            fail = name if fail_at == i else None
            d = delayed(leaf)(i % 7, chunks, delay, fail, dask_key_name=name)
            if fail:
                placed.add(name)
            kinds.append("dev")
        else:
            k = rng.randint(1, min(4, i))
            ins = rng.sample(range(i), k)
            is_host = rng.random() < 0.25
            if is_host:
                fail = name if (fail_kind == "host" and not placed and rng.random() < 0.5) else None
                d = delayed(host_read)(
                    rng.random() < 0.5 and HOST_DEVICE_OUT[0],
                    fail,
                    *[nodes[j][1] for j in ins],
                    dask_key_name=name,
                )
                kinds.append("host")
                if fail:
                    placed.add(name)
            else:
                fail = name if fail_at == i else None
                d = delayed(combine)(
                    chunks, delay, fail, *[nodes[j][1] for j in ins], dask_key_name=name
                )
                if fail:
                    placed.add(name)
                kinds.append("dev")
        nodes.append((kinds[-1], d))
    used = set()
    for _kind, d in nodes:
        for dep in d.dask.dependencies.get(d.key, ()):
            used.add(dep)
    sinks = [d for _k, d in nodes if d.key not in used]
    failing = [d.key for _k, d in nodes if d.key in placed]
    return delayed(download_all)(*sinks, dask_key_name="out"), failing


class Counts(logging.Handler):
    def __init__(self):
        super().__init__()
        self.retry = self.again = 0

    def emit(self, record):
        msg = record.getMessage()
        if "ran out of device memory again" in msg:
            self.again += 1
        elif "ran out of device memory; it runs again" in msg:
            self.retry += 1


COUNTS = Counts()


class EachKey(Callback):
    def __init__(self):
        super().__init__()
        self.pre, self.post = {}, {}

    def _pretask(self, key, dsk, state):
        self.pre[key] = self.pre.get(key, 0) + 1

    def _posttask(self, key, result, dsk, state, id):
        self.post[key] = self.post.get(key, 0) + 1


def same(a, b):
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            if not (
                isinstance(x, np.ndarray) and isinstance(y, np.ndarray) and np.array_equal(x, y)
            ):
                return False
        elif x != y:
            return False
    return True


def outcome(run):
    try:
        return "ok", run()
    except Exception as e:  # noqa: BLE001
        return "err", (type(e).__name__, str(e))


def one(g, cfg, fail_kind, timeout):
    """Returns (status, detail); status in ok, skip, FAIL."""
    base_graph = g
    # sync's peak on the graph (failing graphs: the peak of the run up to the failure)
    peak, _, (st, ref) = peak_of(lambda: outcome(lambda: base_graph.compute(scheduler="sync")))
    if fail_kind is None and st != "ok":
        return "FAIL", f"sync raised uncapped {ref}"
    if fail_kind is not None and st != "err":
        return "FAIL", f"sync did not raise on failing graph: {ref!r}"
    pool = settled_pool()
    base = pool.used_bytes()
    pool.set_capacity(base + peak)
    try:
        st2, ref2 = outcome(lambda: base_graph.compute(scheduler="sync"))
        if (st2, ref2 if st2 == "err" else None) != (st, ref if st == "err" else None) or (
            st == "ok" and not same(ref, ref2)
        ):
            return "skip", f"sync under cap: {st2} {ref2 if st2 == 'err' else ''}"
        pool = settled_pool()
        base = pool.used_bytes()
        pool.set_capacity(base + peak)
        counts = EachKey()
        conf = {
            "gpustreams.enabled": False,
            "gpustreams.backend": "sim",
            **{f"gpustreams.{k}": v for k, v in cfg.items()},
        }
        HOST_OOM.clear()
        faulthandler.dump_traceback_later(timeout, exit=True)
        try:
            with dask.config.set(conf), counts:
                st3, got = outcome(lambda: base_graph.compute(scheduler="gpustreams"))
        finally:
            faulthandler.cancel_dump_traceback_later()
        problems = []
        if st3 == "err" and got[0] == "OutOfMemoryError" and HOST_OOM:
            return "hostoom", f"a host task ran out of memory on {HOST_OOM}"
        if st3 != st:
            problems.append(
                f"launcher {st3} {got if st3 == 'err' else ''} "
                f"where sync {st} {ref if st == 'err' else ''}"
            )
        elif st == "ok" and not same(ref, got):
            problems.append(f"wrong values {got} != {ref}")
        elif st == "err" and got != ref:
            problems.append(f"error {got} != sync's {ref}")
        if st == "ok":
            keys = set(base_graph.__dask_graph__())
            if counts.pre != dict.fromkeys(keys, 1) or counts.post != dict.fromkeys(keys, 1):
                problems.append(f"hooks pre={counts.pre} post={counts.post}")
        else:
            bad = {k: v for k, v in counts.pre.items() if v != 1}
            badp = {k: v for k, v in counts.post.items() if v != 1}
            extra = set(counts.post) - set(counts.pre)
            if bad or badp or extra:
                problems.append(
                    f"hooks (failing) pre!=1 {bad} post!=1 {badp} post-without-pre {extra}"
                )
        got = ref2 = None
        gc.collect()
        leak = pool.used_bytes() - base
        if leak:
            problems.append(f"leak {leak} bytes")
        return ("FAIL", "; ".join(problems)) if problems else ("ok", "")
    finally:
        settled_pool().set_capacity(None)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--graphs", type=int, default=100)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--only", type=int, default=None, help="run only graph i")
    p.add_argument("-v", action="store_true")
    p.add_argument("--no-host-device-out", action="store_true", help="host tasks return floats")
    a = p.parse_args(argv)
    HOST_DEVICE_OUT[0] = not a.no_host_device_out
    lg = logging.getLogger("dask_gpustreams")
    lg.setLevel(logging.WARNING)
    lg.propagate = False
    lg.addHandler(COUNTS)
    tally = {"ok": 0, "skip": 0, "hostoom": 0, "FAIL": 0}
    fails = []
    t0 = time.perf_counter()
    for i in range(a.graphs):
        rng = random.Random(a.seed * 100003 + i)
        fail_kind = rng.choice((None, None, None, "device", "host"))
        g, failing = make_graph(rng, fail_kind)
        if not failing:
            fail_kind = None
        cfg = {
            "streams": rng.choice((1, 2, 4, 8)),
            "policy": rng.choice(POLICIES),
            "launch-order": rng.choice(("depth-first", "dask")),
            "host-threads": rng.choice((1, 2, 4)),
        }
        if a.only is not None and i != a.only:
            continue
        try:
            status, detail = one(g, cfg, fail_kind, a.timeout)
        except Exception:  # noqa: BLE001
            status, detail = "FAIL", "harness: " + traceback.format_exc()
        tally[status] += 1
        if status != "ok" and (status == "FAIL" or a.v):
            print(
                f"seed={a.seed} graph={i} fail_kind={fail_kind} cfg={cfg}: {status} {detail}",
                flush=True,
            )
        if status == "FAIL":
            fails.append(i)
    print(
        f"seed={a.seed}: {sum(tally.values())} graphs, {tally} fails={fails} "
        f"{time.perf_counter() - t0:.1f}s; retries logged {COUNTS.retry}, "
        f"runs again {COUNTS.again}"
    )
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
