"""The benchmark suite (``python -m benchmarks``): every benchmark at ``--quick`` on the sim,
checked; a benchmark that breaks fails the run; ``compare`` flags regressions, not noise."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks import compare, suite
from benchmarks.__main__ import main
from tests.conftest import CHILD_PATH, REPO_ROOT


@pytest.mark.slow
def test_quick_suite_runs_every_benchmark_on_the_sim_with_correct_results(tmp_path, capsys):
    argv = ["run", "--quick", "--backend", "sim", "--out", str(tmp_path)]
    assert main([*argv, "--machine", "ci", "--commit", "abc123"]) == 0, capsys.readouterr().out
    path = tmp_path / "ci" / "abc123-sim-quick.json"
    data = json.loads(path.read_text())
    assert data["format"] == suite.FORMAT
    assert (data["machine"]["name"], data["commit"], data["backend"]) == ("ci", "abc123", "sim")
    assert data["quick"] is True and data["source_digest"]
    assert set(data["benchmarks"]) == set(suite.BENCHMARKS)
    keys = [(r["benchmark"], r["case"], r["mode"]) for r in data["results"]]
    assert len(keys) == len(set(keys)), "a (benchmark, case, mode) twice"
    for name, record in data["benchmarks"].items():
        rows = [r for r in data["results"] if r["benchmark"] == name]
        assert record["rc"] == 0 and rows and record["rows"] == len(rows), (name, record)
        assert (tmp_path / "ci" / "abc123-sim-quick" / record["raw"]).is_dir()
        wrong = [(r["case"], r["mode"], r["check"], r["error"]) for r in rows if r["check"] != "ok"]
        assert not wrong, (name, wrong)  # a fast wrong answer is a failure, so is a skip here
        for r in rows:
            assert r["samples"] == len(r["values"]) >= 2 and r["unit"] == "ms", (name, r)
            assert r["min"] <= r["median"] <= r["max"] and r["spread"] >= 0, (name, r)
    # The run compared with itself: every row within the threshold, exit 0 even when asked.
    capsys.readouterr()
    assert main(["compare", str(path), str(path), "--fail-on-regression"]) == 0
    out = capsys.readouterr().out
    assert f"{len(keys)} rows: 0 regressions, 0 faster" in out
    # A second run of the same commit never overwrites the first.
    second = suite._new_path(tmp_path / "ci" / "abc123-sim-quick")
    assert second.name == "abc123-sim-quick-1"


def test_a_broken_benchmark_fails_the_run_with_an_error_row(tmp_path, monkeypatch, capsys):
    broken = suite.Benchmark(
        "broken", "benchmarks.no_such_module", "a module that is gone", lambda b, q: [], None
    )
    monkeypatch.setitem(suite.BENCHMARKS, "broken", broken)
    argv = ["run", "--quick", "--only", "broken", "--out", str(tmp_path), "--machine", "m"]
    assert main([*argv, "--commit", "c"]) == 1
    data = json.loads((tmp_path / "m" / "c-sim-quick.json").read_text())
    (row,) = data["results"]
    assert row["check"] == "error" and "no rows (exit 1)" in row["error"], row
    assert data["benchmarks"]["broken"]["rc"] == 1


def test_rows_of_a_cut_run_are_read_from_rows_jsonl(tmp_path):
    (tmp_path / "rows.jsonl").write_text(
        json.dumps({"graph": "wide", "mode": "plain sync", "status": "ok", "walls_ms": [1.0]})
        + "\n"
    )
    meta, rows = suite.read_raw(tmp_path)
    assert "unfinished" in meta["note"] and rows[0]["graph"] == "wide"
    row = suite.overhead_rows(meta, rows[0])
    assert (row["case"], row["mode"], row["check"], row["samples"]) == (
        "wide",
        "plain sync",
        "ok",
        1,
    )


def _suite(rows: list[tuple]) -> dict:
    """A suite file of ``(case, mode, median, spread, check)`` rows of one benchmark."""
    return {
        "format": suite.FORMAT,
        "machine": {"name": "m"},
        "commit": "c",
        "backend": "sim",
        "results": [
            {"benchmark": "b", "case": c, "mode": m, "median": x, "spread": s, "check": k}
            for c, m, x, s, k in rows
        ],
    }


def test_compare_flags_regressions_beyond_noise_only(tmp_path):
    old = _suite(
        [
            ("slower", "a", 10.0, 0.5, "ok"),  # 13.0 +- 0.5: 1.3x, 3 ms > 1 ms of noise
            ("noisy", "a", 10.0, 2.0, "ok"),  # 12.0 +- 2.0: 1.2x, 2 ms < 4 ms of noise
            ("same", "a", 10.0, 0.1, "ok"),  # 10.5: 1.05x, within the threshold
            ("faster", "a", 10.0, 0.1, "ok"),  # 5.0: 0.5x
            ("wrong", "a", 10.0, 0.1, "ok"),  # 1.0 but FAILED: a fast wrong answer
            ("gone", "a", 10.0, 0.1, "ok"),
        ]
    )
    new = _suite(
        [
            ("slower", "a", 13.0, 0.5, "ok"),
            ("noisy", "a", 12.0, 2.0, "ok"),
            ("same", "a", 10.5, 0.1, "ok"),
            ("faster", "a", 5.0, 0.1, "ok"),
            ("wrong", "a", 1.0, 0.1, "failed"),
            ("added", "a", 1.0, 0.1, "ok"),
        ]
    )
    lines = {x["key"][1]: x for x in compare.compare(old, new, threshold=1.1)}
    verdicts = {case: x["verdict"] for case, x in lines.items()}
    assert verdicts == {
        "slower": "REGRESSION",
        "noisy": "noise",
        "same": "",
        "faster": "faster",
        "wrong": "REGRESSION (check failed)",
        "gone": "gone",
        "added": "new",
    }
    assert lines["slower"]["ratio"] == pytest.approx(1.3)
    assert lines["noisy"]["noise"] == pytest.approx(4.0)
    # A looser threshold lets the 1.3x slowdown pass; the wrong result still fails.
    assert compare.verdict(old["results"][0], new["results"][0], 1.5)[1] == ""

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(old))
    b.write_text(json.dumps(new))
    cmd = [sys.executable, "-m", "benchmarks", "compare", str(a), str(b)]
    env = {"PYTHONPATH": CHILD_PATH, "PATH": "/usr/bin:/bin"}
    plain = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    assert plain.returncode == 0, plain.stderr  # a report, not a failure, unless asked
    assert "7 rows: 2 regressions, 1 faster, 1 beyond the threshold within noise" in plain.stdout
    strict = subprocess.run(
        [*cmd, "--fail-on-regression"], cwd=REPO_ROOT, env=env, capture_output=True, text=True
    )
    assert strict.returncode == 1, strict.stdout
    without = _suite([r[:5] for r in [("noisy", "a", 12.0, 2.0, "ok")]])
    b.write_text(json.dumps(without))
    calm = subprocess.run(
        [*cmd, "--fail-on-regression"], cwd=REPO_ROOT, env=env, capture_output=True, text=True
    )
    assert calm.returncode == 0, calm.stdout  # noise and rows gone are no regression


def test_compare_refuses_a_file_of_another_format(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"meta": {}, "rows": []}))  # a module's results.json
    with pytest.raises(SystemExit) as e:
        main(["compare", str(bad), str(bad)])
    assert e.value.code == 2
    assert "is not 'dask-gpustreams-bench/1'" in capsys.readouterr().err
