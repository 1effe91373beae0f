"""The benchmark suite: every registered benchmark, one result file keyed by machine and commit.

::

    python -m benchmarks run --quick --backend sim --out /tmp/suite   # all of it, seconds
    python -m benchmarks run --backend cupy --only workloads,overhead --machine h200 --out "$OUT"
    python -m benchmarks list

Each benchmark is one of the existing modules (``bench_workloads``, ``bench_shapes``,
``bench_cluster``, ``bench_overhead``, ``bench_copy``), run by its own command line in a
subprocess of its own (as asv does: no state crosses from one to the next, and
``CUDA_DEVICE_MAX_CONNECTIONS`` is read fresh), with the arguments of :data:`BENCHMARKS` for
``--quick`` or for a full run. The suite then reads the module's ``results.json`` (or, when
the module was cut short, its ``rows.jsonl``) and writes one file,
``OUT/<machine>/<commit>-<backend>[-quick].json`` (never overwritten: ``-1``, ``-2``, ...
where it exists), beside the modules' own outputs in the directory of the same name:

- ``machine`` (name, host, device, CPUs, platform, Python), ``commit`` (``git rev-parse``,
  or ``--commit``), ``dirty``, ``source_digest`` (``report.source_digest``: the package's
  and the benchmarks' sources, the same on any machine for the same code), ``backend``,
  ``quick``, ``command``, ``started``, ``elapsed_s``;
- ``benchmarks``: per benchmark, its command, exit code (``"timeout"`` past ``--timeout-s``),
  seconds, row count and the directory of its own outputs;
- ``results``: one row per benchmark, case and mode: ``median`` and ``spread`` (the
  inter-quartile range of the samples), ``min``, ``max``, ``unit`` (ms of wall time),
  ``samples``, ``values`` (every sample), ``check`` (``ok``; ``failed``: a wrong result,
  however fast; ``error``: an exception; ``skipped``: not run, with the reason in
  ``error``) and ``extra`` (the module's derived metrics: speedups, saturation, memory).

``python -m benchmarks compare A.json B.json`` (``benchmarks/compare.py``) reads two such
files. ``run`` exits 1 when a row's check is ``failed`` or ``error`` or a benchmark exits
nonzero, so a benchmark that rots fails CI (``tests/test_benchmarks_suite.py`` runs
``--quick`` on the sim).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.report import REPO, source_digest

FORMAT = "dask-gpustreams-bench/1"
BACKENDS = ("sim", "cupy")
CHECKS = ("ok", "failed", "error", "skipped")
_STATUS = {"ok": "ok", "FAILED": "failed", "ERROR": "error", "SKIPPED": "skipped"}


# --- rows: each module's rows into the suite's ---------------------------------------------------


def _row(
    case: str, mode: str, raw: dict, *, median: str, spread: str, lo: str, hi: str, values: str
) -> dict:
    """The common fields of a suite row from a module's ``raw`` row (field names given)."""
    status = raw.get("status")
    if status is None:  # bench_copy before the suite: a boolean only
        status = "ok" if raw.get("correct", True) else "FAILED"
    return {
        "case": case,
        "mode": mode,
        "unit": "ms",
        "median": raw.get(median),
        "spread": raw.get(spread),
        "min": raw.get(lo),
        "max": raw.get(hi),
        "samples": len(raw.get(values) or []),
        "values": raw.get(values) or [],
        "check": _STATUS.get(status, "error"),
        "error": raw.get("error") or "",
    }


def _wall(case: str, mode: str, raw: dict, extra: tuple[str, ...]) -> dict:
    row = _row(
        case,
        mode,
        raw,
        median="wall_median_ms",
        spread="wall_iqr_ms",
        lo="wall_min_ms",
        hi="wall_max_ms",
        values="walls_ms",
    )
    row["extra"] = {k: raw[k] for k in extra if raw.get(k) is not None}
    return row


def workloads_rows(meta: dict, raw: dict) -> dict | None:
    extra = (
        "n_tasks",
        "peak_held",
        "peak_used",
        "speedup_vs_best",
        "paired_vs_best",
        "speedup_vs_threads",
    )
    return _wall(raw["workload"], raw["mode"], raw, extra)


def cluster_rows(meta: dict, raw: dict) -> dict | None:
    extra = ("n_tasks", "peak_held", "peak_used", "speedup_vs_off", "speedup_vs_first")
    return _wall(f"{raw['workload']}/workers={raw.get('workers', 1)}", raw["mode"], raw, extra)


def shapes_rows(meta: dict, raw: dict) -> dict | None:
    if raw.get("note"):  # a copy of a one-stream row for another policy: the same run
        return None
    policy = f":{raw['policy']}" if raw.get("policy") else ""
    case = f"{raw['scheduler']}/{raw['family']}/{raw['shape']}"
    mode = f"{raw['mode']}{policy}/streams={raw['streams']}"
    extra = ("n_tasks", "kernel_ms", "saturation", "speedup", "efficiency")
    return _wall(case, mode, raw, extra)


def overhead_rows(meta: dict, raw: dict) -> dict | None:
    extra = ("n_tasks", "us_per_task", "us_per_task_vs_plain_sync")
    return _wall(raw["graph"], raw["mode"], raw, extra)


def copy_rows(meta: dict, raw: dict) -> dict | None:
    case = f"{meta.get('chunks')}x{meta.get('chunk_mib', 0):g}MiB"
    row = _row(
        case,
        raw["mode"],
        raw,
        median="median_ms",
        spread="iqr_ms",
        lo="min_ms",
        hi="max_ms",
        values="walls_ms",
    )
    row["extra"] = {k: raw[k] for k in ("gbps", "of_bound", "speedup_vs_off", "of_ideal")}
    return row


# --- the registry ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Benchmark:
    """One registered benchmark: a module's command line and how to read its rows."""

    name: str
    module: str
    what: str
    #: ``(backend, quick) -> arguments`` of the module, without ``--out``.
    argv: Callable[[str, bool], list[str]]
    #: ``(meta, raw row) -> suite row`` (without ``benchmark``), or None to leave it out.
    rows: Callable[[dict, dict], dict | None]

    def command(self, backend: str, quick: bool, out: str) -> list[str]:
        return [sys.executable, "-m", self.module, *self.argv(backend, quick), "--out", out]


def _workloads(backend: str, quick: bool) -> list[str]:
    if quick:
        return ["--backend", backend, "--quick", "--samples", "2", "--warmup", "0"]
    return ["--backend", backend]


def _shapes(backend: str, quick: bool) -> list[str]:
    if quick:  # every family, scheduler and mode, at toy sizes
        return [
            *("--backend", backend, "--families", "wide,dagger", "--shapes", "linear,tangled"),
            *("--schedulers", "threaded,distributed", "--policies", "auto"),
            *("--streams", "4", "--dist-streams", "4", "--dagger-streams", "4"),
            *("--width", "4", "--depth", "3", "--kernel-ms", "1", "--dist-kernel-ms", "1"),
            *("--matrix", "128", "--tile", "64", "--chain-len", "2", "--ideal", "layers"),
            *("--gantt-policies", "auto", "--samples", "2", "--warmup", "0"),
        ]
    if backend == "sim":  # the run of results/sim-8x6-20ms/
        return [
            *("--backend", "sim", "--kernel-ms", "20", "--dist-kernel-ms", "20"),
            *("--depth", "6", "--samples", "3", "--warmup", "1"),
        ]
    return [  # the H200 command of benchmarks/README.md
        *("--backend", "cupy", "--warmup", "1"),
        *("--dist-policies", "auto,round-robin,least-loaded"),
        *("--gantt-policies", "auto,round-robin", "--budget-s", "270"),
    ]


def _cluster(backend: str, quick: bool) -> list[str]:
    if quick:
        return [
            *("--backend", backend, "--quick", "--workloads", "matmul,tiny-tasks"),
            *("--samples", "2", "--warmup", "0"),
        ]
    return ["--backend", backend, "--samples", "3"]


def _overhead(backend: str, quick: bool) -> list[str]:
    if quick:
        return ["--backend", backend, "--tasks", "200", "--repeats", "2", "--policies", "auto"]
    return ["--backend", backend, "--tasks", "10000", "--repeats", "3"]


def _copy(backend: str, quick: bool) -> list[str]:
    if quick:
        size = ["--chunks", "8", "--chunk-mib", "0.25" if backend == "sim" else "4"]
        runs = ["--samples", "2", "--warmup", "1", "--sim-kernel-ms", "2"]
        return ["--backend", backend, *size, *runs]
    if backend == "sim":
        return ["--backend", "sim", "--chunks", "16", "--chunk-mib", "4"]
    return ["--backend", "cupy", "--chunks", "64", "--chunk-mib", "64", "--samples", "7"]


BENCHMARKS: dict[str, Benchmark] = {
    b.name: b
    for b in (
        Benchmark(
            "workloads",
            "benchmarks.bench_workloads",
            "thirteen dask.array/delayed workloads: threads, sync, launcher, enabled-threads, "
            "enabled-sync",
            _workloads,
            workloads_rows,
        ),
        Benchmark(
            "shapes",
            "benchmarks.bench_shapes",
            "wide and Dagger DAGs: serial, ptds-sync, gpustreams, launcher, hand-launched ideal",
            _shapes,
            shapes_rows,
        ),
        Benchmark(
            "cluster",
            "benchmarks.bench_cluster",
            "the ordinary workloads on a one-worker cluster: plugin off, on, on-noblocks",
            _cluster,
            cluster_rows,
        ),
        Benchmark(
            "overhead",
            "benchmarks.bench_overhead",
            "host cost per no-op task: plain Dask, the plugin by config, the launcher",
            _overhead,
            overhead_rows,
        ),
        Benchmark(
            "copy",
            "benchmarks.bench_copy",
            "upload/kernel/download pipeline: plugin off, on, on-small, hand-launched ideal",
            _copy,
            copy_rows,
        ),
    )
}


# --- running ------------------------------------------------------------------------------------


def _git(*args: str) -> str | None:
    try:
        proc = subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip()


def machine_info(name: str | None) -> dict:
    host = platform.node()
    return {
        "name": name or re.sub(r"[^A-Za-z0-9_.-]", "_", host) or "unknown",
        "host": host,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def read_raw(path: Path) -> tuple[dict, list[dict]]:
    """A module's ``(meta, rows)``: ``results.json``, else the ``rows.jsonl`` of a cut run."""
    if (path / "results.json").exists():
        data = json.loads((path / "results.json").read_text())
        return data.get("meta", {}), data.get("rows", [])
    if (path / "rows.jsonl").exists():
        lines = (path / "rows.jsonl").read_text().splitlines()
        return {"note": "rows.jsonl of an unfinished run"}, [json.loads(x) for x in lines if x]
    return {}, []


def _new_path(base: Path) -> Path:
    path, i = base, 1
    while path.with_suffix(".json").exists() or path.exists():
        path, i = base.with_name(f"{base.name}-{i}"), i + 1
    return path


def run_one(bench: Benchmark, backend: str, quick: bool, raw: Path, timeout: float | None):
    """Run ``bench``'s module into ``raw``; returns (its record, its suite rows, its meta)."""
    cmd = bench.command(backend, quick, str(raw))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    log = raw.parent / f"{bench.name}.log"
    print(f"== {bench.name}: {' '.join(cmd[1:])}", flush=True)
    t0 = time.monotonic()
    with open(log, "w") as f:
        # A session of its own: past the timeout, its whole process group goes (bench_shapes'
        # ptds-sync child, a cluster's workers), not the module's process alone.
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            rc: int | str = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = "timeout"
    seconds = time.monotonic() - t0
    meta, raw_rows = read_raw(raw)
    rows = []
    for r in raw_rows:
        row = bench.rows(meta, r)
        if row is not None:
            rows.append({"benchmark": bench.name, **row})
    if not rows:
        tail = log.read_text().strip().splitlines()[-1:] or [""]
        rows.append(
            {
                "benchmark": bench.name,
                "case": "(run)",
                "mode": "(run)",
                "unit": "ms",
                "median": None,
                "spread": None,
                "samples": 0,
                "values": [],
                "check": "error",
                "error": f"no rows (exit {rc}): {tail[0][:300]}",
            }
        )
    record = {
        "module": bench.module,
        "argv": cmd[1:],
        "rc": rc,
        "seconds": round(seconds, 2),
        "rows": len(rows),
        "raw": raw.name,
        "log": log.name,
    }
    bad = sum(1 for r in rows if r["check"] in ("failed", "error"))
    print(f"   {len(rows)} rows, {bad} failed, exit {rc}, {seconds:.1f} s", flush=True)
    return record, rows, meta


def run(args: argparse.Namespace) -> int:
    machine = machine_info(args.machine)
    commit = args.commit or _git("rev-parse", "--short=12", "HEAD") or "unknown"
    status = _git("status", "--porcelain", "--untracked-files=no")
    names = args.only or list(BENCHMARKS)
    stem = f"{commit}-{args.backend}" + ("-quick" if args.quick else "")
    base = _new_path(Path(args.out) / machine["name"] / stem)
    if args.dry_run:
        for name in names:
            print(" ".join(BENCHMARKS[name].command(args.backend, args.quick, str(base / name))))
        return 0
    base.mkdir(parents=True)
    started = time.monotonic()
    suite: dict[str, Any] = {
        "format": FORMAT,
        "machine": machine,
        "commit": commit,
        "dirty": None if status is None else bool(status),
        "source_digest": source_digest(),
        "backend": args.backend,
        "quick": args.quick,
        "command": [sys.executable, "-m", "benchmarks", *args.command],
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "benchmarks": {},
        "results": [],
    }
    for name in names:
        record, rows, meta = run_one(
            BENCHMARKS[name], args.backend, args.quick, base / name, args.timeout_s
        )
        suite["benchmarks"][name] = record
        suite["results"].extend(rows)
        for key in ("device", "dask", "distributed", "numpy", "cupy", "dask_gpustreams"):
            if meta.get(key) is not None:
                target = suite["machine"] if key == "device" else suite.setdefault("versions", {})
                target.setdefault(key, meta[key])
    suite["elapsed_s"] = round(time.monotonic() - started, 1)
    path = base.with_suffix(".json")
    path.write_text(json.dumps(suite, indent=1, default=str) + "\n")
    bad = [r for r in suite["results"] if r["check"] in ("failed", "error")]
    exits = {n: b["rc"] for n, b in suite["benchmarks"].items() if b["rc"] != 0}
    for r in bad:
        print(f"{r['check'].upper()}: {r['benchmark']} {r['case']} {r['mode']}: {r['error']}")
    print(
        f"{len(suite['results'])} rows from {len(names)} benchmarks, {len(bad)} failed"
        + (f", nonzero exits {exits}" if exits else "")
        + f"; {suite['elapsed_s']:.0f} s; wrote {path}"
    )
    return 1 if bad or exits else 0


def list_benchmarks() -> int:
    for b in BENCHMARKS.values():
        print(f"{b.name:<10} python -m {b.module:<27} {b.what}")
    return 0


def _names(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in BENCHMARKS]
    if bad:
        raise argparse.ArgumentTypeError(
            f"{','.join(bad)} is not a benchmark: choose from {','.join(BENCHMARKS)}"
        )
    return names


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="toy sizes: seconds on the sim")
    p.add_argument("--backend", default="sim", choices=BACKENDS)
    p.add_argument("--only", type=_names, default=None, help="comma-separated benchmark names")
    p.add_argument(
        "--out",
        default=str(REPO / "benchmarks" / "results" / "suite"),
        help="results go to OUT/<machine>/<commit>-<backend>[-quick].json and a folder beside",
    )
    p.add_argument("--machine", default=None, help="the machine's name (default: the host name)")
    p.add_argument("--commit", default=None, help="the commit (default: git rev-parse HEAD)")
    p.add_argument(
        "--timeout-s", type=float, default=None, help="per benchmark; its rows so far are kept"
    )
    p.add_argument("--dry-run", action="store_true", help="print the commands only")
