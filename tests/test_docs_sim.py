"""The code of docs/sim.md runs as the page says, so that the page cannot rot."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import CHILD_PATH, REPO_ROOT

PAGE = os.path.join(REPO_ROOT, "docs", "sim.md")


def _blocks() -> list[str]:
    with open(PAGE) as f:
        return re.findall(r"```python\n(.*?)```", f.read(), re.S)


def test_the_pages_test_of_a_pipeline_passes(monkeypatch):
    namespace: dict = {}
    exec(compile(_blocks()[0], PAGE, "exec"), namespace)
    namespace["test_my_pipeline_on_the_sim"](monkeypatch)


@pytest.mark.slow
def test_the_pages_cluster_gives_its_workers_the_delay_of_the_environment(tmp_path):
    script = tmp_path / "cluster.py"
    script.write_text(_blocks()[1])
    env = {**os.environ, "PYTHONPATH": CHILD_PATH, "GPUSTREAMS_SIM_KERNEL_DELAY": "0,0.002"}
    env.pop("DASK_GPUSTREAMS__BACKEND", None)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    delays = done.stdout.strip().splitlines()[-1]
    assert delays.count("(0.0, 0.002)") == 2, delays
