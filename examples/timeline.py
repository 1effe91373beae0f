"""Record on which stream each task ran, and when; write a Perfetto trace and a Gantt chart.

With ``gpustreams.timeline`` on, the runtime records two timing events per task,
so the times are device times, not Dask's enqueue times. This runs a
``dask.array`` expression on the stream launcher, checks it exactly against
NumPy, then writes ``trace.json`` (open it in https://ui.perfetto.dev or
``chrome://tracing``) and, with matplotlib (the ``[plot]`` extra), ``gantt.png``::

    python examples/timeline.py [--out .] [--streams 4] [--size 4096] [--chunk 1024]

On a cluster, pass the client: ``timeline(client)`` gathers every worker's records.
"""

from __future__ import annotations

import argparse
import os

import dask
import dask.array as da
import numpy as np

from dask_gpustreams.backends import gpu_visible
from dask_gpustreams.diagnostics import plot_gantt, saturation, timeline, to_chrome_trace


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=".", help="folder for trace.json and gantt.png")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=1024)
    args = parser.parse_args()

    if gpu_visible()[0]:
        import cupy as xp
    else:
        from dask_gpustreams import sim as xp  # the simulated device: no GPU needed

    host = np.arange(args.size**2, dtype=np.int64).reshape(args.size, args.size)
    with dask.config.set({"gpustreams.timeline": True, "gpustreams.streams": args.streams}):
        x = da.from_array(host, chunks=args.chunk).map_blocks(xp.asarray)
        y = ((x % 7) * (x.T % 5)).sum(axis=0)
        got = xp.asnumpy(y.compute(scheduler="gpustreams"))
    assert np.array_equal(got, ((host % 7) * (host.T % 5)).sum(axis=0)), "differs from NumPy"

    records = timeline()
    streams = sorted({r["stream"] for r in records})
    span = max(r["end_ms"] for r in records)
    print(f"sum {int(got.sum())}: equal to NumPy's")
    print(f"{len(records)} tasks on streams {streams} in {span:.1f} ms of device time,")
    print(f"saturation {saturation(records):.2f} (task time over wall time; above 1: overlap)")

    os.makedirs(args.out, exist_ok=True)
    trace = os.path.join(args.out, "trace.json")
    to_chrome_trace(records, trace)
    print(f"wrote {trace}: open it in https://ui.perfetto.dev")
    try:
        ax = plot_gantt(records, title=f"{len(records)} tasks on {args.streams} streams")
    except ImportError:
        print("no gantt.png: matplotlib is not installed (pip install 'dask-gpustreams[plot]')")
        return
    gantt = os.path.join(args.out, "gantt.png")
    ax.figure.savefig(gantt, dpi=100)
    print(f"wrote {gantt}")


if __name__ == "__main__":
    main()
