"""The two-GPU benchmarks' modes on the sim, so that ``benchmarks/h200_x2.sh`` cannot rot.

Each runs what the script runs on two H200s, at tiny sizes: the workloads on one worker then
two (``bench_cluster --workers 1,2``), the wide shapes on one in-process worker then two
(``bench_shapes --dist-workers 1,2``), and the per-GPU Gantt (``gantt_cluster``) on two worker
processes. Every result is checked against plain Dask or the NumPy reference.
"""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_cluster, bench_shapes, gantt_cluster


def test_workloads_on_one_worker_then_two_are_checked(tmp_path):
    out = tmp_path / "cluster"
    argv = ["--backend", "sim", "--quick", "--workers", "1,2", "--workloads", "matmul"]
    argv += ["--modes", "off,on", "--warmup", "0", "--samples", "1", "--out", str(out)]
    assert bench_cluster.main(argv) == 0
    data = json.loads((out / "results.json").read_text())
    rows = data["rows"]
    assert [(r["workers"], r["mode"]) for r in rows] == [
        (1, "off"),
        (1, "on"),
        (2, "off"),
        (2, "on"),
    ]
    assert all(r["status"] == "ok" and r["samples"] == 1 for r in rows), rows
    # the sim's pool per worker, as CuPy's on a GPU: the persisted inputs at least
    assert all(r["peak_held"] >= r["peak_used"] >= 2 * 96 * 96 * 4 for r in rows), rows
    assert all(r["speedup_vs_first"] is None for r in rows if r["workers"] == 1)
    assert all(r["speedup_vs_first"] > 0 for r in rows if r["workers"] == 2)
    assert data["meta"]["clusters"] == [
        "LocalCluster(n_workers=1, threads_per_worker=1)",
        "LocalCluster(n_workers=2, threads_per_worker=1)",
    ]
    summary = data["meta"]["summary"]["by_workers"]
    assert set(summary) == {"1", "2"} and summary["2"]["workloads"] == 1
    table = (out / "table.txt").read_text()
    assert "2 worker(s) / 1 worker(s), mode on" in table


def test_a_mode_with_settings_runs_the_plugin_with_them(tmp_path, capsys):
    assert bench_cluster.split_mode("on:launch-ahead=64MiB:streams=2") == (
        "on",
        {"launch_ahead": "64MiB", "streams": 2},
    )
    assert bench_cluster.split_mode("on-noblocks") == ("on-noblocks", {})
    for mode, message in (
        ("off:streams=2", "settings need the mode on or on-noblocks"),
        ("on:streams", "'streams' is not KEY=VALUE"),
        ("on:blocks=off", "blocks is the mode's"),
        ("on:backend=cupy", "backend the benchmark's"),
        ("on:launch-ahead=xx", "gpustreams.launch-ahead='xx' is invalid"),
        ("on:nope=1", "unexpected keyword argument 'nope'"),
        ("fast", "unknown mode 'fast'"),
    ):
        with pytest.raises(SystemExit):
            bench_cluster.parse_args(["--modes", mode])
        assert message in capsys.readouterr().err, mode
    out = tmp_path / "cluster"
    argv = ["--backend", "sim", "--quick", "--workloads", "matmul", "--warmup", "0"]
    argv += ["--modes", "off,on:streams=2", "--samples", "1", "--out", str(out)]
    assert bench_cluster.main(argv) == 0
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert [(r["mode"], r["status"]) for r in rows] == [("off", "ok"), ("on:streams=2", "ok")]
    assert rows[1]["plugin"] == {"backend": "sim", "blocks": "auto", "streams": 2}
    assert "on:streams=2" in (out / "table.txt").read_text()


def test_workers_must_be_counts():
    with pytest.raises(SystemExit):
        bench_cluster.parse_args(["--workers", "0"])
    with pytest.raises(SystemExit):
        bench_cluster.parse_args(["--workers", "two"])
    assert bench_cluster.parse_args([]).workers == [1]


def test_wide_shapes_on_one_worker_then_two(tmp_path):
    out = tmp_path / "shapes"
    argv = ["--backend", "sim", "--schedulers", "distributed", "--families", "wide"]
    argv += ["--shapes", "linear,tangled", "--width", "4", "--depth", "2", "--dist-kernel-ms", "2"]
    argv += ["--modes", "serial,gpustreams,ideal", "--dist-streams", "4", "--threads", "4"]
    argv += ["--policies", "auto", "--dist-blocks", "auto,off", "--dist-workers", "1,2"]
    argv += ["--gantt-streams", "4", "--warmup", "0", "--samples", "1", "--out", str(out)]
    assert bench_shapes.main(argv) == 0
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert all(r["status"] == "ok" for r in rows), [(r["shape"], r["error"]) for r in rows]
    labels = {(r["scheduler"], r["workers"], r["mode"], r["policy"]) for r in rows}
    for scheduler, workers in (("distributed", 1), ("distributed-x2", 2)):
        for mode, policy in (
            ("serial", ""),
            ("gpustreams", "auto"),
            ("gpustreams", "auto/blocks=off"),
        ):
            assert (scheduler, workers, mode, policy) in labels
    # The hand launch runs on this process's device: with the first worker count only.
    assert {r["workers"] for r in rows if r["mode"] == "ideal"} == {1}
    table = (out / "table.txt").read_text()
    assert "distributed scaling" in table and "distributed-x2 scheduler" in table
    assert bench_shapes.parse_args([]).dist_workers == [1]


def test_per_gpu_gantt_on_two_workers(tmp_path, capsys):
    out = tmp_path / "gantt"
    argv = ["--backend", "sim", "--workers", "2", "--shapes", "linear", "--width", "4"]
    argv += ["--depth", "2", "--kernel-ms", "2", "--streams", "4", "--threads", "4"]
    assert gantt_cluster.main([*argv, "--out", str(out)]) == 0  # linear's chains spread
    summary = json.loads((out / "summary.txt").read_text())["shapes"]["linear"]
    assert summary["problem"] is None and summary["verdict"] == "ok"
    assert sorted(summary["gpus"]) == ["w0 dev 0", "w1 dev 1"]
    assert sum(g["tasks"] for g in summary["gpus"].values()) == 8
    assert (out / "gantt.png").stat().st_size > 0 and (out / "trace_linear.json").exists()
    assert "w1 dev 1: " in capsys.readouterr().out


def test_interval_arithmetic_and_verdicts():
    assert gantt_cluster.busy_ms([(0, 2), (1, 3), (5, 6)]) == 4
    assert gantt_cluster.intersect([(0, 4)], [(2, 6), (7, 8)]) == 2
    records = [
        {"key": "a", "worker": "w0", "device": 0, "stream": 0, "start_ms": 0, "end_ms": 10},
        {"key": "b", "worker": "w1", "device": 1, "stream": 0, "start_ms": 0, "end_ms": 0.5},
    ]
    summary = gantt_cluster.per_gpu(records)
    assert summary["both_busy_ms"] == 0.5
    assert gantt_cluster.judge(summary, 2).startswith("ONE-SIDED: 95%")
    assert gantt_cluster.judge(gantt_cluster.per_gpu(records[:1]), 2) == "SERIALIZED onto one GPU"
    assert gantt_cluster.judge(gantt_cluster.per_gpu(records[:1]), 1) == "ok"
    relabelled = gantt_cluster.relabel(
        [{"worker": "tcp://b", "device": 0}, {"worker": "tcp://a", "device": 0}],
        {"tcp://a": "3", "tcp://b": None},
    )
    assert relabelled == [{"worker": "w1", "device": 1}, {"worker": "w0", "device": "3"}]
