"""Shared fixtures of the test suite: state reset, configuration, a keyed policy, the dask CLI."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import subprocess
import sys
import time

import dask
import numpy as np
import pytest

import dask_gpustreams  # noqa: F401  (registers the gpustreams.* defaults and the local hook)
from dask_gpustreams import KernelError, sim
from dask_gpustreams.integrations.local import hook
from dask_gpustreams.runtime import runtimes
from dask_gpustreams.runtime.hosttasks import HostTasks
from dask_gpustreams.runtime.policies import StreamPolicy, base

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: PYTHONPATH of the processes tests start: the repository, then this process's imports
#: (where dask lives when it is not installed in the interpreter, as on the GPU machine).
CHILD_PATH = os.pathsep.join([REPO_ROOT, *(p for p in sys.path if p)])


def _drain_runtimes() -> None:
    """Close the shared runtimes (after their streams' work), forget the resolved backends."""
    runtimes.close_shared(timeout=30)  # a compute still holding one fails the test here
    # A test that expects a failure may leave an unreported error behind.
    with contextlib.suppress(KernelError):
        sim.get_device().synchronize()


@pytest.fixture(autouse=True)
def reset_gpustreams():
    """Each test starts with no runtime, no registered extra policy and an idle sim device."""
    _drain_runtimes()
    policies = dict(base.POLICIES._entries)
    yield
    _drain_runtimes()
    base.POLICIES._entries.clear()
    base.POLICIES._entries.update(policies)
    hook._runs.clear()
    forget_closed_servers()


def forget_closed_servers() -> None:
    """Let in-process workers that a test closed go, with the device arrays in their memory.

    distributed caches the request handlers it has called, bound methods of each worker and
    scheduler (``core._expects_comm`` with no bound, ``utils.has_keyword``), so a closed
    in-process worker lives on with its data for as long as the process: later tests
    that count the sim pool's bytes would see its arrays.
    """
    from distributed import core, utils

    core._expects_comm.cache_clear()
    utils.has_keyword.cache_clear()


@pytest.fixture
def gpustreams():
    """``gpustreams(streams, policy, **more)``: a ``dask.config.set`` enabling the sim runtime."""

    def configure(streams: int = 4, policy: str = "round-robin", **more):
        values = {
            "gpustreams.enabled": True,
            "gpustreams.backend": "sim",
            "gpustreams.streams": streams,
            "gpustreams.policy": policy,
        }
        values.update({f"gpustreams.{k}": v for k, v in more.items()})
        return dask.config.set(values)

    return configure


@pytest.fixture
def launcher(gpustreams):
    """``launcher(streams, policy, **more)``: settings of the sim runtime, plugin switch off."""
    return functools.partial(gpustreams, enabled=False)


@pytest.fixture
def on_the_launcher(monkeypatch):
    """No task group is learned to block the host: on a loaded CPU the sim's slow tasks
    would move to host threads, several at once, each with its own temporaries."""
    monkeypatch.setattr(HostTasks, "threshold_s", float("inf"))


class ByKey(StreamPolicy):
    """Test policy: ``placement[key]`` is the stream index of ``key`` (0 when absent)."""

    name = "test-placement"
    placement: dict = {}

    def select(self, task, pool):
        return pool.slots[self.placement.get(task.key, 0)]


@pytest.fixture
def by_key():
    """Registers the ``test-placement`` policy; returns its placement dict (key -> stream index)."""
    placement: dict = {}
    policy = type("ByKeyPolicy", (ByKey,), {"placement": placement})
    base.register_policy(policy)
    return placement


@pytest.fixture
def rng():
    return np.random.default_rng(20260830)


@pytest.fixture
def run_python():
    """Run ``code`` in a fresh interpreter with the repository importable; return stdout."""

    def run(code: str, env: dict | None = None, timeout: float = 60) -> str:
        full_env = {
            k: v for k, v in os.environ.items() if not k.startswith(("DASK_", "PYTHONPATH"))
        }
        full_env["PYTHONPATH"] = CHILD_PATH
        full_env.update(env or {})
        proc = subprocess.run(
            [sys.executable, "-c", code],
            cwd=REPO_ROOT,
            env=full_env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    return run


@pytest.fixture
def cli_env() -> dict[str, str]:
    """Environment of the processes ``dask_cli`` starts: the sim backend, 4 streams."""
    return {
        "PYTHONPATH": CHILD_PATH,
        "DASK_GPUSTREAMS__BACKEND": "sim",
        "DASK_GPUSTREAMS__STREAMS": "4",
    }


def _written(scheduler_file: str) -> bool:
    """Whether ``scheduler_file`` holds the scheduler's whole JSON, its address in it."""
    try:
        with open(scheduler_file) as f:
            return "address" in json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return False


@pytest.fixture
def dask_cli(tmp_path, cli_env):
    """``start(*args, env=None)`` runs ``dask <args>`` on a scheduler file; all stopped at the end.

    The processes get this one's environment without its ``DASK_*``
    variables, plus ``cli_env`` (whose default ``PYTHONPATH``, ``CHILD_PATH``,
    includes this process's ``sys.path``), plus ``env`` for that process. Logs go
    to ``tmp_path``.
    """
    base_env = {k: v for k, v in os.environ.items() if not k.startswith(("DASK_", "PYTHONPATH"))}
    base_env.update(cli_env)
    scheduler_file = str(tmp_path / "scheduler.json")
    procs: list[subprocess.Popen] = []

    def start(*args: str, env: dict[str, str] | None = None) -> str:
        cmd = [sys.executable, "-m", "dask", *args, "--scheduler-file", scheduler_file]
        log = open(tmp_path / f"{len(procs)}-{args[0]}.log", "w")  # noqa: SIM115
        proc_env = {**base_env, **(env or {})}
        procs.append(subprocess.Popen(cmd, env=proc_env, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 30
        while not _written(scheduler_file):  # the scheduler writes it in place, not at once
            assert time.monotonic() < deadline, "dask scheduler did not start"
            assert procs[0].poll() is None, (tmp_path / "0-scheduler.log").read_text()
            time.sleep(0.05)
        return scheduler_file

    yield start
    for proc in reversed(procs):  # workers first, then the scheduler
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
