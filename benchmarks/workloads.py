"""A shape bound to kernels and data: Dask graphs, hand launches (``ideal``) and result checks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from benchmarks import kernels
from benchmarks.shapes import Node, Shape, output_matrices

#: Relative Frobenius error allowed on gemm shapes (fp32; a race gives O(1) or NaN).
GEMM_RTOL = 2e-3


@dataclass
class Workload:
    """``shape`` with its kernel, its device sources, and the reference of its outputs.

    ``kernel_ms`` is the isolated device time of one task's kernel (Dagger's
    ``tile_kernel_ms``), used for saturation.
    """

    shape: Shape
    backend: str
    kernel: Any  # kernels.Spin or kernels.TileGemm
    kernel_ms: float
    sources: dict = field(repr=False)  # key -> device array
    reference: dict = field(repr=False)  # output key (spin) or matrix name (gemm) -> host array

    # --- Dask graphs ------------------------------------------------------------------------

    def graph(self, token: Any = None, sources: dict | None = None, sync_after: bool = False):
        """A low-level Dask graph of one run and the keys to compute.

        Node keys get ``token`` appended (fresh keys per run, so a distributed
        scheduler never reuses a result still in memory). ``sources`` replaces
        the source arrays (e.g. by futures, substituted into the tasks);
        ``sync_after`` wraps kernels in :class:`kernels.SyncAfter` (``ptds-sync``).
        """
        fn = kernels.SyncAfter(self.kernel, self.backend) if sync_after else self.kernel
        data = self.sources if sources is None else sources
        nodes = {node.key for node in self.shape.nodes}

        def ref(k: tuple) -> Any:
            return k + (token,) if k in nodes else data[k]

        dsk: dict = {}
        for node in self.shape.nodes:
            args = tuple(ref(a) for a in node.args)
            if self.shape.kernel == "spin":
                dsk[node.key + (token,)] = (fn, node.salt, *args)
            else:
                dsk[node.key + (token,)] = (fn, *args)
        return dsk, [k + (token,) for k in self.shape.outputs]

    # --- hand launches ----------------------------------------------------------------------

    def launch(self, node: Node, values: dict) -> Any:
        """Launch ``node``'s kernel on the current stream with its inputs from ``values``."""
        args = [values[a] for a in node.args]
        if self.shape.kernel == "spin":
            return self.kernel(node.salt, *args)
        return self.kernel(*args)

    # --- checks -----------------------------------------------------------------------------

    def check(self, results: list) -> str | None:
        """``None`` if ``results`` (device arrays, in :attr:`Shape.outputs` order) are right."""
        outputs = self.shape.outputs
        if len(results) != len(outputs):
            return f"expected {len(outputs)} outputs, got {len(results)}"
        host = {k: kernels.to_host(self.backend, r) for k, r in zip(outputs, results, strict=True)}
        if self.shape.kernel == "spin":
            bad = [k for k in outputs if not np.array_equal(host[k], self.reference[k])]
            if bad:
                return f"{len(bad)} of {len(outputs)} outputs wrong, e.g. {bad[0]}"
            return None
        tiles = self.shape.params["tiles"]
        for name in output_matrices(self.shape):
            got = np.block(
                [[host[(name, m, n, tiles - 1)] for n in range(tiles)] for m in range(tiles)]
            )
            ref = self.reference[name]
            err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
            if not np.isfinite(got).all() or not err <= GEMM_RTOL:
                return f"matrix {name}: relative error {err:.3g} > {GEMM_RTOL}"
        return None


def spin_workload(shape: Shape, backend: str, spin: kernels.Spin, kernel_ms: float) -> Workload:
    """A wide shape on busy kernels, with NumPy reference outputs."""
    host = {k: kernels.source(seed, spin.size) for k, seed in shape.sources.items()}
    values = dict(host)
    for node in shape.nodes:
        values[node.key] = kernels.mix(node.salt, *(values[a] for a in node.args))
    reference = {k: values[k] for k in shape.outputs}
    sources = {k: kernels.to_device(backend, v) for k, v in host.items()}
    return Workload(shape, backend, spin, kernel_ms, sources, reference)


def gemm_workload(shape: Shape, backend: str, matrix: int, kernel_ms: float) -> Workload:
    """A Dagger gemm shape on ``matrix x matrix`` float32 matrices (N(0, 1/matrix) entries).

    The reference is each node's product computed untiled (cuBLAS on a GPU,
    NumPy on sim), from the same host inputs.
    """
    tiles = shape.params["tiles"]
    tile = matrix // tiles
    rng = np.random.default_rng(0)
    names = sorted({m for m, _, _ in shape.sources.values()})
    full = {
        m: (rng.standard_normal((matrix, matrix), dtype=np.float32) / np.sqrt(matrix)).astype(
            np.float32
        )
        for m in names
    }
    sources = {
        key: kernels.to_device(
            backend,
            np.ascontiguousarray(full[m][i * tile : (i + 1) * tile, j * tile : (j + 1) * tile]),
        )
        for key, (m, i, j) in shape.sources.items()
    }
    values = dict(full)
    for c, a, b in shape.products:
        values[c] = kernels.matmul(backend, values[a], values[b])
    reference = {m: values[m] for m in output_matrices(shape)}
    return Workload(shape, backend, kernels.TileGemm(backend), kernel_ms, sources, reference)


# --- the ideal: hand-launched from one thread ---------------------------------------------------

IDEAL_ASSIGNMENTS = ("layers", "chains", "rr")


def ideal_plan(workload: Workload, n_streams: int, assignment: str) -> list[tuple[Node, int]]:
    """``(node, stream index)`` in issue order for a hand launch.

    - ``layers``: layer by layer; the j-th node of a layer on stream ``j % n``;
    - ``chains``: layer by layer; a producer's first consumer on the producer's
      stream (affinity only), other nodes round-robin;
    - ``rr``: every task on the next stream in Dask's static order (dask.order).
    """
    shape = workload.shape
    if assignment == "layers":
        return [(node, j % n_streams) for layer in shape.layers for j, node in enumerate(layer)]
    if assignment == "chains":
        plan, stream_of, claimed, counter = [], {}, set(), 0
        for layer in shape.layers:
            for node in layer:
                producer = next((a for a in node.args if a in stream_of and a not in claimed), None)
                if producer is not None:
                    claimed.add(producer)
                    s = stream_of[producer]
                else:
                    s, counter = counter % n_streams, counter + 1
                stream_of[node.key] = s
                plan.append((node, s))
        return plan
    if assignment == "rr":
        from dask.order import order

        dsk, _ = workload.graph()
        priority = order(dsk)
        ranked = sorted(shape.nodes, key=lambda n: priority[n.key + (None,)])
        return [(node, i % n_streams) for i, node in enumerate(ranked)]
    raise ValueError(
        f"assignment={assignment!r} is invalid: allowed values are {' | '.join(IDEAL_ASSIGNMENTS)}"
    )


class IdealLauncher:
    """Launches a plan onto ``n`` streams of ``backend`` with event waits, from one thread."""

    def __init__(self, backend: Any, n_streams: int):
        self.backend = backend
        self.streams = [backend.create_stream() for _ in range(n_streams)]

    def run(self, workload: Workload, plan: list[tuple[Node, int]]) -> list:
        backend = self.backend
        streams = self.streams
        values = dict(workload.sources)  # holds every intermediate until the end: no reuse hazard
        events: dict = {}
        placed: dict = {}  # key -> (stream index, sequence number on it)
        seq = [0] * len(streams)
        waited = [dict() for _ in streams]  # per stream: producer stream -> highest seq waited
        for node, s in plan:
            stream = streams[s]
            for a in node.args:
                where = placed.get(a)
                if where is not None and where[0] != s and waited[s].get(where[0], 0) < where[1]:
                    backend.wait_event(stream, events[a])
                    waited[s][where[0]] = where[1]
            with backend.use_stream(stream):
                values[node.key] = workload.launch(node, values)
            event = backend.create_event()
            backend.record(event, stream)
            seq[s] += 1
            events[node.key] = event
            placed[node.key] = (s, seq[s])
        for s, stream in enumerate(streams):
            if seq[s]:
                backend.synchronize_stream(stream)
        return [values[k] for k in workload.shape.outputs]
