"""Fine performance metrics of workers: launch time and egress waits (``context_meter``)."""

from __future__ import annotations

import time

import dask
from distributed import Client, LocalCluster

from dask_gpustreams import StreamsPlugin, sim
from dask_gpustreams.diagnostics.fine_metrics import LAUNCH, WAIT
from tests.sim_tasks import SIM_CLUSTER, ones, slow_inc

CONFIG = SIM_CLUSTER


def _digests(dask_worker):
    return [(k, v) for k, v in dask_worker.digests_total.items() if isinstance(k, tuple)]


def test_fine_performance_metrics_of_launch_and_egress_waits():
    with (
        dask.config.set(CONFIG),
        LocalCluster(
            n_workers=1, threads_per_worker=2, processes=False, dashboard_address=":0"
        ) as lc,
        Client(lc) as client,
    ):
        client.register_plugin(StreamsPlugin())
        x = client.submit(ones, 8, key="ones-1")
        y = client.submit(slow_inc, x, 0.3, key="slow_inc-1")
        assert sim.asnumpy(y.result()).tolist() == [2.0] * 8
        (digests,) = client.run(_digests).values()
        launch = {k[2]: v for k, v in digests if k[0] == "execute" and k[3] == LAUNCH}
        assert set(launch) == {"ones", "slow_inc"}
        assert all(0 < v < 0.3 for v in launch.values())  # enqueueing, not the kernel
        waits = dict(digests).get(("get-data", WAIT, "seconds"), 0)
        assert 0.15 < waits < 5  # the gather waited for the kernel

        # The scheduler aggregates them with distributed's own.
        def scheduler_metrics(dask_scheduler):
            return dict(dask_scheduler.cumulative_worker_metrics)

        deadline = time.monotonic() + 10
        while True:
            on_scheduler = client.run_on_scheduler(scheduler_metrics)
            if ("get-data", WAIT, "seconds") in on_scheduler:
                break
            assert time.monotonic() < deadline, sorted(map(str, on_scheduler))
            time.sleep(0.1)
        assert any(k[0] == "execute" and LAUNCH in k for k in on_scheduler if isinstance(k, tuple))
