"""Random-DAG fuzzer: random Dask graphs through the stream runtime, every result checked exactly.

Run from the repository root (see ``benchmarks/README.md``)::

    python -m benchmarks.fuzz --seed 1 --dags 2000
    python -m benchmarks.fuzz --seconds 900 --routes threaded,launcher
    python -m benchmarks.fuzz --self-check
    python -m benchmarks.fuzz --seed 1 --routes launcher --start 417 --dags 1 -v  # one DAG again

A DAG is either a ``dask.delayed`` graph of 2-24 tasks on arrays of 1-64 elements
(kernels, uploads and downloads, unmarked host tasks that ``.get()`` a device
array, ``host_task``-marked ones that read theirs off the streams on the sim (so a
missing host wait shows), sleeps that pass their input through, NumPy
work; in a fifth of them one kernel fails, and in half of those (``--multi``) 1-3 more
nodes fail: kernels, or tasks whose Python code raises ``TaskRaised``) or a
``dask.array`` expression over
device chunks (elementwise ops, reductions, ``@``, ``rechunk``, slicing,
transposes, concatenation, sleeping kernels). Each has its own stream count
(1-8), policy, kernel delays (``Device.kernel_delay`` and kernels that sleep,
0-2 ms, drawn per DAG from ``DELAYS``: ``GPUSTREAMS_SIM_KERNEL_DELAY`` has no effect
here), 1-3 outputs, and sometimes a ``persist`` of intermediates first; on a
cluster, a tenth of them are computed twice (the same collections again while the
first futures live, as a notebook cell run again: same keys, their definitions again),
and in 15% of the ``dask.delayed`` ones a node has ``retries=1`` and raises at its
first attempt (:class:`FailsOnce`; such tasks stay out of stream blocks); of the
further failing nodes, each has ``retries=1`` with even odds (``Dag.apart``), so that
it stays out of blocks and fails at each attempt: an erred input of the blocks that
read it.
Values are integers below ``P`` (every op ends ``% P``), so float64 results are
exact in any order of evaluation; they are compared with ``==`` to the same
functions run on NumPy values (NaN, the sim's poison, never compares equal).

Routes (``--routes``): ``threaded`` (``gpustreams.enabled``, Dask's threads as
such, ``scheduler=dask.threaded.get``, random ``num_workers`` and ``chunksize``: each
task through the runtime in Dask's threads; by name, ``"threads"`` would run the
launcher), ``launcher``
(``scheduler="gpustreams"``), ``distributed`` (an in-process ``LocalCluster`` of
2 workers x 2 threads, the plugin by ``gpustreams.enabled``; a new cluster with
new settings every 100 DAGs: streams, policy and ``gpustreams.block-size``, of
``BLOCK_SIZES``), ``distributed-spill`` (the same with a memory
target so small that every result is spilled) and ``dask-cuda`` (the same on
``dask_cuda.LocalCUDACluster(n_workers=1)`` with dask-cuda's defaults: one
worker process, one thread, its ``DeviceHostFile``; only with ``--backend cupy``
on a machine with a GPU and dask-cuda, and only when named: the default is the
other four), ``distributed-loss`` (only when named: a ``LocalCluster`` of
``LOSS_WORKERS`` workers x 2 threads of which one, the one with the most tasks in
flight, is closed 0-``LOSS_MS`` ms after each DAG's compute starts, and a new one
started: its results and running tasks, blocks among them, are lost and computed
again; in half the DAGs it is retired instead, as adaptive scaling does, its results
first copied to the others). Outcomes: a wrong value; a hang (a local compute past
``--timeout``; on a cluster, an output pending while no task finishes there for
``--timeout``, or still pending after ``LIVELOCK`` times it; the run goes on
with fresh runtimes or a fresh cluster); an unexpected error (any exception, or
a ``KernelError`` naming another key). With failing nodes, a local compute must raise the
error of one that it runs (a ``KernelError`` or ``TaskRaised`` naming its key); on
distributed, each output derived from one must raise, and every other one give its exact
value; an output may raise the ``TaskRaised`` of a node it derives from, and the
``KernelError`` of any failing kernel of the DAG (work queued behind a failing kernel on
its stream fails with it; the ``queued`` column counts those not of its ancestors).
On a cluster, a leak: once every future and persisted collection of the DAG is dropped,
a task that was not on the scheduler when the DAG started is still there after
``LEAK_WAIT`` s (2; the scheduler is polled, and garbage cycles here collected first). It
is checked when the DAG after next starts (the next DAG's graph travels after the
releases in the client's batched stream, so no wait), the last of a cluster at its close.
Leaks count in their own column, the DAG printed with its command; leaks, like wrong
values, hangs and unexpected errors, make the exit status 1.
A DAG that takes longer than ``--timeout`` without hanging (a cluster that kept
finishing tasks) counts as slow, printed with its command, not as a problem.

``--self-check`` breaks one mechanism at a time and must then find a wrong value
on each route where it matters: ``wait`` (device-side event waits), ``hold``
(inputs held until their consumer's event), ``egress`` (``get_data`` waits for
the key's work), ``spill`` (spilling does), ``failure`` (the worker reports a
kernel failure it finds at once, and clears its streams' errors after; broken,
later DAGs get wrong errors, which count as wrong there); it runs with
``gpustreams.blocks: off`` (task per key), other runs with the workers' setting.
``--backend cupy`` runs
the same kinds of DAGs with CuPy chunks and kernels (CuPy operators), without
failing kernels; its sleeping kernels spin on the device for their delay
(0-2 ms). It adds what shares library
state across streams: same-shape FFTs (each array embedded in a tile of
``FFT_TILE``, a round trip through ``fft2``/``ifft2``, rounded back to integers),
``da.random`` leaves from a CuPy ``RandomState`` (their reference is plain Dask's
result for the same seed), and, where PyTorch has CUDA, PyTorch ops on shared
memory (DLPack). Its DAGs differ from the sim's for the same seed. It is not
tested here (no GPU).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import functools
import gc
import logging
import queue
import sys
import threading
import time
import traceback
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import dask
import dask.array as da
import dask.threaded
import numpy as np
from dask import delayed
from distributed import wait
from distributed.diagnostics.plugin import SchedulerPlugin

import dask_gpustreams
from dask_gpustreams import KernelError, host_task, sim
from dask_gpustreams.backends import gpu_visible
from dask_gpustreams.integrations.distributed.egress import Egress
from dask_gpustreams.integrations.distributed.provenance import Provenance
from dask_gpustreams.markers import is_host_task
from dask_gpustreams.runtime import StreamPool, runtimes
from dask_gpustreams.runtime.policies import make_policy, policy_names

#: Every value is an integer in [0, P): sums of products of them stay exact in float64.
P = 4093
#: Every route; a route's index seeds its DAGs, so new routes go at the end.
ROUTES = (
    "threaded",
    "launcher",
    "distributed",
    "distributed-spill",
    "dask-cuda",
    "distributed-loss",
)
#: The routes that run anywhere, the sim included: the default of ``--routes``.
SIM_ROUTES = ROUTES[:4]
DISTRIBUTED = ("distributed", "distributed-spill", "dask-cuda", "distributed-loss")
#: On ``distributed-loss``: its workers, and the most ms after a DAG's compute starts at
#: which one of them is closed (and a new one started).
LOSS_WORKERS = 3
LOSS_MS = 20.0
#: A worker fetching from the one closed retries to connect for distributed's connect
#: timeout (30 s by default) before it computes the key itself: slow, not wrong.
LOSS_CONFIG = {"distributed.comm.timeouts.connect": "3s"}
#: DAGs per distributed cluster (its stream count and policy are drawn per cluster).
CLUSTER_DAGS = 100
POLICIES = tuple(
    n for n in policy_names() if type(make_policy(n)).__module__.startswith("dask_gpustreams")
)
DELAYS = ((0.0, 0.0), (0.0, 0.0005), (0.0, 0.002))
SPILL = {"distributed.worker.memory.target": 1e-6}  # of 32 MiB: every result is spilled
#: On a cluster, an output still pending after this many ``--timeout``s is a hang even
#: while tasks keep finishing (a livelock, or a DAG too slow to fuzz).
LIVELOCK = 10
#: On a cluster, how long (s, at most ``--timeout``) the tasks of a DAG may stay on the
#: scheduler once the fuzzer dropped its futures (the releases travel in the client's
#: batched stream, every 10 ms): still there after it, they are a leak.
LEAK_WAIT = 2.0
#: A cluster's ``gpustreams.block-size``, drawn for each: the default, and small ones that
#: make many blocks, some read straight by others (stop 58: random graphs in blocks of 3
#: found blocks that erred whole under an erred input, which the default seldom forms).
BLOCK_SIZES = (64, 8, 3)

CLUSTER_CONFIG = {  # only target-based spilling; the process-memory monitor stays out
    "distributed.worker.memory.spill": False,
    "distributed.worker.memory.pause": False,
    "distributed.worker.memory.terminate": False,
    # dask picks distributed's P2P rechunk for large rechunks under a client; it takes
    # host buffers only and fails on device chunks (CuPy's or the sim's) with or without
    # the plugin: the seed-4702 run's one unexpected error.
    "array.rechunk.method": "tasks",
}

# --- task functions: the same code runs on device arrays and, for the reference, on NumPy ---


def add(a, b):
    return (a + b) % P


def affine(a, k):
    return (a * k + 1) % P


def mix(a, b, c):
    return (a * 2 + b + c) % P


def total(a):
    return (a + a.sum()) % P


def flip(a):
    return a[::-1] % P


def inc(a):
    return (a + 1) % P


def _host(x: Any) -> np.ndarray:
    return x if isinstance(x, np.ndarray) else x.get()


def host_get(a):
    """An unmarked host task: the launcher learns it after two slow calls in a row."""
    return (_host(a) * 3 + 1) % P


def _host_off_stream(x: Any) -> np.ndarray:
    """``x`` on the host, read on no stream of the task's where ``x`` is on the sim (a copy
    of its buffer as it is: a file write through GDS, a library's own stream): whole only
    after the host wait that a ``host_task`` is promised on every route."""
    return copy.deepcopy(x).get() if isinstance(x, sim.SimArray) else _host(x)


@host_task
def host_marked(a, b):
    return (_host_off_stream(a) + 2 * _host_off_stream(b)) % P


@host_task
def host_sleep(a, seconds):
    """Sleeps, then returns its input itself (device or host)."""
    time.sleep(seconds)
    return a


def numpy_work(a, b):
    return np.remainder(np.cumsum(_host(a)[::-1]) + _host(b), P)


# --- sim kernels ------------------------------------------------------------------------------


def _fill(out, base, delay):
    time.sleep(delay)
    out[...] = base


def _slow_inc(out, a, delay):
    time.sleep(delay)
    np.remainder(a + 1, P, out=out)


def _boom(out, a):
    raise ValueError("boom")


def sim_fill(base, delay):
    """A device array written by a kernel that sleeps ``delay`` first."""
    out = sim.empty(base.shape)
    sim.launch(_fill, out, base, delay)
    return out


def sim_slow(a, delay):
    """``inc(a)`` by a kernel that sleeps ``delay`` first."""
    out = sim.empty(a.shape)
    sim.launch(_slow_inc, out, a, delay)
    return out


def sim_fail(a):
    """Returns at once; its kernel raises on the stream."""
    out = sim.empty(a.shape)
    sim.launch(_boom, out, a)
    return out


class TaskRaised(RuntimeError):
    """The Python exception of a ``raise`` node (its task's key in ``args[0]``)."""


def raise_task(*args: Any) -> Any:
    """A task whose Python code raises :class:`TaskRaised` naming its key (its last argument)."""
    raise TaskRaised(args[-1])


_SPIN_SOURCE = r"""
extern "C" __global__ void fuzz_spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
"""
#: The shape of every FFT of a cupy DAG (a prime side: cuFFT needs a work area).
FFT_TILE = (128, 1009)


@functools.cache
def _spin_kernel() -> tuple[Any, int]:
    import cupy

    return cupy.RawKernel(_SPIN_SOURCE, "fuzz_spin"), cupy.cuda.Device().attributes["ClockRate"]


def cupy_spin(seconds: float) -> None:
    """A one-thread kernel that spins ``seconds`` on the current stream."""
    if seconds > 0:
        kernel, khz = _spin_kernel()
        kernel((1,), (1,), (np.int64(seconds * 1e3 * khz),))


def cupy_fill(base, delay):
    """``base`` on the device, ready only after a kernel that spins ``delay`` (seconds)."""
    import cupy

    out = cupy.asarray(base)  # before the spin: a pageable copy waits for the stream
    cupy_spin(delay)
    return out.copy()


def cupy_slow(a, delay):
    cupy_spin(delay)
    return inc(a)


def cupy_fft(a):
    """``(2a + 1) % P`` through an FFT round trip of ``a`` embedded in a ``FFT_TILE`` tile."""
    import cupy

    if a.size == 0 or a.ndim not in (1, 2):
        return (a * 2 + 1) % P
    x = a.reshape(1, -1) if a.ndim == 1 else a
    rows, cols = x.shape
    tile = cupy.zeros((max(FFT_TILE[0], rows), max(FFT_TILE[1], cols)))
    tile[:rows, :cols] = x
    back = cupy.fft.ifft2(cupy.fft.fft2(tile)).real[:rows, :cols]
    return ((cupy.rint(back) * 2 + 1) % P).reshape(a.shape)


def cupy_torch(a):
    """``(3a + 2) % P`` by PyTorch on ``a``'s memory (DLPack), as a CuPy array."""
    import cupy
    import torch

    t = torch.from_dlpack(cupy.ascontiguousarray(a))
    return cupy.from_dlpack(torch.fmod(t * 3 + 2, P))


def cupy_random(seed: int, shape: tuple[int, int], chunks: tuple[int, ...]) -> da.Array:
    """Integers below P from ``da.random`` with a CuPy ``RandomState`` (a generator per chunk)."""
    import cupy

    rs = da.random.RandomState(seed, RandomState=cupy.random.RandomState)
    return da.floor(rs.random_sample(shape, chunks=chunks) * P)


def random_reference(seed: int, shape: tuple[int, int], chunks: tuple[int, ...]) -> np.ndarray:
    """``cupy_random`` computed by plain Dask: one thread, no stream runtime."""
    import cupy

    with dask.config.set({"gpustreams.enabled": False}):
        return cupy.asnumpy(cupy_random(seed, shape, chunks).compute(scheduler="sync"))


@functools.cache
def torch_ready() -> bool:
    """Whether PyTorch is importable with CUDA; its CUDA is then started, so that every
    task sees its pool stream as PyTorch's current stream."""
    try:
        import torch
    except ImportError:
        return False
    if not torch.cuda.is_available():
        return False
    torch.cuda.init()
    return True


@dataclass(frozen=True)
class Kernels:
    """The backend-specific task functions; the rest are the generic ones above."""

    upload: Callable
    download: Callable
    fill: Callable
    slow: Callable
    fail: Callable | None
    meta: Any
    fft: Callable | None = None  # cupy only: library state shared across streams
    torch: Callable | None = None


def make_kernels(backend: str) -> Kernels:
    """The task functions of ``backend`` (``sim`` or ``cupy``)."""
    if backend == "sim":
        return Kernels(sim.asarray, sim.asnumpy, sim_fill, sim_slow, sim_fail, np.empty((0, 0)))
    import cupy

    return Kernels(
        cupy.asarray,
        cupy.asnumpy,
        cupy_fill,
        cupy_slow,
        None,
        cupy.empty((0, 0)),
        fft=cupy_fft,
        torch=cupy_torch if torch_ready() else None,
    )


def _same(x, *consts):
    return x


#: References of the delayed ops that differ from their task function (None: fails).
DELAYED_REFS: dict[str, Callable | None] = {
    "upload": _same,
    "to-device": _same,
    "download": _same,
    "to-host": _same,
    "fill": _same,
    "host-sleep": _same,
    "slow": lambda a, delay: inc(a),
    "fail": None,
    "raise": None,
    "fft": lambda a: (a * 2 + 1) % P,
    "torch": lambda a: (a * 3 + 2) % P,
}
GENERIC = {
    "add": add,
    "affine": affine,
    "mix": mix,
    "total": total,
    "flip": flip,
    "host-get": host_get,
    "host-marked": host_marked,
    "host-sleep": host_sleep,
    "numpy": numpy_work,
    "to-device": dask_gpustreams.to_device,
    "to-host": dask_gpustreams.to_host,
    "raise": raise_task,
}


class FailsOnce:
    """``func``, except that its first call raises (a retried task: in-process clusters
    share :data:`ATTEMPTED`, and a copy keeps its token, so a retry anywhere is a second
    call). Marked ``host_task`` where ``func`` is: a wrapper hides the mark (see
    :func:`~dask_gpustreams.host_task`), and a ``host-marked`` node, which reads its inputs
    off the streams on the sim, then ran with no host wait and read them unwritten (a
    wrong value of the fuzzer's own: ``--seed 9003 --routes distributed-loss --start 1499
    --dags 1``, 1 run in 30)."""

    def __init__(self, func: Callable):
        self.func = func
        self.token = uuid.uuid4().hex
        if is_host_task(func):
            host_task(self)

    def __call__(self, *args: Any) -> Any:
        with ATTEMPTED_LOCK:
            first = self.token not in ATTEMPTED
            ATTEMPTED.add(self.token)
        if first:
            raise RetriedError("the first attempt of a retried task fails")
        return self.func(*args)


class RetriedError(RuntimeError):
    """The first attempt of a :class:`FailsOnce` task."""


#: The tokens of the :class:`FailsOnce` tasks attempted in this process.
ATTEMPTED: set[str] = set()
ATTEMPTED_LOCK = threading.Lock()


def delayed_func(name: str, kernels: Kernels) -> Callable:
    return GENERIC.get(name) or getattr(kernels, name)


# --- dask.array ops: ``m`` is an ArrayGraph for the graph, an ArrayReference for NumPy -------


class ArrayGraph:
    """The functions the array ops call to build a graph: dask.array's, and the kernels'."""

    where = staticmethod(da.where)
    maximum = staticmethod(da.maximum)
    concatenate = staticmethod(da.concatenate)

    def __init__(self, kernels: Kernels):
        self.kernels = kernels

    def rechunk(self, x, chunks):
        return x.rechunk(chunks)

    def slow(self, x, delay):
        return x.map_blocks(self.kernels.slow, delay, meta=self.kernels.meta)

    def fft(self, x):
        return x.map_blocks(self.kernels.fft, meta=self.kernels.meta)

    def torch(self, x):
        return x.map_blocks(self.kernels.torch, meta=self.kernels.meta)


class ArrayReference:
    """The same on NumPy arrays."""

    where = staticmethod(np.where)
    maximum = staticmethod(np.maximum)
    concatenate = staticmethod(np.concatenate)

    def rechunk(self, x, chunks):
        return x

    def slow(self, x, delay):
        return inc(x)

    def fft(self, x):
        return (x * 2 + 1) % P

    def torch(self, x):
        return (x * 3 + 2) % P


def _common(x, y):
    return min(x.shape[0], y.shape[0]), min(x.shape[1], y.shape[1])


def a_affine(m, x, k):
    return (x * k + 1) % P


def a_add(m, x, y):
    r, c = _common(x, y)
    return (x[:r, :c] + y[:r, :c]) % P


def a_maximum(m, x, y):
    r, c = _common(x, y)
    return m.maximum(x[:r, :c], y[:r, :c])


def a_matmul(m, x, y):
    c = _common(x, y)[1]
    return (x[:, :c] @ y[:, :c].T) % P


def a_concat(m, x, y):
    c = _common(x, y)[1]
    return m.concatenate([x[:, :c], y[:, :c]], axis=0)


def a_transpose(m, x):
    return x.T


def a_slice(m, x, r0, c0, step):
    return x[r0:, c0::step]


def a_rechunk(m, x, chunks):
    return m.rechunk(x, chunks)


def a_sum(m, x, axis):
    return (x + x.sum(axis=axis, keepdims=True)) % P


def a_cumsum(m, x, axis):
    return x.cumsum(axis=axis) % P


def a_where(m, x, k):
    return m.where(x > k, x, k - x)


def a_slow(m, x, delay):
    return m.slow(x, delay)


def a_fft(m, x):
    return m.fft(x)


def a_torch(m, x):
    return m.torch(x)


ARRAY_UNARY = (a_affine, a_transpose, a_slice, a_rechunk, a_sum, a_cumsum, a_where, a_slow)
ARRAY_BINARY = (a_add, a_maximum, a_matmul, a_concat)
ARRAY_LIBRARY = (a_fft, a_torch)  # cupy DAGs only
ARRAY_OPS = {f.__name__[2:]: f for f in ARRAY_UNARY + ARRAY_BINARY + ARRAY_LIBRARY}


# --- DAGs -------------------------------------------------------------------------------------


@dataclass
class Node:
    """``op(*inputs, *consts)``: inputs are indices of earlier nodes."""

    op: str
    inputs: tuple[int, ...] = ()
    consts: tuple = ()


@dataclass
class Dag:
    """One random graph, its settings and what to compute."""

    route: str
    index: int
    kind: str  # "delayed" or "array"
    nodes: list[Node]
    outputs: list[int]
    streams: int
    policy: str
    delay: tuple[float, float]
    threads: int = 4
    chunksize: int = 1
    optimize: bool = True  # optimize_graph: fused tasks and aliases, or one task per op
    persist: list[int] = field(default_factory=list)  # persisted before node ``split``
    split: int = 0
    failing: int | None = None
    fail_key: str = ""
    #: More failing nodes (``fail``: a kernel that raises; ``raise``: a task that raises
    #: ``TaskRaised``), by index: their keys. Only in DAGs with ``failing``.
    extra: dict[int, str] = field(default_factory=dict)
    again: bool = False  # on a cluster: computed a second time while the first futures live
    block_size: int | None = None  # on a cluster: its gpustreams.block-size
    retried: int | None = None  # on a cluster: a node whose first attempt raises (retries=1)
    #: On a cluster: failing nodes of ``extra`` with ``retries=1``, so outside stream blocks
    #: (they fail at each attempt): the blocks that read them have an erred input.
    apart: list[int] = field(default_factory=list)

    def failures(self) -> dict[int, str]:
        """Every failing node (the failing kernel and ``extra``): its key."""
        first = {} if self.failing is None else {self.failing: self.fail_key}
        return {**first, **self.extra}

    def tainted(self) -> list[bool]:
        """Per node: whether its value derives from a failing node."""
        failing = self.failures()
        bad: list[bool] = []
        for i, node in enumerate(self.nodes):
            bad.append(i in failing or any(bad[j] for j in node.inputs))
        return bad

    def ancestors(self, roots: Any) -> set[int]:
        """The nodes that ``roots`` (node indices) derive from, ``roots`` included."""
        seen: set[int] = set()
        todo = list(roots)
        while todo:
            i = todo.pop()
            if i not in seen:
                seen.add(i)
                todo.extend(self.nodes[i].inputs)
        return seen

    def computed(self) -> set[int]:
        """The nodes a compute of the DAG runs: those its outputs and persists derive from."""
        return self.ancestors([*self.outputs, *self.persist])

    def acceptable(self, nodes: set[int]) -> tuple[set[str], set[str]]:
        """Of the failing nodes among ``nodes``: the keys of the kernels, and of the tasks
        that raise ``TaskRaised``."""
        failing = self.failures()
        kernels = {failing[i] for i in nodes & failing.keys() if self.nodes[i].op == "fail"}
        return kernels, {failing[i] for i in nodes & failing.keys()} - kernels

    def describe(self) -> str:
        def const(c):
            if isinstance(c, np.ndarray):
                return f"<{c.shape}>"
            return f"{c:.4f}" if isinstance(c, float) else repr(c)

        ops = " ".join(
            f"{i}={n.op}({','.join([*map(str, n.inputs), *map(const, n.consts)])})"
            for i, n in enumerate(self.nodes)
        )
        persist = f" persist {self.persist} before {self.split}" if self.persist else ""
        threads = f" threads={self.threads} chunksize={self.chunksize}"
        blocks = "" if self.block_size is None else f" block_size={self.block_size}"
        again = " computed twice" if self.again and self.route in DISTRIBUTED else ""
        retried = "" if self.retried is None else f" node {self.retried} retried"
        if self.extra:
            retried += f" failing nodes {sorted(self.failures())}"
        if self.apart:
            retried += f" ({self.apart} with retries, outside blocks)"
        return (
            f"{self.route} dag {self.index} ({self.kind}): {ops}; outputs {self.outputs}{persist}"
            f"{again}{retried};"
            f" streams={self.streams} policy={self.policy} kernel_delay={self.delay}"
            f" optimize_graph={self.optimize}{blocks}"
            + (threads if self.route == "threaded" else "")
        )


def _earlier(rng: np.random.Generator, n: int) -> int:
    """An earlier node, the recent ones more often."""
    return n - min(int(rng.geometric(0.35)), n)


#: Delayed ops: name, inputs, where they must be, where the output is (``same``: as the
#: first input), weight.
DELAYED_OPS = (
    ("add", 2, "device", "device", 4),
    ("affine", 1, "device", "device", 3),
    ("mix", 3, "device", "device", 2),
    ("total", 1, "device", "device", 1),
    ("flip", 1, "device", "device", 1),
    ("slow", 1, "device", "device", 3),
    ("host-get", 1, "device", "host", 1),
    ("host-marked", 2, "any", "host", 1),
    ("host-sleep", 1, "any", "same", 1),
    ("numpy", 2, "any", "host", 1),
    ("download", 1, "device", "host", 1),
    ("to-host", 1, "device", "host", 1),
)
_WEIGHTS = np.array([op[4] for op in DELAYED_OPS], dtype=float) / sum(op[4] for op in DELAYED_OPS)
#: Ops of cupy DAGs only: same-shape FFTs, PyTorch (where it has CUDA).
LIBRARY_OPS = {
    "fft": ("fft", 1, "device", "device", 2),
    "torch": ("torch", 1, "device", "device", 2),
}


def library_ops(backend: str) -> tuple[str, ...]:
    """The library ops of ``backend``'s DAGs (none on the sim)."""
    if backend != "cupy":
        return ()
    return ("fft", "torch") if torch_ready() else ("fft",)


def delayed_dag(
    rng: np.random.Generator, base: dict, fail: bool, libraries: tuple[str, ...] = ()
) -> Dag:
    """A random ``dask.delayed`` graph of 2-24 tasks on arrays of 1-64 elements."""
    ops, weights = DELAYED_OPS, _WEIGHTS
    if libraries:
        ops = DELAYED_OPS + tuple(LIBRARY_OPS[name] for name in libraries)
        weights = np.array([op[4] for op in ops], dtype=float) / sum(op[4] for op in ops)
    n = int(rng.integers(1, 65))
    size = int(rng.integers(2, 25))
    nodes: list[Node] = []
    where: list[str] = []
    fail_at = int(rng.integers(1, size)) if fail else None

    def add_node(node: Node, loc: str) -> int:
        nodes.append(node)
        where.append(loc)
        return len(nodes) - 1

    def leaf() -> int:
        data = rng.integers(0, P, n).astype(np.float64)
        if rng.random() < 0.5:
            return add_node(Node("fill", (), (data, float(rng.uniform(0, 0.002)))), "device")
        return add_node(Node(str(rng.choice(["upload", "to-device"])), (), (data,)), "device")

    def on_device(j: int) -> int:
        if where[j] == "device":
            return j
        return add_node(Node(str(rng.choice(["upload", "to-device"])), (j,)), "device")

    failing = None
    while len(nodes) < size:
        if not nodes or rng.random() < 0.12:
            leaf()
            continue
        if failing is None and fail_at is not None and len(nodes) >= fail_at:
            failing = add_node(Node("fail", (on_device(_earlier(rng, len(nodes))),)), "device")
            continue
        name, arity, takes, gives, _ = ops[rng.choice(len(ops), p=weights)]
        inputs = [_earlier(rng, len(nodes)) for _ in range(arity)]
        if takes == "device":
            inputs = [on_device(j) for j in inputs]
        consts: tuple = ()
        if name == "affine":
            consts = (int(rng.integers(-3, 4)),)
        elif name in ("slow", "host-sleep"):
            consts = (float(rng.uniform(0, 0.002)),)
        add_node(Node(name, tuple(inputs), consts), where[inputs[0]] if gives == "same" else gives)
    outputs = sorted({len(nodes) - 1, *(int(j) for j in rng.integers(0, len(nodes), 2))})
    dag = Dag(kind="delayed", nodes=nodes, outputs=outputs[: int(rng.integers(1, 4))], **base)
    if failing is not None:
        dag.failing = failing
        dag.fail_key = f"fail-{int(rng.integers(2**63)):x}"
        tainted = dag.tainted()
        if not any(tainted[i] for i in dag.outputs):
            dag.outputs.append(max(i for i, t in enumerate(tainted) if t))
    return dag


def array_dag(rng: np.random.Generator, base: dict, libraries: tuple[str, ...] = ()) -> Dag:
    """A random ``dask.array`` expression of 1-6 ops over 1-3 arrays of device chunks.

    With ``libraries`` (cupy), some leaves are ``da.random`` arrays and the unary ops
    include the library ops.
    """
    unary = ARRAY_UNARY + tuple(f for f in ARRAY_LIBRARY if f.__name__[2:] in libraries)
    nodes: list[Node] = []
    shapes: list[tuple[int, int]] = []

    def chunks(shape) -> tuple[int, ...]:
        return tuple(int(rng.integers(1, s + 1)) for s in shape)

    for _ in range(int(rng.integers(1, 4))):
        shape = (int(rng.integers(1, 13)), int(rng.integers(1, 13)))
        data = rng.integers(0, P, shape).astype(np.float64)
        if libraries and rng.random() < 0.3:
            nodes.append(Node("random", (), (int(rng.integers(2**31)), shape, chunks(shape))))
        else:
            nodes.append(Node("array", (), (data, chunks(shape))))
        shapes.append(shape)
    for _ in range(int(rng.integers(1, 7))):
        if rng.random() < 0.4:
            f = ARRAY_BINARY[int(rng.integers(len(ARRAY_BINARY)))]
            inputs = (_earlier(rng, len(nodes)), _earlier(rng, len(nodes)))
        else:
            f = unary[int(rng.integers(len(unary)))]
            inputs = (_earlier(rng, len(nodes)),)
        shape = shapes[inputs[0]]
        consts: tuple = ()
        if f is a_affine:
            consts = (int(rng.integers(-3, 4)),)
        elif f is a_slice:
            consts = (
                int(rng.integers(shape[0])),
                int(rng.integers(shape[1])),
                1 + int(rng.random() < 0.3),
            )
        elif f is a_rechunk:
            consts = (chunks(shape),)
        elif f in (a_sum, a_cumsum):
            consts = (int(rng.integers(2)),)
        elif f is a_where:
            consts = (int(rng.integers(0, P)),)
        elif f is a_slow:
            consts = (float(rng.uniform(0, 0.002)),)
        nodes.append(Node(f.__name__[2:], inputs, consts))
        shapes.append(f(ArrayReference(), *(np.zeros(shapes[j]) for j in inputs), *consts).shape)
    outputs = sorted({len(nodes) - 1, int(rng.integers(0, len(nodes)))})
    return Dag(kind="array", nodes=nodes, outputs=outputs[: int(rng.integers(1, 3))], **base)


#: Of the DAGs with a failing kernel, the fraction given 1-3 more failing nodes (``--multi``).
MULTI = 0.5
#: The ops a further failing node may replace (device in, device out: a ``fail`` takes the
#: first input as its own).
REPLACEABLE = ("add", "affine", "mix", "total", "flip", "slow")


def add_failures(dag: Dag, rng: np.random.Generator) -> None:
    """1-3 more failing nodes in ``dag``: computed nodes of ``REPLACEABLE`` ops (not the
    retried one) become a failing kernel (``fail`` of their first input; 70%) or a task
    that raises ``TaskRaised`` (``raise``, same inputs)."""
    computed = dag.computed()
    candidates = [
        i
        for i, node in enumerate(dag.nodes)
        if node.op in REPLACEABLE and i in computed and i not in (dag.failing, dag.retried)
    ]
    count = min(len(candidates), 1 + int(rng.integers(3)))
    for i in sorted(int(j) for j in rng.choice(candidates, count, replace=False)):
        node = dag.nodes[i]
        if rng.random() < 0.7:
            dag.extra[i] = f"fail-{int(rng.integers(2**63)):x}"
            dag.nodes[i] = Node("fail", node.inputs[:1])
        else:
            dag.extra[i] = f"raise-{int(rng.integers(2**63)):x}"
            dag.nodes[i] = Node("raise", node.inputs, (dag.extra[i],))


def make_dag(
    seed: int,
    route: str,
    index: int,
    backend: str,
    failures: bool = True,
    multi: float = MULTI,
) -> Dag:
    """DAG ``index`` of ``route`` for ``seed``: the same on every run (``failures``: may fail;
    ``multi``: the fraction of failing DAGs with more failing nodes, drawn apart, so that
    the other DAGs stay those of earlier commits)."""
    rng = np.random.default_rng([seed, ROUTES.index(route), index])
    base = {
        "route": route,
        "index": index,
        "streams": int(rng.integers(1, 9)),
        "policy": str(rng.choice(POLICIES)),
        "delay": DELAYS[int(rng.integers(len(DELAYS)))] if backend == "sim" else (0.0, 0.0),
        "threads": int(rng.choice([1, 2, 4, 8])),
        "chunksize": int(rng.choice([1, 1, 4, 8])),
        "optimize": bool(rng.random() < 0.7),
    }
    libraries = library_ops(backend)
    if rng.random() < 0.25:
        dag = array_dag(rng, base, libraries)
    else:
        fail = rng.random() < 0.2 and failures and backend == "sim"
        dag = delayed_dag(rng, base, fail, libraries)
    if len(dag.nodes) > 2 and rng.random() < 0.2:
        dag.split = int(rng.integers(1, len(dag.nodes)))
        later = {j for node in dag.nodes[dag.split :] for j in node.inputs}
        dag.persist = sorted(j for j in range(dag.split) if j in later or j in dag.outputs)
    dag.again = bool(rng.random() < 0.1)  # drawn last: the DAGs of earlier commits stay
    if route in DISTRIBUTED and dag.kind == "delayed" and rng.random() < 0.15:
        retried = int(rng.integers(len(dag.nodes)))  # drawn after: as above
        if retried != dag.failing:
            dag.retried = retried
    if dag.failing is not None:
        more = np.random.default_rng([seed, ROUTES.index(route), index, 1])
        if more.random() < multi:
            add_failures(dag, more)
            if route in DISTRIBUTED:  # drawn apart: the DAGs of earlier commits stay
                aside = np.random.default_rng([seed, ROUTES.index(route), index, 2])
                dag.apart = [i for i in sorted(dag.extra) if aside.random() < 0.5]
    return dag


def reference(dag: Dag) -> list[np.ndarray | None]:
    """Each node's value computed on NumPy (None where it derives from the failing kernel)."""
    values: list[Any] = []
    for node in dag.nodes:
        args = [values[j] for j in node.inputs]
        if any(a is None for a in args):
            values.append(None)
        elif dag.kind == "array":
            if node.op == "array":
                values.append(node.consts[0])
            elif node.op == "random":
                values.append(random_reference(*node.consts))
            else:
                values.append(ARRAY_OPS[node.op](ArrayReference(), *args, *node.consts))
        else:
            ref = DELAYED_REFS[node.op] if node.op in DELAYED_REFS else GENERIC[node.op]
            values.append(None if ref is None else ref(*args, *node.consts))
    return values


def build(dag: Dag, kernels: Kernels, persist: Callable[[list], list]) -> list:
    """The graph's outputs as Dask collections; ``persist`` persists the intermediates."""
    graph = ArrayGraph(kernels)
    values: list[Any] = []
    for i, node in enumerate(dag.nodes):
        if dag.persist and i == dag.split:
            for j, value in zip(
                dag.persist, persist([values[j] for j in dag.persist]), strict=True
            ):
                values[j] = value
        args = [values[j] for j in node.inputs]
        if dag.kind == "array":
            if node.op == "array":
                data, chunks = node.consts
                x = da.from_array(data, chunks=chunks)
                values.append(x.map_blocks(kernels.upload, meta=kernels.meta))
            elif node.op == "random":
                values.append(cupy_random(*node.consts))
            else:
                values.append(ARRAY_OPS[node.op](graph, *args, *node.consts))
        elif i == dag.retried:
            with dask.annotate(retries=1):
                task = delayed(FailsOnce(delayed_func(node.op, kernels)))
                values.append(task(*args, *node.consts))
        else:
            key = dag.failures().get(i)
            name = {} if key is None else {"dask_key_name": key}
            with dask.annotate(**({"retries": 1} if i in dag.apart else {})):
                task = delayed(delayed_func(node.op, kernels))
                values.append(task(*args, *node.consts, **name))
    return [values[i] for i in dag.outputs]


# --- checking ---------------------------------------------------------------------------------

OK = ("ok", "")


def compare(got: Any, want: np.ndarray) -> str | None:
    """None if ``got`` is exactly ``want``, else what differs."""
    host = np.asarray(_host(got))
    if host.shape != want.shape:
        return f"shape {host.shape}, expected {want.shape}"
    if np.array_equal(host, want):
        return None
    nan = int(np.isnan(host).sum())
    return f"{int((host != want).sum())} of {host.size} differ ({nan} NaN)"


def blame(error: BaseException, dag: Dag, output: int | None = None) -> tuple[str, str]:
    """The outcome of ``error`` raised by a compute of ``dag`` (``output``: by that output's
    future on a cluster; None: by the compute as a whole, one error for every output).

    A compute may raise the ``KernelError`` of any failing kernel that it runs (its
    outputs' and persists' ancestors), or the ``TaskRaised`` of any ``raise`` node that it
    runs. An output on a cluster may raise the ``TaskRaised`` of a ``raise`` node it
    derives from only, and the ``KernelError`` of a failing kernel it derives from or of
    any other that the compute runs (work queued behind a failing kernel on its stream
    fails with it: docs/guide.md#guarantees). So may the retried node's first attempt,
    with a failing kernel in the DAG, which then spends its one retry: its next call,
    :class:`FailsOnce`'s first, raises ``RetriedError`` with no retry left (helper-72:
    seed 5120, DAG 2167); only outputs derived from the retried node see it. Any other
    error, a key of another DAG's among them, is unexpected.
    """
    computed = dag.computed()
    kernels, raised = dag.acceptable(computed)
    derived = computed if output is None else dag.ancestors([output])
    if output is not None:
        raised = dag.acceptable(derived)[1]
    if isinstance(error, KernelError) and error.key in kernels:
        return OK
    if isinstance(error, TaskRaised) and error.args and error.args[0] in raised:
        return OK
    if isinstance(error, RetriedError) and kernels and dag.retried in derived:
        return OK
    return "error", f"{type(error).__name__}: {error}"


def _queued(error: BaseException, dag: Dag, output: int) -> bool:
    """Whether ``error``, accepted for ``output``, is the ``KernelError`` of a failing kernel
    that the output does not derive from (queued behind it on its stream)."""
    return (
        isinstance(error, KernelError)
        and error.key not in dag.acceptable(dag.ancestors([output]))[0]
    )


def check_local(dag: Dag, result: Any, error: BaseException | None) -> tuple[str, str]:
    """A local compute of ``dag``: exact outputs, or the error of a failing node it runs."""
    if error is not None:
        return blame(error, dag)
    failing = dag.failures()
    ran = sorted(failing[i] for i in dag.computed() & failing.keys())
    if ran:
        return "wrong", f"no error for the failing nodes {ran}"
    want = reference(dag)
    for i, got in zip(dag.outputs, result, strict=True):
        problem = compare(got, want[i])
        if problem is not None:
            return "wrong", f"output {i}: {problem}"
    return OK


@contextlib.contextmanager
def kernel_delay(delay: tuple[float, float], backend: str) -> Iterator[None]:
    """``Device.kernel_delay`` set to ``delay`` on the sim device, then restored."""
    if backend != "sim":
        yield
        return
    device = sim.get_device()
    previous = device.kernel_delay
    device.kernel_delay = delay
    try:
        yield
    finally:
        device.kernel_delay = previous


# --- routes -----------------------------------------------------------------------------------


def busy_stacks(frames: int = 8) -> str:
    """The innermost ``frames`` frames of each thread that runs the compute, Dask's work
    or the runtime's (by the file names in its stack): where a hang is."""
    names = {t.ident: t.name for t in threading.enumerate()}
    shown = []
    for ident, frame in sys._current_frames().items():
        if ident == threading.get_ident():
            continue  # this one, printing
        stack = traceback.extract_stack(frame)
        if any(part in f.filename for f in stack for part in ("dask", "distributed", "fuzz")):
            lines = "".join(traceback.format_list(stack[-frames:]))
            shown.append(f"  thread {names.get(ident, ident)}:\n{lines}")
    return "".join(shown)


class ComputeThread:
    """A daemon thread that runs one call at a time, so that a hung call can be left behind."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="fuzz-compute", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while (call := self._calls.get()) is not None:
            fn, box, done = call
            try:
                box["result"] = fn()
            except BaseException as e:  # noqa: BLE001 - every exception is an outcome
                box["error"] = e
            done.set()
            del call, fn, box, done

    def call(self, fn: Callable[[], Any], timeout: float) -> dict | None:
        """``{"result": fn()}`` or ``{"error": exception}``; None if it takes over ``timeout``."""
        box: dict = {}
        done = threading.Event()
        self._calls.put((fn, box, done))
        return box if done.wait(timeout) else None

    def close(self) -> None:
        """End the thread once its call (if any) returns."""
        self._calls.put(None)

    def join(self, timeout: float) -> bool:
        """Whether the thread has ended (after :meth:`close`) within ``timeout`` s."""
        self._thread.join(timeout)
        return not self._thread.is_alive()


class LocalRoute:
    """``threaded`` or ``launcher``: each compute in a thread, waited for with a timeout."""

    def __init__(self, name: str, backend: str, timeout: float):
        self.name = name
        self.backend = backend
        self.kernels = make_kernels(backend)
        self.timeout = timeout
        # Dask's threads as such: by name ("threads") an enabled compute runs the launcher.
        self.scheduler = dask.threaded.get if name == "threaded" else "gpustreams"
        self.thread = ComputeThread()

    def __enter__(self) -> LocalRoute:
        return self

    def __exit__(self, *exc: object) -> None:
        self.thread.close()

    def config(self, dag: Dag) -> dict:
        config = {
            "gpustreams.backend": self.backend,
            "gpustreams.streams": dag.streams,
            "gpustreams.policy": dag.policy,
        }
        if self.name == "threaded":
            config.update(
                {"gpustreams.enabled": True, "num_workers": dag.threads, "chunksize": dag.chunksize}
            )
        return config

    def run(self, dag: Dag) -> tuple[str, str]:
        """Compute ``dag``; its outcome and what went wrong."""
        scheduler = self.scheduler

        def compute() -> tuple:
            options = {"scheduler": scheduler, "optimize_graph": dag.optimize}
            outs = build(dag, self.kernels, lambda xs: dask.persist(*xs, **options))
            return dask.compute(*outs, **options)

        with dask.config.set(self.config(dag)), kernel_delay(dag.delay, self.backend):
            box = self.thread.call(compute, self.timeout)
        if box is None:
            stacks = busy_stacks()
            # The hung compute keeps its thread and runtime; the next DAG gets fresh ones.
            self.thread.close()
            self.thread = ComputeThread()
            runtimes.forget()
            return "hang", f"no result after {self.timeout} s; where the threads were:\n{stacks}"
        return check_local(dag, box.get("result"), box.get("error"))


class Hang(Exception):
    """An output that the cluster stopped making progress on; the message says how."""


class Finished(SchedulerPlugin):
    """Counts the tasks that finish on the scheduler (to ``memory`` or ``erred``): an output
    pending while this count grows is slow, not hung (DAG 53 of seed 0 on distributed-spill,
    14,751 tasks, took 73 s on 2 cores with the plugin off)."""

    name = "fuzz-finished"

    def __init__(self) -> None:
        self.count = 0

    def transition(self, key: Any, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        if finish in ("memory", "erred"):
            self.count += 1


def _has_streams_plugin(dask_worker: Any) -> str:
    """On a worker: its status and whether the plugin is set up there (a wrong output's report)."""
    from dask_gpustreams import StreamsPlugin

    return f"{dask_worker.status.name}, plugin {StreamsPlugin.name in dask_worker.plugins}"


def scheduler_keys(
    before: frozenset = frozenset(), within: frozenset | None = None, *, dask_scheduler: Any
) -> dict[Any, str]:
    """The scheduler's tasks (``within`` those keys) not in ``before``: key to state."""
    tasks = dask_scheduler.tasks
    if within is not None:
        return {k: tasks[k].state for k in within if k in tasks and k not in before}
    return {k: ts.state for k, ts in tasks.items() if k not in before}


def holders(keys: frozenset, *, dask_scheduler: Any) -> dict[Any, tuple[list, int]]:
    """What keeps each of ``keys`` on the scheduler: the clients that want it, and how
    many tasks depend on it (a leak's detail)."""
    tasks = dask_scheduler.tasks
    return {
        k: (sorted(c.client_key for c in ts.who_wants or ()), len(ts.dependents))
        for k in keys
        if (ts := tasks.get(k)) is not None
    }


@dataclass
class Pending:
    """A DAG whose leak check waits for the next two DAGs on the cluster.

    The next DAG's graph travels after this one's releases in the client's batched
    stream (callbacks in order on the client's loop): once its compute returned, the
    scheduler has handled them. So the tasks of this DAG still there when the next DAG
    starts (``keys``) must be gone when the one after starts; each DAG's start looks at
    the scheduler once (``before``), and the check costs nothing more, where waiting for
    the releases took 10 ms (the stream's interval) of a DAG's 40. The last DAGs of a
    cluster are checked at its close (``settle``).
    """

    dag: Dag
    before: frozenset  # the scheduler's tasks when the DAG started
    keys: frozenset | None = None  # its tasks still there when the next DAG started


def has_plugin(dask_worker: Any) -> bool:
    """Whether ``dask_worker`` has the gpustreams plugin (run on each worker)."""
    return dask_gpustreams.StreamsPlugin.name in dask_worker.plugins


class DistributedRoute:
    """``distributed``, ``distributed-spill``, ``dask-cuda`` or ``distributed-loss``: a
    cluster, new every CLUSTER_DAGS DAGs (an in-process LocalCluster, or a
    LocalCUDACluster)."""

    def __init__(self, name: str, backend: str, timeout: float, seed: int):
        self.name = name
        self.backend = backend
        self.kernels = make_kernels(backend)
        self.timeout = timeout
        self.seed = seed
        self.batch: int | None = None
        self.client: Any = None
        self.cluster: Any = None
        self.started: list = []  # distributed-loss: the workers started after a loss
        self.losses = 0  # distributed-loss: the workers closed or retired
        self.interrupted = 0  # ... of which had tasks in flight when they went
        self.last_loss = ""  # ... the last one, as a wrong output's report gives it
        self.loss_error: BaseException | None = None  # what the last loss raised
        #: Outputs that raised the KernelError of a failing kernel they do not derive from
        self.queued = 0
        self._config: Any = None  # the dask.config.set of the cluster's settings
        self.pending: list[Pending] = []  # at most the two DAGs before
        #: DAGs whose tasks stayed on the scheduler, and what stayed (run_route takes them)
        self.leaks: list[tuple[Dag, str]] = []

    def __enter__(self) -> DistributedRoute:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self, batch: int) -> None:
        """A cluster whose stream count and policy are drawn for ``batch``."""
        from distributed import Client, LocalCluster

        rng = np.random.default_rng([self.seed, ROUTES.index(self.name), batch, 0])
        self.streams, self.policy = int(rng.integers(1, 9)), str(rng.choice(POLICIES))
        self.block_size = int(rng.choice(BLOCK_SIZES))
        spill = self.name == "distributed-spill"
        config = {
            **CLUSTER_CONFIG,
            **(SPILL if spill else {}),
            **(LOSS_CONFIG if self.name == "distributed-loss" else {}),
            "gpustreams.enabled": True,
            "gpustreams.backend": self.backend,
            "gpustreams.streams": self.streams,
            "gpustreams.policy": self.policy,
            "gpustreams.block-size": self.block_size,
        }
        self._config = dask.config.set(config)
        self._config.__enter__()
        if self.name == "dask-cuda":
            from dask_cuda import LocalCUDACluster

            self.cluster = LocalCUDACluster(
                n_workers=1, dashboard_address=":0", silence_logs=logging.CRITICAL
            )
        else:
            self.cluster = LocalCluster(
                processes=False,
                n_workers=LOSS_WORKERS if self.name == "distributed-loss" else 2,
                threads_per_worker=2,
                dashboard_address=":0",
                silence_logs=logging.CRITICAL,
                **({"memory_limit": "32 MiB"} if spill else {}),
            )
        self.client = Client(self.cluster)
        self.batch = batch
        self.finished = Finished()
        scheduler = self.cluster.scheduler

        async def add_finished() -> None:  # on the scheduler's loop, beside its transitions
            scheduler.add_plugin(self.finished)

        self.cluster.sync(add_finished)
        missing = [w for w, on in self.client.run(has_plugin).items() if not on]
        if missing:
            raise RuntimeError(f"{self.name}: no gpustreams plugin on the workers {missing}")
        if self.kernels.torch is not None:
            self.client.run(torch_ready)  # as in this process: PyTorch's CUDA started

    def close(self) -> None:
        """Close the cluster, giving up after the timeout (a hung worker may never close)."""
        if self.client is None:
            return
        with contextlib.suppress(Exception):  # a hung cluster's scheduler answers, mostly
            self.settle()
        self.pending = []
        for worker in self.started:  # before their scheduler: else they try to reconnect
            with contextlib.suppress(Exception):
                self.cluster.sync(worker.close, timeout=self.timeout)
        self.started = []
        for closing in (self.client, self.cluster):  # a hung one may not close: left behind
            with contextlib.suppress(Exception):
                closing.close(timeout=self.timeout)
        self._config.__exit__(None, None, None)
        self.client = self.cluster = self.batch = None

    def run(self, dag: Dag) -> tuple[str, str]:
        """Compute ``dag``; gather its outputs one by one in a random order.

        Its leak check waits for the next DAG (or ``settle``): see ``Pending``.
        """
        batch = dag.index // CLUSTER_DAGS
        if batch != self.batch:
            self.close()
            self.start(batch)
        dag.streams, dag.policy, dag.block_size = self.streams, self.policy, self.block_size
        before = frozenset(self.client.run_on_scheduler(scheduler_keys))
        for pending in list(self.pending):
            if pending.keys is None:  # the DAG just before: its tasks not released yet
                pending.keys = before - pending.before
            else:  # the DAG after it ran to its end: its releases were handled
                self.pending.remove(pending)
                self.check_leak(pending, pending.keys & before)
        outcome = self.compute(dag)  # returns with every future of the DAG dropped
        if outcome[0] != "hang":  # else the cluster is closed, the pending DAGs checked
            self.pending.append(Pending(dag, before))
        return outcome

    def compute(self, dag: Dag) -> tuple[str, str]:
        """Compute ``dag`` and check it; its futures and collections die on return."""
        client = self.client
        with kernel_delay(dag.delay, self.backend):
            # Futures are released by dropping them: Client.cancel of a persisted key whose
            # dependents no client wants fails an assertion in the scheduler (2026.8.0).
            options = {"optimize_graph": dag.optimize}
            loss = None
            try:
                outs = build(dag, self.kernels, lambda xs: client.persist(xs, **options))
                futures = client.compute(outs, **options)
                if self.name == "distributed-loss":
                    self.last_loss = ""  # this DAG's, once its loss is under way
                    rng = np.random.default_rng([self.seed, ROUTES.index(self.name), dag.index])
                    after, retire = rng.random() * LOSS_MS / 1e3, bool(rng.random() < 0.5)
                    loss = threading.Timer(after, self.lose_worker, (retire,))
                    loss.start()
                outcome = self.check(dag, futures)
            except Exception as e:  # noqa: BLE001 - every exception is an outcome
                return blame(e, dag)
            finally:
                if loss is not None:
                    loss.join(self.timeout)
            if loss is not None:  # the DAG's own outcome first
                error, self.loss_error = self.loss_error, None
                if loss.is_alive():  # left behind: the cluster is replaced
                    self.close()
                    if outcome == OK:
                        return "hang", f"the worker's loss did not end within {self.timeout} s"
                elif error is not None and outcome == OK:
                    return "error", f"losing a worker: {type(error).__name__}: {error}"
            if outcome != OK or not dag.again:
                return outcome
            # The same keys again while the first futures live (a notebook cell run twice):
            # the graph carries definitions of keys the scheduler already has.
            try:
                again = client.compute(outs, **options)
            except Exception as e:  # noqa: BLE001 - every exception is an outcome
                return blame(e, dag)
            outcome, detail = self.check(dag, again)
            return outcome, detail and f"computed again: {detail}"

    def lose_worker(self, retire: bool) -> None:
        """Close the worker with the most tasks in flight and start a new one
        (``distributed-loss``). Closed, its results and running tasks are lost; retired
        (``retire``: the scheduler's ``retire_workers``, as adaptive scaling does), its
        results are first copied to the other workers."""
        from distributed import Worker
        from distributed.core import Status

        cluster = self.cluster
        scheduler = cluster.scheduler

        async def lose() -> None:
            # Of the workers running here (one closed before may still be on the scheduler).
            running = {
                w.address: w
                for w in (*cluster.workers.values(), *self.started)
                if w.status == Status.running
            }
            states = [ws for ws in scheduler.workers.values() if ws.address in running]
            busiest = max(states, key=lambda ws: (len(ws.processing), len(ws.has_what)))
            victim = running[busiest.address]
            self.interrupted += bool(busiest.processing)
            self.last_loss = (
                f"{'retired' if retire else 'closed'} {victim.address}, which was running"
                f" {sorted(map(str, busiest.processing))[:6]} and held"
                f" {sorted(map(str, busiest.has_what))[:6]}"
            )
            if retire:
                retiring = scheduler.retire_workers([victim.address], close_workers=True)
                await asyncio.wait_for(retiring, self.timeout)
            await victim.close()  # retired: closed already (then this returns at once)
            self.losses += 1
            self.started = [w for w in self.started if w is not victim]
            self.started.append(await Worker(scheduler.address, nthreads=2))

        try:
            cluster.sync(lose)
        except Exception as e:  # noqa: BLE001 - an outcome of the DAG, taken after its join
            self.loss_error = e

    def settle(self) -> None:
        """The leak checks of the pending DAGs, now."""
        pendings, self.pending = self.pending, []
        for pending in pendings:
            if pending.keys is None:  # no DAG since: its tasks are all that is new
                keys = self.client.run_on_scheduler(scheduler_keys, pending.before)
                pending.keys = frozenset(keys)
            self.check_leak(pending, pending.keys)

    def check_leak(self, pending: Pending, keys: frozenset) -> None:
        """A leak of ``pending`` (its tasks ``keys``, if any, stay) goes to ``leaks``."""
        leak = self.leak(keys)
        if leak is not None:
            self.leaks.append((pending.dag, leak))

    def leak(self, keys: frozenset) -> str | None:
        """None once the scheduler holds none of ``keys``; else what stays after
        ``LEAK_WAIT`` s (at most ``--timeout``).

        The first look is mostly the last: see ``Pending``. Else the releases may still
        be on their way: a poll. A future of the DAG still alive in this process (the
        client's ``futures`` keeps its key) is in a garbage cycle: distributed's
        ``Client._gather`` leaves one (its frame in an ``AllExit`` traceback) when an
        output errs while gathered. Then the young generations are collected, then all:
        a cycle is not a leak. A task that this client still wants on the scheduler but
        holds no future of any more waits for its release, which the client has sent, up
        to ``--timeout``: on a loaded machine (two fuzzers on two cores) releases took
        more than 2 s to be handled.
        """
        start = time.monotonic()
        wait_for = min(LEAK_WAIT, self.timeout)
        generations = iter((1, 2))
        pause = 0.002
        while keys and (left := self.client.run_on_scheduler(scheduler_keys, within=keys)):
            waited = time.monotonic() - start
            if waited >= wait_for:
                # The tasks a client wants first, then those that nothing depends on:
                # what keeps the others.
                held = self.client.run_on_scheduler(holders, frozenset(left))
                left = {k: state for k, state in left.items() if k in held}
                if not left:  # released meanwhile
                    return None
                mine = self.client.id
                released = [k for k in held if mine in held[k][0] and k not in self.client.futures]
                if released and wait_for < self.timeout:
                    wait_for = self.timeout
                    continue
                first = sorted(held, key=lambda k: (not held[k][0], held[k][1], str(k)))[:4]
                shown = ", ".join(
                    f"{k} ({left[k]}; wanted by {held[k][0]}, {held[k][1]} dependents"
                    f"{'; a future of this client' if k in self.client.futures else ''})"
                    for k in first
                ).replace(repr(mine), "this client")
                more = f" and {len(left) - 4} more" if len(left) > 4 else ""
                return (
                    f"{len(left)} tasks stay on the scheduler {waited:.1f} s after every"
                    f" future was dropped: {shown}{more}"
                )
            if (self.client.futures and waited >= 0.02) or waited >= 0.1:
                generation = next(generations, None)
                if generation is not None:
                    gc.collect(generation)
                    continue
            time.sleep(pause)  # a poll: the releases are on their way
            pause = min(2 * pause, 0.05)
        return None

    def check(self, dag: Dag, futures: list) -> tuple[str, str]:
        """Each output exact or the failing kernel's error; those derived from it the error."""
        want = reference(dag)
        tainted = dag.tainted()
        order = np.random.default_rng(dag.index).permutation(len(futures))
        for k in order:
            i = dag.outputs[k]
            try:
                got = self.result(futures[k])
            except Hang as e:
                self.close()
                return "hang", f"output {i} pending: {e}"
            except Exception as e:  # noqa: BLE001 - every exception is an outcome
                # The future's state keeps this very exception (in-process cluster), and
                # raising it appended these frames to its traceback: the futures would stay
                # reachable from the client's ``futures`` and never be released.
                e.__traceback__ = None
                outcome = blame(e, dag, i)
                if outcome != OK:
                    if self.last_loss:
                        outcome = (outcome[0], f"{outcome[1]} (output {i}; {self.last_loss})")
                    return outcome
                self.queued += _queued(e, dag, i)
                continue
            if tainted[i]:
                where = self.whereabouts(futures[k])
                return "wrong", f"output {i} derives from a failing node, yet resolved{where}"
            problem = compare(got, want[i])
            if problem is not None:
                return "wrong", f"output {i}: {problem}"
        return OK

    def whereabouts(self, future: Any) -> str:
        """Where a wrong output's key is now, and this DAG's loss (``distributed-loss``)."""
        try:
            holders = self.client.who_has([future]).get(future.key, ())
            plugins = self.client.run(_has_streams_plugin, workers=list(holders))
        except Exception as e:  # noqa: BLE001 - a report, not an outcome
            return f" (where: {type(e).__name__}: {e})"
        lost = f"; {self.last_loss}" if self.last_loss else ""
        return f" (held by {plugins or 'no worker'}{lost})"

    def result(self, future: Any) -> Any:
        """``future.result()``, waited for while tasks keep finishing on the cluster.

        Raises Hang when none finishes for ``timeout`` s, or when the output is still
        pending after ``LIVELOCK * timeout`` s: a fixed wait called large DAGs hung.
        """
        start = last = time.monotonic()
        count = self.finished.count
        while not future.done():
            with contextlib.suppress(TimeoutError):
                wait(future, timeout=min(1.0, self.timeout))
            now = time.monotonic()
            if self.finished.count != count:
                count, last = self.finished.count, now
            elif now - last >= self.timeout:
                raise Hang(f"no task finished on the cluster for {self.timeout} s ({count} did)")
            if now - start >= LIVELOCK * self.timeout:
                raise Hang(
                    f"still pending after {LIVELOCK * self.timeout:.0f} s while tasks kept"
                    f" finishing ({count}): a livelock, or a DAG too slow to fuzz"
                )
        return future.result()


def make_route(name: str, backend: str, timeout: float, seed: int) -> Any:
    if name in DISTRIBUTED:
        return DistributedRoute(name, backend, timeout, seed)
    return LocalRoute(name, backend, timeout)


# --- runs -------------------------------------------------------------------------------------


@dataclass
class Tally:
    """Outcomes of one route's DAGs."""

    dags: int = 0
    failing: int = 0
    multi: int = 0  # DAGs with 2 or more failing nodes
    queued: int = 0  # on a cluster: outputs that raised a kernel error not of their ancestors
    wrong: int = 0
    hangs: int = 0
    errors: int = 0
    leaks: int = 0  # on a cluster: DAGs whose tasks stayed once their futures were dropped
    slow: int = 0  # not hung, yet over --timeout: not a problem, but never silent
    seconds: float = 0.0

    def add(self, dag: Dag, outcome: str, seconds: float, slow: bool) -> None:
        self.dags += 1
        self.failing += dag.failing is not None
        self.multi += len(dag.failures()) > 1
        self.wrong += outcome == "wrong"
        self.hangs += outcome == "hang"
        self.errors += outcome == "error"
        self.slow += slow
        self.seconds += seconds

    def bad(self) -> int:
        return self.wrong + self.hangs + self.errors + self.leaks


def run_route(
    route: Any,
    args: argparse.Namespace,
    quota: int | None,
    seconds: float | None,
    failures: bool = True,
    until: Callable[[Tally], bool] | None = None,
) -> Tally:
    """DAGs ``args.start, ...`` on ``route`` until ``quota`` DAGs, ``seconds`` or ``until``.

    ``failures``: some DAGs have a failing kernel. Problems are printed with the
    command that runs their DAG again, except in a self-check (``until`` set). On a
    cluster, a DAG's leak is found while the next DAG runs, or at the end.
    """
    tally = Tally()
    deadline = time.monotonic() + seconds if seconds is not None else None
    queued = getattr(route, "queued", 0)
    index = args.start

    def report(dag: Dag, outcome: str, detail: str, problem: bool) -> None:
        if args.verbose or (problem and until is None):
            print(f"{outcome.upper()} {detail}\n  {dag.describe()}", flush=True)
            if problem:
                print(
                    f"  again: python -m benchmarks.fuzz --seed {args.seed} --routes {route.name}"
                    f" --start {dag.index} --dags 1 --backend {args.backend}",
                    flush=True,
                )

    def leaks() -> None:
        for dag, detail in getattr(route, "leaks", ()):
            tally.leaks += 1
            report(dag, "leak", detail, True)
        if hasattr(route, "leaks"):
            route.leaks.clear()

    while (quota is None or tally.dags < quota) and (
        deadline is None or time.monotonic() < deadline
    ):
        dag = make_dag(args.seed, route.name, index, args.backend, failures, args.multi)
        t0 = time.perf_counter()
        outcome, detail = route.run(dag)
        elapsed = time.perf_counter() - t0
        slow = outcome != "hang" and elapsed > args.timeout
        tally.add(dag, outcome, elapsed, slow)
        if slow:
            detail = f"{detail} (slow: {elapsed:.1f} s, over --timeout {args.timeout} s)".lstrip()
        report(dag, outcome, detail, outcome != "ok" or slow)
        leaks()
        if until is not None and until(tally):
            break
        index += 1
    if hasattr(route, "settle"):
        route.settle()
        leaks()
    tally.queued = getattr(route, "queued", 0) - queued
    return tally


def print_tallies(tallies: dict[str, Tally], seconds: float) -> Tally:
    """The per-route table and the summary line; returns the sum over the routes."""
    print(
        f"{'route':<18} {'DAGs':>7} {'failing':>7} {'wrong':>5} {'hangs':>5} {'errors':>6}"
        f" {'leaks':>5} {'slow':>5} {'s':>7} {'multi':>5} {'queued':>6}"
    )
    total = Tally()
    for name, t in tallies.items():
        print(
            f"{name:<18} {t.dags:>7} {t.failing:>7} {t.wrong:>5} {t.hangs:>5} {t.errors:>6}"
            f" {t.leaks:>5} {t.slow:>5} {t.seconds:>7.1f} {t.multi:>5} {t.queued:>6}"
        )
        for f in (
            "dags",
            "failing",
            "multi",
            "queued",
            "wrong",
            "hangs",
            "errors",
            "leaks",
            "slow",
        ):
            setattr(total, f, getattr(total, f) + getattr(t, f))
    print(
        f"fuzz: {total.dags} DAGs ({total.failing} with a failing kernel, {total.multi} with"
        f" several failing nodes), {total.wrong} wrong,"
        f" {total.hangs} hangs, {total.errors} unexpected errors, {total.leaks} leaks,"
        f" {total.slow} slow (over"
        f" --timeout, not hung), {seconds:.1f} s",
        flush=True,
    )
    return total


def _not_corrupt_report(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("gpustreams: result of ")


@contextlib.contextmanager
def quiet(verbose: bool) -> Iterator[None]:
    """Unless ``verbose``, without the workers' reports of corrupt results (each failing
    kernel gives some) and dask.array's warnings of many chunks; afterwards, the
    runtimes made here dropped (a hung one would still hold its streams)."""
    logger = logging.getLogger("dask_gpustreams")
    with warnings.catch_warnings():
        if not verbose:
            logger.addFilter(_not_corrupt_report)
            warnings.simplefilter("ignore", da.PerformanceWarning)
        try:
            yield
        finally:
            logger.removeFilter(_not_corrupt_report)
            runtimes.forget()


def fuzz(args: argparse.Namespace) -> int:
    """Run the DAGs over the routes (each its share of ``--dags`` or ``--seconds``)."""
    t0 = time.perf_counter()
    tallies = {}
    n = len(args.routes)
    if args.backend == "cupy":  # PyTorch ops only where it has CUDA: say which ran
        print(f"cupy DAGs: da.random leaves and the ops {', '.join(library_ops('cupy'))}")
    with quiet(args.verbose):
        for k, name in enumerate(args.routes):
            quota = None if args.seconds else args.dags // n + (k < args.dags % n)
            seconds = args.seconds / n if args.seconds else None
            with make_route(name, args.backend, args.timeout, args.seed) as route:
                tallies[name] = run_route(route, args, quota, seconds)
    return int(print_tallies(tallies, time.perf_counter() - t0).bad() > 0)


# --- self-check -------------------------------------------------------------------------------

_RECORD = StreamPool.record


def _no_wait(self, slot, producer, event, seq):
    return None


def _record_without_refs(self, slot, event, refs, *args):
    return _RECORD(self, slot, event, None, *args)


async def _no_egress_wait(self, keys):
    return {}


def _no_spill_wait(self, key, value):
    return None


def _no_error_clearing(self, *args):
    return None


def _no_error_reports() -> contextlib.ExitStack:
    """The worker neither reports the errors it finds nor clears its streams' errors after."""
    stack = contextlib.ExitStack()
    for name in ("_report", "clear_stream_errors_soon"):
        stack.enter_context(mock.patch.object(Provenance, name, _no_error_clearing))
    return stack


@dataclass(frozen=True)
class Mechanism:
    """What breaks a mechanism, the routes where it matters, and whether DAGs fail kernels.

    Without failing kernels, breaking it must give wrong values; with them (``failure``),
    wrong values, hangs or wrong errors.
    """

    patch: Callable[[], Any]
    routes: tuple[str, ...]
    failures: bool = False

    def found(self, tally: Tally) -> int:
        return tally.bad() if self.failures else tally.wrong


MECHANISMS = {
    # device-side event waits between streams
    # (spilling waits for every result anyway)
    "wait": Mechanism(lambda: mock.patch.object(StreamPool, "wait", _no_wait), ROUTES[:3]),
    # the hold of a task's inputs until its event completes
    "hold": Mechanism(
        lambda: mock.patch.object(StreamPool, "record", _record_without_refs), SIM_ROUTES
    ),
    # get_data (peer fetch, gather) waits for the key's work
    "egress": Mechanism(
        lambda: mock.patch.object(Egress, "wait_for", _no_egress_wait), ("distributed",)
    ),
    # spilling waits for the key's work
    "spill": Mechanism(
        lambda: mock.patch.object(Egress, "before_spill", _no_spill_wait), ("distributed-spill",)
    ),
    # a kernel failure the worker finds is reported at once, and its streams are synchronized
    # after, so later work runs again
    "failure": Mechanism(_no_error_reports, ("distributed",), failures=True),
}


def self_check(args: argparse.Namespace) -> int:
    """Each mechanism broken in turn: each of its routes must find a problem in ``--dags``."""
    missed = 0
    # The mechanisms are those of task per key: a stream block waits for its own outputs
    # and checks its own events (it survives a broken ``failure``), so none is formed.
    with quiet(args.verbose), dask.config.set({"gpustreams.blocks": "off"}):
        for name in args.self_check:
            mechanism = MECHANISMS[name]
            found = dags = hits = 0
            routes = [r for r in args.routes if r in mechanism.routes]
            for route_name in routes:
                # The cluster starts inside the patch: the spill hook is bound as it installs.
                with (
                    mechanism.patch(),
                    make_route(route_name, args.backend, args.timeout, args.seed) as route,
                ):
                    tally = run_route(
                        route, args, args.dags, None, mechanism.failures, mechanism.found
                    )
                runtimes.forget()  # made while broken
                print(
                    f"  {name} on {route_name}: {tally.wrong} wrong, {tally.hangs} hangs,"
                    f" {tally.errors} unexpected errors, {tally.leaks} leaks in {tally.dags} DAGs",
                    flush=True,
                )
                found += mechanism.found(tally)
                dags += tally.dags
                hits += mechanism.found(tally) > 0
            verdict = "found" if routes and hits == len(routes) else "NOT FOUND"
            missed += verdict != "found"
            print(f"self-check {name}: {found} wrong in {dags} DAGs ({verdict})", flush=True)
    return int(missed > 0)


# --- command line -----------------------------------------------------------------------------


def _names(allowed: tuple[str, ...]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = [s.strip() for s in text.split(",") if s.strip()]
        bad = [n for n in names if n not in allowed]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(allowed)}")
        return names

    return parse


def dask_cuda_problem(backend: str) -> str | None:
    """Why the ``dask-cuda`` route cannot run with ``backend`` here, or None if it can."""
    if backend != "cupy":
        return (
            f"it needs --backend cupy, not {backend!r} (a dask-cuda worker is a process on a"
            " GPU; the sim runs the other routes)"
        )
    try:
        import dask_cuda  # noqa: F401
    except ImportError as e:
        return f"dask-cuda is not installed ({e})"
    ok, reason = gpu_visible()
    return None if ok else f"it needs a GPU: {reason}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.fuzz", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--seed", type=int, default=0, help="DAG i of a route is the same per seed")
    parser.add_argument(
        "--dags", type=int, help="DAGs in all (200; a self-check: at most, per route: 1000)"
    )
    parser.add_argument("--seconds", type=float, help="run this long instead of --dags")
    parser.add_argument("--start", type=int, default=0, help="index of the first DAG")
    parser.add_argument(
        "--routes",
        type=_names(ROUTES),
        default=list(SIM_ROUTES),
        help=f"of {', '.join(ROUTES)} (default: {','.join(SIM_ROUTES)})",
    )
    parser.add_argument("--backend", choices=("sim", "cupy"), default="sim")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds a compute may take")
    parser.add_argument(
        "--self-check",
        type=_names(tuple(MECHANISMS)),
        nargs="?",
        const=list(MECHANISMS),
        metavar="MECHANISMS",
        help=f"break each mechanism ({', '.join(MECHANISMS)}; default all) and find wrong values",
    )
    parser.add_argument(
        "--multi",
        type=float,
        default=MULTI,
        help=f"of the DAGs with a failing kernel, the fraction given 1-3 more failing nodes,"
        f" kernels or tasks that raise (default {MULTI}; 0: one failing kernel a DAG)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="print every DAG")
    args = parser.parse_args(argv)
    if args.self_check and args.backend != "sim":
        parser.error("--self-check needs --backend sim (the poison that shows wrong values)")
    if "dask-cuda" in args.routes:
        problem = dask_cuda_problem(args.backend)
        if problem:
            parser.error(f"--routes dask-cuda cannot run: {problem}")
    if args.dags is None:
        args.dags = 1000 if args.self_check else 200
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the fuzzer (or its self-check); 1 if anything was wrong, hung, raised or leaked."""
    args = parse_args(argv)
    return self_check(args) if args.self_check else fuzz(args)


if __name__ == "__main__":
    # Run the importable module, not this __main__ copy: process workers (dask-cuda)
    # unpickle the task functions by reference to benchmarks.fuzz.
    from benchmarks.fuzz import main as fuzz_main

    raise SystemExit(fuzz_main())
