"""``gpustreams.nvtx``: one NVTX range per task, named by its key; nothing at all when off."""

from __future__ import annotations

import re
import sys

import dask
import dask.threaded
import numpy as np
import pytest

from dask_gpustreams import StreamsConfig, sim
from dask_gpustreams.backends.sim import SimBackend
from dask_gpustreams.diagnostics import nvtx as nvtx_module
from dask_gpustreams.runtime import EventRegistry, get_runtime

BOOL = "True | False (or 'true'/'false', 'yes'/'no', 'on'/'off', 1/0)"


def ones(n):
    return sim.asarray(np.ones(n))


def inc(a):
    out = sim.empty(a.shape)
    sim.launch(np.add, a, 1.0, out=out)
    return out


@pytest.fixture
def ranges(monkeypatch):
    """The ranges pushed, as ``[(message, color, category)]``; ``"pop"`` for each pop."""
    log: list = []

    def fake():
        return (lambda *args: log.append(args)), (lambda: log.append("pop"))

    monkeypatch.setattr(nvtx_module, "range_functions", fake)
    return log


def test_off_by_default_and_validated_as_a_boolean():
    assert dask.config.get("gpustreams.nvtx") is False
    assert StreamsConfig.from_dask_config().nvtx is False
    assert StreamsConfig(nvtx="yes").nvtx is True
    with dask.config.set({"gpustreams.nvtx": "on"}):
        assert StreamsConfig.from_dask_config().nvtx is True
    message = "^" + re.escape(f"gpustreams.nvtx='maybe' is invalid: allowed values are {BOOL}")
    with pytest.raises(ValueError, match=message):
        StreamsConfig(nvtx="maybe")


def test_off_the_backend_is_untouched(gpustreams):
    with gpustreams(streams=2):
        dask.threaded.get({"x": (ones, 4), "y": (inc, "x")}, "y")
        runtime = get_runtime()
    assert "use_stream" not in vars(runtime.backend)  # the class's method, called as before


def test_one_range_per_task_named_by_its_key_with_its_stream(gpustreams, by_key, ranges):
    by_key.update({"x": 0, ("y", 0): 1})
    with gpustreams(streams=2, policy="test-placement", nvtx=True):
        y = dask.threaded.get({"x": (ones, 4), ("y", 0): (inc, "x")}, ("y", 0))
    assert sim.asnumpy(y).tolist() == [2.0] * 4
    pushed = [entry for entry in ranges if entry != "pop"]
    assert sorted((m, c) for m, _, c in pushed) == [("('y', 0)", "stream 1"), ("x", "stream 0")]
    assert ranges.count("pop") == len(pushed) == 2
    assert all(color in nvtx_module.PALETTE for _, color, _ in pushed)


def test_ranges_on_the_launcher_and_none_for_copies(gpustreams, ranges):
    with gpustreams(streams=3, nvtx=True):
        dsk = {("a", i): (ones, 8) for i in range(5)}
        dsk["total"] = (lambda *xs: float(sum(sim.asnumpy(x).sum() for x in xs)), *dsk)
        assert dask.get(dsk, "total", scheduler="gpustreams") == 40.0
    pushed = [entry for entry in ranges if entry != "pop"]
    assert sorted(m for m, _, _ in pushed) == sorted(map(str, dsk))
    assert {c for _, _, c in pushed} <= {"stream 0", "stream 1", "stream 2"}
    assert ranges.count("pop") == len(pushed)


def test_a_task_that_raises_pops_its_range(ranges):
    runtime = get_runtime(StreamsConfig(backend="sim", streams=2, nvtx=True))

    def fail(_):
        raise ZeroDivisionError

    with pytest.raises(ZeroDivisionError):
        runtime.run("bad", fail, {}, EventRegistry())
    assert ranges == [("bad", ranges[0][1], ranges[0][2]), "pop"]


def test_without_nvtx_or_cupy_the_runtime_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "nvtx", None)
    monkeypatch.setitem(sys.modules, "cupy", None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'dask-gpustreams\[nvtx\]'"):
        nvtx_module.annotate(SimBackend(), None)


def test_with_the_nvtx_package(gpustreams):
    pytest.importorskip("nvtx")
    with gpustreams(streams=2, nvtx=True):
        y = dask.threaded.get({"x": (ones, 4), "y": (inc, "x")}, "y")
        assert "use_stream" in vars(get_runtime().backend)
    assert sim.asnumpy(y).tolist() == [2.0] * 4
