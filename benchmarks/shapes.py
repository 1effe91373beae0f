"""The DAG shapes of the benchmark, as plain structures (no kernels, no Dask).

Two families:

- ``dagger``: Dagger.jl's four shapes exactly as ``test/benchmark.jl`` defines them
  (ground-truth section 7). A node is a tiled gemm ``C = A @ B`` over ``T x T``
  tiles, one task per ``(m, n, k)``: ``C[m,n] (+)= A[m,k] @ B[k,n]`` (beta 0 for
  the first ``k``, then 1), in Dagger's loop order ``n, m, k``. Node graphs:
  linear ``X -> X@M -> ...`` (``chain_len`` nodes); diamond ``B1=S@M1, B2=S@M2,
  J=B1@B2``; chainlink ``chain_len`` chained diamonds ``b1=cur@M1, b2=cur@M2,
  cur=b1@b2``; tangled ``T1=S1@S2, T2=S2@S1, U1=T1@T2, U2=T2@T1, J=U1@U2``.
- ``wide``: ``width x depth`` graphs of busy kernels: linear (``width``
  independent chains), diamond (a root, then ``depth`` times a fan-out to
  ``width`` nodes and a join), chainlink (node ``(i, d)`` depends on ``(i, d-1)``
  and ``((i+1) % width, d-1)``) and tangled (1-3 random dependencies on the two
  previous layers, at least one on the previous layer; fixed seed).

A :class:`Shape` lists its nodes in a topological order (Dagger's issue order
for ``dagger``; chain by chain for wide linear, layer by layer otherwise).
``Node.args`` are the keys passed to the node's kernel, in order.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from functools import cached_property

WIDE = ("linear", "diamond", "chainlink", "tangled")
DAGGER = ("linear", "diamond", "chainlink", "tangled")


@dataclass(frozen=True)
class Node:
    """One task: its key, the keys of its kernel's arguments, and a salt (busy kernels)."""

    key: tuple
    args: tuple
    salt: int = 0


@dataclass
class Shape:
    """A DAG of kernel tasks over source data.

    ``sources`` maps each data key to what it holds: for busy kernels an
    integer seed; for gemm tiles ``(matrix name, row tile, column tile)``.
    ``products`` (gemm shapes) lists the node-level products ``(C, A, B)``.
    """

    name: str
    family: str
    kernel: str  # "spin" | "gemm"
    sources: dict
    nodes: list[Node]
    params: dict = field(default_factory=dict)
    products: list[tuple[str, str, str]] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.family}-{self.name}"

    @property
    def n_tasks(self) -> int:
        return len(self.nodes)

    @cached_property
    def depth(self) -> dict:
        """Each node's layer: 0 for nodes fed by sources only."""
        depth: dict = {}
        for node in self.nodes:
            depth[node.key] = 1 + max((depth[a] for a in node.args if a in depth), default=-1)
        return depth

    @cached_property
    def layers(self) -> list[list[Node]]:
        """The nodes grouped by :attr:`depth`, each layer in generation order."""
        layers: list[list[Node]] = [[] for _ in range(max(self.depth.values()) + 1)]
        for node in self.nodes:
            layers[self.depth[node.key]].append(node)
        return layers

    @property
    def critical_path(self) -> int:
        """Tasks on a longest dependency path."""
        return len(self.layers)

    @cached_property
    def outputs(self) -> list[tuple]:
        """Keys of the nodes no other node consumes (what a run hands back)."""
        consumed = {a for node in self.nodes for a in node.args}
        return [node.key for node in self.nodes if node.key not in consumed]

    def describe(self) -> str:
        return (
            f"{self.label}: {self.n_tasks} tasks, critical path {self.critical_path}, "
            f"max parallelism {max(len(layer) for layer in self.layers)}"
        )


# --- wide shapes of busy kernels -------------------------------------------------------------


def wide_shape(name: str, width: int = 8, depth: int = 16, seed: int = 0) -> Shape:
    """The ``width x depth`` version of ``name`` (one of :data:`WIDE`)."""
    if width < 1 or depth < 1:
        raise ValueError(f"width and depth must be >= 1; got {width} x {depth}")
    builder = {
        "linear": _wide_linear,
        "diamond": _wide_diamond,
        "chainlink": _wide_chainlink,
        "tangled": _wide_tangled,
    }.get(name)
    if builder is None:
        raise ValueError(f"shape={name!r} is invalid: allowed values are {' | '.join(WIDE)}")
    sources, nodes = builder(width, depth, seed)
    salted = [Node(n.key, n.args, salt) for salt, n in enumerate(nodes, start=1)]
    return Shape(name, "wide", "spin", sources, salted, {"width": width, "depth": depth})


def _col(i: int) -> str:
    # Per-column key prefixes ("w0", "w1", ...): timelines color tasks by column.
    return f"w{i}"


def _wide_linear(width: int, depth: int, seed: int):
    sources = {("src", i): i for i in range(width)}
    nodes = []
    for i in range(width):  # chain by chain
        for d in range(depth):
            prev = ("src", i) if d == 0 else (_col(i), d - 1)
            nodes.append(Node((_col(i), d), (prev,)))
    return sources, nodes


def _wide_diamond(width: int, depth: int, seed: int):
    sources = {("src", 0): 0}
    nodes = [Node(("join", 0), (("src", 0),))]
    for d in range(1, depth + 1):
        branch = [Node((_col(i), d), (("join", d - 1),)) for i in range(width)]
        nodes.extend(branch)
        nodes.append(Node(("join", d), tuple(n.key for n in branch)))
    return sources, nodes


def _wide_chainlink(width: int, depth: int, seed: int):
    sources = {("src", i): i for i in range(width)}
    nodes = []
    for d in range(depth):
        for i in range(width):
            j = (i + 1) % width
            if d == 0:
                args = (("src", i), ("src", j)) if j != i else (("src", i),)
            else:
                args = ((_col(i), d - 1), (_col(j), d - 1)) if j != i else ((_col(i), d - 1),)
            nodes.append(Node((_col(i), d), args))
    return sources, nodes


def _wide_tangled(width: int, depth: int, seed: int):
    rng = random.Random(seed)
    sources = {("src", i): i for i in range(width)}
    layers = [list(sources)]  # layer -1: the sources
    nodes = []
    for d in range(depth):
        previous = layers[-1]
        before = layers[-2] if len(layers) > 1 else []
        layer = []
        for i in range(width):
            first = rng.choice(previous)
            others = [k for k in previous + before if k != first]
            extra = rng.sample(others, min(len(others), rng.randint(0, 2)))
            nodes.append(Node((_col(i), d), (first, *extra)))
            layer.append((_col(i), d))
        layers.append(layer)
    return sources, nodes


# --- Dagger.jl's gemm shapes -----------------------------------------------------------------


def dagger_shape(name: str, tiles: int = 4, chain_len: int = 4) -> Shape:
    """Dagger.jl's ``name`` (one of :data:`DAGGER`) over ``tiles x tiles`` tiled matrices."""
    if name == "linear":
        inputs = ["X", "M"]
        products, cur = [], "X"
        for i in range(1, chain_len + 1):
            products.append((f"L{i}", cur, "M"))
            cur = f"L{i}"
    elif name == "diamond":
        inputs = ["S", "M1", "M2"]
        products = [("B1", "S", "M1"), ("B2", "S", "M2"), ("J", "B1", "B2")]
    elif name == "chainlink":
        inputs = ["S", "M1", "M2"]
        products, cur = [], "S"
        for i in range(1, chain_len + 1):
            products += [(f"b1_{i}", cur, "M1"), (f"b2_{i}", cur, "M2")]
            products.append((f"C{i}", f"b1_{i}", f"b2_{i}"))
            cur = f"C{i}"
    elif name == "tangled":
        inputs = ["S1", "S2"]
        products = [
            ("T1", "S1", "S2"),
            ("T2", "S2", "S1"),
            ("U1", "T1", "T2"),
            ("U2", "T2", "T1"),
            ("J", "U1", "U2"),
        ]
    else:
        raise ValueError(f"shape={name!r} is invalid: allowed values are {' | '.join(DAGGER)}")
    sources = {(m, i, j): (m, i, j) for m in inputs for i in range(tiles) for j in range(tiles)}
    computed = {c for c, _, _ in products}

    def tile(matrix: str, i: int, j: int) -> tuple:
        # A computed matrix's tile is its last partial sum, k = tiles - 1.
        return (matrix, i, j, tiles - 1) if matrix in computed else (matrix, i, j)

    nodes = []
    for c, a, b in products:
        for n in range(tiles):  # Dagger's dag_gemm! loop order: n, m, k
            for m in range(tiles):
                for k in range(tiles):
                    args = (tile(a, m, k), tile(b, k, n))
                    if k > 0:
                        args += ((c, m, n, k - 1),)
                    nodes.append(Node((c, m, n, k), args))
    return Shape(
        name,
        "dagger",
        "gemm",
        sources,
        nodes,
        {"tiles": tiles, "chain_len": chain_len, "nodes": len(products)},
        products,
    )


def output_matrices(shape: Shape) -> list[str]:
    """Gemm shapes: the node matrices no other product reads."""
    read = {x for _, a, b in shape.products for x in (a, b)}
    return [c for c, _, _ in shape.products if c not in read]
