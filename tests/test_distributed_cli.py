"""The command-line routes: a real ``dask scheduler`` and ``dask worker`` on localhost.

The workers get the sim backend through the environment
(``DASK_GPUSTREAMS__BACKEND=sim``); this process has ``gpustreams.enabled``
unset, so its client installs nothing: the plugin comes from the preloads.
Preload options (``--streams 2``) and bad settings (in a process's
environment or its options) on each route, issue 12 problems 4, 7 and the
preload arguments: bad ones fail the tasks with an error naming them.
"""

from __future__ import annotations

import json
import re
import sys
import time

import click
import cloudpickle
import numpy as np
import pytest
from distributed import Client
from distributed.cli import dask_worker

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


def plugin_streams(dask_worker):
    """(streams, policy) of the worker's plugin settings."""
    config = dask_worker.plugins["gpustreams"].config
    return config.streams, config.policy


def by_name(client):
    return {w["name"]: a for a, w in client.scheduler_info()["workers"].items()}


def address(scheduler_file):
    with open(scheduler_file) as f:
        return json.load(f)["address"]


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
    dask_cli(
        "scheduler", "--no-dashboard", "--port", "0",
        "--preload", "dask_gpustreams", "--streams", "2", "--policy", "round-robin",
    )  # fmt: skip
    scheduler_file = dask_cli("worker", "--nthreads", "1", "--no-dashboard")
    with Client(scheduler_file=scheduler_file, timeout=30) as client:
        client.wait_for_workers(1, timeout=30)
        dask_cli("worker", "--nthreads", "1", "--no-dashboard")
        client.wait_for_workers(2, timeout=30)
        assert list(client.run(has_plugin).values()) == [True, True]
        assert all(client.gather(client.map(lambda i: on_pool_stream(), range(4))))
        assert list(client.run(plugin_streams).values()) == [(2, "round-robin")] * 2


def test_dask_worker_preload_options_and_bad_settings_fail_the_tasks_naming_them(dask_cli):
    scheduler_file = dask_cli("scheduler", "--no-dashboard", "--port", "0")
    # The address first: dask worker reads its first unknown argument as the address.
    worker = ("worker", address(scheduler_file), "--nthreads", "1", "--no-dashboard", "--no-nanny")
    preload = ("--preload", "dask_gpustreams")
    # dask-cuda passes --create-cuda-context to every preload: ignored.
    dask_cli(*worker, "--name", "good", *preload, "--streams", "2", "--policy", "round-robin",
             "--create-cuda-context")  # fmt: skip
    dask_cli(*worker, "--name", "bad-value", *preload, env={"DASK_GPUSTREAMS__STREAMS": "abc"})
    dask_cli(*worker, "--name", "unknown-key", *preload, env={"DASK_GPUSTREAMS__STREAM": "4"})
    dask_cli(*worker, "--name", "bad-option", *preload, "--stream", "2")
    with Client(scheduler_file=scheduler_file, timeout=30) as client:
        client.wait_for_workers(4, timeout=60)  # the workers with bad settings join too
        workers = by_name(client)
        good = workers["good"]
        assert client.submit(on_pool_stream, workers=[good], pure=False).result()
        assert client.run(plugin_streams, workers=[good]) == {good: (2, "round-robin")}

        errors = {
            "bad-value": "gpustreams.streams='abc' is invalid: allowed values are an int >= 1 "
            "and <= 128",
            "unknown-key": "unknown configuration key gpustreams.stream=4; did you mean "
            "gpustreams.streams? known keys: ",
            "bad-option": "preload argument: No such option '--stream'. (Did you mean one of: "
            "'--copy-streams', '--host-threads', '--streams'?)",
        }
        for name, error in errors.items():
            message = f"gpustreams cannot start on worker {workers[name]}: {error}"
            for _ in range(2):  # every task, not only the first
                future = client.submit(on_pool_stream, workers=[workers[name]], pure=False)
                with pytest.raises(ValueError, match="^" + re.escape(message)):
                    future.result()


def test_dask_scheduler_preload_with_a_bad_scheduler_config_fails_the_tasks(dask_cli):
    dask_cli("scheduler", "--no-dashboard", "--port", "0", "--preload", "dask_gpustreams",
             env={"DASK_GPUSTREAMS__STREAMS": "0"})  # fmt: skip
    scheduler_file = dask_cli("worker", "--nthreads", "1", "--no-dashboard", "--no-nanny")
    with Client(scheduler_file=scheduler_file, timeout=30) as client:
        client.wait_for_workers(1, timeout=30)
        [worker] = by_name(client).values()
        message = (
            f"gpustreams cannot start on worker {worker}: the scheduler's config: "
            "gpustreams.streams=0 is invalid: allowed values are an int >= 1 and <= 128"
        )
        with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
            client.submit(on_pool_stream, pure=False).result()


@pytest.mark.parametrize("argv", [["--streams=2"], ["--streams", "2"], ["--preload-argv", "-x"]])
def test_a_preload_option_read_as_the_scheduler_address_is_a_usage_error(argv, tmp_path):
    args = ["--scheduler-file", str(tmp_path / "none.json"), "--preload", "dask_gpustreams"]
    message = f"{argv[0]!r} was read as the scheduler address, not as an option of --preload"
    with pytest.raises(click.UsageError, match="^" + re.escape(message)):
        dask_worker.main([*args, *argv], standalone_mode=False)  # the command line's parse
