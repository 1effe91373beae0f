"""The random-DAG fuzzer with ``--backend cupy``: a short fixed-seed run on the GPU.

Its DAGs add same-shape FFTs, ``da.random`` leaves from a CuPy ``RandomState``
and, where PyTorch has CUDA, PyTorch ops (``benchmarks/fuzz.py``).
"""

import re

import pytest

pytest.importorskip("cupy")

from benchmarks import fuzz  # noqa: E402

SUMMARY = re.compile(r"^fuzz: (\d+) DAGs .*, (\d+) wrong, (\d+) hangs, (\d+) unexpected errors")


RUNS = [("threaded,launcher", 120), ("distributed", 30)]


@pytest.mark.parametrize(("routes", "dags"), RUNS, ids=["local", "distributed"])
def test_fixed_seed_cupy_run_is_exact(capsys, routes, dags):
    code = fuzz.main(["--backend", "cupy", "--seed", "3", "--dags", str(dags), "--routes", routes])
    out = capsys.readouterr().out
    match = SUMMARY.match(out.strip().splitlines()[-1])
    assert match, out
    assert code == 0 and tuple(int(g) for g in match.groups()) == (dags, 0, 0, 0), out
