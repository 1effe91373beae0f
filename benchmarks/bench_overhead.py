"""Host overhead of the stream runtime per task, by scheduler.

Runs ``--tasks`` no-op tasks (each returns its input array; no kernels) as a wide graph,
under plain Dask (synchronous and threaded schedulers, plugin off), the plugin by config
(``gpustreams.enabled``) with ``scheduler="sync"`` by name (the launcher, every task on
the calling thread), with Dask's own schedulers as such (``dask.local.get_sync`` and
``dask.threaded.get``: each task through the runtime in Dask's threads), and the stream
launcher (``scheduler="gpustreams"``). Prints microseconds per task, tasks per second, and
the difference to plain Dask's synchronous scheduler: for the plugin on a synchronous
route that difference is the runtime's own cost. Two graphs: ``wide`` (every task reads
one source array) and ``chains`` (chains of 20 tasks, so event waits and stream reuse are
exercised). The modes take turns: each of ``--repeats`` rounds runs every mode once,
starting one further each round, after collecting garbage untimed, and the difference to
plain sync is paired by round (the host's drift between calls is as large as the
differences measured). Every run is checked: each output must be the source array itself
(a no-op task returns its input), else the row is FAILED. ``--profile`` reruns the
launcher on each graph of ``--graphs`` under cProfile and prints where the time goes.
``--out DIR`` also writes ``results.json`` (meta; one row per graph and mode, with every
sample) and ``rows.jsonl`` (rows as they complete), the files ``python -m benchmarks run``
reads::

    python -m benchmarks.bench_overhead --backend sim
    python -m benchmarks.bench_overhead --backend cupy --tasks 20000 --profile
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import dask
import dask.base
import dask.local
import dask.threaded

import dask_gpustreams
from benchmarks import kernels, report
from dask_gpustreams.backends import resolve_backend
from dask_gpustreams.runtime.policies import policy_names

CHAIN = 20


def noop(x):
    return x


def graph(kind: str, n: int, source) -> tuple[dict, list]:
    dsk: dict = {"src": source}
    if kind == "wide":
        for i in range(n):
            dsk[("t", i)] = (noop, "src")
        return dsk, [("t", i) for i in range(n)]
    chains = max(1, n // CHAIN)
    for c in range(chains):
        for d in range(CHAIN):
            dsk[(f"c{c}", d)] = (noop, "src" if d == 0 else (f"c{c}", d - 1))
    return dsk, [(f"c{c}", CHAIN - 1) for c in range(chains)]


def by_name(name: str) -> Callable:
    """The scheduler ``compute(scheduler=name)`` gets under the config of the call."""

    def get(dsk, keys, **kwargs):
        return dask.base.get_scheduler(scheduler=name)(dsk, keys, **kwargs)

    return get


#: Schedulers by mode: plain Dask's two local schedulers (as functions, so that the
#: plugin's rows run each task through the runtime in Dask's threads), ``"sync"`` by name
#: and the stream launcher.
SCHEDULERS = {
    "sync": dask.local.get_sync,
    "threads": dask.threaded.get,
    "sync by name": by_name("sync"),
    "launcher": dask_gpustreams.get,
}


def run_once(get, dsk: dict, keys: list, config: dict, threads: int) -> tuple[float, str | None]:
    """Seconds of one run, and what is wrong with its outputs (None: each is the source).

    The garbage of earlier runs is collected first, untimed, so that no mode pays
    for another's.
    """
    kwargs = {"num_workers": threads} if get is dask.threaded.get else {}
    gc.collect()
    with dask.config.set(config):
        t0 = time.perf_counter()
        results = get(dsk, keys, **kwargs)
        wall = time.perf_counter() - t0
    wrong = [j for j, r in enumerate(results) if r is not dsk["src"]]
    if len(results) != len(keys) or wrong:
        return wall, f"{len(wrong)} of {len(keys)} outputs are not the source"
    return wall, None


def sampled(
    rows: list[tuple[str, object, dict]], dsk: dict, keys: list, threads: int, repeats: int
) -> tuple[list[list[float]], list[str | None]]:
    """Each row's seconds in ``repeats`` rounds (after one warm-up each), and its first problem.

    In a round every mode runs once, in turn, starting one further each round, so that
    drift of the host between rounds and the order of the modes weigh on all alike.
    """
    walls: list[list[float]] = [[] for _ in rows]
    problems: list[str | None] = [None] * len(rows)
    for i in range(repeats + 1):
        for j in (*range(i % len(rows), len(rows)), *range(i % len(rows))):
            _, get, config = rows[j]
            wall, problem = run_once(get, dsk, keys, config, threads)
            if problem is not None and problems[j] is None:
                problems[j] = f"run {i}: {problem}"
            if i:
                walls[j].append(wall)
    return walls, problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_overhead", description=__doc__)
    p.add_argument("--backend", default="auto", choices=("auto", "cupy", "sim"))
    p.add_argument("--tasks", type=int, default=20_000)
    p.add_argument("--graphs", default="wide,chains")
    p.add_argument("--policies", default="auto,round-robin")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeline", action="store_true", help="also measure with the timeline on")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--out", default=None, help="also write results.json and rows.jsonl here")
    args = p.parse_args(argv)
    backend = resolve_backend(args.backend)
    policies = [x for x in args.policies.split(",") if x]
    bad = [x for x in policies if x not in policy_names()]
    if bad:
        p.error(f"--policies {','.join(bad)} is invalid: allowed values are {policy_names()}")
    source = kernels.to_device(backend, kernels.source(0, 256))
    out = None if args.out is None else report.out_dir(args, f"overhead-{backend}")
    command = sys.argv[1:] if argv is None else argv
    meta = {
        "argv": [sys.executable, "-m", "benchmarks.bench_overhead", *command],
        "args": vars(args),
        "backend": backend,
        "started": datetime.datetime.now().isoformat(),
        **report.environment(backend),
    }
    results: list[dict] = []
    print(
        f"backend {backend}, {args.tasks} no-op tasks, {args.streams} streams, threaded "
        f"scheduler with {args.threads} threads; median of {args.repeats} rounds of every "
        "mode in turn; 'vs plain sync': the median over rounds of us/task minus plain "
        "Dask's synchronous scheduler's in the same round"
    )
    print(f"{'graph':<7} {'mode':<34} {'us/task':>8} {'tasks/s':>9} {'vs plain sync':>14}")
    for kind in args.graphs.split(","):
        dsk, keys = graph(kind, args.tasks, source)
        n = len(dsk) - 1
        plain = {"gpustreams.enabled": False}
        rows = [(f"plain {m}", SCHEDULERS[m], plain) for m in ("sync", "threads")]
        for policy in policies:
            config = {
                "gpustreams.backend": backend,
                "gpustreams.streams": args.streams,
                "gpustreams.policy": policy,
            }
            for mode in ("sync by name", "sync", "threads", "launcher"):
                label = {
                    "launcher": f"launcher {policy}",
                    "sync by name": f"enabled 'sync' {policy}",
                }.get(
                    mode,
                    f"enabled {SCHEDULERS[mode].__module__}.{SCHEDULERS[mode].__name__} {policy}",
                )
                enabled = {**config, "gpustreams.enabled": mode != "launcher"}
                rows.append((label, SCHEDULERS[mode], enabled))
        if args.timeline:
            tl = {**rows[-1][2], "gpustreams.timeline": True}
            rows.append((rows[-1][0] + " +timeline", dask_gpustreams.get, tl))
        all_walls, problems = sampled(rows, dsk, keys, args.threads, args.repeats)
        base_walls = all_walls[0]  # plain sync's, round by round
        for (label, _, _), walls, problem in zip(rows, all_walls, problems, strict=True):
            wall = statistics.median(walls)
            paired = statistics.median(w - b for w, b in zip(walls, base_walls, strict=True))
            print(
                f"{kind:<7} {label:<34} {wall / n * 1e6:8.1f} {n / wall:9.0f} "
                f"{paired / n * 1e6:14.1f}" + (f"  FAILED: {problem}" if problem else ""),
                flush=True,
            )
            row = {
                "graph": kind,
                "mode": label,
                "backend": backend,
                "n_tasks": n,
                "samples": len(walls),
                "walls_ms": [w * 1e3 for w in walls],
                **report.summarize([w * 1e3 for w in walls]),
                "us_per_task": wall / n * 1e6,
                "us_per_task_vs_plain_sync": paired / n * 1e6,
                "status": "FAILED" if problem else "ok",
                "error": problem or "",
            }
            results.append(row)
            if out is not None:
                with open(os.path.join(out, "rows.jsonl"), "a") as f:
                    f.write(json.dumps(row) + "\n")
    if out is not None:
        report.write_json(os.path.join(out, "results.json"), meta, results)
        print(f"results in {out}")
    if args.profile:
        for kind in args.graphs.split(","):
            profile(backend, args, policies[0], kind)
    return 1 if any(r["status"] != "ok" for r in results) else 0


def profile(backend: str, args: argparse.Namespace, policy: str, kind: str) -> None:
    """cProfile of the launcher on the ``kind`` graph."""
    source = kernels.to_device(backend, kernels.source(0, 256))
    dsk, keys = graph(kind, args.tasks, source)
    config = {
        "gpustreams.backend": backend,
        "gpustreams.streams": args.streams,
        "gpustreams.policy": policy,
    }
    with dask.config.set(config):
        dask_gpustreams.get(dsk, keys)  # warm-up
        prof = cProfile.Profile()
        prof.enable()
        dask_gpustreams.get(dsk, keys)
        prof.disable()
    print(f"\ncProfile, the launcher, {kind} graph, policy {policy}: top 15 by")
    print("own time, then the package's functions by cumulative time (per call: percall)")
    print(report.profile_text(prof, 15, "dask_gpustreams"))


if __name__ == "__main__":
    raise SystemExit(main())
