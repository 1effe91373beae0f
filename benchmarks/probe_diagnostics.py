"""The diagnostics on a real device: NVTX's cost per task, and what a worker shows mid-run.

1. NVTX: the launcher's host cost per no-op task (``scheduler="gpustreams"``, wide graph
   of ``--tasks`` tasks, median of ``--repeats``) with ``gpustreams.nvtx`` off and on,
   side by side in one run.
2. A one-worker cluster (``LocalCUDACluster`` if dask-cuda imports, else ``LocalCluster``)
   with the plugin: while a graph of busy kernels runs, the worker's ``/metrics`` (its
   ``dask_worker_gpustreams_*`` lines) and ``dask_gpustreams.status(client)``; after it,
   the same again, and the task count checked against the graph's.
3. With bokeh installed, the scheduler's ``/gpustreams`` page: listed in ``/sitemap.json``,
   opened, then the same graph again, and the bars, rows and busy fractions that its
   session shows (the page times tasks only while it is open).

::

    python -m benchmarks.probe_diagnostics --backend cupy
    python -m benchmarks.probe_diagnostics --backend sim --tasks 2000
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import dask
import numpy as np

import dask_gpustreams
from benchmarks import kernels


def _noop(*args):
    return args[0] if args else None


def nvtx_cost(backend: str, tasks: int, repeats: int) -> None:
    """Microseconds per no-op task through the launcher, NVTX off against on."""
    print(f"== launcher, {tasks} no-op tasks, median of {repeats}: NVTX off / on ==")
    for nvtx in (False, True, False, True):
        walls = []
        for r in range(repeats):
            src = ("nv-src", nvtx, r)
            dsk = {src: (kernels.to_device, backend, kernels.source(r, 16))}
            dsk.update({("nv", nvtx, r, i): (_noop, src) for i in range(tasks)})
            keys = [k for k in dsk if k != src]
            with dask.config.set({"gpustreams.backend": backend, "gpustreams.nvtx": nvtx}):
                t0 = time.perf_counter()
                dask_gpustreams.get(dsk, keys)
                walls.append(time.perf_counter() - t0)
        print(f"nvtx={nvtx!s:5} {statistics.median(walls) / tasks * 1e6:7.1f} us/task", flush=True)


def _metrics(address: str) -> list[str]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        text = response.read().decode()
    return [line for line in text.splitlines() if line.startswith("dask_worker_gpustreams")]


def cluster_view(backend: str, kernel_ms: float, tasks: int) -> None:
    """``/metrics`` and ``status(client)`` of a worker while a graph runs, and after it."""
    from distributed import Client, LocalCluster, wait

    try:
        from dask_cuda import LocalCUDACluster

        cluster = LocalCUDACluster(n_workers=1, dashboard_address=":0")
    except ImportError:
        cluster = LocalCluster(n_workers=1, threads_per_worker=1, dashboard_address=":0")
    with cluster, Client(cluster) as client:
        client.register_plugin(dask_gpustreams.StreamsPlugin(backend=backend))
        info = client.scheduler_info()["workers"]
        worker = next(iter(info.values()))
        address = f"{worker['host']}:{worker['services']['dashboard']}"
        from dask_gpustreams.backends import create_backend

        spin, _ = kernels.calibrate_spin(create_backend(backend), kernel_ms, 5)
        host = kernels.source(0, spin.size)
        src = dask.delayed(kernels.to_device, name="diag-src")(backend, host)
        outs = [dask.delayed(spin)(i, src, dask_key_name=f"spin-{i}") for i in range(tasks)]
        futures = client.compute(outs)
        wait(futures[len(futures) // 4])  # a quarter into the run, to look at it
        print("== worker /metrics, during the run ==")
        print("\n".join(_metrics(address)))
        print(dask_gpustreams.status(client))
        wait(futures)
        results = client.gather(futures)
        exact = all(
            np.array_equal(kernels.to_host(backend, r), kernels.mix(i, host))
            for i, r in enumerate(results)
        )
        print("== after the run ==")
        lines = _metrics(address)
        print("\n".join(lines))
        print(dask_gpustreams.status(client))
        total = [ln for ln in lines if ln.startswith("dask_worker_gpustreams_tasks_total")]
        print(f"results exact: {exact}; tasks submitted: {tasks}; {total}")
        with _page(cluster) as page:  # timing starts with the page: a second graph, timed
            again = [dask.delayed(spin)(i, src, dask_key_name=f"again-{i}") for i in range(tasks)]
            wait(client.compute(again))
            _show(page, tasks)


@contextlib.contextmanager
def _page(cluster: Any) -> Iterator[Any]:
    """The ``/gpustreams`` page's server-side document while a browser session is open."""
    try:
        from bokeh.client import pull_session
    except ImportError:
        print("== dashboard page: bokeh is not installed ==")
        yield None
        return
    from dask_gpustreams.diagnostics.dashboard import ROUTE

    port = cluster.scheduler.http_server.port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/sitemap.json", timeout=10) as r:
        print(f"== dashboard page: {ROUTE} in /sitemap.json: {ROUTE in json.load(r)['paths']} ==")
    with pull_session(url=f"http://127.0.0.1:{port}{ROUTE}"):
        apps = cluster.scheduler.http_application.applications
        (app,) = [a for a in apps if ROUTE in a.app_paths]
        (session,) = app.get_sessions(ROUTE)
        (page,) = session.document.components
        deadline = time.monotonic() + 10
        while "no workers yet" in page.header.text and time.monotonic() < deadline:
            time.sleep(0.1)  # until the page's first poll has turned timing on at the workers
        yield page


def _show(page: Any, expected: int, timeout: float = 10.0) -> None:
    """Print what the page shows once it has ``expected`` bars (or after ``timeout``)."""
    if page is None:
        return
    deadline = time.monotonic() + timeout
    while len(page.tasks.data["key"]) < expected and time.monotonic() < deadline:
        time.sleep(0.1)  # the page polls the workers on its own period
    busy = ", ".join(f"{b:.2f}" for b in page.busy.data["busy"])
    print(f"bars {len(page.tasks.data['key'])} (at least {expected} expected)")
    print(f"rows {list(page.y_range.factors)}; busy {busy}")
    print(f"header: {page.header.text}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="cupy", choices=("cupy", "sim"))
    p.add_argument("--tasks", type=int, default=10_000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kernel-ms", type=float, default=20.0)
    p.add_argument("--cluster-tasks", type=int, default=64)
    a = p.parse_args(argv)
    if a.backend == "cupy":
        nvtx_cost(a.backend, a.tasks, a.repeats)
    cluster_view(a.backend, a.kernel_ms, a.cluster_tasks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
