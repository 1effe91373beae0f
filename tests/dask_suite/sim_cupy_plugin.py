"""Pytest plugin of ``run.py``: dask's CuPy tests on SimArray chunks, the plugin on.

Loaded with ``-p sim_cupy_plugin`` (``run.py`` puts this folder on the path). At
``pytest_configure``, before dask's test modules are imported, it checks that
``cupy`` is the shim, enables ``gpustreams`` on the simulated device for the
whole session (every local compute runs its tasks on the sim's stream pool) and
registers :func:`legacy_stream_order`; it skips the tests of
:data:`inapplicable.INAPPLICABLE`, each with its reason, and ends the terminal
summary with the number of tasks the runtime ran.
"""

from __future__ import annotations

import os

import dask
import pytest
from dask.callbacks import Callback
from inapplicable import PREFIX, reason

import dask_gpustreams
from dask_gpustreams import sim

HERE = os.path.dirname(os.path.abspath(__file__))


def legacy_stream_order(dsk: dict) -> None:
    """What the caller queued on its current stream completes before the graph's tasks start.

    Dask's tests make CuPy arrays in the test body and put them in graphs, and
    ``da.from_array`` itself copies its input (``x = x.copy()``) on the caller's
    stream. On a GPU, CuPy's default stream is CUDA's legacy stream, whose earlier
    work the pool's (blocking) streams wait for; the sim's default stream is not
    ordered with other streams (docs/guide.md). Without this host sync at each
    compute's start, tasks read the copy's block before it is written (with the
    values of the block's previous array: its poison is queued on the same stream).
    """
    sim.get_device().current_stream().synchronize()


def pytest_configure(config: pytest.Config) -> None:
    import cupy

    if os.path.dirname(os.path.dirname(os.path.abspath(cupy.__file__))) != HERE:
        raise pytest.UsageError(f"cupy is {cupy.__file__}, not the sim shim in {HERE}")
    dask.config.set(
        {"gpustreams.enabled": True, "gpustreams.backend": "sim", "gpustreams.streams": 4}
    )
    Callback(start=legacy_stream_order).register()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        why = reason(item.path.name, item.name)
        if why is not None:
            item.add_marker(pytest.mark.skip(reason=PREFIX + why))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """One line for run.py's callers: the tasks the session ran on the sim's compute streams."""
    rows = dask_gpustreams.status().rows
    tasks = sum(row["tasks_run"] or 0 for row in rows)
    backends = sorted({str(row["backend"]) for row in rows})
    terminalreporter.write_line(f"gpustreams: {tasks} tasks ran on streams, backend {backends}")
