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
