"""Two local computes at once on one runtime (sim, one stream): a kernel failure of one
that the other's sync reports first still fails what derives from it, or was skipped
behind it (found by helper-92's fuzzing of concurrent computes).

Before, the compute whose results derive from the failure, or whose kernels were skipped
behind it, returned NaN with no error: the final wait (``StreamRuntime.synchronize``)
raised only a failure no sync had reported yet, where the sim's other thread had.
"""

from __future__ import annotations

import threading

import dask
import dask.threaded
import numpy as np
import pytest
from dask import delayed

from dask_gpustreams import KernelError, host_task, sim

WAIT = 10.0  # seconds; a gate not opened by then fails the test, never hangs it


def _gated_boom(out, a, started, gate):
    started.set()
    gate.wait(WAIT)
    raise ValueError("boom")


def gated_fail(a, started, gate):
    out = sim.empty(a.shape)
    sim.launch(_gated_boom, out, a, started, gate)
    return out


def inc(a):
    return a + 1


def inc_then_say(a, launched):
    out = a + 1  # enqueued behind the failing kernel, on the only stream
    launched.set()
    return out


@host_task
def after(x, done):
    """Holds its compute's final sync until the other compute has ended."""
    assert done.wait(WAIT)
    return x


def _compute(graph, box, scheduler, done):
    try:
        box["result"] = dask.compute(*graph, scheduler=scheduler)
    except Exception as e:  # noqa: BLE001 - the outcome, asserted by the test
        box["error"] = e
    finally:
        done.set()


def _run_gated(a_graph, b_graph, scheduler, gates, dones):
    """Compute A, then B once A's kernel has started, open the gate once B has launched its
    work behind it; return both outcomes once both computes have ended."""
    started, launched, gate = gates
    a, b = {}, {}
    ta = threading.Thread(target=_compute, args=(a_graph, a, scheduler, dones[0]))
    tb = threading.Thread(target=_compute, args=(b_graph, b, scheduler, dones[1]))
    ta.start()
    assert started.wait(WAIT)
    tb.start()
    assert launched.wait(WAIT)
    gate.set()
    ta.join(3 * WAIT)
    tb.join(3 * WAIT)
    assert not ta.is_alive() and not tb.is_alive()
    return a, b


@pytest.mark.parametrize("route", ["launcher", "threaded"])
@pytest.mark.parametrize("reports_first", ["B, whose kernels queued behind it", "A, its own"])
def test_a_failure_that_another_compute_reports_first_still_fails_this_one(route, reports_first):
    config = {"gpustreams.backend": "sim", "gpustreams.streams": 1}
    scheduler = "gpustreams"
    if route == "threaded":
        config["gpustreams.enabled"] = True
        scheduler = dask.threaded.get
    started, gate, launched = threading.Event(), threading.Event(), threading.Event()
    a_done, b_done = threading.Event(), threading.Event()
    x = np.arange(4.0)
    # A: a kernel that fails once the gate opens. B: a chain queued behind it on the only
    # stream. The other's host task holds one compute's final sync until the other ends.
    a_graph = [delayed(gated_fail)(delayed(sim.asarray)(x), started, gate, dask_key_name="A")]
    up = delayed(sim.asarray)(x, dask_key_name="B-up")
    b_graph = [delayed(inc_then_say)(delayed(inc)(up, dask_key_name="B-1"), launched)]
    if reports_first.startswith("B"):
        a_graph.append(delayed(after)(x, b_done))
    else:
        b_graph.append(delayed(after)(x, a_done))
    # Set here, once: two threads' dask.config.set, ended out of order, would leave it set.
    with dask.config.set(config):
        a, b = _run_gated(a_graph, b_graph, scheduler, (started, launched, gate), (a_done, b_done))
    # A's result derives from its failing kernel, and B's kernels were skipped behind it:
    # both raise A's KernelError, whoever reported it first, and neither returns a value.
    for name, box in (("A", a), ("B", b)):
        assert "result" not in box, f"{name} returned {box['result']}"
        assert isinstance(box["error"], KernelError), box["error"]
        assert box["error"].key == "A"


# --- a consumer on another stream (known gap of the sim) ---------------------------------------


def _boom_once_open(out, started, gate):
    started.set()
    gate.wait(WAIT)
    raise ValueError("boom")


def a_fail():
    out = sim.empty(4)
    sim.launch(_boom_once_open, out, started, gate)
    return out


def _slow_fill(out, value, gate):
    gate.wait(WAIT)
    out[...] = value


def b_slow():
    out = sim.empty(4)
    sim.launch(_slow_fill, out, 10.0, gate2)
    return out


def _fill(out, value):
    out[...] = value


def b_make():
    out = sim.empty(4)
    sim.launch(_fill, out, 1.0)  # queued behind A's failing kernel on slot 0: skipped
    return out


def b_add(x, y):
    out = x + y
    launched.set()
    return out


started, gate, gate2, launched = (threading.Event() for _ in range(4))


def test_a_consumer_on_another_stream_of_a_kernel_skipped_behind_a_reported_failure(by_key):
    """B-make is skipped behind A's failure on slot 0; A reports the failure before B-add,
    on slot 1, reaches its wait for B-make's event (helper-93's review). B-add fails, as on
    CUDA, where the fault is sticky. Until stop 58 the sim passed a reported failure on
    to no stream that waited for it: B-add read B-make's unwritten output, its own event
    was clean, and B returned a wrong value (a strict xfail)."""
    for e in (started, gate, gate2, launched):
        e.clear()
    a_done = threading.Event()
    a, b = {}, {}

    def run(graph, box, done):
        try:
            box["result"] = dask.compute(*graph, scheduler="gpustreams")
        except Exception as e:  # noqa: BLE001 - the outcome, asserted below
            box["error"] = e
        finally:
            done.set()

    by_key.update({"A": 0, "B-make": 0, "B-slow": 1, "B-add": 1})
    a_graph = [delayed(a_fail)(dask_key_name="A")]
    slow = delayed(b_slow)(dask_key_name="B-slow")
    make = delayed(b_make)(dask_key_name="B-make")
    b_graph = [delayed(b_add)(make, slow, dask_key_name="B-add")]
    config = {
        "gpustreams.backend": "sim",
        "gpustreams.streams": 2,
        "gpustreams.policy": "test-placement",
    }
    with dask.config.set(config):
        ta = threading.Thread(target=run, args=(a_graph, a, a_done))
        tb = threading.Thread(target=run, args=(b_graph, b, threading.Event()))
        ta.start()
        assert started.wait(WAIT)
        tb.start()
        assert launched.wait(WAIT)
        gate.set()  # A's kernel fails; B-make is skipped behind it
        assert a_done.wait(WAIT)  # A's final wait has reported the failure
        gate2.set()  # now slot 1 reaches its wait for B-make's event
        ta.join(WAIT)
        tb.join(WAIT)
    assert isinstance(a.get("error"), KernelError), a
    # B's result derives from B-make's skipped kernel: it must raise, not return a value.
    assert "result" not in b, f"B returned {sim.asnumpy(b['result'][0])} (expected an error)"
    assert isinstance(b["error"], KernelError)


# --- work launched after another compute's sync reported the failure ---------------------------


def add_host_value(a, h):
    """Launched only once its host input is ready: after the other compute has ended."""
    return a + h


@pytest.mark.parametrize("route", ["launcher", "threaded"])
@pytest.mark.parametrize(
    "case",
    [
        "B's kernel skipped behind A's failure, read on its stream",
        "A's failing kernel, read on its stream",
        "A's failing kernel, read on another stream",
    ],
)
def test_work_launched_after_another_compute_reported_the_failure_it_reads_fails(
    route, case, by_key
):
    """The consumer is launched only after the other compute's sync has reported (and so
    cleared) the failure: it runs on output never written, its own event clean, and its
    compute returned NaN with no error (helper-99, stop 58). Now a compute during which
    a failure was reported checks the events of all its work; on CUDA the fault is
    sticky, and every later sync raises it."""
    started, gate, launched = threading.Event(), threading.Event(), threading.Event()
    a_done, b_done = threading.Event(), threading.Event()
    config = {"gpustreams.backend": "sim", "gpustreams.streams": 1}
    scheduler = "gpustreams"
    if case.endswith("another stream"):
        by_key.update({"A-f": 0, "A-y": 1})
        config.update({"gpustreams.streams": 2, "gpustreams.policy": "test-placement"})
    if route == "threaded":
        # Two threads at least: a compute's host task waits for the other's end.
        config.update({"gpustreams.enabled": True, "num_workers": 4})
        scheduler = dask.threaded.get
    x = np.arange(4.0)
    af = delayed(gated_fail)(
        delayed(sim.asarray)(x, dask_key_name="A-up"), started, gate, dask_key_name="A-f"
    )
    up = delayed(sim.asarray)(x, dask_key_name="B-up")
    bx = delayed(inc_then_say)(up, launched, dask_key_name="B-x")
    if case.startswith("B"):
        # B's kernel is skipped behind A's failure; A's final sync reports it; then B
        # launches B-y on the same stream, after B-x's event, reading B-x's output.
        a_graph = [af]
        h = delayed(after)(0.0, a_done, dask_key_name="B-h")
        b_graph = [delayed(add_host_value)(bx, h, dask_key_name="B-y")]
        readers = {"B": "B-y"}
    else:
        # B's sync reports A's failure (B-x was skipped behind it); then A launches A-y.
        h = delayed(after)(0.0, b_done, dask_key_name="A-h")
        a_graph = [delayed(add_host_value)(af, h, dask_key_name="A-y")]
        b_graph = [bx]
        readers = {"A": "A-y"}
    with dask.config.set(config):
        a, b = _run_gated(a_graph, b_graph, scheduler, (started, launched, gate), (a_done, b_done))
        # The runtime is clean afterwards: a good compute on it is exact.
        good = dask.compute(delayed(inc)(delayed(sim.asarray)(x)), scheduler=scheduler)[0]
    np.testing.assert_array_equal(sim.asnumpy(good), x + 1)
    # Both computes ran A's failing kernel or work skipped behind it: both raise A-f's
    # error, and neither returns a value.
    for name, box in (("A", a), ("B", b)):
        assert "result" not in box, (
            f"{name} returned {[sim.asnumpy(r) for r in box['result']]} "
            f"with no error ({readers.get(name, name)} read unwritten output)"
        )
        assert isinstance(box["error"], KernelError), box["error"]
        assert box["error"].key == "A-f"
