"""The per-GPU timeline of one run of the wide shapes on a cluster: one Gantt row per (GPU, stream).

Run from the repository root (see ``benchmarks/README.md``)::

    python -m benchmarks.gantt_cluster --backend cupy --workers 2      # LocalCUDACluster, 2 GPUs
    python -m benchmarks.gantt_cluster --backend sim --workers 2 --depth 4 --kernel-ms 4

The cluster has ``--workers`` workers: with ``cupy`` a ``dask_cuda.LocalCUDACluster`` (one
worker per GPU), with ``sim`` a ``LocalCluster`` of worker processes (each with its own
simulated device, so the timeline tells the workers apart). The plugin runs with
``timeline=True`` and ``--blocks`` (stream blocks, default ``auto``). For each of ``--shapes``
(the wide shapes of ``bench_shapes``, 8 ms busy kernels by default) one warm-up run, then one
recorded run; its results are checked exactly against the NumPy reference.

Each record's worker is named ``w<i>`` and its device is the worker's physical GPU (the
first entry of the ``CUDA_VISIBLE_DEVICES`` that dask-cuda gives each worker; on the sim the
worker's index), so the Gantt rows read ``w0 dev 0 stream 3``. Per shape and GPU it prints
the keys and records (a stream block's getters run on the worker's event loop and leave
no record), their device time and the share of the run's span during
which that GPU was busy, and how long both GPUs were busy at once. A graph whose tasks all
ran on one GPU is reported ``SERIALIZED``, one with more than 90% of its task time on one
GPU ``ONE-SIDED``; the exit status is then 1 (2 for a wrong result).

Outputs in ``--out``: ``gantt.png`` (one panel per shape), ``trace_<shape>.json`` (Perfetto),
``records.json`` and ``summary.txt``.
"""

from __future__ import annotations

import os

os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")  # 16 streams need the queues

import argparse
import json
import sys
import time
from typing import Any

from benchmarks import bench_shapes, kernels
from benchmarks.shapes import WIDE, wide_shape
from benchmarks.workloads import spin_workload
from dask_gpustreams.backends import create_backend, resolve_backend
from dask_gpustreams.config import BLOCKS
from dask_gpustreams.diagnostics import clear_timeline, plot_gantt, timeline, to_chrome_trace


def _physical_gpu() -> str | None:
    """On a worker: its GPU as the host numbers it (dask-cuda rotates CUDA_VISIBLE_DEVICES)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",")[0].strip() if visible else None


def make_cluster(args: argparse.Namespace, backend: str) -> tuple[Any, str]:
    extra = {} if args.protocol is None else {"protocol": args.protocol}
    shown = "" if args.protocol is None else f", protocol={args.protocol!r}"
    if backend == "cupy":
        from dask_cuda import LocalCUDACluster

        cluster = LocalCUDACluster(
            n_workers=args.workers,
            threads_per_worker=args.threads,
            dashboard_address=None,
            **extra,
        )
        kind = "LocalCUDACluster("
    else:
        from distributed import LocalCluster

        cluster = LocalCluster(
            n_workers=args.workers,
            threads_per_worker=args.threads,
            processes=True,
            dashboard_address=None,
            **extra,
        )
        kind = "LocalCluster(processes=True, "
    described = f"{kind}n_workers={args.workers}, threads_per_worker={args.threads}{shown})"
    return cluster, described


def relabel(records: list[dict], gpus: dict[str, Any]) -> list[dict]:
    """Records with ``worker`` = ``w<i>`` and ``device`` = the worker's physical GPU
    (``gpus``: address -> GPU or None; None, as on the sim: the worker's index)."""
    order = sorted(gpus)
    out = []
    for r in records:
        address = r["worker"]
        if address not in gpus:
            out.append(r)
            continue
        i = order.index(address)
        gpu = gpus[address]
        out.append(dict(r, worker=f"w{i}", device=i if gpu is None else gpu))
    return out


def busy_ms(spans: list[tuple[float, float]]) -> float:
    """The length of the union of ``(start, end)`` intervals."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(spans):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Milliseconds during which both unions of intervals are busy."""
    both = busy_ms(a) + busy_ms(b) - busy_ms(a + b)
    return max(0.0, both)


def per_gpu(records: list[dict]) -> dict:
    """Per (worker, GPU): tasks, device time, busy share of the span; both-busy time."""
    if not records:
        return {"span_ms": 0.0, "gpus": {}, "both_busy_ms": None}
    t0 = min(r["start_ms"] for r in records)
    span = max(r["end_ms"] for r in records) - t0
    spans: dict[str, list[tuple[float, float]]] = {}
    streams: dict[str, set] = {}
    for r in records:
        g = f"{r['worker']} dev {r['device']}"
        spans.setdefault(g, []).append((r["start_ms"], r["end_ms"]))
        streams.setdefault(g, set()).add(r["stream"])
    keys: dict[str, set] = {}
    for r in records:
        keys.setdefault(f"{r['worker']} dev {r['device']}", set()).add(str(r["key"]))
    gpus = {
        g: {
            "records": len(s),
            "tasks": len(keys[g]),
            "streams_used": len(streams[g]),
            "task_ms": sum(e - b for b, e in s),
            "busy_ms": busy_ms(s),
            "busy_share": busy_ms(s) / span if span > 0 else None,
        }
        for g, s in sorted(spans.items())
    }
    names = sorted(spans)
    both = intersect(spans[names[0]], spans[names[1]]) if len(names) == 2 else None
    return {"span_ms": span, "gpus": gpus, "both_busy_ms": both}


#: A GPU with more than this share of the run's task time makes the run ONE-SIDED.
ONE_SIDED = 0.9


def judge(summary: dict, workers: int) -> str:
    """``ok``, or why the run was not spread over the GPUs (``SERIALIZED``, ``ONE-SIDED``)."""
    gpus = summary["gpus"]
    if workers < 2:
        return "ok"
    if len(gpus) < 2:
        return "SERIALIZED onto one GPU"
    total = sum(s["task_ms"] for s in gpus.values())
    top = max(gpus, key=lambda g: gpus[g]["task_ms"])
    share = gpus[top]["task_ms"] / total if total > 0 else 1.0
    if share > ONE_SIDED:
        return f"ONE-SIDED: {share:.0%} of the task time on {top}"
    return "ok"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.gantt_cluster", description=__doc__.split("\n", 1)[0]
    )
    p.add_argument("--backend", default="auto", choices=("auto", "cupy", "sim"))
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--protocol", default=None, help="the cluster's protocol (tcp, ucx, ...)")
    p.add_argument("--shapes", default=",".join(WIDE))
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--depth", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kernel-ms", type=float, default=8.0)
    p.add_argument("--streams", type=int, default=16, help="per worker")
    p.add_argument("--threads", type=int, default=16, help="per worker")
    p.add_argument("--policy", default="auto")
    p.add_argument("--blocks", default="auto", choices=BLOCKS)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    args.shapes = [s for s in args.shapes.split(",") if s]
    bad = [s for s in args.shapes if s not in WIDE]
    if bad:
        p.error(f"unknown shapes {bad}; choose from {', '.join(WIDE)}")
    return args


def main(argv: list[str] | None = None) -> int:
    from distributed import Client

    from dask_gpustreams.integrations.distributed import StreamsPlugin

    args = parse_args(argv)
    backend = resolve_backend(args.backend)
    out = bench_shapes.out_dir(args, f"gantt-{backend}")
    device = create_backend(backend)
    spin, ms = kernels.calibrate_spin(device, args.kernel_ms, kernels.default_blocks(backend))
    print(f"busy kernel: target {args.kernel_ms} ms -> {ms:.3f} ms alone; writing to {out}")
    cluster, described = make_cluster(args, backend)
    print(described, flush=True)
    panels, summaries, all_records, status = [], {}, [], 0
    with cluster, Client(cluster) as client:
        gpus = client.run(_physical_gpu)
        print("workers and their GPUs:", json.dumps(gpus))
        client.register_plugin(
            StreamsPlugin(
                backend=backend,
                streams=args.streams,
                policy=args.policy,
                timeline=True,
                blocks=args.blocks,
            )
        )
        for name in args.shapes:
            wl = spin_workload(
                wide_shape(name, args.width, args.depth, args.seed), backend, spin, ms
            )
            keys = list(wl.sources)
            futures = client.scatter([wl.sources[k] for k in keys], hash=False)
            sources = dict(zip(keys, futures, strict=True))
            for run in ("warm-up", "recorded"):
                clear_timeline(client)
                dsk, outputs = wl.graph(f"{run}-{time.monotonic_ns()}", sources=sources)
                t0 = time.perf_counter()
                results = client.get(dsk, outputs)
                wall = (time.perf_counter() - t0) * 1e3
                problem = wl.check(results)
                del results
                if problem is not None:
                    break
            records = relabel(timeline(client), gpus)
            summary = per_gpu(records)
            summary.update(wall_ms=wall, problem=problem, tasks=wl.shape.n_tasks)
            verdict = judge(summary, args.workers)
            if problem is not None:
                verdict, status = f"WRONG RESULT: {problem}", 2
            elif verdict != "ok":
                status = max(status, 1)
            summary["verdict"] = verdict
            summaries[name] = summary
            all_records += [dict(r, shape=name) for r in records]
            to_chrome_trace(records, os.path.join(out, f"trace_{name}.json"))
            panels.append((name, records, summary))
            lines = [
                f"{name}: {wl.shape.n_tasks} tasks, wall {wall:.1f} ms, {len(records)} records, "
                f"span {summary['span_ms']:.1f} ms"
                + (
                    f", both GPUs busy {summary['both_busy_ms']:.1f} ms"
                    if summary["both_busy_ms"] is not None
                    else ""
                )
                + f": {verdict}"
            ]
            for g, s in summary["gpus"].items():
                share = s["busy_share"]
                lines.append(
                    f"  {g}: {s['tasks']} keys ({s['records']} records) on "
                    f"{s['streams_used']} streams, "
                    f"{s['task_ms']:.1f} ms of task time, busy {s['busy_ms']:.1f} ms"
                    + (f" ({share:.0%} of the span)" if share is not None else "")
                )
            print("\n".join(lines), flush=True)
            client.cancel(futures)
    with open(os.path.join(out, "records.json"), "w") as f:
        json.dump({"cluster": described, "args": vars(args), "records": all_records}, f)
    with open(os.path.join(out, "summary.txt"), "w") as f:
        json.dump({"cluster": described, "kernel_ms": ms, "shapes": summaries}, f, indent=1)
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        print(f"gantt.png skipped: {e}")
        return status
    tracks = max(
        (len({(r["worker"], r["device"], r["stream"]) for r in rs}) for _, rs, _ in panels),
        default=1,
    )
    fig = Figure(figsize=(13, (1.0 + 0.22 * tracks) * len(panels)), layout="constrained")
    axes = fig.subplots(len(panels), 1, squeeze=False).ravel()
    for ax, (name, records, summary) in zip(axes, panels, strict=True):
        plot_gantt(
            records,
            ax=ax,
            title=f"wide {name} · {args.workers} workers · {args.streams} streams each · "
            f"blocks {args.blocks} · {summary['verdict']}",
        )
        leg = ax.get_legend()
        if leg is not None:
            leg.remove()
    fig.savefig(os.path.join(out, "gantt.png"), dpi=90)
    print(f"wrote {os.path.join(out, 'gantt.png')}")
    return status


if __name__ == "__main__":
    sys.exit(main())
