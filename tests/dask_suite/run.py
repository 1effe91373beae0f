"""Run dask.array's own CuPy test modules on SimArray chunks, with dask_gpustreams on.

    .venv/bin/python tests/dask_suite/run.py [--ci] [PYTEST_ARGS ...]

One pytest session over the ``dask/array/tests/test_cupy_*.py`` modules of the
installed dask, in place (the node ids are dask's), under ``pytest.ini`` here
rather than this repository's. ``cupy`` is the shim in ``cupy/`` (the simulated
device under CuPy's name) and ``-p sim_cupy_plugin`` turns ``gpustreams`` on
with the sim backend for the whole session, so every compute of those tests runs
its tasks on the sim's stream pool. The plugin skips the tests that cannot apply
to the sim, each with its reason (``inapplicable.py``). ``--ci``
runs :data:`CI_MODULES` only, as ``tests/test_dask_array_suite.py`` does; other
arguments go to pytest (``--junitxml``, ``-k``...). The exit status is pytest's.
"""

from __future__ import annotations

import os
import subprocess
import sys

import dask

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
#: Where dask is installed: the session runs there, so dask's conftest.py applies.
SITE = os.path.dirname(os.path.dirname(os.path.abspath(dask.__file__)))

#: Every CuPy module of dask's tests (test_cupy_sparse.py skips itself: it needs cupyx).
MODULES = (
    "core",
    "creation",
    "gufunc",
    "linalg",
    "overlap",
    "percentile",
    "random",
    "reductions",
    "routines",
    "slicing",
    "sparse",
)
#: The modules CI runs (about 20 s of CPU): linalg (tall-skinny QR and SVD, 19 s alone)
#: and random (its two process-pool tests take 18 s) run with the default only.
CI_MODULES = (
    "core",
    "creation",
    "gufunc",
    "overlap",
    "percentile",
    "reductions",
    "routines",
    "slicing",
)


def paths(modules: tuple[str, ...]) -> list[str]:
    """The node-id paths of ``test_cupy_<module>.py`` for each module, relative to :data:`SITE`."""
    return [f"dask/array/tests/test_cupy_{module}.py" for module in modules]


def command(modules: tuple[str, ...], *pytest_args: str) -> list[str]:
    """The pytest command line, to run in :data:`SITE` with :func:`environment`."""
    return [
        sys.executable,
        "-P",  # the working directory (site-packages) is not put first on sys.path
        "-m",
        "pytest",
        "-p",
        "sim_cupy_plugin",
        "-p",
        "no:cacheprovider",
        "-c",
        os.path.join(HERE, "pytest.ini"),
        "--rootdir",
        SITE,
        *paths(modules),
        *pytest_args,
    ]


def environment() -> dict[str, str]:
    """This environment without ``DASK_*`` settings; the shim, then the repository, on the path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DASK_", "PYTHONPATH"))}
    env["PYTHONPATH"] = os.pathsep.join([HERE, REPO, *(p for p in sys.path if p)])
    return env


def run(modules: tuple[str, ...], *pytest_args: str, **kwargs) -> subprocess.CompletedProcess:
    """Run the session; ``kwargs`` go to :func:`subprocess.run`."""
    return subprocess.run(command(modules, *pytest_args), cwd=SITE, env=environment(), **kwargs)


def main(argv: list[str]) -> int:
    ci = "--ci" in argv
    args = [a for a in argv if a != "--ci"]
    return run(CI_MODULES if ci else MODULES, *args).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
