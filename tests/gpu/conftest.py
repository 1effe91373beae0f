"""GPU tests: run with the ``cupy`` backend on a real device, skipped where none is visible."""

import pytest

from dask_gpustreams.backends import gpu_visible


def pytest_collection_modifyitems(config, items):
    ok, reason = gpu_visible()
    if ok:
        return
    skip = pytest.mark.skip(reason=f"no GPU: {reason}")
    for item in items:
        if "tests/gpu/" in item.nodeid.replace("\\", "/"):
            item.add_marker(skip)
