"""The launcher's launch orders: the depth-first order (the default) and ``dask.order``."""

from __future__ import annotations

import numpy as np
import pytest
from dask.callbacks import Callback
from dask.core import flatten

from benchmarks.probes.probe_order_memory import Held, chunks
from dask_gpustreams.integrations.launcher import get as launcher_get
from dask_gpustreams.runtime.ordering import depth_first
from tests.test_local_scheduler import combine, leaf


def reductions(outputs: int, leaves: int) -> dict:
    """``outputs`` sums, each of ``leaves`` leaf tasks; keys in graph order, leaves first."""
    deps: dict = {}
    for o in range(outputs):
        for i in range(leaves):
            deps[("leaf", o, i)] = ("data",)  # an input known before: not a task
    for o in range(outputs):
        deps[("sum", o)] = frozenset(("leaf", o, i) for i in range(leaves))
    return deps


def test_each_output_ranks_after_its_inputs_and_before_the_next_outputs_inputs():
    deps = reductions(3, 4)
    ranks = depth_first(deps, [("sum", o) for o in range(3)])
    assert sorted(ranks, key=ranks.get) == [
        k for o in range(3) for k in [*(("leaf", o, i) for i in range(4)), ("sum", o)]
    ]


def test_the_order_follows_the_graph_not_the_sets_of_inputs():
    """A task's inputs are visited in graph order, not in the order the task lists them (a
    frozenset's is its hash order, which the hash seed changes)."""
    deps = reductions(2, 6)
    leaves = [("leaf", 1, i) for i in range(6)]
    deps[("sum", 1)] = tuple(reversed(leaves))
    ranks = depth_first(deps, [("sum", 1), ("sum", 0)])
    assert sorted(ranks, key=ranks.get)[:7] == [*leaves, ("sum", 1)]


def test_keys_that_no_output_reaches_rank_last_in_graph_order():
    deps = {"a": (), "unused": ("a",), "b": ("a",), "dangling": ()}
    ranks = depth_first(deps, ["b"])
    assert sorted(ranks, key=ranks.get) == ["a", "b", "unused", "dangling"]


def test_a_cycle_is_walked_once_and_every_key_ranked():
    deps = {"a": ("b",), "b": ("a",), "c": ()}
    ranks = depth_first(deps, ["a", "c"])
    assert sorted(ranks.values()) == [0, 1, 2] and ranks["c"] == 2


def test_a_shared_input_ranks_once_before_its_first_consumer():
    deps = {"x": (), "y": ("x",), "z": ("x", "y")}
    assert depth_first(deps, ["y", "z"]) == {"x": 0, "y": 1, "z": 2}


def test_a_chunks_last_consumer_ranks_as_soon_as_it_is_ready_not_after_the_first_tree():
    """``max - min`` of 3 chunks: each chunk's ``min`` ranks right after its ``max`` (it lets
    the chunk go), and the ``min`` tree's root as soon as its last ``min`` has ranked."""
    deps: dict = {}
    for i in range(3):
        deps[("x", i)] = ()
        deps[("max", i)] = (("x", i),)
        deps[("min", i)] = (("x", i),)
    deps["MAX"] = tuple(("max", i) for i in range(3))
    deps["MIN"] = tuple(("min", i) for i in range(3))
    deps["out"] = ("MAX", "MIN")
    ranks = depth_first(deps, ["out"])
    assert sorted(ranks, key=ranks.get) == [
        *(k for i in range(3) for k in [("x", i), ("max", i), ("min", i)]),
        "MIN",
        "MAX",
        "out",
    ]


def test_tasks_that_only_share_an_input_wait_for_the_walk():
    """A matmul: ``c[i, j]`` sums the products ``p[i, j, k]`` of ``a[i, k]`` and ``b[k, j]``.
    Once row ``a[1, 0]`` ranks, ``p[1, j, 0]`` is ready for every ``j``, but none but the
    last is its input's last reader, so they wait for the walk to reach their sums: the
    products of later sums are not launched (and held) early."""
    n = 3
    r = range(n)
    deps: dict = {("a", i, k): () for i in r for k in r} | {("b", k, j): () for k in r for j in r}
    for i in r:
        for j in r:
            for k in r:
                deps[("p", i, j, k)] = (("a", i, k), ("b", k, j))
            deps[("c", i, j)] = tuple(("p", i, j, k) for k in r)
    ranks = depth_first(deps, [("c", i, j) for i in r for j in r])
    order = sorted(ranks, key=ranks.get)
    row = order[order.index(("a", 1, 0)) : order.index(("c", 1, 0)) + 1]
    assert row == [*(x for k in r for x in [("a", 1, k), ("p", 1, 0, k)]), ("c", 1, 0)]


def test_an_input_listed_twice_counts_once_for_the_last_reader_rule():
    """``c`` is ``b``'s only reader, whether it lists ``b`` once or twice: it ranks as soon as
    ``b`` has, before ``a``, which the walk reaches only after the outputs."""
    for deps_of_c in [("b",), ("b", "b")]:
        ranks = depth_first({"a": (), "b": (), "c": deps_of_c}, ["b"])
        assert sorted(ranks, key=ranks.get) == ["b", "c", "a"]


@pytest.mark.parametrize("seed", range(200))
def test_every_key_ranks_once_after_its_inputs_on_random_graphs(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 60))
    deps = {
        k: tuple(int(d) for d in rng.choice(k, size=min(k, int(rng.integers(0, 4))), replace=False))
        for k in range(n)
    }
    outputs = [int(k) for k in rng.choice(n, size=int(rng.integers(1, n + 1)), replace=False)]
    ranks = depth_first(deps, outputs)
    assert sorted(ranks.values()) == list(range(n))
    assert all(ranks[d] < ranks[k] for k, ds in deps.items() for d in ds)


class CountedKey:
    """A key that counts how often it is hashed (Dask's tuple keys hash in Python each time)."""

    hashes = 0

    def __init__(self, n: int):
        self.n = n

    def __hash__(self) -> int:
        CountedKey.hashes += 1
        return hash(self.n)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CountedKey) and other.n == self.n


def test_the_walk_hashes_each_key_and_each_edge_about_once():
    """The launcher ranks a whole graph before its first round: each key is hashed about
    twice (to number it, and in the ranks returned) and each edge and output once; the rest
    of the walk is on positions (bounded with some slack below). A walk on the keys
    themselves hashed this graph's 15,756 times."""
    rng = np.random.default_rng(0)
    keys = [CountedKey(i) for i in range(300)]
    deps = {
        k: tuple(keys[int(d)] for d in rng.choice(i, size=min(i, 3), replace=False))
        for i, k in enumerate(keys)
    }
    edges = sum(len(d) for d in deps.values())
    outputs = keys[-10:]
    CountedKey.hashes = 0
    ranks = depth_first(deps, outputs)
    assert CountedKey.hashes <= 3 * len(keys) + 2 * edges
    assert all(ranks[d] < ranks[k] for k, ds in deps.items() for d in ds)


@pytest.mark.parametrize("launch_order", ["depth-first", "dask"])
def test_the_launcher_finishes_an_output_before_it_starts_the_last_ones_leaves(
    launcher,  # noqa: F811
    launch_order,
):
    """12 sums of 2 leaves on 2 streams, the graph's leaves listed first: more tasks are ready
    than a round takes from the start, and a launch in graph order would start all 24 leaves
    before any sum. By either order, at most 2 sums have a leaf launched and are not launched
    themselves (so their leaves are dropped soon); every value is exact under random delays."""
    rng = np.random.default_rng(0)
    n = 12
    dsk = {
        ("leaf", o, i): (leaf, float(2 * o + i), 4, rng.uniform(0, 1e-3))
        for o in range(n)
        for i in range(2)
    }
    for o in range(n):
        dsk[("sum", o)] = (combine, ("leaf", o, 0), ("leaf", o, 1), rng.uniform(0, 1e-3))
    keys = [("sum", o) for o in range(n)]
    seen = []
    pretask = Callback(pretask=lambda key, dsk, state: seen.append(key))
    with launcher(streams=2, policy="round-robin", **{"launch-order": launch_order}), pretask:
        got = launcher_get(dsk, keys)
    waiting, most = set(), 0
    for key in seen:
        if key[0] == "leaf":
            waiting.add(key[1])
        else:
            waiting.discard(key[1])
        most = max(most, len(waiting))
    assert most <= 2
    assert sorted(seen) == sorted(dsk)
    assert [g.get().tolist() for g in got] == [[4.0 * o + 1] * 4 for o in range(n)]


@pytest.mark.parametrize("launch_order", ["depth-first", "dask"])
def test_either_order_keeps_a_chunks_two_reductions_together(launcher, launch_order):  # noqa: F811
    """``x.max() - x.min()``: each chunk feeds a max and a min. By either order both run
    soon after the chunk, so the launcher never holds half of x's 64 chunks; a depth-first
    walk without its early last consumers held every chunk until the second reduction (77
    here)."""
    x = chunks(16, 16)  # 64 chunks of 32 x 32
    graph = x.max() - x.min()
    held = Held(list(flatten(graph.__dask_keys__())))
    with launcher(streams=8, **{"launch-order": launch_order}), held:
        got = graph.compute(scheduler="gpustreams")
    assert got.get() == (x.max() - x.min()).compute(scheduler="sync").get()
    assert held.most < x.npartitions // 2
