"""Layering: the runtime knows no scheduler; backends and the sim know no runtime.

Checked twice: statically (every import statement, including those inside
functions) and dynamically (``sys.modules`` of a fresh interpreter that
imports and uses a layer with the package's ``__init__`` left out).

Integrations and diagnostics ask the runtime, in task records, and never reach
through it: they import no backend module (nor CuPy), and no module outside
``runtime/`` touches a pool's slots (``pool.slots``, ``record.slot``, a slot's
bookkeeping), checked on the syntax tree of every module. Diagnostics read
nothing of a runtime but its public answers (no ``runtime.backend``,
``runtime.timeline``, ``record.event``). In the distributed integration, the
taints and the failure records are written only by their owners' modules;
the other parts call their methods.
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

BACKEND_MODULES = ("dask_gpustreams.backends", "cupy", "cupyx")

FORBIDDEN = {
    "runtime": SCHEDULER_MODULES + INTEGRATIONS,
    "backends": SCHEDULER_MODULES + INTEGRATIONS + RUNTIME,
    "sim": SCHEDULER_MODULES + INTEGRATIONS + RUNTIME,
    "integrations": BACKEND_MODULES,
    "diagnostics": BACKEND_MODULES,
}

#: Imports a layer makes in spite of :data:`FORBIDDEN`, each with its reason.
ALLOWED = {
    # The NVTX library CuPy ships, the fallback where the nvtx package is missing: it
    # pushes ranges on the host, whichever backend runs; no device is touched.
    ("diagnostics/nvtx.py", "cupy.cuda"),
    ("diagnostics/nvtx.py", "cupy.cuda.nvtx"),
}

#: Attributes that lead to a pool's slots, and the slots' own bookkeeping: only
#: ``runtime/`` reads them (``StreamRuntime.stream_stats``, ``TaskRecord.stream_index``,
#: ``StreamPool.streams`` answer the others).
SLOT_ATTRIBUTES = frozenset({"slots", "slot", "inflight", "_assigned", "waited"})
#: ``(file, function)`` that still reach the slots, each to move onto the runtime's API.
KNOWN_SLOT_REACHES: set[tuple[str, str]] = set()

#: What leads from a runtime to its backend, pool, copies, events and timeline's
#: storage, and a task record's events: diagnostics ask the runtime instead
#: (``done(record)``, ``timeline_snapshot()``, ``enable_timeline()``, ``n_streams``,
#: ``pinned_stats()``, ``record.timed``), nor do they read a runtime's private names.
RUNTIME_INTERNALS = frozenset(
    {
        "backend",
        "pool",
        "transfers",
        "events",
        "policy",
        "host_tasks",
        "timeline",
        "timeline_maxlen",
    }
)
RECORD_INTERNALS = frozenset({"event", "start"})


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


def forbidden_imports(layer: str, files: list[str] | None = None) -> dict[str, list[str]]:
    """``file -> forbidden modules it imports`` for the modules of ``layer`` (or ``files``)."""
    bad = {}
    for path in _layer_files(layer) if files is None else files:
        rel = os.path.relpath(path, PACKAGE)
        found = sorted(
            m
            for m in imported_modules(path)
            if _matches(m, FORBIDDEN[layer]) and (rel, m) not in ALLOWED
        )
        if found:
            bad[rel] = found
    return bad


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_import_statements(layer):
    assert _layer_files(layer), f"no modules found under dask_gpustreams/{layer}"
    assert forbidden_imports(layer) == {}


def test_integrations_and_diagnostics_import_no_backend_module():
    """As the parametrized test checks them; here the rule itself is pinned down."""
    for layer in ("integrations", "diagnostics"):
        assert set(BACKEND_MODULES) <= set(FORBIDDEN[layer])
        assert forbidden_imports(layer) == {}
    allowed_files = {f for f, _ in ALLOWED}
    assert allowed_files == {"diagnostics/nvtx.py"}


def test_a_planted_backend_import_is_found(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import cupy\n"
        "def f():\n"
        "    from dask_gpustreams.backends.cupy import CupyBackend\n"
        "    from dask_gpustreams import backends\n"
    )
    assert forbidden_imports("integrations", [str(sample)]) == {
        os.path.relpath(str(sample), PACKAGE): [
            "cupy",
            "dask_gpustreams.backends",
            "dask_gpustreams.backends.cupy",
            "dask_gpustreams.backends.cupy.CupyBackend",
        ]
    }


def slot_reaches(path: str) -> list[str]:
    """``file:line .attr`` of each read or write of :data:`SLOT_ATTRIBUTES` in ``path``.

    Also an import of ``StreamSlot`` and a ``getattr`` of those names. Those inside
    the functions of :data:`KNOWN_SLOT_REACHES` are left out.
    """
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    rel = os.path.relpath(path, PACKAGE)
    known = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and (rel, node.name) in KNOWN_SLOT_REACHES
        for inner in ast.walk(node)
    }
    found = []
    for node in ast.walk(tree):
        if id(node) in known:
            continue
        name = None
        if isinstance(node, ast.Attribute) and node.attr in SLOT_ATTRIBUTES:
            name = node.attr
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr")
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in SLOT_ATTRIBUTES
        ):
            name = node.args[1].value
        elif isinstance(node, ast.ImportFrom) and any(a.name == "StreamSlot" for a in node.names):
            name = "StreamSlot"
        if name is not None:
            found.append(f"{rel}:{node.lineno} .{name}")
    return found


def test_nothing_outside_the_runtime_touches_a_pool_slot():
    outside = [
        p
        for p in _layer_files("")
        if not os.path.relpath(p, PACKAGE).startswith("runtime" + os.sep)
    ]
    assert len(outside) > 20  # every module of the package but the runtime's
    assert [hit for path in outside for hit in slot_reaches(path)] == []
    assert not KNOWN_SLOT_REACHES  # every reach moved onto the runtime's API


def planted(tmp_path, scan, source: str) -> list[str]:
    """``scan``'s hits (``line .attr``, sorted) in a module of ``source`` under ``tmp_path``."""
    sample = tmp_path / "sample.py"
    sample.write_text(source)
    rel = os.path.relpath(str(sample), PACKAGE)
    return sorted(hit.removeprefix(f"{rel}:") for hit in scan(str(sample)))


def test_a_planted_slot_reach_is_found(tmp_path):
    source = (
        "from dask_gpustreams.runtime.pool import StreamSlot\n"
        "def f(runtime, record):\n"
        "    n = sum(s.seq for s in runtime.pool.slots)\n"
        "    return n + record.slot.index + len(getattr(record, 'slot').inflight)\n"
    )
    assert planted(tmp_path, slot_reaches, source) == sorted(
        ["1 .StreamSlot", "3 .slots", "4 .slot", "4 .slot", "4 .inflight"]
    )


def _is_runtime(node: ast.expr) -> bool:
    """``runtime`` or ``<anything>.runtime``: how the diagnostics name a runtime."""
    return (isinstance(node, ast.Name) and node.id == "runtime") or (
        isinstance(node, ast.Attribute) and node.attr == "runtime"
    )


def runtime_reaches(path: str) -> list[str]:
    """``file:line .attr`` of each read or write, in ``path``, of a runtime's internals.

    :data:`RUNTIME_INTERNALS` and private (``_``) names of a runtime, and
    :data:`RECORD_INTERNALS` of anything (a method call such as ``.start()`` aside).
    """
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    rel = os.path.relpath(path, PACKAGE)
    called = {id(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        on_runtime = _is_runtime(node.value) and (
            node.attr in RUNTIME_INTERNALS or node.attr.startswith("_")
        )
        if on_runtime or (node.attr in RECORD_INTERNALS and id(node) not in called):
            found.append(f"{rel}:{node.lineno} .{node.attr}")
    return found


def test_diagnostics_ask_the_runtime_not_its_internals():
    files = _layer_files("diagnostics")
    assert len(files) > 5
    assert [hit for path in files for hit in runtime_reaches(path)] == []


def test_integrations_ask_the_runtime_not_its_internals():
    """The backend's transfer functions and the policy's needs come through the runtime
    (``transfer_functions``, ``needs_critical_path``), as the diagnostics' answers do."""
    files = _layer_files("integrations")
    assert len(files) > 10
    assert [hit for path in files for hit in runtime_reaches(path)] == []


def test_a_planted_runtime_reach_is_found(tmp_path):
    source = (
        "def f(runtime, plugin, record, callback):\n"
        "    runtime.timeline = None\n"
        "    done = plugin.runtime.backend.done(record.event)\n"
        "    callback.start()\n"
        "    return runtime._state, record.start, runtime.done(record), runtime.n_streams\n"
    )
    assert planted(tmp_path, runtime_reaches, source) == sorted(
        ["2 .timeline", "3 .backend", "3 .event", "5 ._state", "5 .start"]
    )


#: The distributed integration's shared records and the modules that write them: their
#: types' (``Taints``, ``FailureRecords``) and ``Provenance``'s, which holds both. Elsewhere
#: they are read, or changed through their types' methods (``note``, ``succeeded``;
#: ``record``, ``take``, ``expire``).
RECORD_OWNERS = {
    "taint": ("integrations/distributed/provenance.py",),
    "failures": (
        "integrations/distributed/failures.py",
        "integrations/distributed/provenance.py",
    ),
}
#: What changes a mapping in place (its own methods, or a statement on an item of it).
MAPPING_WRITES = frozenset(
    {"pop", "popitem", "clear", "update", "setdefault", "move_to_end", "__setitem__"}
)


def record_writes(path: str) -> list[str]:
    """``file:line .attr`` of each write, in ``path``, to the records of :data:`RECORD_OWNERS`
    outside their owner's module: an assignment of ``x.attr``, of ``x.attr[k]`` or its
    deletion, and a call of a mapping's writing methods on ``x.attr``."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    rel = os.path.relpath(path, PACKAGE)
    owned = {name for name, owners in RECORD_OWNERS.items() if rel in owners}
    found = []

    def record_of(node: ast.expr) -> str | None:
        if isinstance(node, ast.Attribute) and node.attr in RECORD_OWNERS:
            return node.attr if node.attr not in owned else None
        return None

    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            inner = target.value if isinstance(target, ast.Subscript) else target
            name = record_of(inner)
            if name is not None and not isinstance(target, ast.Name):
                found.append(f"{rel}:{node.lineno} .{name}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            name = record_of(node.func.value)
            if name is not None and node.func.attr in MAPPING_WRITES:
                found.append(f"{rel}:{node.lineno} .{name}")
    return found


def integration_hits(scan, must_have: str) -> list[str]:
    """``scan``'s hits in the modules of the integrations and diagnostics (``must_have`` one)."""
    files = _layer_files("integrations") + _layer_files("diagnostics")
    assert any(path.endswith(must_have) for path in files)
    return [hit for path in files for hit in scan(path)]


def test_taints_and_failure_records_are_written_only_by_their_owners():
    assert integration_hits(record_writes, "egress.py") == []


def test_a_planted_record_write_is_found(tmp_path):
    source = (
        "def f(provenance, key, pending):\n"
        "    provenance.taint[key] = pending\n"
        "    provenance.taint.pop(key, None)\n"
        "    del provenance.failures[key]\n"
        "    provenance.failures = {}\n"
        "    provenance.taint.note(key, pending)\n"
        "    return provenance.failures.take(key), provenance.taint.get(key)\n"
    )
    assert planted(tmp_path, record_writes, source) == sorted(
        ["2 .taint", "3 .taint", "4 .failures", "5 .failures"]
    )


#: What a ``Provenance`` shows of its state, read-only: outside its module these are read, or
#: handed on (a part binds one once), never reached through.
PROVENANCE_VIEWS = frozenset({"runtime", "registry", "taint", "failures", "held"})
PROVENANCE_MODULE = "integrations/distributed/provenance.py"


def _is_provenance(node: ast.expr) -> bool:
    """``provenance`` or ``<anything>.provenance``: how the other parts name a ``Provenance``."""
    return (isinstance(node, ast.Name) and node.id == "provenance") or (
        isinstance(node, ast.Attribute) and node.attr == "provenance"
    )


def provenance_reaches(path: str) -> list[str]:
    """``file:line .attr`` of each reach, in ``path``, into a provenance's state.

    A private (``_``) name of a provenance, an assignment to or deletion of an
    attribute of one, and any attribute taken through one of its
    :data:`PROVENANCE_VIEWS` (``provenance.taint.note(...)``: a method of the record
    called past the facade). Its own module is its owner.
    """
    rel = os.path.relpath(path, PACKAGE)
    if rel == PROVENANCE_MODULE:
        return []
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        if _is_provenance(node.value) and (
            node.attr.startswith("_") or not isinstance(node.ctx, ast.Load)
        ):
            found.append(f"{rel}:{node.lineno} .{node.attr}")
        inner = node.value
        if (
            isinstance(inner, ast.Attribute)
            and inner.attr in PROVENANCE_VIEWS
            and _is_provenance(inner.value)
        ):
            found.append(f"{rel}:{node.lineno} .{inner.attr}.{node.attr}")
    return found


def test_the_distributed_parts_use_the_provenance_through_its_methods():
    assert integration_hits(provenance_reaches, "execution.py") == []


def test_a_planted_provenance_reach_is_found(tmp_path):
    source = textwrap.dedent(
        """\
        def f(provenance, plugin, key, pending):
            provenance.taint.note(key, pending)
            plugin.provenance.failures.take(key)
            provenance.runtime = None
            n = len(provenance._registry) + len(provenance.registry.records([key]))
            provenance.note_pending(key, pending)
            return provenance.failures, len(provenance.registry), plugin.provenance.runtime
        """
    )
    assert planted(tmp_path, provenance_reaches, source) == sorted(
        ["2 .taint.note", "3 .failures.take", "4 .runtime", "5 ._registry", "5 .registry.records"]
    )


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
