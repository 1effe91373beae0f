"""Randomized stress of StreamsPlugin registration sequences (sim backend, in-process cluster).

Client threads register the plugin under two names (``gpustreams``, ``gpustreams-2``),
unregister it, and submit small sim chains checked exactly, with gated and slow tasks so
that teardowns overlap registrations; once a sequence settles, every worker is checked: at
most one plugin set up, exactly one where one is registered (a probe task runs on a pool
stream), and ``get_data`` unwrapped where none is. ``--failing``: a quarter of the
registrations are of a plugin with bad settings (``StreamsPlugin.failing``).

    python -m benchmarks.fuzz_registrations --seed 1 --seeds 10 --sequences 8
"""

from __future__ import annotations

import argparse
import logging
import random
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutTimeout

import dask
import numpy as np
from distributed import Client, LocalCluster

from benchmarks import fuzz_registration_tasks as T
from dask_gpustreams import StreamsPlugin

NAMES = ("gpustreams", "gpustreams-2")
#: Whether some registrations are of a plugin with bad settings (``--failing``).
FAILING = False
#: distributed's own race: an unregister while ``plugin_add`` awaits the old teardown
#: raises KeyError on the client (not the plugin's to fix).
DIST_RACES: list = []
#: Log lines a sequence may give (by design, or distributed's race above).
EXPECTED_WARNINGS = (
    "failed to setup",
    "cannot start on worker",
    "failed to teardown",
    "registrations overlapped",
    "is set up again",
    "does not exist",
)


class Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[str] = []

    def emit(self, record):
        msg = record.getMessage()
        if record.exc_info:
            msg += " | " + "".join(traceback.format_exception(*record.exc_info))[-600:]
        self.records.append(f"{record.name}:{record.levelname}: {msg}")


def gen_ops(rng, n_threads):
    plans = []
    for _ in range(n_threads):
        ops = []
        for _ in range(rng.randint(2, 6)):
            r = rng.random()
            if r < 0.40:
                k = rng.randint(1, 4)
                if FAILING and rng.random() < 0.25:
                    k = 0  # a plugin with bad settings
                ops.append(("register", rng.choice(NAMES), k))
            elif r < 0.65:
                ops.append(("unregister", rng.choice(NAMES)))
            else:
                length = rng.randint(1, 4)
                start = rng.choice(["plain", "slow", "gated", "gated"])
                ops.append(("graph", start, length, rng.randint(1, 9), rng.random() < 0.5))
            ops.append(("sleep", rng.choice([0, 0, 0.005, 0.02, 0.05])))
        plans.append(ops)
    return plans


def run_graph(client, op, gate_id, addrs, rng_seed):
    _, start, length, v, pin = op
    rng = random.Random(rng_seed)
    n = 64
    kw = {}
    if pin and len(addrs) > 1:
        kw = dict(workers=[rng.choice(addrs)])
    if start == "plain":
        base = client.submit(T.produce, n, float(v), 0.0, pure=False, **kw)
    elif start == "slow":
        base = client.submit(
            T.slow_produce, n, float(v), rng.choice([0.05, 0.1, 0.2]), pure=False, **kw
        )
    else:
        base = client.submit(T.gated_produce, n, float(v), gate_id, pure=False, **kw)
    x, expect = base, float(v)
    keys = [base.key]
    for _ in range(length - 1):
        x = client.submit(T.add, x, base, rng.choice([0.0, 0.0, 0.02]), pure=False)
        keys.append(x.key)
        expect += v
    return x, expect, keys


def run_sequence(client, lc, seed, seq, handler, report):
    rng = random.Random(seed * 1000 + seq)
    gate_id = seed * 1000 + seq
    gate = T.GATES[gate_id] = threading.Event()
    addrs = list(lc.scheduler.workers)
    n_threads = rng.randint(2, 4)
    plans = gen_ops(rng, n_threads)
    gate_delay = rng.choice([0.0, 0.05, 0.2, 0.5, 1.0])
    graphs = []  # (future, expect, desc)
    errors = []
    lock = threading.Lock()

    def do(ops, tseed):
        for i, op in enumerate(ops):
            kind = op[0]
            try:
                if kind == "register" and op[2] == 0:
                    try:
                        client.register_plugin(StreamsPlugin.failing(ValueError("bad")), name=op[1])
                    except ValueError as e:
                        if "cannot start" not in str(e):
                            raise
                elif kind == "register":
                    client.register_plugin(StreamsPlugin(streams=op[2]), name=op[1])
                elif kind == "unregister":
                    try:
                        client.unregister_worker_plugin(op[1])
                    except ValueError as e:
                        if "does not exist" not in str(e):
                            raise
                elif kind == "graph":
                    f, expect, keys = run_graph(client, op, gate_id, addrs, tseed * 100 + i)
                    with lock:
                        graphs.append((f, expect, op, keys))
                elif kind == "sleep":
                    time.sleep(op[1])
            except Exception as e:
                with lock:
                    errors.append((op, repr(e)))

    t0 = time.monotonic()
    ex = ThreadPoolExecutor(n_threads + 1)
    futs = [ex.submit(do, ops, k) for k, ops in enumerate(plans)]

    def opener():
        time.sleep(gate_delay)
        gate.set()

    ex.submit(opener)
    hung = False
    for f in futs:
        try:
            f.result(timeout=90)
        except FutTimeout:
            hung = True
    gate.set()
    ex.shutdown(wait=not hung)
    problems = []
    if hung:
        problems.append("HANG: a client op did not return in 90 s")
    for op, e in errors:
        if op[0] == "unregister" and e == f"KeyError('{op[1]}')":
            DIST_RACES.append((seed, seq, op))  # distributed: plugin_add's pop, then remove
            continue
        problems.append(f"client op {op} raised {e}")
    for f, expect, op, keys in graphs:
        try:
            got = T.values(f.result(timeout=60))
            if not np.array_equal(got, np.full(64, expect)):
                off = [T.OFF_STREAMS.get(k) for k in keys]
                tag = (
                    "WRONG RESULT (input made off the streams)" if any(off[:-1]) else "WRONG RESULT"
                )
                problems.append(f"{tag} {op}: {got[:3]} != {expect}; off streams per task: {off}")
        except Exception as e:
            if FAILING and "cannot start" in str(e):
                continue  # a plugin with bad settings was registered when it ran
            problems.append(f"graph {op} raised {e!r}")
    if T.GATE_TIMEOUTS:
        problems.append(f"gate timeouts {T.GATE_TIMEOUTS}")
        T.GATE_TIMEOUTS.clear()
    # Invariants, on every worker.
    snaps = client.run(T.snapshot, workers=addrs)
    for addr, s in snaps.items():
        active = [p for p in s["plugins"] if p["active"]]
        registered = [p for p in s["plugins"] if p["error"] is None]
        failing = [p for p in s["plugins"] if p["error"] is not None]
        if failing:  # by design its tasks fail while it is registered: check what runs
            try:
                on = client.submit(
                    T.on_a_pool_stream, pure=False, workers=[addr], allow_other_workers=False
                ).result(timeout=30)
                if not on:
                    problems.append(
                        f"{addr}: a failing plugin registered, a task ran off streams: {s}"
                    )
            except ValueError as e:
                if "cannot start" not in str(e):
                    problems.append(f"{addr}: probe raised {e!r}")
            if len(active) > 1:
                problems.append(f"{addr}: {len(active)} active plugins {s}")
            continue
        if len(active) > 1:
            problems.append(f"{addr}: {len(active)} active plugins {s}")
        if registered:
            if len(active) != 1:
                problems.append(
                    f"{addr}: registered {len(registered)} but {len(active)} active: {s}"
                )
            for p in active:
                if p["runtime_closed"]:
                    problems.append(f"{addr}: active plugin's runtime closed: {s}")
            try:
                on = client.submit(
                    T.on_a_pool_stream, pure=False, workers=[addr], allow_other_workers=False
                ).result(timeout=30)
                if not on:
                    problems.append(f"{addr}: registered but a task ran off the pool streams: {s}")
            except Exception as e:
                problems.append(f"{addr}: probe task raised {e!r}")
        else:
            if not s["get_data_plain"]:
                problems.append(f"{addr}: no plugin registered but get_data still wrapped: {s}")
            if active:
                problems.append(f"{addr}: active but not registered?? {s}")
    warnings = list(handler.records)
    handler.records.clear()
    unexpected = [w for w in warnings if not any(x in w for x in EXPECTED_WARNINGS)]
    report.append(
        dict(
            seed=seed,
            seq=seq,
            plans=plans,
            gate_delay=gate_delay,
            problems=problems,
            n_warn=len(warnings),
            unexpected=unexpected,
            kinds=sorted(
                {w.split(": ", 2)[-1][:40] for w in warnings if "does not exist" not in w}
            ),
            secs=round(time.monotonic() - t0, 2),
            snaps=snaps,
        )
    )
    del T.GATES[gate_id]
    T.OFF_STREAMS.clear()
    return problems


def main() -> None:
    global FAILING
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1, help="the first seed (one cluster each)")
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--sequences", type=int, default=8, help="sequences per cluster")
    parser.add_argument("--failing", action="store_true")
    args = parser.parse_args()
    FAILING = args.failing
    seed0, nseeds, per = args.seed, args.seeds, args.sequences
    handler = Collect()
    for name in ("dask_gpustreams", "distributed"):
        logging.getLogger(name).addHandler(handler)
    total = bad = 0
    for seed in range(seed0, seed0 + nseeds):
        rng = random.Random(seed)
        n_workers = rng.randint(1, 2)
        report = []
        with (
            dask.config.set(
                {
                    "gpustreams.backend": "sim",
                    "gpustreams.streams": 2,
                    "distributed.worker.memory.spill": False,
                }
            ),
            LocalCluster(
                n_workers=n_workers,
                threads_per_worker=2,
                processes=False,
                dashboard_address=":0",
            ) as lc,
            Client(lc) as client,
        ):
            if rng.random() < 0.5:
                client.register_plugin(StreamsPlugin())
            handler.records.clear()
            for seq in range(per):
                problems = run_sequence(client, lc, seed, seq, handler, report)
                r = report[-1]
                total += 1
                print(
                    f"seed={seed} seq={seq} w={n_workers} secs={r['secs']} warns={r['n_warn']} "
                    f"kinds={r['kinds']} problems={len(problems)} "
                    f"unexpected={len(r['unexpected'])}",
                    flush=True,
                )
                if problems or r["unexpected"]:
                    bad += 1
                    print("  PLANS:", r["plans"], "gate_delay", r["gate_delay"])
                    for p in problems:
                        print("  PROBLEM:", p[:1500])
                    for u in r["unexpected"]:
                        print("  UNEXPECTED LOG:", u[:1500])
                if any(p.startswith("HANG") for p in problems):
                    break
    print(f"DONE total={total} bad={bad} distributed-remove-races={len(DIST_RACES)}")


if __name__ == "__main__":
    main()
