"""Random local computes at once on one runtime (sim), some of them failing, checked exactly.

Each round draws one configuration (streams, policy, route) and 2-3 random DAGs of
``benchmarks.fuzz`` (delayed DAGs, most of them with a failing node, some array DAGs),
and computes each from its own thread, all started at a barrier. Each outcome must be:

- the NumPy reference's values exactly, only where the compute ran no failing node; or
- an error of a failing node the compute runs (``own``), or the ``KernelError`` of a
  failing kernel of another compute of the round (``foreign``: its work may have queued
  behind that kernel on a shared stream, which CUDA's sticky fault fails too;
  ``foreign-clean`` where the compute runs no failing node of its own).

Anything else is a failure: a value without an error (``wrong``), an error of another
kind (``unexpected``) or a compute that does not end (``hang``). After each round, one
good compute on the same runtime must be exact (``stuck`` otherwise: a failure of the
round still held a stream).

helper-99 (stop 58) found with it the wrong values that stop 59's check of every event
of a compute during which a failure was reported removed (docs/sim.md).

    python -m benchmarks.probes.probe_concurrent_failures --route launcher --streams 4 \\
        --seed 1 --minutes 2
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable

import dask
import dask.threaded
import numpy as np
from dask.array import PerformanceWarning

from benchmarks import fuzz
from dask_gpustreams import KernelError, sim

#: The outcomes that are right (see the module's docstring).
ACCEPTED = ("ok", "own", "foreign", "foreign-clean")

#: The base of every DAG's description (the fuzzer's fields; the round sets the rest).
BASE = {"streams": 0, "policy": "", "delay": (0.0, 0.0), "threads": 4, "chunksize": 1}


def round_dags(seed: int, rnd: int, route: str, n: int) -> list[fuzz.Dag]:
    """``n`` random DAGs of round ``rnd``, most with failing nodes, some split by a persist."""
    dags = []
    for j in range(n):
        rng = np.random.default_rng([seed, rnd, j])
        base = {**BASE, "route": route, "index": rnd * 10 + j, "optimize": rng.random() < 0.7}
        if rng.random() < 0.15:
            dag = fuzz.array_dag(rng, base)
        else:
            dag = fuzz.delayed_dag(rng, base, rng.random() < 0.6)
            if dag.failing is not None and rng.random() < 0.5:
                fuzz.add_failures(dag, rng)
        if len(dag.nodes) > 2 and rng.random() < 0.15:
            dag.split = int(rng.integers(1, len(dag.nodes)))
            later = {k for node in dag.nodes[dag.split :] for k in node.inputs}
            dag.persist = sorted(k for k in range(dag.split) if k in later or k in dag.outputs)
        dags.append(dag)
    return dags


def good_dag(seed: int, rnd: int, route: str) -> fuzz.Dag:
    rng = np.random.default_rng([seed, rnd, 99])
    base = {**BASE, "route": route, "index": rnd * 10 + 9, "optimize": True}
    return fuzz.delayed_dag(rng, base, False)


def compute_of(dag: fuzz.Dag, kernels: fuzz.Kernels, scheduler: object) -> Callable[[], list]:
    def compute() -> list:
        options = {"scheduler": scheduler, "optimize_graph": dag.optimize}
        outs = fuzz.build(dag, kernels, lambda xs: dask.persist(*xs, **options))
        # Read on this thread, which waits for its own streams' work only.
        return [sim.asnumpy(r) for r in dask.compute(*outs, **options)]

    return compute


def classify(dag: fuzz.Dag, box: dict, others_kernels: set) -> tuple[str, str]:
    """``(status, detail)``: ok, own, foreign, or a failure (wrong, unexpected...)."""
    error = box.get("error")
    if error is None:
        return fuzz.check_local(dag, box["result"], None)
    if fuzz.check_local(dag, None, error) == fuzz.OK:
        return "own", ""
    if isinstance(error, KernelError) and error.key in others_kernels:
        # Counted apart where the compute runs no failing node of its own: its results may
        # have been right (its upload's event recorded on a stream in error), as on CUDA.
        ran = dag.computed() & dag.failures().keys()
        return ("foreign" if ran else "foreign-clean"), ""
    return "unexpected", f"{type(error).__name__}: {error}"


def run_at_once(computes: list[Callable[[], list]], timeout: float) -> tuple[list[dict], list]:
    """Each of ``computes`` in a thread of its own, started together; their outcomes, and
    the indices of those that did not end within ``timeout`` seconds."""
    boxes: list[dict] = [{} for _ in computes]
    dones = [threading.Event() for _ in computes]
    barrier = threading.Barrier(len(computes))

    def target(compute: Callable[[], list], box: dict, done: threading.Event) -> None:
        try:
            barrier.wait(10)
            box["result"] = compute()
        except Exception as e:  # noqa: BLE001 - the outcome, classified by the caller
            box["error"] = e
        finally:
            done.set()

    for i, args in enumerate(zip(computes, boxes, dones, strict=True)):
        threading.Thread(target=target, args=args, daemon=True, name=f"compute-{i}").start()
    deadline = time.monotonic() + timeout
    hung = [i for i, d in enumerate(dones) if not d.wait(max(0.0, deadline - time.monotonic()))]
    return boxes, hung


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--route", choices=["launcher", "threaded"], required=True)
    parser.add_argument("--streams", type=int, required=True)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--minutes", type=float, default=2.0)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds a round")
    parser.add_argument("--delay", type=float, default=0.002, help="kernel delay, 0 to this")
    args = parser.parse_args()
    warnings.simplefilter("ignore", PerformanceWarning)  # the random rechunks' chunk counts

    kernels = fuzz.make_kernels("sim")
    scheduler = dask.threaded.get if args.route == "threaded" else "gpustreams"
    sim.get_device().kernel_delay = (0.0, args.delay)
    end = time.monotonic() + 60 * args.minutes
    counts: Counter = Counter()
    rnd = 0
    while time.monotonic() < end:
        rng = np.random.default_rng([args.seed, rnd, 1000])
        n = int(rng.choice([2, 2, 3]))
        policy = str(rng.choice(fuzz.POLICIES))
        config = {
            "gpustreams.backend": "sim",
            "gpustreams.streams": args.streams,
            "gpustreams.policy": policy,
        }
        if args.route == "threaded":
            workers = int(rng.choice([1, 2, 4, 8]))
            config.update({"gpustreams.enabled": True, "num_workers": workers})
        dags = round_dags(args.seed, rnd, args.route, n)
        failing = [
            {k for i, k in d.failures().items() if d.nodes[i].op == "fail" and i in d.computed()}
            for d in dags
        ]
        tag = f"seed={args.seed} round={rnd} streams={args.streams} policy={policy} dags={n}"
        with dask.config.set(config):
            boxes, hung = run_at_once(
                [compute_of(d, kernels, scheduler) for d in dags], args.timeout
            )
            if hung:
                counts["hang"] += 1
                print(f"HANG {tag}: computes {hung}\n{fuzz.busy_stacks(12)}", flush=True)
                break  # the runtime is stuck: later rounds would say nothing new
            for j, (dag, box) in enumerate(zip(dags, boxes, strict=True)):
                others = set().union(*(failing[k] for k in range(n) if k != j))
                status, detail = classify(dag, box, others)
                counts[status] += 1
                if status not in ACCEPTED:
                    print(f"FAIL[{status}] {tag} compute {j}: {detail}", flush=True)
                    for k, d in enumerate(dags):
                        print(f"   dag {k}: {d.describe()} failing={d.failures()}", flush=True)
            good = good_dag(args.seed, rnd, args.route)
            boxes, hung = run_at_once([compute_of(good, kernels, scheduler)], args.timeout)
            status, detail = ("hang", "") if hung else classify(good, boxes[0], set())
            if status != "ok":
                counts["stuck"] += 1
                print(f"STUCK[{status}] {tag}: a good compute after it: {detail}", flush=True)
        rnd += 1
    computes = sum(counts[s] for s in (*ACCEPTED, "wrong", "unexpected"))
    bad = computes - sum(counts[s] for s in ACCEPTED)
    print(
        f"route={args.route} streams={args.streams} seed={args.seed}: {rnd} rounds, "
        f"{computes} computes, {bad} failed; {dict(sorted(counts.items()))}",
        flush=True,
    )
    return 1 if bad or counts["hang"] or counts["stuck"] else 0


if __name__ == "__main__":
    sys.exit(main())
