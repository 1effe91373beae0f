"""Modes measured in turn (``bench_shapes --rounds``, ``bench_overhead``), on the sim.

The host's drift between calls is as large as the differences these benchmarks report, so
their modes take turns and their ratios are paired by round: these tests keep that so.
"""

from __future__ import annotations

import json
import statistics

import pytest

from benchmarks import bench_overhead, bench_shapes


def test_shapes_in_rounds_share_the_samples_and_pair_the_ratios(tmp_path):
    out = tmp_path / "shapes"
    argv = ["--backend", "sim", "--schedulers", "threaded", "--families", "wide"]
    argv += ["--shapes", "linear", "--width", "2", "--depth", "2", "--kernel-ms", "2"]
    argv += ["--modes", "serial-sync,launcher,ideal", "--streams", "1,2", "--policies", "auto"]
    argv += ["--ideal", "layers,rr", "--warmup", "1", "--samples", "3"]
    argv += ["--rounds", "2", "--out", str(out)]
    assert bench_shapes.main(argv) == 0
    data = json.loads((out / "results.json").read_text())
    rows = data["rows"]
    assert all(r["status"] == "ok" for r in rows), [(r["mode"], r["error"]) for r in rows]
    # The process's host speed goes with the run (short-kernel shapes correlate with it).
    assert data["meta"]["host_loop_ns"] > 0
    measured = [r for r in rows if not r.get("note")]
    # 3 samples over 2 rounds: 2 then 1, each row with its walls per round.
    for r in measured:
        assert [len(w) for w in r["round_walls_ms"]] == [2, 1], r
        assert sorted(sum(r["round_walls_ms"], [])) == sorted(r["walls_ms"])
    # One stream: the ideal is measured once and reported for its other assignment too.
    alias = [r for r in rows if r.get("note")]
    assert [(r["mode"], r["policy"], r["streams"]) for r in alias] == [("ideal", "rr", 1)]
    assert alias[0]["walls_ms"] and alias[0]["walls_ms"] == next(
        r["walls_ms"] for r in measured if (r["mode"], r["streams"]) == ("ideal", 1)
    )
    base = next(r for r in rows if r["mode"] == "serial-sync")
    launcher = next(r for r in rows if r["mode"] == "launcher" and r["streams"] == 2)
    want = statistics.median(
        statistics.median(b) / statistics.median(w)
        for b, w in zip(base["round_walls_ms"], launcher["round_walls_ms"], strict=True)
    )
    assert launcher["paired_vs_plain_best"] == pytest.approx(want)
    assert "paired by round" in (out / "table.txt").read_text()


def test_rounds_and_samples_must_be_counts():
    with pytest.raises(SystemExit):
        bench_shapes.parse_args(["--rounds", "0"])
    with pytest.raises(SystemExit):
        bench_shapes.parse_args(["--samples", "0", "--rounds", "2"])
    assert bench_shapes.parse_args([]).rounds == 1


def test_overhead_modes_take_turns_and_pair_with_plain_sync(tmp_path, monkeypatch):
    order = []
    run_once = bench_overhead.run_once

    def noted(get, dsk, keys, config, threads):
        order.append((get, config.get("gpustreams.enabled"), config.get("gpustreams.policy")))
        return run_once(get, dsk, keys, config, threads)

    monkeypatch.setattr(bench_overhead, "run_once", noted)
    out = tmp_path / "overhead"
    argv = ["--backend", "sim", "--tasks", "40", "--graphs", "chains", "--policies", "auto"]
    argv += ["--repeats", "2", "--streams", "2", "--threads", "2", "--out", str(out)]
    assert bench_overhead.main(argv) == 0
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert [r["samples"] for r in rows] == [2] * 6
    assert all(r["status"] == "ok" for r in rows)
    assert rows[0]["mode"] == "plain sync" and rows[0]["us_per_task_vs_plain_sync"] == 0
    # Three rounds (a warm-up, then 2) of all six modes, each round starting one further.
    modes = list(dict.fromkeys(order))
    assert len(modes) == 6 and len(order) == 18
    assert [modes.index(m) for m in order[::6]] == [0, 1, 2]
    for r in rows[1:]:
        walls, base = r["walls_ms"], rows[0]["walls_ms"]
        diffs = [(w - b) * 1e3 / r["n_tasks"] for w, b in zip(walls, base, strict=True)]
        assert r["us_per_task_vs_plain_sync"] == pytest.approx(statistics.median(diffs))


def test_a_failure_in_a_later_round_names_its_round(tmp_path, monkeypatch):
    checks = []
    check = bench_shapes.Workload.check

    def wrong_in_round_one(self, results):
        checks.append(None)
        return "a wrong tile" if len(checks) == 4 else check(self, results)

    monkeypatch.setattr(bench_shapes.Workload, "check", wrong_in_round_one)
    out = tmp_path / "shapes"
    argv = ["--backend", "sim", "--schedulers", "threaded", "--families", "wide"]
    argv += ["--shapes", "linear", "--width", "2", "--depth", "2", "--kernel-ms", "1"]
    argv += ["--modes", "serial-sync,launcher", "--streams", "2", "--policies", "auto"]
    argv += ["--warmup", "0", "--samples", "2", "--rounds", "2", "--out", str(out)]
    assert bench_shapes.main(argv) == 0
    rows = {r["mode"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
    # Round 0: serial-sync, launcher; round 1: serial-sync, then the launcher's run fails.
    assert rows["launcher"]["status"] == "FAILED"
    assert rows["launcher"]["error"] == "round 1, run 0: a wrong tile"
    assert rows["launcher"]["samples"] == 1 and rows["serial-sync"]["samples"] == 2
    assert "paired_vs_plain_best" not in rows["launcher"]
