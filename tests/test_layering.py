"""Layering: the runtime knows no scheduler; backends and the sim know no runtime.

Checked twice: statically (every import statement, including those inside
functions) and dynamically (``sys.modules`` of a fresh interpreter that
imports and uses a layer with the package's ``__init__`` left out).
"""

from __future__ import annotations

import ast
import json
import os
import textwrap

import pytest

PACKAGE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "dask_gpustreams"
)

SCHEDULER_MODULES = ("distributed", "dask.local", "dask.threaded", "dask.multiprocessing")
INTEGRATIONS = ("dask_gpustreams.integrations",)
RUNTIME = ("dask_gpustreams.runtime",)

FORBIDDEN = {
    "runtime": SCHEDULER_MODULES + INTEGRATIONS,
    "backends": SCHEDULER_MODULES + INTEGRATIONS + RUNTIME,
    "sim": SCHEDULER_MODULES + INTEGRATIONS + RUNTIME,
}


def _module_name(path: str) -> str:
    rel = os.path.relpath(path, os.path.dirname(PACKAGE))[: -len(".py")]
    parts = rel.split(os.sep)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: str) -> set[str]:
    """Every module named by an import statement of ``path`` (relative ones resolved)."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    package = _module_name(path)
    if not path.endswith("__init__.py"):
        package = package.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def _matches(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _layer_files(layer: str) -> list[str]:
    files = []
    for dirpath, _, names in os.walk(os.path.join(PACKAGE, layer)):
        files += [os.path.join(dirpath, n) for n in names if n.endswith(".py")]
    return sorted(files)


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_import_statements(layer):
    files = _layer_files(layer)
    assert files, f"no modules found under dask_gpustreams/{layer}"
    bad = {
        os.path.relpath(path, PACKAGE): sorted(
            m for m in imported_modules(path) if _matches(m, FORBIDDEN[layer])
        )
        for path in files
    }
    assert {k: v for k, v in bad.items() if v} == {}


def test_import_scanner_sees_imports_inside_functions(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        "def f():\n    import distributed.worker\n    from dask.local import get_sync\n"
    )
    assert {"distributed.worker", "dask.local", "dask.local.get_sync"} <= imported_modules(
        str(sample)
    )


# Imports ``dask_gpustreams.<layer>`` with a bare parent package (its ``__init__``,
# which installs the local scheduler hook, does not run), uses it, and prints the
# modules then loaded.
ISOLATED = textwrap.dedent(
    """
    import json, sys, types
    pkg = types.ModuleType("dask_gpustreams")
    pkg.__path__ = [{package!r}]
    sys.modules["dask_gpustreams"] = pkg
    {body}
    print(json.dumps(sorted(sys.modules)))
    """
)

USE_RUNTIME = """
import numpy as np
from dask_gpustreams.runtime import EventRegistry, get_runtime
from dask_gpustreams.config import StreamsConfig
from dask_gpustreams import sim
rt = get_runtime(StreamsConfig(backend="sim", streams=2, policy="round-robin"))
reg = EventRegistry()
x = rt.run("x", lambda inputs: sim.asarray(np.ones(3)), {}, reg)
rt.run("y", lambda inputs: sim.launch(np.negative, inputs["x"], out=inputs["x"]), {"x": x}, reg)
rt.synchronize(["y"], reg)
assert x.get().tolist() == [-1.0, -1.0, -1.0]
"""

USE_BACKENDS = """
import numpy as np
from dask_gpustreams.backends import create_backend, resolve_backend
from dask_gpustreams import sim
backend = create_backend(resolve_backend("sim"))
stream = backend.create_stream()
with backend.use_stream(stream, "k"):
    x = sim.asarray(np.arange(3.0))
event = backend.create_event()
backend.record(event, stream)
backend.synchronize_event(event)
assert x.get().tolist() == [0.0, 1.0, 2.0]
"""


def _loaded(run_python, body):
    code = ISOLATED.format(package=PACKAGE, body=body.strip())
    return json.loads(run_python(code).splitlines()[-1])


def test_runtime_loads_no_scheduler_integration(run_python):
    modules = _loaded(run_python, USE_RUNTIME)
    assert "dask_gpustreams.runtime.runtime" in modules
    assert [m for m in modules if _matches(m, ("distributed",) + INTEGRATIONS)] == []


def test_backends_and_sim_load_no_runtime(run_python):
    modules = _loaded(run_python, USE_BACKENDS)
    assert {"dask_gpustreams.backends.sim", "dask_gpustreams.sim._device"} <= set(modules)
    assert [m for m in modules if _matches(m, ("distributed",) + INTEGRATIONS + RUNTIME)] == []


def test_importing_the_package_does_not_import_cupy(run_python):
    code = textwrap.dedent(
        """
        import json, sys
        import dask_gpustreams.runtime, dask_gpustreams.backends, dask_gpustreams.sim
        print(json.dumps(sorted(sys.modules)))
        """
    )
    modules = json.loads(run_python(code).splitlines()[-1])
    assert "dask_gpustreams.integrations.local" in modules  # the hook is installed
    assert [m for m in modules if _matches(m, ("cupy", "cupyx"))] == []


def test_policies_read_the_pool_only_through_its_view():
    """Policies use :class:`PoolView`'s members of a pool and no slot's bookkeeping.

    The pool alone keeps what is assigned and recorded on each stream (its in-flight
    work, pending count, waits and locks), so a policy cannot depend on how it does.
    """
    from dask_gpustreams.runtime.pool import PoolView, StreamSlot
    from dask_gpustreams.runtime.registry import TaskRecord

    view = {n for n in vars(PoolView) if not n.startswith("_")} | set(PoolView.__annotations__)
    bookkeeping = (set(StreamSlot.__slots__) | {"pending"}) - {"index", "stream", "priority"}
    bookkeeping -= set(TaskRecord.__slots__)  # a record's ``seq`` is the policies' to read
    bad = []
    for path in _layer_files(os.path.join("runtime", "policies")):
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            on_pool = isinstance(node.value, ast.Name) and node.value.id == "pool"
            if (on_pool and node.attr not in view) or node.attr in bookkeeping:
                bad.append(f"{os.path.relpath(path, PACKAGE)}:{node.lineno} .{node.attr}")
    assert view >= {"slots", "load", "is_tail"}
    assert "inflight" in bookkeeping and "pending" in bookkeeping
    assert bad == []
