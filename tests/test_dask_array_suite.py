"""dask.array's own CuPy tests pass on SimArray chunks with the plugin on (issue 14, item 4).

``tests/dask_suite/run.py --ci`` runs dask's ``test_cupy_*.py`` modules of
:data:`run.CI_MODULES` in a fresh pytest session, where ``cupy`` is the sim shim
and every compute goes through the stream runtime on the simulated device. An
ordering or lifetime bug of the runtime, or a sim op that computes or predicts
wrongly, fails dask's ``assert_eq`` there (poisoned or stale values, a shape or
dtype other than NumPy's). The tests that cannot apply to the sim are skipped
with their reasons (``tests/dask_suite/inapplicable.py``); this test pins them.
The other modules run with ``python tests/dask_suite/run.py`` (all of them).
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import dask
import pytest

from tests.dask_suite import inapplicable, run

pytestmark = pytest.mark.slow

#: The outcome counts of the CI modules on the dask they were counted on (the venv's); on
#: another dask only the exit status and the skips are checked. The xpasses are dask's xfails
#: of ``cupy.dot(numpy)`` (test_basic 22-24), which the sim takes (host operands are staged).
COUNTED_ON = "2026.8.0"
EXPECTED = {"passed": 265, "skipped": 23, "xfailed": 1, "xpassed": 3}


def test_dask_cupy_modules_pass_on_sim_chunks_with_the_plugin(tmp_path):
    junit = tmp_path / "junit.xml"
    proc = run.run(
        run.CI_MODULES,
        "-q",
        "--junitxml",
        str(junit),
        capture_output=True,
        text=True,
        timeout=240,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    summary = re.search(r"^=*\s*(\d+ passed.*) in [\d.]+s", output, re.M)
    assert summary, output[-2000:]
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (\w+)", summary.group(1))}
    if dask.__version__ == COUNTED_ON:
        assert counts == EXPECTED
    assert "failed" not in counts and "error" not in counts and counts["passed"] > 0

    # The computes went through the stream runtime on the sim.
    tasks = re.search(r"^gpustreams: (\d+) tasks ran on streams, backend \['sim'\]$", output, re.M)
    assert tasks and int(tasks.group(1)) > 10_000, output[-2000:]

    # Skipped as inapplicable: exactly the listed tests of these modules, with their reasons.
    skipped = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        for skip in case.findall("skipped"):
            message = skip.get("message", "")
            if inapplicable.PREFIX in message:
                module = case.get("classname").rsplit(".", 1)[-1] + ".py"
                skipped[(module, case.get("name"))] = message.split(inapplicable.PREFIX, 1)[1]
    assert skipped == {
        (module, name): inapplicable.reason(module, name) for module, name in skipped
    }
    listed = {pattern.split("::")[0] for pattern in inapplicable.INAPPLICABLE}
    ci_files = {f"test_cupy_{m}.py" for m in run.CI_MODULES}
    assert {module for module, _ in skipped} == listed & ci_files
    assert len(skipped) == 7  # asanyarray, view_fortran, diagonal, tokenize, bincount, 2 nanarg
