"""Whether the streams are on and what they are doing: :func:`status`.

Everything here reads state that the runtime and the worker plugin keep
anyway: tasks run are the events recorded on the compute streams (their
sequence numbers), tasks in flight the recorded events not yet complete plus
the tasks being launched, held bytes the arrays that those events keep alive.
Nothing is created: a process without a runtime reports its settings only.

>>> print(dask_gpustreams.status())  # doctest: +SKIP
>>> print(dask_gpustreams.status(client))  # one row per worker  # doctest: +SKIP
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from dask.utils import format_bytes

#: The fields of each row of :attr:`StreamsStatus.rows`.
STATUS_FIELDS = (
    "worker",
    "host",
    "pid",
    "enabled",
    "started",
    "backend",
    "device",
    "streams",
    "policy",
    "settings",
    "tasks_run",
    "tasks_in_flight",
    "held_bytes",
    "pinned_staging_bytes",
    "pinned_results_bytes",
    "pinned_limit_bytes",
    "stream_waits",
    "egress_waits",
    "egress_wait_seconds",
    "failures",
    "error",
)


@dataclass(frozen=True)
class StreamsStatus:
    """What :func:`status` found: ``rows`` (data) and, printed, a table.

    ``rows`` has one dict per runtime of each process or worker (one per
    process or worker without a runtime), with the fields of
    :data:`STATUS_FIELDS`:

    - ``worker`` (address, None for this process), ``host``, ``pid``;
    - ``enabled``: ``gpustreams.enabled`` here; on a worker, whether its
      plugin is set up;
    - ``started``: whether a runtime exists; ``backend``, ``device``,
      ``streams``, ``policy`` and ``settings`` (every field of
      :class:`~dask_gpustreams.StreamsConfig`) are then the runtime's, else
      what a runtime would get (``backend`` not resolved yet);
    - ``tasks_run``: tasks launched on the compute streams; ``tasks_in_flight``:
      those whose event has not completed, plus those being launched;
    - ``held_bytes``: bytes of arrays (inputs, and copies' device sources) held
      until the events of the tasks that read them are seen complete (the
      periodic release runs every half second on workers, at the end of a
      local graph);
    - ``pinned_staging_bytes``, ``pinned_results_bytes`` (pinned download
      results still alive), ``pinned_limit_bytes`` (``pinned-pool-size``);
    - ``stream_waits``: event waits enqueued for other streams' work;
    - ``egress_waits``, ``egress_wait_seconds``: get_data and spill requests of
      a worker that waited for events, and how long; ``failures``: the task
      runs whose kernels the worker found failed (by a task that read their
      result, or a request for it: it is then recomputed), each once however
      often found; None outside a worker;
    - ``error``: why settings could not be read (an invalid ``gpustreams.*``),
      a worker plugin's bad settings (its tasks fail with them), or a worker's
      exception; else None.

    A worker's runtime counts are those of its plugin's runtime; workers of one
    process that share a runtime report the same counts. Without a client, the
    rows are every runtime of this process (in-process workers' included).
    """

    rows: tuple[dict, ...]

    def __iter__(self) -> Iterator[dict]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __str__(self) -> str:
        return format_table(self.rows)

    __repr__ = __str__

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # IPython
        printer.text(str(self))


def status(client: Any = None) -> StreamsStatus:
    """The stream runtimes of this process, or of every worker of ``client``.

    Parameters
    ----------
    client
        A ``distributed.Client``: one ``client.run`` on every worker; a worker
        that fails to answer gets a row with its ``error``. ``None``: this
        process (the threaded scheduler and ``scheduler="gpustreams"``).

    Returns
    -------
    StreamsStatus
        ``.rows`` as data; ``print()`` shows a table. See :class:`StreamsStatus`.

    Creates no runtime and changes nothing (runtime counters are read as they are).
    """
    if client is None:
        return StreamsStatus(tuple(process_rows()))
    rows: list[dict] = []
    for address, part in sorted(client.run(_worker_rows, on_error="return").items()):
        if isinstance(part, BaseException):
            rows.append(_row(worker=address, error=f"{type(part).__name__}: {part}"))
        else:
            rows.extend(part)
    return StreamsStatus(tuple(rows))


def process_rows(worker: Any = None) -> list[dict]:
    """The rows of this process (``worker`` None) or of ``worker`` (a distributed Worker)."""
    from dask_gpustreams.runtime.runtime import live_runtimes

    base: dict[str, Any] = {"worker": None if worker is None else worker.address}
    plugin = None if worker is None else worker.plugins.get("gpustreams")
    if worker is None:
        from dask_gpustreams.config import enabled

        try:
            base["enabled"] = enabled()
        except ValueError as e:
            base["enabled"], base["error"] = False, str(e)
        runtimes = live_runtimes()
    else:
        base["enabled"] = bool(getattr(plugin, "_active", False))
        if base["enabled"]:  # else none are counted: "-", not 0
            base.update(egress_counts(plugin))
        runtime = getattr(plugin, "runtime", None) if base["enabled"] else None
        runtimes = [runtime] if runtime is not None else []
    rows = [_row(**base, **runtime_counts(rt)) for rt in runtimes]
    if worker is None and "error" not in base:
        # What this process's config gives now, where no runtime has it: a bad value, or,
        # while enabled (or with no runtime at all), the settings a compute's runtime gets.
        configured = _configured(None)
        if (
            not rows
            or "error" in configured
            or (base["enabled"] and all(r["settings"] != configured["settings"] for r in rows))
        ):
            rows.append(_row(**base, **configured))
    return rows or [_row(**base, **_configured(plugin))]


def _worker_rows(dask_worker: Any) -> list[dict]:
    return process_rows(dask_worker)


def egress_counts(plugin: Any) -> dict:
    """A worker plugin's egress waits, their seconds and the kernel failures it found."""
    egress = getattr(plugin, "egress", None)
    provenance = getattr(plugin, "provenance", None)
    return {
        "egress_waits": getattr(egress, "waits", 0),
        "egress_wait_seconds": getattr(egress, "wait_seconds", 0.0),
        "failures": getattr(provenance, "kernel_failures", 0),
    }


def _settings(config: Any) -> dict:
    return {k.replace("_", "-"): v for k, v in asdict(config).items()}


def _configured(plugin: Any) -> dict:
    """The settings a runtime would get here (a worker: its plugin's), without creating one.

    A worker's plugin whose settings are bad gives its error (its tasks fail with it).
    """
    from dask_gpustreams.config import StreamsConfig

    if getattr(plugin, "error", None) is not None:
        return {"error": str(plugin.error)}
    try:
        config = getattr(plugin, "config", None) or StreamsConfig.from_dask_config()
    except ValueError as e:
        return {"error": str(e)}
    return {
        "backend": config.backend,
        "streams": config.streams,
        "policy": config.policy,
        "settings": _settings(config),
    }


def runtime_counts(runtime: Any) -> dict:
    """A runtime's settings and counters (no locks taken, nothing released or created)."""
    tasks_run = waits = in_flight = 0
    held: dict[int, int] = {}
    for stream in runtime.stream_stats():
        if stream.kind == "compute":
            tasks_run += stream.recorded
            waits += stream.waits
            in_flight += stream.launching + stream.in_flight
        for refs in stream.held:
            _held_arrays(refs, held)
    pinned = runtime.pinned_stats()
    return {
        "started": True,
        "backend": runtime.backend_name,
        "device": runtime.device_id,
        "streams": runtime.n_streams,
        "policy": runtime.config.policy,
        "settings": _settings(runtime.config),
        "tasks_run": tasks_run,
        "tasks_in_flight": in_flight,
        "held_bytes": sum(held.values()),
        "pinned_staging_bytes": pinned.staging_bytes,
        "pinned_results_bytes": pinned.results_bytes,
        "pinned_limit_bytes": pinned.limit_bytes,
        "stream_waits": waits,
    }


def _held_arrays(refs: Any, found: dict[int, int], depth: int = 0) -> None:
    """Add ``id -> nbytes`` of the arrays in ``refs`` (a task's inputs and holds)."""
    if refs is None or depth > 3:
        return
    if isinstance(refs, Mapping):
        refs = refs.values()
    elif not isinstance(refs, (tuple, list)):
        nbytes = getattr(refs, "nbytes", None)
        if isinstance(nbytes, int):
            found[id(refs)] = nbytes
        return
    for ref in refs:
        _held_arrays(ref, found, depth + 1)


def _row(**values: Any) -> dict:
    row = dict.fromkeys(STATUS_FIELDS)
    row.update(host=socket.gethostname(), pid=os.getpid(), enabled=False, started=False)
    row.update(values)
    return row


# --- the table --------------------------------------------------------------------------------

_COLUMNS = (
    "worker",
    "enabled",  # gpustreams.enabled, not whether a runtime ran: scheduler="gpustreams" needs none
    "backend",
    "dev",
    "streams",
    "policy",
    "tasks",
    "in flight",
    "held",
    "pinned",
    "stream waits",
    "egress waits",
    "failures",
)


def _cells(row: dict) -> list[str]:
    def size(n: Any) -> str:
        return "-" if n is None else format_bytes(n)

    started = row["started"]
    backend = row["backend"] or "-"
    if not started and row["backend"] is not None:
        backend += " (not started)"
    egress = "-"
    if row["egress_waits"] is not None:
        egress = f"{row['egress_waits']} ({row['egress_wait_seconds']:.3g} s)"
    pinned = "-"
    if started:
        used = row["pinned_staging_bytes"] + row["pinned_results_bytes"]
        pinned = f"{size(used)} / {size(row['pinned_limit_bytes'])}"
    return [
        row["worker"] or f"pid {row['pid']}",
        "yes" if row["enabled"] else "no",
        backend,
        "-" if row["device"] is None else str(row["device"]),
        "-" if row["streams"] is None else str(row["streams"]),
        row["policy"] or "-",
        str(row["tasks_run"]) if started else "-",
        str(row["tasks_in_flight"]) if started else "-",
        size(row["held_bytes"]) if started else "-",
        pinned,
        str(row["stream_waits"]) if started else "-",
        egress,
        "-" if row["failures"] is None else str(row["failures"]),
    ]


#: The settings that are byte sizes, shown as such (``block-size`` counts values, not bytes).
_BYTE_SETTINGS = frozenset(
    ("pinned-pool-size", "launch-ahead", "small-blocks", "large-tasks", "shared-blocks")
)


def _setting_text(settings: dict) -> str:
    shown = {k: v for k, v in settings.items() if k not in ("backend", "streams", "policy")}
    parts = []
    for k, v in shown.items():
        if isinstance(v, int) and not isinstance(v, bool) and k in _BYTE_SETTINGS:
            v = format_bytes(v)
        elif v is None:
            v = "auto"
        parts.append(f"{k}={v}")
    return " ".join(parts)


def _label(row: dict) -> str:
    return row["worker"] or f"pid {row['pid']}"


def format_table(rows: tuple[dict, ...] | list[dict]) -> str:
    """The rows of :class:`StreamsStatus` as a text table, then their settings and errors."""
    if not rows:
        return "gpustreams: no process answered"
    table = [list(_COLUMNS)] + [_cells(r) for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(_COLUMNS))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in table
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    settings: dict[str, list[str]] = {}
    for r in rows:
        if r["settings"]:
            settings.setdefault(_setting_text(r["settings"]), []).append(_label(r))
    if len(settings) == 1:
        lines += [f"settings: {text}" for text in settings]
    else:  # which rows have which: the table shows only backend, streams and policy
        lines += [
            f"settings ({', '.join(dict.fromkeys(who))}): {text}"
            for text, who in sorted(settings.items())
        ]
    for r in rows:
        if r["error"]:
            lines.append(f"error ({_label(r)}): {r['error']}")
    return "\n".join(lines)
