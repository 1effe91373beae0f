"""The probes that patch library methods restore them, on the sim (``--startup`` and
``--hook-times``, the two modes of theirs that run without a GPU)."""

from __future__ import annotations

import ast
import re
import threading
import time

import pytest

from benchmarks import probe_distributed
from benchmarks.kernels import Spin
from benchmarks.probes import probe_host, probe_pool_growth
from dask_gpustreams.integrations.distributed.execution import Execution
from dask_gpustreams.integrations.distributed.plugin import StreamsPlugin
from dask_gpustreams.integrations.local import LocalSchedulerHook
from dask_gpustreams.runtime.runtime import StreamRuntime

PATCHED = [
    (StreamRuntime, "run"),
    (LocalSchedulerHook, "_start"),
    (StreamsPlugin, "transition"),
    (Execution, "prepare"),
    (Spin, "__call__"),
]


def _methods() -> list:
    return [vars(cls).get(name) for cls, name in PATCHED]


@pytest.mark.slow
def test_probe_host_startup_restores_what_it_times(capsys):
    before = _methods()
    assert probe_host.main(["--startup", "--backend", "sim", "--shapes", "linear"]) == 0
    assert _methods() == before
    assert "to first run ms" in capsys.readouterr().out


@pytest.mark.slow
def test_probe_distributed_hook_times_restores_the_classes(capsys):
    before = _methods()  # the sim's cluster is in-process: its worker patches these classes
    argv = ["--backend", "sim", "--hook-times", "--shapes", "linear", "--reps", "1"]
    assert probe_distributed.main([*argv, "--kernel-ms", "1"]) == 0
    assert _methods() == before
    out = capsys.readouterr().out
    assert "StreamRuntime.run" in out and "WRONG" not in out
    # the hook's cost a task, the empty hook's (the timer's own), and the hook net of it
    hook, empty, net = map(float, out.split("\nlinear ")[-1].split())
    assert hook > empty > 0 and net == pytest.approx(hook - empty, abs=0.11)


def test_probe_task_gaps_sees_every_task_under_both_schedulers(capsys):
    """The probe runs on the sim, and its callbacks see the same tasks under plain sync and
    the launcher (a scheduler whose tasks it missed would split a wrong wall)."""
    from benchmarks import bench_workloads as bw
    from benchmarks.probes import probe_task_gaps

    arrays = bw.make_arrays("sim")
    size = bw.sizes_for("sim", True, {})["transpose"]
    collections = bw.WORKLOADS["transpose"].build(arrays, size)
    seen = {}
    for scheduler in probe_task_gaps.SCHEDULERS:
        fields, groups = probe_task_gaps.split(arrays, collections, scheduler)
        seen[scheduler] = (fields["n"], sorted(groups))
    assert seen["sync"] == seen["gpustreams"] and seen["sync"][0] > 0, seen
    argv = ["--backend", "sim", "--quick", "--workloads", "transpose", "--reps", "1"]
    assert probe_task_gaps.main(argv) == 0
    assert "in tasks of" in capsys.readouterr().out


def test_probe_threaded_route_times_both_routes_and_checks_results(capsys, monkeypatch):
    from benchmarks.probes import probe_threaded_route as probe

    assert probe.main(["--backend", "sim", "--quick", "--reps", "1"]) == 0
    rows = capsys.readouterr().out.splitlines()[1:]
    assert [row.split()[:3] for row in rows] == [["1", "1", "1"], ["8", "2", "4"]]
    monkeypatch.setattr(probe, "inc", lambda x: x + 2)  # a wrong answer is not timed
    with pytest.raises(AssertionError, match="wrong result"):
        probe.main(["--backend", "sim", "--quick", "--reps", "1"])


# --- probe_pool_growth's log, on a pool that stands for CuPy's -------------------------------


class GrowingPool:
    """Serves a request from what was freed, else grows by it (taking 1 ms, as cudaMalloc
    does, so that threads' growths overlap)."""

    def __init__(self) -> None:
        self.total = self.free = 0

    def total_bytes(self) -> int:
        return self.total

    def free_bytes(self) -> int:
        return self.free

    def malloc(self, size: int) -> int:
        if self.free >= size:
            self.free -= size
        else:
            self.total += size
            time.sleep(0.001)
        return size


class StandingStream:
    """Records the allocations made while it is current."""

    entered = 0

    def __enter__(self):
        StandingStream.entered += 1
        return self

    def __exit__(self, *exc):
        return None


MIB = probe_pool_growth.MIB


def test_pool_growth_is_logged_by_workload_mode_and_run(capsys):
    growth = probe_pool_growth.Growth([MIB, 16 * MIB], lambda: 7, StandingStream)
    pool = GrowingPool()
    malloc = growth.wrap(pool, pool.malloc, routable=True)
    growth.start("qr", probe_pool_growth.SETUP)
    malloc(4 * MIB)
    growth.start("qr", "launcher")
    for cold, size in ((True, 32 * MIB), (False, 32 * MIB), (False, 0)):
        growth.next_run(cold)
        if size:
            malloc(size)
    growth.next_run(cold=True)  # a second round, in which nothing grows
    growth.report()
    out = capsys.readouterr().out
    assert [(e[0], e[1], e[4]) for e in growth.events[("qr", "launcher")]] == [
        (0, 0, 32 * MIB),
        (0, 1, 32 * MIB),
    ]
    assert growth.runs[("qr", "launcher")] == [3, 1]
    assert "round 1: 32 32 0" in out and "round 2: 0" in out
    assert [e[4] for e in growth.events[("qr", probe_pool_growth.SETUP)]] == [4 * MIB]


def test_pool_growth_of_threads_allocating_at_once_is_counted_once():
    growth = probe_pool_growth.Growth([MIB], lambda: 0, StandingStream)
    pool = GrowingPool()
    malloc = growth.wrap(pool, pool.malloc, routable=True)
    growth.start("matmul", "launcher")
    growth.next_run(cold=True)

    def allocate() -> None:
        for _ in range(5):
            malloc(2 * MIB)

    threads = [threading.Thread(target=allocate) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(e[4] for e in growth.events[("matmul", "launcher")]) == pool.total == 80 * MIB


def test_launcher_classes_routes_only_mid_sized_requests_off_the_default_stream():
    stream = [7]
    growth = probe_pool_growth.Growth([MIB, 16 * MIB], lambda: stream[0], StandingStream)
    pool = GrowingPool()
    malloc = growth.wrap(pool, pool.malloc, routable=True)
    growth.start("qr", "launcher-classes")
    growth.classes_on = True
    StandingStream.entered = 0
    for size in (MIB // 2, 4 * MIB, 32 * MIB):
        malloc(size)
    stream[0] = 0  # the legacy default stream
    malloc(4 * MIB)
    assert StandingStream.entered == 1
    async_pool = growth.wrap(pool, pool.malloc, routable=False)
    stream[0] = 7
    with pytest.raises(ValueError, match="launcher-classes needs CuPy's default pool"):
        async_pool(4 * MIB)


@pytest.mark.parametrize(
    ("classes", "message"),
    [("inf", "positive MiB numbers"), ("0,16", "positive MiB numbers"), ("1,1", "must differ")],
)
def test_pool_growth_classes_name_the_bad_value(classes, message):
    with pytest.raises(ValueError, match=f"--classes '{classes}' is invalid: .*{message}"):
        probe_pool_growth.parse_bounds(classes)


# --- the Dagger tile probes, on the sim and on the model device -------------------------------


def test_probe_dagger_loop_checks_every_mode_in_turn(capsys):
    """Plain sync, the launcher with a setting of its own and the ideal, in turn: every
    result checked (a wrong one returns 1), one line each with its pool growth."""
    from benchmarks.probes import probe_dagger_loop

    modes = "plain-sync,launcher:policy=round-robin,ideal"
    argv = ["--backend", "sim", "--shape", "linear", "--modes", modes, "--seconds", "0.2"]
    assert probe_dagger_loop.main(argv) == 0
    out = capsys.readouterr().out
    for mode in modes.split(","):
        assert f"linear {mode} (in turn with 2 other)" in out, out
    assert probe_dagger_loop.launcher_settings("launcher:shared-blocks=1 MiB;policy=auto") == {
        "gpustreams.shared-blocks": "1 MiB",
        "gpustreams.policy": "auto",
    }


def test_probe_dagger_loop_names_a_bad_mode(capsys):
    from benchmarks.probes import probe_dagger_loop

    with pytest.raises(SystemExit):
        probe_dagger_loop.main(["--backend", "sim", "--modes", "launcher,fast"])
    assert "mode 'fast' is invalid: allowed values are plain-sync | launcher | ideal" in (
        capsys.readouterr().err
    )


def test_probe_launch_loop_runs_the_launcher_on_its_model_device(capsys):
    from benchmarks.probes import probe_launch_loop

    argv = ["--shapes", "linear", "--policies", "auto", "--reps", "2"]
    assert probe_launch_loop.main(argv) == 0
    assert "linear     auto" in capsys.readouterr().out


def test_spy_summary_counts_a_function_once_a_stack(tmp_path, capsys):
    from benchmarks.probes import spy_summary

    raw = tmp_path / "raw.txt"
    raw.write_text(
        "main.<locals>.<lambda> (p.py:3);f (a.py:1);f (a.py:2);g (b.py:9) 3\n"
        "other (c.py:1);g (b.py:9) 5\n"
    )
    kept, inclusive, leaf = spy_summary.summarize(str(raw), "main.<locals>.<lambda>")
    assert kept == 3
    assert inclusive["f (a.py)"] == 3 and inclusive["g (b.py)"] == 3
    assert leaf == {"g (b.py)": 3}


def test_probe_slow_samples_checks_each_compute_and_splits_slow_from_the_others(capsys):
    """Each mode's turns from a cold pool, every compute checked (a wrong one returns 1),
    one line a compute and, per mode, its slow computes against the others."""
    from benchmarks.probes import probe_slow_samples

    argv = ["--backend", "sim", "--quick", "--modes", "sync,launcher"]
    assert probe_slow_samples.main([*argv, "--samples", "2", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert out.count(" ok\n") == 6 and "WRONG" not in out, out
    for mode in ("sync", "launcher"):
        assert re.search(rf"^{mode} +other +\d+ computes", out, re.M), out


@pytest.mark.parametrize(
    "route, extra",
    [("launcher", []), ("threaded", []), ("distributed", ["--threads", "3", "--blocks", "off"])],
)
def test_probe_concurrent_failures_runs_failing_computes_at_once_and_finds_them_right(
    route, extra, capsys, monkeypatch
):
    """The probe's rounds each start 2-3 computes at once, most with a failing node, and
    check every outcome; on a fixed seed it sees failures (its own and another compute's)
    and no wrong value, hang or stuck runtime."""
    from benchmarks.probes import probe_concurrent_failures as probe
    from dask_gpustreams import sim

    monkeypatch.setattr(sim.get_device(), "kernel_delay", (0.0, 0.0))  # restored: the probe sets it
    argv = ["--route", route, "--streams", "2", "--seed", "3", "--rounds", "12", *extra]
    code = probe.main(argv)
    out = capsys.readouterr().out
    assert code == 0, out
    counts = ast.literal_eval(out.rsplit("failed; ", 1)[1])
    assert counts["rounds"] == 12 and counts["ok"] > 0, out
    assert counts["own"] > 0, out  # failures ran, and reached their computes
    assert not {"wrong", "unexpected", "hang", "stuck"} & counts.keys(), out
