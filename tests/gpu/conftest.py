"""GPU tests: run with the ``cupy`` backend on a real device, skipped where none is visible."""

import faulthandler
import sys
import threading

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


#: Seconds after the session ends before every thread's stack is printed: on the H200 the
#: process had not exited 28-44 s after pytest's summary (rc 124 from ``timeout`` at bda1af9,
#: fb64bbc, 57470ab and bf8671a). The stacks showed threads inside ``weakref.finalize``: CuPy's
#: cuFFT ``PlanCache`` runs ``gc.collect()`` as it ends, one per stream of each thread then
#: (``backends/cufft_plans.py``, 419ebfc). Kept, so that a new cause shows the same way.
EXIT_STACKS_AFTER_S = 15


def pytest_unconfigure(config):
    """Where a GPU is visible: name the threads that outlive the session, and print every
    thread's stack if the interpreter has not exited ``EXIT_STACKS_AFTER_S`` later."""
    if not gpu_visible()[0]:
        return
    alive = [t for t in threading.enumerate() if t is not threading.main_thread()]
    names = ", ".join(f"{t.name}{'' if t.daemon else ' (not daemon)'}" for t in alive)
    print(f"\nthreads alive after the session: {names or 'none'}", file=sys.stderr)
    faulthandler.dump_traceback_later(EXIT_STACKS_AFTER_S, exit=False)
