"""Values a task gets from a client inside its worker (``integrations/distributed/gathered.py``).

On the simulated device, in-process clusters of one worker. Kept apart from
``tests/test_distributed.py``: with that module's cluster still alive, ``Client.gather``
of a ``Future`` made inside a task waited for ever (seen, not investigated).
"""

from __future__ import annotations

import time

import dask
import numpy as np
import pytest
from dask import delayed
from distributed import Future, wait, worker_client

from dask_gpustreams import sim
from tests.test_distributed import add, cluster, produce


def read_through_a_client(x, i, how, inner_delay, read_delay):
    """``x`` plus a value (key ``inner-i``, 1.0) computed through ``worker_client`` and got by
    ``how`` (``result`` or ``gather``), read by a kernel on this task's stream after
    ``read_delay`` seconds; the inner key is released before this task returns."""
    with worker_client() as c:
        future = c.compute(delayed(produce)(x.size, 1.0, inner_delay, dask_key_name=f"inner-{i}"))
        y = future.result() if how == "result" else c.gather(future)
        del future
    return add(x, y, read_delay)


def after_a_while(n):
    """A block of ``n`` sevens, allocated once the inner key above has been released."""
    time.sleep(0.2)
    return produce(n, 7.0, 0.0)


def downloaded(a, _):
    return sim.asnumpy(a)


@pytest.mark.parametrize("how", ["result", "gather"])
@pytest.mark.parametrize("hazard", ["lifetime", "order"])
def test_a_value_got_from_a_client_inside_a_task_is_ordered_and_held(by_key, how, hazard):
    """The inner key runs on stream 1, the task reading it on stream 0. "order": the inner
    kernel is slow, so a read not ordered after it finds poison. "lifetime": the read is
    slow, and a task on stream 1 allocates a block of the inner value's size once the
    inner key is gone from the worker (its 7s would be read). Exact, twice."""
    inner_delay, read_delay = (0.3, 0.0) if hazard == "order" else (0.0, 0.5)
    config = {"gpustreams.streams": 2, "gpustreams.policy": "test-placement"}
    with cluster(n_workers=1, config={**config, "gpustreams.blocks": "off"}):
        for i in range(2):  # (no device array kept here: it would outlive the worker)
            by_key.update({f"outer-{i}": 0, f"inner-{i}": 1, f"fast-{i}": 1})
            x = delayed(produce)(1024, 2.0, 0.0, dask_key_name=f"x-{i}")
            task = delayed(read_through_a_client)(
                x, i, how, inner_delay, read_delay, dask_key_name=f"outer-{i}"
            )
            fast = delayed(after_a_while)(1024, dask_key_name=f"fast-{i}")
            got = delayed(downloaded)(task, fast, dask_key_name=f"get-{i}").compute()
            np.testing.assert_array_equal(got, np.full(1024, 3.0))


def doubled_from_the_worker(key):
    """Twice the value of ``key``, gathered from this task's worker (its own memory, as is)."""
    with worker_client() as client:
        y = client.gather(Future(key, client))
    return add(y, y)


def through_a_local_compute(key):
    (got,) = dask.compute(delayed(doubled_from_the_worker)(key), scheduler="sync")
    return sim.asnumpy(got)


def test_a_key_gathered_inside_a_local_compute_in_a_task_is_ordered():
    """The gathering task runs on a local compute's runtime, the key's kernel (0.3 s) on
    the worker's: the wait covers every runtime of the process. Exact, 3 times."""
    config = {"gpustreams.enabled": True, "gpustreams.blocks": "off"}
    with cluster(n_workers=1, config=config) as client:
        for _ in range(3):
            future = client.submit(produce, 4096, 1.0, 0.3, pure=False)
            wait(future)  # the task has returned; its kernel still runs
            got = client.submit(through_a_local_compute, future.key, pure=False).result()
            np.testing.assert_array_equal(got, np.full(4096, 2.0))
