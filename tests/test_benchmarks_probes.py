"""The probes that patch library methods restore them, on the sim (``--startup`` and
``--hook-times``, the two modes of theirs that run without a GPU)."""

from __future__ import annotations

import pytest

from benchmarks import probe_distributed
from benchmarks.kernels import Spin
from benchmarks.probes import probe_host
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
