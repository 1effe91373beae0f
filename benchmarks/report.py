"""Rows of the shape benchmark: statistics, derived metrics, table, JSON/CSV and figures."""

from __future__ import annotations

import argparse
import csv
import datetime
import hashlib
import io
import json
import math
import os
import platform
import pstats
import statistics
import subprocess
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def source_digest(root: Path = REPO) -> str:
    """A short hash of the package's and the benchmarks' Python sources under ``root``.

    Names the code a result came from without git, whose copy on a remote
    machine may be stale: compare with the digest of a checkout.
    """
    digest = hashlib.sha256()
    for path in sorted([*root.glob("dask_gpustreams/**/*.py"), *root.glob("benchmarks/*.py")]):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def out_dir(args: argparse.Namespace, backend: str) -> str:
    """A new directory: ``--out`` or the default, with a suffix if it exists already."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = args.out or str(REPO / "benchmarks" / "results" / f"{backend}-{stamp}")
    path, i = base, 1
    while os.path.exists(path) and os.listdir(path):
        path, i = f"{base}-{i}", i + 1
    os.makedirs(path, exist_ok=True)
    return path


def host_loop_ns(n: int = 200_000) -> float:
    """ns per iteration of a loop of dict reads and writes: how fast this process's host runs.

    On the H200's host it took 87.7-210.1 ns in different processes, and the launcher's
    share of ideal with 0.5 ms kernels correlated with it (``docs/launcher.md``), so every run
    records it (``environment``) to tell a slow process from a slow change.
    """
    d: dict[int, int] = {}
    t0 = time.perf_counter()
    for i in range(n):
        d[i & 1023] = d.get(i & 1023, 0) + 1
    return (time.perf_counter() - t0) / n * 1e9


def environment(backend: str) -> dict:
    """Versions, host, CUDA/CuPy/gpustreams environment variables, source digest, commit and
    device of a run (``backend``: ``cupy`` queries the current device)."""
    import dask
    import distributed
    import numpy as np

    import dask_gpustreams

    env = {
        "python": platform.python_version(),
        "dask": dask.__version__,
        "distributed": distributed.__version__,
        "numpy": np.__version__,
        "dask_gpustreams": dask_gpustreams.__version__,
        "host": platform.node(),
        "host_loop_ns": round(host_loop_ns(), 1),
        "env": {
            k: v
            for k, v in os.environ.items()
            if k.startswith(("CUDA_DEVICE_MAX", "CUPY_", "DASK_GPUSTREAMS"))
        },
    }
    env["source_digest"] = source_digest()
    try:
        env["commit"] = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=5
        ).stdout.strip()
    except Exception:
        env["commit"] = None
    if backend == "cupy":
        import cupy

        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        env["cupy"] = cupy.__version__
        env["device"] = (
            props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        )
        env["sms"] = props["multiProcessorCount"]
        env["cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
    else:
        env["device"] = "dask_gpustreams.sim"
    return env


MODE_ORDER = ("serial", "serial-sync", "ptds-sync", "gpustreams", "launcher", "ideal")
#: Modes without the plugin's stream pool (one row per shape).
UNPOOLED_MODES = ("serial", "serial-sync", "ptds-sync")
#: Modes measured per stream count and policy.
STREAM_MODES = ("gpustreams", "launcher", "ideal")
CSV_FIELDS = (
    "scheduler",
    "family",
    "shape",
    "mode",
    "policy",
    "streams",
    "n_tasks",
    "critical_path",
    "kernel_ms",
    "samples",
    "wall_median_ms",
    "wall_min_ms",
    "wall_max_ms",
    "wall_iqr_ms",
    "saturation",
    "speedup",
    "ideal_saturation",
    "efficiency",
    "status",
    "error",
)


def round_shares(samples: int, rounds: int) -> list[int]:
    """``samples`` shared out over at most ``rounds`` rounds (as many as samples at most),
    the first rounds taking one more where they do not divide evenly."""
    n = min(rounds, samples)
    return [samples // n + (k < samples % n) for k in range(n)]


def summarize(walls: list[float]) -> dict:
    """Median, min, max and inter-quartile range of wall times (ms)."""
    if not walls:
        return {}
    q = statistics.quantiles(walls, n=4, method="inclusive") if len(walls) > 1 else [walls[0]] * 3
    return {
        "wall_median_ms": statistics.median(walls),
        "wall_min_ms": min(walls),
        "wall_max_ms": max(walls),
        "wall_iqr_ms": q[2] - q[0],
    }


def profile_text(profile: Any, top: int, package: str | None = None) -> str:
    """A cProfile's ``top`` calls by own time; with ``package``, its calls by cumulative time."""
    out = io.StringIO()
    stats = pstats.Stats(profile, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    if package is not None:
        stats.sort_stats("cumulative").print_stats(package, top)
    return out.getvalue()


def derive(rows: list[dict]) -> None:
    """Fill in saturation, speedup over ``serial`` and efficiency against the best ``ideal``.

    Speedup compares with the ``serial`` row of the same scheduler and shape;
    efficiency divides by the best ``ideal`` saturation of the same scheduler,
    shape and stream count (``serial``: 1 stream; ``ptds-sync``: its threads).
    """
    serial = {}
    ideal: dict[tuple, float] = defaultdict(float)
    for r in rows:
        med = r.get("wall_median_ms")
        r["saturation"] = r["kernel_ms"] * r["n_tasks"] / med if med else None
        if r["status"] != "ok" or med is None:
            continue
        group = (r["scheduler"], r["family"], r["shape"])
        if r["mode"] == "serial":
            serial[group] = med
        if r["mode"] == "ideal":
            key = (*group, r["streams"])
            ideal[key] = max(ideal[key], r["saturation"])
    for r in rows:
        group = (r["scheduler"], r["family"], r["shape"])
        med = r.get("wall_median_ms")
        r["speedup"] = serial[group] / med if med and group in serial else None
        best = ideal.get((*group, r["streams"]))
        r["ideal_saturation"] = best
        r["efficiency"] = r["saturation"] / best if best and r["saturation"] else None


def write_json(path: str, meta: dict, rows: list[dict]) -> None:
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1, default=str)


def write_csv(path: str, rows: list[dict], fields: Sequence[str] = CSV_FIELDS) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fields, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: _fmt(r.get(k)) for k in fields})


def _fmt(v: Any) -> Any:
    return f"{v:.4g}" if isinstance(v, float) else ("" if v is None else v)


def _num(v: float | None, spec: str) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def _label(r: dict) -> str:
    return f"{r['mode']}:{r['policy']}" if r["policy"] else r["mode"]


def table(rows: list[dict], headline_streams: int = 8) -> str:
    """The printed tables: saturation by stream count, then every mode at ``headline_streams``."""
    out = []
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["scheduler"], r["family"])].append(r)
    for (scheduler, family), rs in groups.items():
        streams = sorted({r["streams"] for r in rs if r["mode"] in STREAM_MODES})
        kernel = sorted({round(r["kernel_ms"], 3) for r in rs})
        out.append(
            f"\n== {scheduler} scheduler · {family} shapes · isolated kernel {kernel} ms "
            f"· saturation (kernel ms x tasks / median wall) by stream count =="
        )
        head = f"{'shape':<10} {'mode:policy':<30}" + "".join(f"{n:>7}" for n in streams)
        out.append(head)
        cells: dict[tuple, dict] = defaultdict(dict)
        for r in rs:
            if r["mode"] in STREAM_MODES:
                cells[(r["shape"], _label(r))][r["streams"]] = r
        for (shape, label), by_n in cells.items():
            line = f"{shape:<10} {label:<30}"
            for n in streams:
                r = by_n.get(n)
                line += f"{_cell(r):>7}"
            out.append(line)
        shapes = list(dict.fromkeys(r["shape"] for r in rs))
        at = sorted(
            (r for r in rs if r["mode"] in UNPOOLED_MODES or r["streams"] == headline_streams),
            key=lambda r: (shapes.index(r["shape"]), MODE_ORDER.index(r["mode"])),
        )
        out.append(
            f"\n-- {scheduler} · {family}: serial, ptds-sync and every mode at "
            f"{headline_streams} streams --"
        )
        out.append(
            f"{'shape':<10} {'mode:policy':<30} {'n':>3} {'median ms':>10} {'[min - max]':>19} "
            f"{'IQR':>6} {'sat':>6} {'speedup':>7} {'eff':>5}  status"
        )
        for r in at:
            spread = f"[{_num(r.get('wall_min_ms'), '.1f')} - {_num(r.get('wall_max_ms'), '.1f')}]"
            eff = r.get("efficiency")
            out.append(
                f"{r['shape']:<10} {_label(r):<30} {r['streams']:>3} "
                f"{_num(r.get('wall_median_ms'), '.1f'):>10} {spread:>19} "
                f"{_num(r.get('wall_iqr_ms'), '.1f'):>6} {_num(r.get('saturation'), '.2f'):>6} "
                f"{_num(r.get('speedup'), '.2f'):>7} "
                f"{('-' if eff is None else f'{eff:.0%}'):>5}  {_status(r)}"
            )
    return "\n".join(out)


def _cell(r: dict | None) -> str:
    if r is None:
        return ""
    if r["status"] != "ok":
        return r["status"][:6]
    return _num(r.get("saturation"), ".2f")


def _status(r: dict) -> str:
    return r["status"] if not r.get("error") else f"{r['status']}: {r['error']}"


# --- figures ------------------------------------------------------------------------------------


def plot_saturation(rows: list[dict], scheduler: str, path: str) -> bool:
    """Saturation per shape (one panel each) and stream count: policies, ideal, serial, ptds."""
    rs = [r for r in rows if r["scheduler"] == scheduler and r.get("saturation")]
    if not rs:
        return False
    from matplotlib.figure import Figure

    shapes = list(dict.fromkeys((r["family"], r["shape"]) for r in rs))
    cols = min(4, len(shapes))
    nrows = math.ceil(len(shapes) / cols)
    fig = Figure(figsize=(4.2 * cols, 3.4 * nrows), layout="constrained")
    axes = fig.subplots(nrows, cols, squeeze=False).ravel()
    for ax, (family, shape) in zip(axes, shapes, strict=False):
        mine = [r for r in rs if (r["family"], r["shape"]) == (family, shape)]
        lines: dict[str, list[tuple[int, float]]] = defaultdict(list)
        for r in mine:
            if r["mode"] in STREAM_MODES and r["status"] == "ok":
                lines[_label(r)].append((r["streams"], r["saturation"]))
        for label, pts in sorted(lines.items()):
            pts.sort()
            style = "--" if label.startswith("ideal") else "-"
            ax.plot(*zip(*pts, strict=True), style, marker="o", ms=3, label=label)
        for r in mine:
            if r["mode"] in UNPOOLED_MODES and r["status"] == "ok":
                color = "black" if r["mode"] == "serial" else "gray"
                ax.axhline(r["saturation"], color=color, ls=":", lw=1, label=r["mode"])
        ax.set_xscale("log", base=2)
        ax.set_title(f"{family} {shape}", fontsize="medium")
        ax.set_xlabel("streams")
        ax.set_ylabel("saturation")
        ax.grid(alpha=0.3)
    for ax in axes[len(shapes) :]:
        ax.set_visible(False)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside right upper", fontsize="small")
    fig.suptitle(f"Saturation vs streams · {scheduler} scheduler")
    fig.savefig(path, dpi=110)
    return True


def plot_wall(rows: list[dict], scheduler: str, path: str, streams: int = 8) -> bool:
    """Median wall per shape and mode (bars, min-max whiskers); one panel per shape family.

    ``gpustreams`` and ``ideal`` rows are those at ``streams`` streams.
    """
    rs = [
        r
        for r in rows
        if r["scheduler"] == scheduler
        and r["status"] == "ok"
        and r.get("wall_median_ms")
        and (r["mode"] in UNPOOLED_MODES or r["streams"] == streams)
    ]
    if not rs:
        return False
    from matplotlib.figure import Figure

    families = list(dict.fromkeys(r["family"] for r in rs))
    labels = list(dict.fromkeys(_label(r) for r in sorted(rs, key=_mode_rank)))
    colors = {label: f"C{i % 10}" for i, label in enumerate(labels)}
    fig = Figure(figsize=(12, 3.6 * len(families)), layout="constrained")
    axes = fig.subplots(len(families), 1, squeeze=False).ravel()
    width = 0.8 / len(labels)
    for ax, family in zip(axes, families, strict=True):
        mine = [r for r in rs if r["family"] == family]
        shapes = list(dict.fromkeys(r["shape"] for r in mine))
        for j, label in enumerate(labels):
            xs, ys, lo, hi = [], [], [], []
            for i, shape in enumerate(shapes):
                r = next((r for r in mine if r["shape"] == shape and _label(r) == label), None)
                if r is None:
                    continue
                xs.append(i + (j - (len(labels) - 1) / 2) * width)
                ys.append(r["wall_median_ms"])
                lo.append(r["wall_median_ms"] - r["wall_min_ms"])
                hi.append(r["wall_max_ms"] - r["wall_median_ms"])
            if xs:
                ax.bar(xs, ys, width, yerr=[lo, hi], capsize=1.5, color=colors[label], label=label)
        ax.set_xticks(range(len(shapes)), shapes)
        ax.set_yscale("log")
        ax.set_ylabel("median wall per graph (ms)")
        ax.set_title(f"{family} shapes", fontsize="medium")
        ax.grid(axis="y", alpha=0.3)
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="outside right upper", fontsize="small")
    fig.suptitle(f"Wall time per shape and mode · {scheduler} scheduler · {streams} streams")
    fig.savefig(path, dpi=110)
    return True


def _mode_rank(r: dict) -> int:
    return MODE_ORDER.index(r["mode"])
