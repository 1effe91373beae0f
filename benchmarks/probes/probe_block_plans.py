"""Which graphs get other stream blocks than at another commit (issue 13's cut changes).

A change to ``dask_gpustreams.integrations.blocks.partition`` changes the blocks of some
graphs and not others; the H200 numbers of the graphs whose blocks did not change still
hold. This probe builds the graphs of the workload suite (``bench_workloads``, at the
H200's sizes, NumPy-backed: nothing is computed) and the wide shapes (width 8 and 32,
depth 16), partitions each for one worker of ``--threads`` threads in blocks of 64 with
this tree's ``partition`` and with that of ``--against`` (``git show COMMIT:...``; told the
threads where it takes them), and prints each one's blocks, the most values a block of it
holds until it ends (its inputs from outside and its outputs: ``blocks._held``), and whether
the groups are the same. The scheduler's own levels and priorities are close to these, not
equal.

``python -m benchmarks.probes.probe_block_plans --against e320eb2``
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import dask
from dask._task_spec import DataNode, convert_legacy_graph
from dask.order import order

from benchmarks import bench_workloads
from benchmarks.shapes import WIDE, wide_shape
from dask_gpustreams.integrations import blocks

BLOCKS_PATH = "dask_gpustreams/integrations/blocks.py"


def partition_at(commit: str) -> Callable:
    """``partition`` of ``commit``'s ``integrations/blocks.py``, loaded as a module."""
    source = subprocess.run(
        ["git", "show", f"{commit}:{BLOCKS_PATH}"], capture_output=True, text=True, check=True
    ).stdout
    path = Path(tempfile.mkdtemp()) / f"blocks_{commit}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.partition


def graphs() -> Iterator[tuple[str, dict, list]]:
    """(name, {key: dependencies}, candidates) of each workload and wide shape."""
    arrays = bench_workloads.make_arrays("numpy")
    sizes = bench_workloads.sizes_for("cupy", False)
    for name, workload in bench_workloads.WORKLOADS.items():
        collections = workload.build(arrays, sizes[name])
        expr = dask.base.collections_to_expr(collections, optimize_graph=True)
        dsk = convert_legacy_graph(dict(expr.__dask_graph__()))
        deps = {k: list(v.dependencies) for k, v in dsk.items()}
        yield name, deps, [k for k, v in dsk.items() if not isinstance(v, DataNode)]
    for width in (8, 32):
        for name in WIDE:
            shape = wide_shape(name, width, 16)
            deps = {k: [] for k in shape.sources}
            deps.update({n.key: list(n.args) for n in shape.nodes})
            yield f"{name} x{width}", deps, [n.key for n in shape.nodes]


def dependents_of(deps: dict) -> dict:
    """{key: the keys that read it} of the graph ``deps``."""
    dependents: dict = {k: [] for k in deps}
    for k, ds in deps.items():
        for d in ds:
            dependents[d].append(k)
    return dependents


def groups(partition: Callable, deps: dict, candidates: list, **threads: int) -> list:
    """``partition``'s groups of ``candidates`` on one worker, blocks of 64
    (``threads=N``: the worker's threads, where ``partition`` takes them)."""
    dependents = dependents_of(deps)
    priority = order({k: (sum, ds) if ds else 1 for k, ds in deps.items()})
    level: dict = {}
    for k in sorted(deps, key=priority.__getitem__):
        level[k] = 1 + max((level[d] for d in deps[k]), default=-1)
    found = partition(
        candidates,
        deps.__getitem__,
        dependents.__getitem__,
        level,
        1,
        64,
        priority.__getitem__,
        **threads,
    )
    return found


def most_held(found: list, deps: dict) -> int:
    """The most values one of the groups ``found`` holds until its block ends."""
    dependents = dependents_of(deps)
    held = (blocks._held(g, deps.__getitem__, dependents.__getitem__, None) for g in found)
    return max(held, default=0)


def same(a: list, b: list) -> bool:
    """Whether the groups ``a`` and ``b`` are the same, whatever their order."""
    return sorted(sorted(map(str, g)) for g in a) == sorted(sorted(map(str, g)) for g in b)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--against", required=True, help="the commit to compare with")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="the worker's threads, for this tree's partition (1: dask-cuda's default)",
    )
    args = p.parse_args(argv)
    theirs = partition_at(args.against)
    takes = "threads" in inspect.signature(theirs).parameters
    threads_of_theirs = {"threads": args.threads} if takes else {}
    print(f"threads: {args.threads} (this tree's partition; {args.against}'s: {takes})")
    them = f"{args.against:>9}"
    print(f"{'graph':<14} {'tasks':>6} {'blocks':>7} {them} {'held':>5} {them}  same")
    for name, deps, candidates in graphs():
        ours = groups(blocks.partition, deps, candidates, threads=args.threads)
        old = groups(theirs, deps, candidates, **threads_of_theirs)
        held, held_old = most_held(ours, deps), most_held(old, deps)
        counts = f"{len(ours):>7} {len(old):>9} {held:>5} {held_old:>9}"
        print(f"{name:<14} {len(deps):>6} {counts}  {same(ours, old)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
