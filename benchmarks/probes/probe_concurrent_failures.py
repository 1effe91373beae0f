"""Random computes at once on one runtime or cluster (sim), some failing, checked exactly.

Each round draws 2-3 random DAGs of ``benchmarks.fuzz`` (delayed DAGs, most of them with
a failing node, some array DAGs, some split by a persist) and computes each from its own
thread, all started at a barrier: on one local runtime (``--route launcher`` or
``threaded``: a policy drawn per round) or on one in-process ``LocalCluster`` with the
plugin (``--route distributed``: ``--workers``, ``--threads``, ``--blocks``). A local
compute's outcome, or on a cluster each output's, must be:

- the NumPy reference's values exactly, only where it derives from no failing node (a
  local compute: where the compute runs none); or
- an error of a failing node it derives from or runs (``own``), or the ``KernelError`` of
  a failing kernel of another compute of the round (``foreign``: its work may have queued
  behind that kernel on a shared stream, which CUDA's sticky fault fails too;
  ``foreign-clean`` where its DAG runs no failing node of its own).

Anything else is a failure: a value without an error (``wrong``), an error of another
kind (``unexpected``) or a compute that does not end (``hang``). After each round, one
good compute on the same runtime or cluster must be exact (``stuck`` otherwise).

helper-99 (stop 58) found with it the wrong values that stop 59's check of every event
of a local compute during which a failure was reported removed (docs/sim.md); helper-101
(stop 59) ran the distributed route (7,608 pairs, none wrong).

    python -m benchmarks.probes.probe_concurrent_failures --route launcher --streams 4 \\
        --seed 1 --minutes 2
    python -m benchmarks.probes.probe_concurrent_failures --route distributed --streams 2 \\
        --workers 1 --threads 4 --blocks off --seed 1 --minutes 2
"""

from __future__ import annotations

import argparse
import contextlib
import logging
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
from distributed import Client, LocalCluster

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


def local_compute(dag: fuzz.Dag, kernels: fuzz.Kernels, scheduler: object) -> Callable[[], list]:
    """A compute of ``dag`` on the local ``scheduler``: its outputs' values, or it raises."""

    def compute() -> list:
        options = {"scheduler": scheduler, "optimize_graph": dag.optimize}
        outs = fuzz.build(dag, kernels, lambda xs: dask.persist(*xs, **options))
        # Read on this thread, which waits for its own streams' work only.
        return [sim.asnumpy(r) for r in dask.compute(*outs, **options)]

    return compute


def cluster_compute(
    dag: fuzz.Dag, kernels: fuzz.Kernels, client: Client, timeout: float
) -> Callable[[], list]:
    """A compute of ``dag`` on ``client``'s cluster: each output's value or exception."""

    def compute() -> list:
        options = {"optimize_graph": dag.optimize}
        outs = fuzz.build(dag, kernels, lambda xs: client.persist(xs, **options))
        outcomes: list = []
        for future in client.compute(outs, **options):
            try:
                outcomes.append(sim.asnumpy(future.result(timeout=timeout)))
            except Exception as e:  # noqa: BLE001 - the output's outcome
                outcomes.append(e)
        return outcomes

    return compute


def foreign(dag: fuzz.Dag, error: BaseException, others_kernels: set) -> str | None:
    """``foreign`` or ``foreign-clean`` if ``error`` is another compute's kernel failure.

    Counted apart where ``dag`` runs no failing node of its own: its results may have
    been right (an upload's event recorded on a stream in error), as on CUDA."""
    if not (isinstance(error, KernelError) and error.key in others_kernels):
        return None
    return "foreign" if dag.computed() & dag.failures().keys() else "foreign-clean"


def classify(dag: fuzz.Dag, box: dict, others_kernels: set, cluster: bool) -> list[tuple]:
    """``(status, detail)`` of the compute (local) or of each output (``cluster``)."""
    error = box.get("error")
    if error is not None or not cluster:
        if error is None:
            return [fuzz.check_local(dag, box["result"], None)]
        if fuzz.check_local(dag, None, error) == fuzz.OK:
            return [("own", "")]
        status = foreign(dag, error, others_kernels)
        return [(status, "") if status else ("unexpected", f"{type(error).__name__}: {error}")]
    want, tainted = fuzz.reference(dag), dag.tainted()
    statuses = []
    for i, got in zip(dag.outputs, box["result"], strict=True):
        if isinstance(got, BaseException):
            own = fuzz.blame(got, dag, i) == fuzz.OK
            status = "own" if own else foreign(dag, got, others_kernels)
            detail = "" if status else f"output {i}: {type(got).__name__}: {got}"
            statuses.append((status or "unexpected", detail))
        elif tainted[i]:
            statuses.append(("wrong", f"output {i} derives from a failing node, yet has a value"))
        else:
            problem = fuzz.compare(got, want[i])
            statuses.append(("ok", "") if problem is None else ("wrong", f"output {i}: {problem}"))
    return statuses


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


def local_config(route: str, rng: np.random.Generator) -> dict:
    """A round's settings of a local route: a policy, and Dask's thread count (threaded)."""
    config = {"gpustreams.policy": str(rng.choice(fuzz.POLICIES))}
    if route == "threaded":
        config.update({"gpustreams.enabled": True, "num_workers": int(rng.choice([1, 2, 4, 8]))})
    return config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--route", choices=["launcher", "threaded", "distributed"], required=True)
    parser.add_argument("--streams", type=int, required=True)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--minutes", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=None, help="stop after this many too")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds a round")
    parser.add_argument("--delay", type=float, default=0.002, help="kernel delay, 0 to this")
    parser.add_argument("--workers", type=int, default=1, help="distributed")
    parser.add_argument("--threads", type=int, default=2, help="distributed: a worker's")
    parser.add_argument("--blocks", choices=["auto", "off"], default="auto", help="distributed")
    parser.add_argument("--block-size", type=int, default=None, help="distributed")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore", PerformanceWarning)  # the random rechunks' chunk counts
    sim.get_device().kernel_delay = (0.0, args.delay)
    config = {"gpustreams.backend": "sim", "gpustreams.streams": args.streams}
    cluster = args.route == "distributed"
    with contextlib.ExitStack() as stack:
        client = None
        if cluster:
            for name in ("distributed", "dask_gpustreams"):  # each failed task, each recompute
                logger = logging.getLogger(name)
                stack.callback(logger.setLevel, logger.level)  # put back: main() is called
                logger.setLevel(logging.CRITICAL)
            config.update({**fuzz.CLUSTER_CONFIG, "gpustreams.enabled": True})
            config["gpustreams.blocks"] = args.blocks
            if args.block_size:
                config["gpustreams.block-size"] = args.block_size
            stack.enter_context(dask.config.set(config))
            workers = LocalCluster(
                n_workers=args.workers,
                threads_per_worker=args.threads,
                processes=False,
                dashboard_address=":0",
                silence_logs=logging.CRITICAL,
            )
            client = stack.enter_context(Client(stack.enter_context(workers)))
        counts = stress(args, config, client)
    computes = sum(counts[s] for s in (*ACCEPTED, "wrong", "unexpected"))
    bad = computes - sum(counts[s] for s in ACCEPTED)
    what = "outputs" if cluster else "computes"
    print(
        f"route={args.route} streams={args.streams} seed={args.seed}: {counts['rounds']} "
        f"rounds, {computes} {what}, {bad} failed; {dict(sorted(counts.items()))}",
        flush=True,
    )
    return 1 if bad or counts["hang"] or counts["stuck"] else 0


def stress(args: argparse.Namespace, config: dict, client: Client | None) -> Counter:
    """The rounds of :func:`main` until ``args.minutes`` have passed (or ``args.rounds`` ran); the
    outcomes' counts."""
    kernels = fuzz.make_kernels("sim")

    def computes(dags: list[fuzz.Dag]) -> list[Callable[[], list]]:
        if client is not None:
            return [cluster_compute(d, kernels, client, args.timeout) for d in dags]
        scheduler = dask.threaded.get if args.route == "threaded" else "gpustreams"
        return [local_compute(d, kernels, scheduler) for d in dags]

    end = time.monotonic() + 60 * args.minutes
    counts: Counter = Counter()
    rnd = 0
    while time.monotonic() < end and rnd != args.rounds:
        rng = np.random.default_rng([args.seed, rnd, 1000])
        n = int(rng.choice([2, 2, 3]))
        round_config = config if client is not None else {**config, **local_config(args.route, rng)}
        dags = round_dags(args.seed, rnd, args.route, n)
        failing = [
            {k for i, k in d.failures().items() if d.nodes[i].op == "fail" and i in d.computed()}
            for d in dags
        ]
        tag = f"seed={args.seed} round={rnd} streams={args.streams} dags={n}"
        with dask.config.set(round_config):
            boxes, hung = run_at_once(computes(dags), args.timeout)
            if hung:
                counts["hang"] += 1
                print(f"HANG {tag}: computes {hung}\n{fuzz.busy_stacks(12)}", flush=True)
                break  # the runtime is stuck: later rounds would say nothing new
            for j, (dag, box) in enumerate(zip(dags, boxes, strict=True)):
                others = set().union(*(failing[k] for k in range(n) if k != j))
                for status, detail in classify(dag, box, others, client is not None):
                    counts[status] += 1
                    if status not in ACCEPTED:
                        print(f"FAIL[{status}] {tag} compute {j}: {detail}", flush=True)
                        for k, d in enumerate(dags):
                            print(f"   dag {k}: {d.describe()} failing={d.failures()}", flush=True)
            good = good_dag(args.seed, rnd, args.route)
            boxes, hung = run_at_once(computes([good]), args.timeout)
            on_cluster = client is not None
            statuses = [("hang", "")] if hung else classify(good, boxes[0], set(), on_cluster)
            if any(status != "ok" for status, _ in statuses):
                counts["stuck"] += 1
                print(f"STUCK {tag}: a good compute after it: {statuses}", flush=True)
        rnd += 1
        counts["rounds"] = rnd
    return counts


if __name__ == "__main__":
    sys.exit(main())
