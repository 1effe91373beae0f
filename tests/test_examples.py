"""Every example in ``examples/`` runs on the simulated device and reports exact results.

Each runs as a user runs it, ``python examples/NAME.py ...``, in a subprocess with
small sizes and with CUDA devices hidden, so the examples take their no-GPU path.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TESTED = {"dask_array", "demo", "distributed_cluster", "dask_cuda_cluster", "timeline"}

pytestmark = pytest.mark.slow


def run_example(name: str, *args: str) -> str:
    """Run ``examples/<name>.py`` with ``args`` on the sim; its stdout (stderr on failure)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": ""}
    env.pop("DASK_GPUSTREAMS__BACKEND", None)
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / f"{name}.py"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def arange(size: int) -> np.ndarray:
    return np.arange(size**2, dtype=np.int64).reshape(size, size)


def worker_rows(out: str) -> list[list[str]]:
    """The worker rows of a printed ``status(client)`` table, split into cells."""
    return [line.split() for line in out.splitlines() if line.startswith("tcp://")]


def test_every_example_is_tested():
    assert {p.stem for p in EXAMPLES.glob("*.py")} == TESTED


def test_dask_array():
    out = run_example("dask_array")
    assert re.fullmatch(
        r"<StreamRuntime backend=sim device=0 streams=8 policy='auto'>: \d+ ms, "
        r"result matches plain Dask\n",
        out,
    )


def test_demo():
    out = run_example("demo", "--kernel-ms", "1", "--width", "2", "--depth", "3", "--streams", "2")
    lines = out.splitlines()
    assert lines[0] == (
        "dask-gpustreams 0.1.0: sim backend, 1 ms kernels, 2 x 3 DAGs, scheduler='gpustreams'"
    )
    assert [line.split()[:2] for line in lines[2:6]] == [
        ["linear", "6"],
        ["diamond", "5"],
        ["chainlink", "6"],
        ["tangled", "6"],
    ]
    assert lines[-1] == "all results exact"


def test_demo_on_dasks_threads():
    out = run_example(
        "demo", "--kernel-ms", "1", "--width", "2", "--depth", "2", "--scheduler", "threads"
    )
    assert "scheduler='threads'" in out.splitlines()[0]
    assert out.splitlines()[-1] == "all results exact"


@pytest.mark.parametrize(
    "args, message",
    [
        (("--width", "0"), "--width 0: a shape needs at least 1"),
        (("--depth", "-1"), "--depth -1: a shape needs at least 1"),
        (("--kernel-ms", "0"), "--kernel-ms 0: the kernels need a duration above 0"),
    ],
)
def test_demo_refuses_an_empty_shape_or_kernel(args, message):
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "demo.py"), *args], capture_output=True, text=True
    )
    assert done.returncode == 2 and message in done.stderr, done


@pytest.mark.parametrize("streams", ["0", "200"])
def test_demo_refuses_a_stream_count_out_of_range(streams):
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "demo.py"), "--streams", streams],
        capture_output=True,
        text=True,
    )
    message = f"gpustreams.streams={streams} is invalid: allowed values are an int >= 1 and <= 128"
    assert done.returncode == 2 and done.stdout == "", done
    assert done.stderr.endswith(f"demo.py: error: {message}\n"), done


def test_distributed_cluster():
    out = run_example("distributed_cluster", "--workers", "2", "--size", "128", "--chunk", "64")
    x = arange(128)
    want = ((x % 7) * (x.T % 5) + x).sum(axis=0)
    assert out.splitlines()[0] == f"sum {int(want.sum())}: equal to NumPy's, 128 columns"
    rows = worker_rows(out)
    assert len(rows) == 2
    # on, sim backend, device 0, 4 streams, policy auto, no task in flight, no failure
    assert all(r[1:6] == ["yes", "sim", "0", "4", "auto"] and r[7] == "0" for r in rows)
    assert all(r[-1] == "0" for r in rows)
    assert sum(int(r[6]) for r in rows) >= 8  # an upload and a product per chunk, at least


def dask_cuda_expected(size: int) -> str:
    x = arange(size) % 10
    return f"LocalCluster: sum {int((x @ x.T).sum())}, equal to NumPy's"


def test_dask_cuda_cluster_without_a_gpu_says_so_and_runs_on_the_sim():
    out = run_example("dask_cuda_cluster", "--size", "96", "--chunk", "32", "--streams", "3")
    lines = out.splitlines()
    assert lines[0].startswith("LocalCUDACluster needs a GPU and none is visible: ")
    assert lines[1] == (
        "Running the same code on a LocalCluster of 2 workers on the simulated device."
    )
    assert lines[2] == dask_cuda_expected(96)
    rows = worker_rows(out)
    assert [r[1:5] for r in rows] == [["yes", "sim", "0", "3"]] * 2


def test_dask_cuda_cluster_backend_sim_runs_without_a_message():
    out = run_example("dask_cuda_cluster", "--backend", "sim", "--size", "64", "--chunk", "32")
    assert out.splitlines()[0] == dask_cuda_expected(64)


def test_dask_cuda_cluster_backend_cupy_without_a_gpu_stops_with_the_reason():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "dask_cuda_cluster.py"), "--backend", "cupy"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr.startswith("--backend cupy needs a GPU: ")


def test_timeline_writes_a_trace_and_a_gantt_chart(tmp_path):
    out = run_example(
        "timeline", "--out", str(tmp_path), "--streams", "3", "--size", "128", "--chunk", "32"
    )
    x = arange(128)
    lines = out.splitlines()
    assert lines[0] == f"sum {int(((x % 7) * (x.T % 5)).sum())}: equal to NumPy's"
    tasks, streams = re.fullmatch(
        r"(\d+) tasks on streams \[([\d, ]+)\] in [\d.]+ ms of device time,", lines[1]
    ).groups()
    assert int(tasks) >= 16 + 16  # at least an upload and a product per chunk
    assert {int(s) for s in streams.split(", ")} <= {0, 1, 2}
    trace = json.loads((tmp_path / "trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == int(tasks)
    assert {e["args"]["stream"] for e in spans} == {int(s) for s in streams.split(", ")}
    assert lines[3:] == [
        f"wrote {tmp_path / 'trace.json'}: open it in https://ui.perfetto.dev",
        f"wrote {tmp_path / 'gantt.png'}",
    ]
    assert (tmp_path / "gantt.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
