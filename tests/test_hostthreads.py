"""HostThreads: the launcher's host-task threads run calls in order and end when idle."""

from __future__ import annotations

import logging
import re
import threading

import pytest

from dask_gpustreams.runtime.hostthreads import HostThreads

TIMEOUT = 10.0


def test_calls_run_in_submission_order_on_at_most_size_threads():
    pool = HostThreads(2, "test-host")
    release = threading.Event()
    running: list[int] = []
    both = threading.Barrier(2, timeout=TIMEOUT)
    done = threading.Event()
    order: list[int] = []

    def blocking(i):
        running.append(i)
        if i < 2:
            both.wait()  # two run at once...
        assert release.wait(TIMEOUT)

    for i in range(3):
        pool.submit(blocking, i)
    pool.submit(lambda: (order.append(3), done.set()))
    assert len(pool.threads()) == 2  # ...and no third starts
    assert not done.is_set()
    release.set()
    assert done.wait(TIMEOUT)
    assert sorted(running[:2]) == [0, 1] and running[2] == 2 and order == [3]
    pool.shutdown()
    assert pool.threads() == set()


def test_threads_end_after_the_idle_timeout_and_start_again(monkeypatch):
    monkeypatch.setattr(HostThreads, "idle_timeout", 0.05)
    pool = HostThreads(4, "test-host")
    ran = threading.Event()
    pool.submit(ran.set)
    assert ran.wait(TIMEOUT)
    (first,) = pool.threads()
    first.join(TIMEOUT)
    assert not first.is_alive() and pool.threads() == set()
    again = threading.Event()
    pool.submit(again.set)
    assert again.wait(TIMEOUT)
    assert first not in pool.threads()
    pool.shutdown()


def test_shutdown_runs_the_queued_calls_then_refuses_new_ones():
    pool = HostThreads(1, "test-host")
    gate = threading.Event()
    ran: list[int] = []
    pool.submit(gate.wait, TIMEOUT)
    pool.submit(ran.append, 1)
    threads = pool.threads()
    closer = threading.Thread(target=pool.shutdown)
    closer.start()
    gate.set()
    closer.join(TIMEOUT)
    assert not closer.is_alive() and ran == [1]
    assert not any(t.is_alive() for t in threads)
    with pytest.raises(RuntimeError, match="cannot run host tasks on 'test-host' after shutdown"):
        pool.submit(ran.append, 2)


def test_a_call_that_raises_is_logged_and_the_thread_goes_on(caplog):
    pool = HostThreads(1, "test-host")
    ran = threading.Event()
    with caplog.at_level(logging.ERROR, logger="dask_gpustreams"):
        pool.submit(lambda: 1 / 0)
        pool.submit(ran.set)
        assert ran.wait(TIMEOUT)
    pool.shutdown()
    [record] = caplog.records
    assert re.fullmatch(
        r"gpustreams: host call <function .*<lambda> at 0x[0-9a-f]+> raised", record.getMessage()
    )
    assert record.exc_info[0] is ZeroDivisionError
