"""The Bokeh document of the dashboard page (imported only where Bokeh and a dashboard run).

One row per (worker, stream): the tasks' device time as bars, colored by key
prefix as in Dask's task stream, on a time axis that follows the last
:attr:`StreamsPage.span_ms`; beside it, each stream's busy fraction over the
last :attr:`StreamsPage.window` seconds. Built as distributed's own pages
(``distributed/dashboard/components/scheduler.py``: ``workers_doc``): a
periodic update that reads state already on the scheduler, here the
:class:`~.feed.TimelineFeed`'s records, never waiting.
"""

from __future__ import annotations

import time
import weakref
from collections import deque
from typing import Any

from bokeh.layouts import column, row
from bokeh.models import (
    ColumnDataSource,
    DataRange1d,
    Div,
    FactorRange,
    HoverTool,
    NumeralTickFormatter,
    Range1d,
)
from bokeh.plotting import figure
from distributed.dashboard.components.scheduler import BOKEH_THEME, env
from distributed.utils import color_of

from dask_gpustreams.diagnostics.dashboard.feed import (
    TimelineFeed,
    busy_fraction,
    timeline_feed,
    timing_summary,
)

_TASK_COLUMNS = ("row", "start", "end", "duration", "key", "name", "color")


class StreamsPage:
    """The figures of one page session, updated from a :class:`TimelineFeed`."""

    #: Milliseconds between updates of the figures.
    update_ms = 1000
    #: Task bars kept on the page (the oldest go first).
    n_rectangles = 5000
    #: Milliseconds of time shown (the view follows the newest task).
    span_ms = 30_000
    #: Seconds of the busy fractions.
    window = 10.0

    def __init__(self, feed: TimelineFeed):
        self.feed = feed
        # Start with what the feed kept (earlier sessions' polls), up to the bars shown.
        self.cursor = max(0, feed.total - self.n_rectangles)
        self.rows: dict[tuple[str, str], int] = {}  # (worker, "stream i") -> stream index
        self.recent: dict[tuple[str, str], deque] = {}  # spans within the busy window
        self.tasks = ColumnDataSource({c: [] for c in _TASK_COLUMNS})
        self.busy = ColumnDataSource({"row": [], "busy": [], "percent": []})
        self.y_range = FactorRange(factors=[])
        self.header = Div(sizing_mode="stretch_width")
        self.timeline = figure(
            title="Device time of each task, per worker and stream",
            x_axis_type="datetime",
            x_range=DataRange1d(follow="end", follow_interval=self.span_ms, range_padding=0),
            y_range=self.y_range,
            tools="xpan,xwheel_zoom,box_zoom,reset,save",
            active_scroll="xwheel_zoom",
            sizing_mode="stretch_both",
            min_height=300,
        )
        self.timeline.hbar(
            y="row",
            left="start",
            right="end",
            height=0.8,
            fill_color="color",
            line_color=None,
            source=self.tasks,
        )
        self.timeline.add_tools(
            HoverTool(
                tooltips=[
                    ("key", "@key"),
                    ("device time", "@duration{0.000} ms"),
                    ("worker, stream", "@row"),
                ]
            )
        )
        self.occupancy = figure(
            title=f"Busy, last {self.window:g} s",
            x_range=Range1d(0, 1),
            y_range=self.y_range,
            tools="",
            toolbar_location=None,
            width=220,
            sizing_mode="stretch_height",
            min_height=300,
        )
        self.occupancy.hbar(y="row", right="busy", height=0.8, source=self.busy)
        self.occupancy.xaxis.formatter = NumeralTickFormatter(format="0%")
        self.occupancy.yaxis.visible = False
        self.occupancy.add_tools(HoverTool(tooltips=[("busy", "@percent{0.0}%")]))
        self.root = column(
            self.header,
            row(self.timeline, self.occupancy, sizing_mode="stretch_both"),
            sizing_mode="stretch_both",
        )

    def update(self) -> None:
        """Add the records received since the last update; recompute the busy fractions."""
        records, self.cursor = self.feed.since(self.cursor)
        if records:
            self._add(records)
        now = time.time()
        lo = now - self.window
        busy = []
        for r in self.rows:
            spans = self.recent[r]
            while spans and spans[0][1] < lo:
                spans.popleft()
            busy.append(busy_fraction(spans, lo, now))
        self.busy.data = {
            "row": list(self.rows),
            "busy": busy,
            "percent": [100 * b for b in busy],
        }
        self.header.text = (
            "<b>GPU streams</b>: the device time of each task on its stream, from the "
            f"runtimes' timing events. Timing {timing_summary(self.feed.timing)}; "
            f"{self.feed.total} tasks received."
        )

    def _add(self, records: list[dict]) -> None:
        new_rows = False
        data: dict[str, list] = {c: [] for c in _TASK_COLUMNS}
        for r in records:
            key = (r["worker"], f"stream {r['stream']}")
            if key not in self.rows:
                self.rows[key] = r["stream"]
                self.recent[key] = deque()
                new_rows = True
            start, end = r["start"] * 1e3, r["end"] * 1e3
            self.recent[key].append((r["start"], r["end"]))
            data["row"].append(key)
            data["start"].append(start)
            data["end"].append(end)
            data["duration"].append(end - start)
            data["key"].append(r["key"])
            data["name"].append(r["name"])
            data["color"].append(color_of(r["name"]))
        if new_rows:
            self.rows = dict(sorted(self.rows.items(), key=lambda kv: (kv[0][0], kv[1])))
            self.y_range.factors = list(self.rows)
        self.tasks.stream(data, rollover=self.n_rectangles)


def timeline_doc(scheduler: Any, extra: dict, doc: Any) -> None:
    """The page's document (a function of distributed's ``BokehApplication``)."""
    feed = timeline_feed(scheduler)
    page = StreamsPage(feed)
    page.update()
    ref = weakref.ref(page)  # as distributed's add_periodic_callback: no cycle through the doc

    def update() -> None:
        p = ref()
        if p is not None:
            p.update()

    doc.add_periodic_callback(update, page.update_ms)
    doc.components = [page]  # keeps the page alive with its document
    doc.title = "Dask: GPU streams"
    doc.add_root(page.root)
    doc.template = env.get_template("simple.html")
    doc.template_variables.update(extra)
    doc.theme = BOKEH_THEME
    feed.open_session()
    doc.on_session_destroyed(lambda context: feed.close_session())
