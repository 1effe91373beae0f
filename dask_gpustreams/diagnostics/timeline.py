"""The task timeline: on which stream each task's GPU work ran, and when.

With ``gpustreams.timeline`` on, each :class:`~dask_gpustreams.runtime.StreamRuntime`
keeps, per task, the stream and two timing events: one recorded before the
task's work (after its event waits) and one after it. This module collects
them, then transforms and presents them, in three separate steps:

- collect: :func:`timeline` turns the runtimes' events into plain records
  (dicts) with times in milliseconds from the earliest start, in this process
  or, given a distributed ``client``, on every worker with one ``client.run``;
  :func:`clear_timeline` drops what was recorded so far;
- transform: :func:`to_rectangles` (pure) and :func:`saturation`;
- present: :func:`to_chrome_trace` (Perfetto / ``chrome://tracing`` JSON, one
  track per device and stream) and :func:`plot_gantt` (matplotlib, on an ``ax``).

>>> dask.config.set({"gpustreams.enabled": True, "gpustreams.timeline": True})  # doctest: +SKIP
>>> x.compute()  # doctest: +SKIP
>>> records = dask_gpustreams.timeline()  # doctest: +SKIP
>>> to_chrome_trace(records, "trace.json")  # doctest: +SKIP
>>> plot_gantt(records).figure.savefig("gantt.png")  # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
import socket
import uuid
import warnings
from collections.abc import Sequence
from typing import Any

import dask.config
from dask.utils import key_split

#: This process, among a client's workers: host and pid alone may repeat (containers
#: sharing a host name, each its workers' pid 1).
_PROCESS = uuid.uuid4().hex

#: The fields of each record returned by :func:`timeline`.
RECORD_FIELDS = ("key", "name", "worker", "device", "pool", "stream", "start_ms", "end_ms")


def timeline(client: Any = None, *, timeout: float = 10.0) -> list[dict]:
    """The completed tasks recorded by the stream runtimes, as plain records.

    Parameters
    ----------
    client
        A ``distributed.Client``: gather the records of every worker with one
        ``client.run`` call. ``None``: the runtimes of this process (the local
        threaded or synchronous scheduler).
    timeout
        Seconds to wait, per runtime, for the clock anchor event.

    Returns
    -------
    list of dict
        One record per task whose work has completed, sorted by start, with the
        fields of :data:`RECORD_FIELDS`: ``key``; ``name`` (the key's prefix);
        ``worker`` (address, ``None`` without a client); ``device``; ``pool``
        (``"<policy>/<n streams>"`` of the runtime); ``stream`` (index in the
        pool); ``start_ms`` and ``end_ms``, device times in milliseconds from
        the earliest start among all records. Times of different processes are
        aligned through the host clock (exact within a process).

    Nothing is recorded unless ``gpustreams.timeline`` was true when the runtime
    was created; tasks still running are left out. An empty result warns
    (``UserWarning``) when that is why: no runtime records a timeline, and none
    would be created with one (locally: ``gpustreams.timeline`` is off here; on a
    cluster: on every worker's plugin, as each worker reads its own config).
    """
    if client is None:
        parts = [_collect_process(timeout)]
        recording = parts[0]["recording"] or _timeline_setting()
    else:
        parts = []
        processes: dict[str, dict] = {}
        responses = client.run(_collect_worker, timeout)
        recording = any(part["recording"] for part in responses.values())
        for address, part in sorted(responses.items()):
            # Workers of one process (processes=False) see all its runtimes: take its
            # records once, each under the worker whose plugin owns its runtime (the
            # process's first worker for the others: local computes, say).
            first = processes.get(part["process"])
            if first is None:
                processes[part["process"]] = first = part
                part["owners"] = {}
                parts.append(part)
            if part["runtime"] is not None:
                first["owners"][part["runtime"]] = address
            part["worker"] = address
        for part in parts:
            for r in part["records"]:
                r["worker"] = part["owners"].get(r["runtime"], part["worker"])
    rows = [(r.get("worker", part["worker"]), r) for part in parts for r in part["records"]]
    if not rows:
        if not recording:
            warnings.warn(_OFF_LOCAL if client is None else _OFF_CLUSTER, UserWarning, stacklevel=2)
        return []
    t0 = min(r["start"] for _, r in rows)
    records = [
        {
            "key": r["key"],
            "name": key_split(r["key"]),
            "worker": worker,
            "device": r["device"],
            "pool": r["pool"],
            "stream": r["stream"],
            "start_ms": (r["start"] - t0) * 1e3,
            "end_ms": (r["end"] - t0) * 1e3,
        }
        for worker, r in rows
    ]
    records.sort(key=lambda r: (r["start_ms"], r["end_ms"]))
    return records


_OFF_LOCAL = (
    "timeline() is empty: gpustreams.timeline is off (the default), so no stream runtime of "
    "this process records one; turn it on before computing: "
    "dask.config.set({'gpustreams.timeline': True})"
)
_OFF_CLUSTER = (
    "timeline(client) is empty: gpustreams.timeline is off on every worker (the default), so "
    "none records one; a worker reads its own config when its plugin starts, so a "
    "dask.config.set here does not reach it: turn it on with "
    "client.register_plugin(StreamsPlugin(timeline=True))"
)


def _timeline_setting() -> bool:
    """Whether this process's ``gpustreams.timeline`` is on (a bad value counts as on)."""
    from dask_gpustreams.config import parse_bool

    try:
        return parse_bool("timeline", dask.config.get("gpustreams.timeline", False))
    except ValueError:  # the compute reports it; the timeline is not known to be off
        return True


def clear_timeline(client: Any = None) -> None:
    """Drop the records kept so far by the runtimes of this process, or of every worker."""
    if client is None:
        _clear_process()
    else:
        client.run(_clear_process)


def _clear_process() -> None:
    from dask_gpustreams.runtime import live_runtimes

    for runtime in live_runtimes():
        runtime.clear_timeline()


def _collect_process(timeout: float = 10.0) -> dict:
    """This process's completed records, with start/end as host clock seconds (``time.time``).

    Each record names its runtime (``id``), for :func:`_collect_worker`.
    """
    from dask_gpustreams.runtime import live_runtimes

    records: list[dict] = []
    recording = False
    for runtime in live_runtimes():
        recording = recording or runtime.timeline_enabled
        for record in _runtime_records(runtime, runtime.timeline_snapshot(), timeout):
            record["runtime"] = id(runtime)
            records.append(record)
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "process": _PROCESS,
        "worker": None,
        "records": records,
        "recording": recording,
    }


def _collect_worker(timeout: float = 10.0, dask_worker: Any = None) -> dict:
    """:func:`_collect_process` on a worker, with the ``id`` of its plugin's runtime (or None).

    ``recording`` also holds where the plugin's runtime, not created yet, would record.
    """
    part = _collect_process(timeout)
    plugin = dask_worker.plugins.get("gpustreams") if dask_worker is not None else None
    runtime = None
    if getattr(plugin, "_active", False):
        runtime = getattr(plugin, "runtime", None)
        part["recording"] = part["recording"] or plugin.config.timeline
    part["runtime"] = None if runtime is None else id(runtime)
    return part


def _runtime_records(runtime: Any, snapshot: list, timeout: float) -> list[dict]:
    """The records of ``snapshot`` (``runtime``'s) timed and completed, on the host clock.

    Warns and gives none if the runtime's clock anchor does not complete in ``timeout`` s.
    """
    try:
        times = runtime.task_times(snapshot, timeout)
    except TimeoutError as e:
        warnings.warn(f"timeline: {e}", RuntimeWarning, stacklevel=3)
        return []
    device = runtime.device_id
    pool = f"{runtime.config.policy}/{runtime.n_streams}"
    return [
        {
            "key": r.key,
            "device": device,
            "pool": pool,
            "stream": r.stream_index,
            "start": start,
            "end": end,
        }
        for r, start, end in times
    ]


class RecordCursor:
    """The records of one runtime's timeline that completed since the previous :meth:`take`.

    The newest record read is remembered, and records not yet complete are
    kept for the next call. If that record has left the timeline (cleared,
    replaced, or more than its ``maxlen`` records appended since), every
    record in it is new. For readers that poll (the dashboard's feed, the
    Prometheus series of device time).
    """

    #: Records kept for a later call because their tasks had not completed.
    max_pending = 100_000

    def __init__(self, runtime: Any):
        self.runtime = runtime
        self._last: Any = None
        self._pending: list = []

    def take(self) -> list:
        """The completed :class:`~dask_gpustreams.runtime.TaskRecord` s not taken before."""
        runtime = self.runtime
        snapshot = runtime.timeline_snapshot()
        new = snapshot
        if self._last is not None:
            for i in range(len(snapshot) - 1, -1, -1):
                if snapshot[i] is self._last:
                    new = snapshot[i + 1 :]
                    break
        if snapshot:
            self._last = snapshot[-1]
        done = runtime.done
        ready, pending = [], []
        for record in (*self._pending, *new):
            if not record.timed:  # launched while the timeline was being turned on
                continue
            (ready if done(record) else pending).append(record)
        self._pending = pending[-self.max_pending :]
        return ready


def _track(record: dict) -> tuple:
    return (record["worker"] or "", record["device"], record["pool"], record["stream"])


def to_rectangles(records: Sequence[dict]) -> dict:
    """Gantt rectangles of ``records``: one track per worker, device, pool and stream.

    Returns ``{"tracks": [label, ...], "rectangles": [{"track", "start", "duration",
    "name", "key"}, ...]}`` where ``track`` indexes ``tracks`` and times are in ms.
    The pool appears in the labels only when the records come from several pools.
    """
    keys = sorted({_track(r) for r in records})
    several_workers = len({k[0] for k in keys}) > 1
    several_pools = len({k[:3] for k in keys}) > len({k[:2] for k in keys})
    labels = []
    for worker, device, pool, stream in keys:
        parts = [worker] if several_workers else []
        parts.append(f"dev {device}")
        if several_pools:
            parts.append(pool)
        parts.append(f"stream {stream}")
        labels.append(" ".join(parts))
    index = {k: i for i, k in enumerate(keys)}
    rectangles = [
        {
            "track": index[_track(r)],
            "start": r["start_ms"],
            "duration": r["end_ms"] - r["start_ms"],
            "name": r["name"],
            "key": str(r["key"]),
        }
        for r in records
    ]
    return {"tracks": labels, "rectangles": rectangles}


def to_chrome_trace(records: Sequence[dict], path: str | os.PathLike | None = None) -> dict:
    """``records`` as a Chrome trace (Perfetto, ``chrome://tracing``); written to ``path`` if given.

    Each worker and device is a process, each stream of it a thread (track);
    each task a complete ("X") event named after its key prefix, with the key
    in its arguments.
    """
    processes: dict[tuple, int] = {}
    threads: dict[tuple, int] = {}
    for k in sorted({_track(r) for r in records}):
        pid = processes.setdefault(k[:2], len(processes))
        threads.setdefault(k, sum(1 for t in threads if t[:2] == k[:2]))
    several_pools = len({k[:3] for k in threads}) > len(processes)
    meta: list[dict] = []
    for (worker, device), pid in processes.items():
        name = f"{worker} device {device}" if worker else f"device {device}"
        meta += _track_metadata("process", pid, None, name)
    for k, tid in threads.items():
        name = f"{k[2]} stream {k[3]}" if several_pools else f"stream {k[3]}"
        meta += _track_metadata("thread", processes[k[:2]], tid, name)
    events = [
        {
            "name": r["name"],
            "cat": "task",
            "ph": "X",
            "ts": r["start_ms"] * 1e3,
            "dur": (r["end_ms"] - r["start_ms"]) * 1e3,
            "pid": processes[_track(r)[:2]],
            "tid": threads[_track(r)],
            "args": {"key": str(r["key"]), "pool": r["pool"], "stream": r["stream"]},
        }
        for r in records
    ]
    trace = {"traceEvents": meta + events, "displayTimeUnit": "ms"}
    if path is not None:
        with open(path, "w") as f:
            json.dump(trace, f)
    return trace


def _track_metadata(kind: str, pid: int, tid: int | None, name: str) -> list[dict]:
    """Chrome-trace metadata events naming a process or thread track and fixing its order."""
    ids = {"pid": pid} if tid is None else {"pid": pid, "tid": tid}
    order = pid if tid is None else tid
    return [
        {"ph": "M", "name": f"{kind}_name", **ids, "args": {"name": name}},
        {"ph": "M", "name": f"{kind}_sort_index", **ids, "args": {"sort_index": order}},
    ]


def plot_gantt(records: Sequence[dict], ax: Any = None, *, title: str | None = None) -> Any:
    """Draw ``records`` as a Gantt chart, one row per stream, colored by key prefix.

    Draws on ``ax`` if given, else on a new figure (not registered with pyplot);
    returns the axes. Save with ``plot_gantt(records).figure.savefig(path)``.
    Raises ``ValueError`` without records (an empty timeline: see :func:`timeline`).
    """
    if not records:
        raise ValueError("plot_gantt needs at least one record; got none")
    rects = to_rectangles(records)
    tracks = rects["tracks"]
    if ax is None:
        from matplotlib.figure import Figure

        fig = Figure(figsize=(10, 1.2 + 0.28 * max(1, len(tracks))), layout="constrained")
        ax = fig.subplots()
    import matplotlib

    names = sorted({r["name"] for r in rects["rectangles"]})
    cmap = matplotlib.colormaps["tab20" if len(names) > 10 else "tab10"]
    colors = {name: cmap(i % cmap.N) for i, name in enumerate(names)}
    groups: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for r in rects["rectangles"]:
        groups.setdefault((r["track"], r["name"]), []).append((r["start"], r["duration"]))
    for (track, name), spans in groups.items():
        ax.broken_barh(spans, (track - 0.4, 0.8), facecolors=colors[name], edgecolor="w", lw=0.3)
    ax.set_yticks(range(len(tracks)), tracks)
    ax.set_ylim(len(tracks) - 0.5, -0.5)
    ax.set_xlabel("time (ms)")
    if title:
        ax.set_title(title)
    if 1 < len(names) <= 12:
        from matplotlib.patches import Patch

        ax.legend(
            handles=[Patch(color=colors[n], label=n) for n in names],
            loc="upper right",
            fontsize="small",
        )
    return ax


def saturation(records: Sequence[dict], kernel_ms: float | None = None) -> float:
    """Dagger.jl's GPU saturation of a run: work time over wall time.

    ``kernel_ms`` x number of records / (last end - first start) when
    ``kernel_ms`` (the isolated time of one task's kernel) is given, else the sum
    of the recorded task durations over that span. Above 1 means tasks
    overlapped. Pass only the records of the kernel tasks of one run.
    """
    if not records:
        raise ValueError("saturation needs at least one record; got none")
    wall = max(r["end_ms"] for r in records) - min(r["start_ms"] for r in records)
    if kernel_ms is None:
        work = sum(r["end_ms"] - r["start_ms"] for r in records)
    else:
        work = kernel_ms * len(records)
    return work / wall if wall > 0 else float("inf")
