"""The command-line routes: a real ``dask scheduler`` and ``dask worker`` on localhost.

The workers get the sim backend through the environment
(``DASK_GPUSTREAMS__BACKEND=sim``); this process has ``gpustreams.enabled``
unset, so its client installs nothing: the plugin comes from the preloads.
"""

from __future__ import annotations

import sys
import time

import cloudpickle
import numpy as np
from distributed import Client

from dask_gpustreams import sim

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _fill(out, value, delay):
    time.sleep(delay)
    out[...] = value


def produce(n, value, delay):
    out = sim.empty(n)
    sim.launch(_fill, out, value, delay)
    return out


def inc(a):
    out = sim.empty(a.shape)
    sim.launch(np.add, a, 1.0, out=out)
    return out


def has_plugin(dask_worker):
    return "gpustreams" in dask_worker.plugins


def on_pool_stream():
    device = sim.get_device()
    return device.current_stream() is not device.default_stream


def test_dask_worker_preload(dask_cli):
    dask_cli("scheduler", "--no-dashboard", "--port", "0")
    scheduler_file = dask_cli(
        "worker", "--nworkers", "2", "--nthreads", "2", "--no-dashboard",
        "--preload", "dask_gpustreams",
    )  # fmt: skip
    with Client(scheduler_file=scheduler_file, timeout=30) as client:
        client.wait_for_workers(2, timeout=30)
        assert all(client.run(has_plugin).values())
        a, b = sorted(client.scheduler_info()["workers"])
        for i in range(5):
            x = client.submit(produce, 1000, float(i), 0.05, workers=[a], pure=False)
            y = client.submit(inc, x, workers=[b], pure=False)
            np.testing.assert_array_equal(sim.asnumpy(y.result()), np.full(1000, i + 1.0))
        assert client.submit(on_pool_stream, pure=False).result()


def test_dask_scheduler_preload_reaches_workers_that_join_later(dask_cli):
    dask_cli("scheduler", "--no-dashboard", "--port", "0", "--preload", "dask_gpustreams")
    scheduler_file = dask_cli("worker", "--nthreads", "1", "--no-dashboard")
    with Client(scheduler_file=scheduler_file, timeout=30) as client:
        client.wait_for_workers(1, timeout=30)
        dask_cli("worker", "--nthreads", "1", "--no-dashboard")
        client.wait_for_workers(2, timeout=30)
        assert list(client.run(has_plugin).values()) == [True, True]
        assert all(client.gather(client.map(lambda i: on_pool_stream(), range(4))))
