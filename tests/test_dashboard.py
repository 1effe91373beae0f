"""The ``gpustreams`` page of the scheduler's dashboard and the records it is built from."""

from __future__ import annotations

import json
import time
import urllib.request
from collections import deque
from types import SimpleNamespace

import dask
import pytest
from distributed import Client, LocalCluster

from dask_gpustreams.diagnostics.dashboard import ROUTE, busy_fraction, timeline_feed
from dask_gpustreams.diagnostics.dashboard.feed import RecordCursor, timing_summary
from tests.sim_tasks import SIM_CLUSTER, ones, slow_inc

CONFIG = {**SIM_CLUSTER, "gpustreams.enabled": True}  # the client preload registers it


async def _poll(dask_scheduler, timing=True):
    """The data function: one poll of the workers; (new records, all kept, timing states)."""
    feed = timeline_feed(dask_scheduler)
    new = await feed.poll(timing)
    return new, list(feed.records), dict(feed.timing)


def _worker_timelines(client) -> dict:
    def on(dask_worker):
        runtime = dask_worker.plugins["gpustreams"].runtime
        return None if runtime is None else runtime.timeline is not None

    return client.run(on)


def _get(port: int, path: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
        return response.status, response.read()


@pytest.fixture
def cluster():
    def start(n_workers=2, **config):
        return (
            dask.config.set({**CONFIG, **{f"gpustreams.{k}": v for k, v in config.items()}}),
            LocalCluster(
                n_workers=n_workers, threads_per_worker=2, processes=False, dashboard_address=":0"
            ),
        )

    return start


def test_busy_fraction():
    assert busy_fraction([], 0, 10) == 0
    assert busy_fraction([(1, 2), (3, 5)], 0, 10) == pytest.approx(0.3)
    assert busy_fraction([(-5, 1), (9, 20)], 0, 10) == pytest.approx(0.2)  # clipped to the window
    assert busy_fraction([(0, 10), (0, 10)], 0, 10) == 1
    assert busy_fraction([(0, 1)], 5, 5) == 0


def test_record_cursor_takes_each_completed_record_once():
    def record(done=True, timed=True):
        return SimpleNamespace(timed=timed, event=SimpleNamespace(done=done))

    # The runtime's records API over a timeline the test sets (None: timing off).
    runtime = SimpleNamespace(timeline=deque(maxlen=3), done=lambda r: r.event.done)
    runtime.timeline_snapshot = lambda: list(runtime.timeline or ())
    cursor = RecordCursor(runtime)
    assert cursor.take() == []
    r1, r2 = record(), record(done=False)
    runtime.timeline.extend([r1, r2])
    assert cursor.take() == [r1]
    assert cursor.take() == []  # r2 is pending
    r2.event.done = True
    r3 = record()
    runtime.timeline.append(r3)
    assert cursor.take() == [r2, r3]
    more = [record(), record(timed=False), record()]  # r3 leaves the timeline
    runtime.timeline.extend(more)
    assert cursor.take() == [more[0], more[2]]  # launched while timing turned on: no start
    runtime.timeline = None  # timing turned off
    assert cursor.take() == []
    runtime.timeline = deque([r4 := record()])  # and on again
    assert cursor.take() == [r4]


def test_timing_summary():
    assert timing_summary({}) == "no workers yet"
    text = timing_summary({"a": "config", "b": "config", "c": "page", "d": "no-runtime"})
    assert text.startswith("on (gpustreams.timeline): 2 workers; on while the page is open: 1")


@pytest.mark.parametrize("n_tasks", [12])
def test_page_is_served_listed_and_holds_the_run(cluster, n_tasks):
    pytest.importorskip("bokeh")
    conf, lc = cluster(timeline=True)
    with conf, lc, Client(lc) as client:
        port = lc.scheduler.http_server.port
        x = client.submit(ones, 64, pure=False)
        ys = client.map(slow_inc, [x] * (n_tasks - 1), [0.01] * (n_tasks - 1), pure=False)
        client.gather(ys)  # waits for the tasks' events: every record is complete
        new, kept, timing = client.run_on_scheduler(_poll)
        assert len(new) == len(kept) == n_tasks
        assert sorted(r["key"] for r in new) == sorted(str(f.key) for f in [x, *ys])
        assert set(timing) == set(client.scheduler_info()["workers"])
        assert set(timing.values()) == {"config"}
        for r in new:
            assert r["worker"] in timing
            assert r["stream"] in (0, 1)
            assert r["end"] >= r["start"]
            assert r["name"] in ("ones", "slow_inc")
        slow = [r for r in new if r["name"] == "slow_inc"]
        assert min(r["end"] - r["start"] for r in slow) >= 0.009  # device time, not enqueue
        again, kept, _ = client.run_on_scheduler(_poll)
        assert again == [] and len(kept) == n_tasks  # each record once

        status, body = _get(port, "/sitemap.json")
        assert status == 200
        assert ROUTE in json.loads(body)["paths"]
        status, body = _get(port, ROUTE)
        assert status == 200
        assert b'href="gpustreams"' in body  # the navigation bar
        assert b'href="gpustreams"' in _get(port, "/status")[1]

        # The GET opened a session: its page shows every task, one row per (worker, stream).
        feed = timeline_feed(lc.scheduler)
        assert feed.sessions == 1
        (app,) = [a for a in lc.scheduler.http_application.applications if ROUTE in a.app_paths]
        (session,) = app.get_sessions(ROUTE)
        (page,) = session.document.components
        deadline = time.monotonic() + 10
        while len(page.tasks.data["key"]) < n_tasks:
            assert time.monotonic() < deadline, page.tasks.data["key"]
            time.sleep(0.05)
        assert sorted(page.tasks.data["key"]) == sorted(r["key"] for r in new)
        rows = {(r["worker"], f"stream {r['stream']}") for r in new}
        assert set(page.y_range.factors) == rows
        assert list(page.busy.data["row"]) == list(page.y_range.factors)
        assert all(0 <= b <= 1 for b in page.busy.data["busy"])
        assert "on (gpustreams.timeline): 2 workers" in page.header.text

        # A browser's view: a session over the websocket gets the same bars.
        from bokeh.client import pull_session

        with pull_session(url=f"http://127.0.0.1:{port}{ROUTE}") as browser:
            (tasks,) = [m for m in browser.document.models if "key" in getattr(m, "data", {})]
            assert sorted(tasks.data["key"]) == sorted(r["key"] for r in new)


def test_timing_is_on_while_polled(cluster):
    conf, lc = cluster(n_workers=1, timeline=False)
    with conf, lc, Client(lc) as client:
        feed = timeline_feed(lc.scheduler)
        feed.lease = 0.5
        new, _, timing = client.run_on_scheduler(_poll)
        assert new == [] and set(timing.values()) == {"no-runtime"}
        x = client.submit(ones, 8, pure=False)
        x.result()  # creates the runtime, without a timeline
        assert set(_worker_timelines(client).values()) == {False}
        new, _, timing = client.run_on_scheduler(_poll)
        assert new == [] and set(timing.values()) == {"page"}
        assert set(_worker_timelines(client).values()) == {True}
        ys = client.map(slow_inc, [x] * 5, pure=False)
        client.gather(ys)
        new, _, _ = client.run_on_scheduler(_poll)
        assert sorted(r["key"] for r in new) == sorted(str(y.key) for y in ys)
        # No poll for longer than the lease: the worker drops the timeline.
        deadline = time.monotonic() + 10
        while set(_worker_timelines(client).values()) != {False}:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        client.submit(ones, 8, pure=False).result()
        new, _, timing = client.run_on_scheduler(_poll, timing=False)
        assert new == [] and set(timing.values()) == {"off"}
        # timing=False lets it go at once, once no task executes
        client.run_on_scheduler(_poll)
        assert set(_worker_timelines(client).values()) == {True}
        client.run_on_scheduler(_poll, timing=False)
        deadline = time.monotonic() + 10
        while set(_worker_timelines(client).values()) != {False}:
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_timeline_config_is_never_turned_off(cluster):
    conf, lc = cluster(n_workers=1, timeline=True)
    with conf, lc, Client(lc) as client:
        client.submit(ones, 8, pure=False).result()
        client.run_on_scheduler(_poll, timing=False)
        time.sleep(0.1)
        assert set(_worker_timelines(client).values()) == {True}
        new, _, timing = client.run_on_scheduler(_poll, timing=False)
        assert set(timing.values()) == {"config"}


def test_without_bokeh_nothing_is_added(run_python):
    out = run_python(
        "import sys\n"
        "sys.modules['bokeh'] = None  # not installed\n"
        "import dask, distributed\n"
        "import dask_gpustreams.diagnostics.dashboard as d\n"
        "from dask_gpustreams.integrations.distributed import StreamsPlugin\n"
        "with dask.config.set({'gpustreams.backend': 'sim', 'gpustreams.enabled': True}):\n"
        "    with distributed.LocalCluster(n_workers=1, processes=False, dashboard_address=':0')"
        " as lc, distributed.Client(lc) as c:\n"
        "        assert c.submit(sum, [1, 2]).result() == 3\n"
        "        names = c.run_on_scheduler(lambda dask_scheduler: list(dask_scheduler.plugins))\n"
        "        print(d.add_dashboard_page(lc.scheduler), 'gpustreams-erred-inputs' in names)\n"
    )
    assert out.split() == ["False", "True"]  # no page; the plugin's scheduler part runs
