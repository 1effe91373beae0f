"""The cost of ``StreamBlocks``' wrapper of the scheduler's ``_transition`` (split.py).

``python -m benchmarks.bench_split_cost call``: ns per call of ``_transition``, bare and
wrapped, on a transition that changes nothing (the key is in the finish state already:
the wrapper's cost stands out most). ``python -m benchmarks.bench_split_cost graph``: a
5,000-task no-op graph on ``LocalCluster(processes=False)`` with the plugin, best of 5
after a warm-up, with the wrapper taken off and put on again in turn.
"""

from __future__ import annotations

import asyncio
import functools
import sys
import time
import timeit

import dask
from distributed import Client, LocalCluster
from distributed.scheduler import Scheduler

from dask_gpustreams import StreamsPlugin
from dask_gpustreams.integrations.distributed.blocks import StreamBlocks


def noop() -> int:
    return 0


async def _per_call(number: int = 200_000) -> dict[str, float]:
    scheduler = await Scheduler(dashboard_address=":0", validate=False)
    try:
        plugin = StreamBlocks()
        plugin.scheduler = scheduler
        bare = scheduler._transition
        wrapped = functools.partial(plugin._transition, bare)
        scheduler.new_task("k", None, "released")
        ns: dict[str, float] = {}
        for name, call in (("bare", bare), ("wrapped", wrapped)) * 2:
            best = min(timeit.repeat(lambda c=call: c("k", "released", "s"), number=number))
            ns[name] = best / number * 1e9
        return ns
    finally:
        await scheduler.close()


def _wrap(dask_scheduler: Scheduler, on: bool) -> None:
    """Put the plugin's wrapper of ``_transition`` on the scheduler, or take it off."""
    transition = dask_scheduler._transition
    bare = transition.args[0] if isinstance(transition, functools.partial) else transition
    plugin = dask_scheduler.plugins["gpustreams-blocks"]
    dask_scheduler._transition = functools.partial(plugin._transition, bare) if on else bare


def graph_seconds(tasks: int = 5000, runs: int = 5) -> dict[str, float]:
    """Best of ``runs`` of a ``tasks``-task no-op graph, bare and wrapped, alternating on
    one cluster (after a warm-up), so that both see the same machine over time."""
    config = {"gpustreams.backend": "sim", "distributed.scheduler.validate": False}
    with (
        dask.config.set(config),
        LocalCluster(n_workers=1, processes=False, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        client.register_plugin(StreamsPlugin())
        times: dict[str, list[float]] = {"bare": [], "wrapped": []}
        for run in range(runs + 1):
            for name in times:
                client.run_on_scheduler(_wrap, on=name == "wrapped")
                dsk = {("noop", name, run, i): (noop,) for i in range(tasks)}
                start = time.perf_counter()
                client.get(dsk, list(dsk))
                if run:  # the first is a warm-up
                    times[name].append(time.perf_counter() - start)
        return {name: min(t) for name, t in times.items()}


def main() -> None:
    if sys.argv[1:] == ["call"]:
        ns = asyncio.run(_per_call())
        print(f"_transition: {ns['bare']:.0f} ns bare, {ns['wrapped']:.0f} ns wrapped")
    else:
        best = graph_seconds()
        bare, wrapped = best["bare"], best["wrapped"]
        print(f"5,000 no-op tasks, best of 5: {bare:.3f} s bare, {wrapped:.3f} s wrapped")


if __name__ == "__main__":
    main()
