"""SimArray's NumPy protocols: operators, ufuncs, indexing and NumPy functions on the sim,
and dask.array over SimArray chunks, with plain Dask and through the stream runtime.

Values are compared exactly with NumPy wherever the sim runs NumPy's own code on the
same data in the same order (a kernel is the NumPy function on the buffers), and on
integer-valued floats wherever dask sums in another order (exact for such sums). Sums
of sines (not integers, summed in dask's order), the moments (``std``) and the SVD
(where dask uses other formulas than NumPy) are compared with a tight tolerance.
"""

from __future__ import annotations

import contextlib
import pickle
import re
import threading
import time

import dask
import dask.array as da
import dask.local
import dask.threaded
import numpy as np
import pytest
from dask.array.utils import meta_from_array
from dask.base import named_schedulers

from dask_gpustreams import KernelError, sim
from dask_gpustreams.runtime import StreamPool
from dask_gpustreams.sim import POISON_BYTE

GATE_TIMEOUT = 5.0
N = 1000

device = sim.get_device()


def gated(gate: threading.Event):
    def kernel():
        if not gate.wait(GATE_TIMEOUT):
            raise TimeoutError("gate never opened")

    return kernel


def slow_copy(out, src, delay):
    time.sleep(delay)
    np.copyto(out, src)


def to_host(result):
    """A result with its device arrays copied back (tuples, lists and scalars kept)."""
    if isinstance(result, sim.SimArray):
        return result.get()
    if isinstance(result, tuple) and hasattr(result, "_fields"):  # QRResult, SVDResult
        return type(result)(*(to_host(r) for r in result))
    if isinstance(result, (tuple, list)):
        return type(result)(to_host(r) for r in result)
    return result


def leaves(result):
    if isinstance(result, (tuple, list)):
        for r in result:
            yield from leaves(r)
    else:
        yield result


def sorted_and_assigned(x):
    """``x`` sorted in place along its first axis, and ``x`` with a row assigned from a list."""
    a, b = x.copy(), x.copy()
    a.sort(axis=0)
    b[1] = [1, 2, 3, 4, 5, 6]
    return a, b


def assert_same(got, expected):
    """Same structure, and per array the same shape, dtype and values."""
    assert type(got) is type(expected) or not isinstance(expected, (tuple, list))
    if isinstance(expected, (tuple, list)):
        assert len(got) == len(expected)
        for g, e in zip(got, expected, strict=True):
            assert_same(g, e)
        return
    assert np.shape(got) == np.shape(expected)
    assert np.asarray(got).dtype == np.asarray(expected).dtype
    np.testing.assert_array_equal(got, expected)


@pytest.fixture
def streams():
    return device.create_stream(), device.create_stream()


# --- ops against NumPy -----------------------------------------------------------------------


def inplace(x, y, i):
    z = x.copy()
    z += y.T
    z[1:3, 2] = -5
    z[0] = y[:, 0]
    z[i[0] % 4, 1] *= 2
    z[z > 20] = 0  # a device mask: written by a kernel, no sync needed
    np.copyto(z, 1.5, where=z < 0)
    z[..., -1] = np.arange(4)
    return z


#: name -> f(x, y, i): x (4, 6) and y (6, 4) integer-valued floats, i (4, 6) int64
OPS = {
    "scalar operators": lambda x, y, i: (1 - x) * 2 + x / 4 - 3**x % 7,
    "integer operators": lambda x, y, i: (i // 3, i % 4, (i & 3) | 8, ~(i > 2), -abs(-i)),
    "comparisons": lambda x, y, i: (x >= 3, x == y.T, x != 2),
    "divmod": lambda x, y, i: divmod(i, 3),
    "ufuncs": lambda x, y, i: (np.sin(x), np.sqrt(np.exp(x / 10)), np.maximum(x, y.T)),
    "weak scalars": lambda x, y, i: (x.astype("float32") + 1.5, i.astype("int8") * 3),
    "matmul": lambda x, y, i: (x @ y, x @ y[:, 0], y[:, 0] @ y, np.matmul(x[None], y)),
    "ufunc methods": lambda x, y, i: (
        np.add.reduce(x, axis=1),
        np.maximum.reduce(x, axis=0, keepdims=True),
        np.add.accumulate(i, axis=1),
        np.multiply.outer(x[0], y[:, 0]),
    ),
    "ufunc out": lambda x, y, i: np.add(x, 1, out=x.copy()),
    "ufunc at": lambda x, y, i: (lambda z: (np.add.at(z, [0, 0, 2], 1), z)[1])(x.copy()),
    "in place": inplace,
    "sum": lambda x, y, i: (x.sum(), x.sum(axis=0, keepdims=True), np.sum(i, axis=(0, 1))),
    "mean": lambda x, y, i: (x.mean(axis=1), np.mean(i, axis=1, dtype="float32")),
    "moments": lambda x, y, i: (x.std(ddof=1), x.var(axis=1)),
    "extrema": lambda x, y, i: (x.max(axis=0), np.min(x), np.amax(i, axis=1)),
    "prod any all": lambda x, y, i: (
        np.prod(i % 3 + 1, axis=0),
        np.any(x > 8, axis=1),
        (x >= 0).all(),
    ),
    "arg": lambda x, y, i: (x.argmax(axis=1), np.argmin(x, axis=0, keepdims=True), x.argmax()),
    "nan and order": lambda x, y, i: (
        np.nansum(x),
        np.nanmax(x, axis=0),
        np.median(x, axis=0),
        np.count_nonzero(i % 2, axis=0),
    ),
    "scans and sorts": lambda x, y, i: (
        np.cumsum(x),
        np.cumprod(i % 3 + 1, axis=1),
        np.sort(-x, axis=1),
        np.argsort(-x, axis=0, kind="stable"),
    ),
    "joining": lambda x, y, i: (
        np.concatenate([x, x + 1], axis=0),
        np.concatenate([x, y.T], axis=None),
        np.stack([x, x], axis=-1),
        np.hstack([x, i]),
        np.vstack([x, y.T]),
    ),
    "shapes": lambda x, y, i: (
        x.T,
        np.transpose(x[None], (2, 0, 1)),
        x.reshape(2, -1),
        np.reshape(x, (3, 8), order="F"),
        x.ravel(),
        np.squeeze(x[None, :, None]),
        np.expand_dims(x, 1),
        np.broadcast_to(x[0], (3, 6)),
        np.moveaxis(x[None], 0, -1),
        x.swapaxes(0, 1),
    ),
    "moving": lambda x, y, i: (
        np.flip(x, axis=1),
        np.roll(x, 2, axis=0),
        np.tile(x[:2, :2], (2, 3)),
        np.repeat(x, 2, axis=0),
        np.take(x, [5, 0, 2], axis=1),
        x.take(i[0] % 6),
        np.diagonal(x),
        np.diag(x[0]),
        np.diag(x, k=1),
    ),
    "several outputs": lambda x, y, i: (
        np.split(x, 3, axis=1),
        np.broadcast_arrays(x, y[0, :1]),
        np.atleast_3d(x, y[0]),
    ),
    "elementwise functions": lambda x, y, i: (
        np.where(x > 3, x, -y.T),
        np.where(x > 3, 1.5, 0),
        np.clip(x, 2, 7),
        np.round(x / 3, 2),
        np.isclose(x, y.T),
        np.copy(x),
        x.astype("int16"),
    ),
    "complex": lambda x, y, i: (lambda c: (c.real, c.imag, np.angle(c), c.conj()))(x + 1j * y.T),
    "indexing": lambda x, y, i: (
        x[1:, ::2],
        x[2],
        x[2, 3],
        x[None, ..., 1],
        x[[0, 2]],
        x[i[0] % 4],
        x[i % 4, i % 6],
        x[np.arange(24).reshape(4, 6) % 2 == 0],
        x[x > 3],
    ),
    "creation": lambda x, y, i: (
        np.full_like(x, 7),
        np.zeros_like(x, dtype="int32"),
        np.ones_like(x, shape=(2, 3)),
        np.asarray([1, 2], like=x),
        np.arange(5, like=x),
        np.full((2, 2), 3.5, like=x),
        np.zeros(3, like=x),
        np.eye(3, like=x),
    ),
    "products": lambda x, y, i: (
        np.dot(x, y),
        np.dot(x[0], y[:, 0]),
        np.dot(x, 2),
        np.tensordot(x, y, axes=(1, 0)),
        np.tensordot(x, x, axes=2),
        np.outer(x[0], y[0]),
    ),
    "linalg": lambda x, y, i: (
        np.linalg.qr(x),
        np.linalg.qr(y, mode="r"),
        np.linalg.svd(x),
        np.linalg.svd(y, full_matrices=False, compute_uv=False),
        np.linalg.lstsq(y, y[:, 0] + 1),  # residuals' shape depends on the rank: a host sync
    ),
    "fft": lambda x, y, i: (
        np.fft.fft(x),
        np.fft.ifft2(np.fft.fft2(x)),
        np.fft.fftn(x, s=(4, 8), axes=(0, 1)),
        np.fft.rfft(x, axis=0),
        np.fft.irfft(np.fft.rfft(x), n=6),
        np.fft.rfft2(x.astype("float32")),
    ),
    "indices": lambda x, y, i: (
        np.unravel_index(i[0] % 24, (4, 6)),
        np.ravel_multi_index((i[0] % 4, i[1] % 6), (4, 6)),
    ),
    "routines": lambda x, y, i: (
        np.diff(x, axis=0),
        np.diff(x, n=2, prepend=0, append=[[1]] * 4),
        np.einsum("ij,jk->ik", x, y),
        np.einsum("ij,ij", x, x),
        np.einsum("i...->...", x),
        np.tril(x, -1),
        np.triu(x, 1),
        np.digitize(x, np.arange(0.0, 10.0, 3.0)),
        np.searchsorted(np.sort(x.ravel()), y[0]),
        np.interp(y[0], np.arange(6.0), x[0]),
        np.linspace(x[0], x[1], 5),
        np.percentile(x, [25, 50], axis=0),
        np.quantile(x, 0.5),
        (np.isreal(x), np.iscomplex(x), np.fix(x / 3), np.sinc(x / 4), np.i0(x)),
        np.nan_to_num(x),
        x.view("int32"),
        np.array([x[0], x[1]], like=x),
    ),
    "sort, list assignment": lambda x, y, i: sorted_and_assigned(x),
    "data-dependent": lambda x, y, i: (
        np.nonzero(x > 6),
        np.unique(i % 5),
        np.argwhere(x > 7),
        np.bincount(i[0]),
        np.compress([True, False, True, False], x, axis=0),
    ),
    "host values": lambda x, y, i: (
        np.allclose(x, x),
        np.array_equal(x, y.T),
        np.shape(x),
        np.ndim(x),
        np.result_type(x, 1.0),
    ),
}


@pytest.mark.parametrize("name", OPS)
def test_op_matches_numpy(name, rng):
    x = rng.integers(0, 10, (4, 6)).astype("float64")
    y = rng.integers(0, 10, (6, 4)).astype("float64")
    i = rng.integers(0, 50, (4, 6))
    expected = OPS[name](x, y, i)
    result = OPS[name](sim.asarray(x), sim.asarray(y), sim.asarray(i))
    numpy_arrays = [e for e in leaves(expected) if isinstance(e, (np.ndarray, np.generic))]
    device_arrays = [r for r in leaves(result) if isinstance(r, sim.SimArray)]
    assert len(device_arrays) == len(numpy_arrays)  # array results stay on the device
    assert_same(to_host(result), expected)


def test_ops_enqueue_on_the_current_stream_and_return_at_once(streams):
    a, _ = streams
    gate = threading.Event()
    with a:
        x = sim.asarray(np.arange(6.0))
        sim.launch(gated(gate))  # everything below queues behind this kernel
        t0 = time.perf_counter()
        y = (np.sin(x) ** 2 + x * 0.5).sum()
        z = np.concatenate([x[::2], x.T])
        elapsed = time.perf_counter() - t0
        assert (y.shape, y.dtype, z.shape) == ((), np.dtype("float64"), (9,))
        assert y._stream_id == a.id and z._stream_id == a.id  # allocated on the current stream
    assert elapsed < GATE_TIMEOUT / 2
    assert not a.record().done
    gate.set()
    with a:
        assert y.item() == (np.sin(np.arange(6.0)) ** 2 + np.arange(6.0) * 0.5).sum()
        np.testing.assert_array_equal(z.get(), [0, 2, 4, 0, 1, 2, 3, 4, 5])


def test_host_operands_are_staged_at_launch(streams):
    a, _ = streams
    gate = threading.Event()
    host, index = np.ones(4), np.array([3, 0])
    with a:
        x = sim.asarray(np.arange(4.0))
        sim.launch(gated(gate))
        y = x + host
        z = x[index]
        host[:] = 100  # after the launches, before the kernels run
        index[:] = 1
        gate.set()
        np.testing.assert_array_equal(y.get(), [1, 2, 3, 4])
        np.testing.assert_array_equal(z.get(), [3, 0])


@pytest.mark.parametrize(
    "read",
    [
        lambda x: x[x > 2].get(),
        lambda x: np.nonzero(x > 2)[0].get(),
        lambda x: bool((x > 2).any()),
        lambda x: float(x[3]),
        lambda x: x.max().item(),
        lambda x: x.tolist(),
    ],
    ids=["mask", "nonzero", "bool", "float", "item", "tolist"],
)
def test_data_dependent_ops_and_host_values_wait_for_the_current_stream(streams, read):
    a, _ = streams
    with a:
        x = sim.asarray(np.zeros(4))
        sim.launch(slow_copy, x, np.arange(4.0), 0.05)  # zeros until the kernel has run
        assert np.array_equal(read(x), read(sim.asarray(np.arange(4.0))))


def test_errors_of_shapes_and_dtypes_raise_at_launch():
    x = sim.asarray(np.ones((3, 4)))
    with pytest.raises(ValueError, match="cannot be broadcast"):
        x + np.ones(3)
    with pytest.raises(ValueError, match="matmul: Input operand 1 has a mismatch"):
        x @ x
    with pytest.raises(ValueError, match="zero-size array to reduction operation maximum"):
        np.max(sim.empty((0, 3)), axis=0)
    with pytest.raises(IndexError):
        x[3]
    with pytest.raises(np.exceptions.AxisError):
        x.sum(axis=2)
    with pytest.raises(OverflowError):
        sim.asarray(np.zeros(3, "uint8"))[0] = 300
    with pytest.raises(ValueError, match="could not broadcast"):
        x[0] = np.ones(3)
    with pytest.raises(TypeError, match="Cannot cast"):
        x.astype("int32", casting="safe")
    with pytest.raises(TypeError, match="structured dtypes"):
        np.empty_like(x, dtype=[("vals", "f8"), ("arg", "i8")])


def test_kernel_errors_surface_at_the_next_sync_with_the_task_key():
    x = sim.asarray(np.arange(4.0))
    with device.task("gather"):
        y = x[sim.asarray(np.array([0, 9]))]  # out of bounds: only the kernel can tell
    with pytest.raises(KernelError, match=r"task 'gather' failed: IndexError") as info:
        y.get()
    assert info.value.key == "gather"


def test_no_implicit_host_conversion_and_no_unknown_functions():
    x = sim.asarray(np.arange(4.0))
    for convert in (np.asarray, np.array):
        with pytest.raises(TypeError, match=r"Implicit conversion .* use \.get\(\)"):
            convert(x)
    with pytest.raises(TypeError, match="no implementation found for 'numpy.gradient'"):
        np.gradient(x)
    with pytest.raises(TypeError, match="out= is not supported by sum"):
        np.sum(x, out=sim.empty(()))


def test_operands_freed_while_queued_show_poison(streams):
    """Ops hold their operands' buffers, not the arrays, as launches do: on a GPU."""
    a, b = streams
    gate = threading.Event()
    with a:
        x = sim.asarray(np.full(N, 3.0))
    done = a.record()
    with b:
        b.wait_event(done)
        sim.launch(gated(gate))
        y = x * 2
    del x  # back to a's free list at once
    with a:
        z = sim.empty(N)  # the same block, poisoned by a
    a.synchronize()
    gate.set()
    with b:
        assert np.isnan(y.get()).all()
    del z


def test_arrays_stay_hashable_picklable_and_iterable():
    x = sim.asarray(np.arange(6.0).reshape(2, 3))
    assert x in {x} and hash(x) == hash(x)
    assert [r.get().tolist() for r in x] == [[0, 1, 2], [3, 4, 5]]
    assert len(x) == 2
    y = x + 1
    y.get()  # a pickle is a snapshot: it does not wait for queued kernels
    np.testing.assert_array_equal(pickle.loads(pickle.dumps(y))._view, x.get() + 1)
    assert dask.base.tokenize(x) == dask.base.tokenize(x) != dask.base.tokenize(x + 0)


def test_slices_are_new_arrays_with_no_base_as_cupy_reports_for_a_copy():
    """``base`` is None: a slice is a new array, never a view (distributed's P2P rechunk
    reads ``shard.base`` to decide whether to copy a shard, then needs a host buffer, which
    neither a SimArray nor a cupy.ndarray is)."""
    x = sim.asarray(np.arange(6.0).reshape(2, 3))
    y = x[:, 1:]
    assert x.base is None and y.base is None
    np.testing.assert_array_equal(y.get(), [[1, 2], [4, 5]])
    with pytest.raises(TypeError, match="bytes-like object is required"):
        memoryview(y)


def test_empty_arrays_take_no_pool_memory_and_launch_nothing():
    pool = sim.get_default_memory_pool()
    used = pool.used_bytes()
    x = sim.empty((0, 5))
    y = np.concatenate([x, x]) + 1
    assert pool.used_bytes() == used
    assert (y.shape, y.dtype) == ((0, 5), np.dtype("float64"))
    total = x.sum(axis=0)  # empty inputs, a non-empty result: NumPy on the host, uploaded
    np.testing.assert_array_equal(total.get(), np.zeros(5))


def test_reused_zero_dimensional_int_block_is_poisoned():
    x = sim.asarray(np.int64(7))
    x.get()
    block = x._block
    del x
    y = sim.empty((), "int64")  # a reduction's result, say
    assert y._block is block
    assert y.get().reshape(1).view(np.uint8).tolist() == [POISON_BYTE] * 8


def test_kernel_delay_is_validated(monkeypatch):
    monkeypatch.setattr(device, "kernel_delay", (0.0, 0.01))
    assert device.kernel_delay == (0.0, 0.01)
    with pytest.raises(ValueError, match=r"kernel_delay must satisfy 0 <= low <= high"):
        device.kernel_delay = (0.02, 0.01)


@pytest.mark.parametrize("value", [0.002, None, ("a", "b"), (0, 1, 2)])
def test_a_kernel_delay_not_two_numbers_is_a_value_error_naming_it(monkeypatch, value):
    monkeypatch.setattr(device, "kernel_delay", (0.0, 0.01))
    message = r"^kernel_delay must satisfy 0 <= low <= high < inf, got " + re.escape(repr(value))
    with pytest.raises(ValueError, match=message):
        device.kernel_delay = value
    assert device.kernel_delay == (0.0, 0.01)


def test_importing_the_package_starts_no_thread(run_python):
    code = (
        "import threading, dask_gpustreams\n"
        "print(sorted(t.name for t in threading.enumerate()))\n"
        "dask_gpustreams.sim.get_device()\n"
        "print(sorted(t.name for t in threading.enumerate()))\n"
        "dask_gpustreams.sim.get_device().synchronize()\n"
        "print(sorted(t.name for t in threading.enumerate()))\n"
    )
    before, created, used = run_python(code).splitlines()
    assert "sim-stream-" not in before
    assert "sim-stream-" not in created  # the default stream starts at its first use
    assert "sim-stream-" in used


# --- dask.array over SimArray chunks ---------------------------------------------------------


def chunks_of(host, chunks):
    return da.from_array(host, chunks=chunks).map_blocks(sim.asarray)


def overlap_stencil(b):
    return np.roll(b, 1, axis=0) + np.roll(b, -1, axis=0) - 2 * b


def block_fft2(a, b):
    return np.concatenate([np.fft.fft2(a[i : i + 10]) for i in range(0, 40, 10)])


def arg_reductions(xp):
    """Over distinct values: with ties, the first of the minima is not NumPy's first."""

    def f(x, y):
        z = x * 1600 + xp.arange(1600.0).reshape(40, 40)  # a host operand of the kernels
        return z.argmax(axis=0), z.argmin(), z.max(axis=1)

    return f


#: name -> (f(x, y) on dask arrays, f(A, B) on NumPy arrays or None for the same f, exact)
EXPRESSIONS = {
    "elementwise chain": (lambda x, y: (np.sin(x) ** 2 + x * 0.5).sum(axis=1), None, False),
    "transpose mean": (lambda x, y: (x + x.T).mean(axis=0), None, True),
    "std": (lambda x, y: ((x * 2 + 1) ** 2 - x).std(axis=0), None, False),
    "matmul": (lambda x, y: x @ y, None, True),
    "rechunk": (lambda x, y: x.rechunk((7, 13)) - y[:, :1], lambda a, b: a - b[:, :1], True),
    "slicing": (lambda x, y: x[3:37:2, ::3] + x[-2, 5], None, True),
    "concatenate": (lambda x, y: np.concatenate([x, y], axis=1)[::3], None, True),
    "where astype": (
        lambda x, y: np.where(x > 4, x, -y[:, :1]).astype("int32") // 3,
        None,
        True,
    ),
    "arg reductions": (arg_reductions(da), arg_reductions(np), True),
    "tensordot": (lambda x, y: np.tensordot(x, y, axes=(0, 0)), None, True),
    "cumsum": (lambda x, y: np.cumsum(x, axis=0), None, True),
    "map_overlap": (
        lambda x, y: x.map_overlap(overlap_stencil, depth={0: 1, 1: 0}, boundary="periodic"),
        lambda a, b: np.roll(a, 1, axis=0) + np.roll(a, -1, axis=0) - 2 * a,
        True,
    ),
    "fft2 blocks": (lambda x, y: x.rechunk((10, 40)).map_blocks(np.fft.fft2), block_fft2, True),
    "svd": (
        lambda x, y: da.linalg.svd(x.rechunk((10, 40)))[1],
        lambda a, b: np.linalg.svd(a)[1],
        False,
    ),
}


def routes():
    gpustreams_missing = "gpustreams" not in named_schedulers
    return [
        pytest.param("sync", False, id="sync"),
        pytest.param("threads", False, id="threads"),
        pytest.param(dask.threaded.get, True, id="plugin-threads"),
        pytest.param(dask.local.get_sync, True, id="plugin-get_sync"),
        pytest.param("sync", True, id="plugin-sync"),
        pytest.param(
            "gpustreams",
            True,
            id="gpustreams-scheduler",
            marks=pytest.mark.skipif(
                gpustreams_missing, reason="scheduler='gpustreams' is not registered"
            ),
        ),
    ]


@pytest.fixture
def random_kernel_times(monkeypatch):
    """Kernels sleep up to 0.5 ms: streams interleave differently from run to run."""
    monkeypatch.setattr(device, "kernel_delay", (0.0, 0.0005))


@pytest.mark.parametrize("scheduler, plugin", routes())
@pytest.mark.parametrize("name", EXPRESSIONS)
def test_dask_array_expression(gpustreams, random_kernel_times, rng, name, scheduler, plugin):
    A = rng.integers(0, 10, (40, 40)).astype("float64")
    B = rng.integers(0, 10, (40, 30)).astype("float64")
    dask_fn, numpy_fn, exact = EXPRESSIONS[name]
    expr = dask_fn(chunks_of(A, 10), chunks_of(B, (10, 15)))
    expected = (numpy_fn or dask_fn)(A, B)
    with gpustreams(streams=4) if plugin else contextlib.nullcontext():
        result = dask.compute(expr, scheduler=scheduler)[0]
    assert all(isinstance(r, sim.SimArray) for r in leaves(result))
    if exact:
        assert_same(to_host(result), expected)
    else:
        np.testing.assert_allclose(to_host(result), expected, rtol=1e-12)


def test_meta_and_chunks_are_sim_arrays():
    A = np.arange(12.0).reshape(3, 4)
    x = chunks_of(A, 2)
    assert isinstance(x._meta, sim.SimArray) and x._meta.shape == (0, 0)
    meta = meta_from_array(sim.asarray(A), ndim=1, dtype="int32")
    assert isinstance(meta, sim.SimArray) and (meta.shape, meta.dtype) == ((0,), np.dtype("int32"))
    assert isinstance((x.sum(axis=0) * 2)._meta, sim.SimArray)
    assert all(isinstance(b, sim.SimArray) for b in dask.compute(*x.to_delayed().ravel()))


@pytest.mark.parametrize("plugin", [False, True], ids=["plain", "plugin"])
def test_dask_array_from_a_sim_array(gpustreams, plugin):
    A = np.arange(64.0).reshape(8, 8)
    xs = sim.asarray(A)
    xs.get()  # complete: pool streams are not ordered after the default stream
    x = da.from_array(xs, chunks=(4, 2), asarray=False)
    assert isinstance(x._meta, sim.SimArray)
    with gpustreams(streams=4) if plugin else contextlib.nullcontext():
        result = (x.T * 2).sum(axis=0).compute()
    np.testing.assert_array_equal(result.get(), (A.T * 2).sum(axis=0))


# --- the poison pool still catches a dropped input hold ---------------------------------------


def reduction_runs(rng, runs):
    """``((2x + 1) * 3 - x).sum(axis=0)`` over 16 chunks, ``runs`` times: (got, expected)."""
    results = []
    for _ in range(runs):
        A = rng.integers(0, 100, (64, 64)).astype("float64")
        expr = ((chunks_of(A, 16) * 2 + 1) * 3 - chunks_of(A, 16)).sum(axis=0)
        results.append((expr.compute().get(), ((A * 2 + 1) * 3 - A).sum(axis=0)))
    return results


RUNS = 4


@pytest.fixture
def slow_kernels(monkeypatch):
    """Kernels sleep up to 2 ms: a consumer on one stream lags its producer's stream."""
    monkeypatch.setattr(device, "kernel_delay", (0.0, 0.002))


def test_held_inputs_keep_reductions_exact(gpustreams, slow_kernels, rng):
    with gpustreams(streams=4):
        assert all(np.array_equal(got, expected) for got, expected in reduction_runs(rng, RUNS))


def test_dropped_input_holds_read_poison(gpustreams, slow_kernels, rng, monkeypatch):
    """The test above is meaningful: without the runtime's holds, chunks that dask frees
    while a kernel on another stream still reads them are poisoned by their own stream."""
    record = StreamPool.record
    monkeypatch.setattr(
        StreamPool,
        "record",
        lambda self, slot, event, refs, *a, **k: record(self, slot, event, None, *a, **k),
    )
    with gpustreams(streams=4):
        wrong = [
            got for got, expected in reduction_runs(rng, RUNS) if not np.array_equal(got, expected)
        ]
    assert any(np.isnan(got).any() for got in wrong)
