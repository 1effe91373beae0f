"""The ordinary-workloads benchmark end to end at ``--quick`` sizes, and its result checks."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks import bench_workloads as bw


def test_quick_run_is_correct_and_writes_its_outputs(tmp_path):
    backend = "sim" if bw.sim_has_ops() else "numpy"
    out = tmp_path / "run"
    assert bw.main(["--backend", backend, "--quick", "--out", str(out)]) == 0
    for name in ("results.json", "results.csv", "table.txt", "speedup.png", "rows.jsonl"):
        assert (out / name).stat().st_size > 0, name
    data = json.loads((out / "results.json").read_text())
    rows = data["rows"]
    assert {(r["workload"], r["mode"]) for r in rows} == {
        (w, m) for w in bw.WORKLOADS for m in bw.MODES
    }
    assert len((out / "rows.jsonl").read_text().splitlines()) == len(rows)
    status = [f"{r['workload']}/{r['mode']}: {r['status']} {r['error']}" for r in rows]
    assert all(r["status"] in ("ok", "SKIPPED") for r in rows), status
    ran = {r["workload"] for r in rows if r["status"] == "ok"}
    assert len(ran) >= len(bw.WORKLOADS) // 2, status
    for r in rows:
        if r["workload"] in ran and r["mode"] != "launcher":
            assert r["status"] == "ok" and r["samples"] == 5 and r["n_tasks"] > 0, r
        if r["mode"] == "launcher" and data["meta"]["launcher"] != "registered":
            assert r["status"] == "SKIPPED" and r["error"] == data["meta"]["launcher"]
        if r["status"] == "ok" and backend == "sim":
            assert r["peak_held"] >= r["peak_used"] >= r["base_bytes"] and r["peak_used"] > 0
    means = data["meta"]["geomean"]
    assert means["threads"]["speedup_vs_threads"] == pytest.approx(1.0)
    assert "geometric mean" in (out / "table.txt").read_text()


@pytest.mark.parametrize(
    ("got", "tol", "expected"),
    [
        (np.array([1.0, 2.0, 3.0]), None, None),
        (np.array([1.0, 2.0, 3.0 + 1e-12]), None, "1 of 3 differ"),
        (np.array([1.0, 2.0, 3.0 + 1e-12]), (1e-5, 1e-6), None),
        (np.array([1.0, 2.0, 3.1]), (1e-5, 1e-6), "not allclose"),
        (np.array([1.0, np.nan, 3.0]), (1e-5, 1e-6), "1 NaN of 3"),
        (np.array([1.0, 2.0]), None, "expected float64[3]"),
        (np.array([1.0, 2.0, 3.0], np.float32), None, "float32[3], expected float64[3]"),
    ],
)
def test_a_wrong_result_is_named(got, tol, expected):
    found = bw.problem(bw.NumpyArrays(), got, np.array([1.0, 2.0, 3.0]), tol)
    assert (found is None) if expected is None else (expected in found), found


def _row(mode: str, rounds: list[list[float]]) -> dict:
    walls = [w for r in rounds for w in r]
    return {
        "workload": "w",
        "mode": mode,
        "status": "ok",
        "wall_median_ms": float(np.median(walls)),
        "round_walls_ms": rounds,
    }


def test_paired_speedups_follow_the_rounds_through_a_host_that_drifts():
    """The launcher is 5% faster than plain sync in two rounds of three; in the third the
    host was three times slower while the launcher ran. The ratio of medians says 0.35x,
    the median over rounds of each round's ratio 1.05x; against threads it follows the
    better plain mode."""
    rows = [
        _row("threads", [[200.0], [200.0], [600.0]]),
        _row("sync", [[105.0], [105.0], [315.0]]),
        _row("launcher", [[100.0], [315.0], [300.0]]),
    ]
    means = bw.derive(rows)
    launcher = rows[2]
    assert launcher["speedup_vs_best"] == pytest.approx(105.0 / 300.0)
    assert launcher["paired_vs_best"] == pytest.approx(1.05)
    assert rows[1]["paired_vs_best"] == pytest.approx(1.0)
    assert means["launcher"]["paired_vs_best"] == pytest.approx(1.05)


def test_no_paired_speedup_where_the_rounds_differ():
    rows = [_row("sync", [[100.0], [100.0]]), _row("launcher", [[90.0]])]
    bw.derive(rows)
    assert rows[1]["paired_vs_best"] is None and rows[1]["speedup_vs_best"] is not None


def test_each_run_starts_after_a_full_collection(tmp_path, monkeypatch):
    """A garbage collection (85-130 ms on the H200's matmul) of what earlier runs left must
    not land in a random sample: one full collection before each run, warm-ups included."""
    backend = "sim" if bw.sim_has_ops() else "numpy"
    collections = []
    monkeypatch.setattr(bw.gc, "collect", lambda *a: collections.append(a) or 0)
    argv = ["--backend", backend, "--quick", "--workloads", "tiny-tasks", "--modes", "sync"]
    argv += ["--samples", "3", "--rounds", "1", "--warmup", "1", "--out", str(tmp_path / "r")]
    assert bw.main(argv) == 0
    assert collections == [()] * 4
