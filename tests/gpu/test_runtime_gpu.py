"""The runtime on a real GPU: ordering, memory lifetime and concurrency with CuPy streams."""

import time

import dask
import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from dask_gpustreams import StreamsConfig, get_runtime  # noqa: E402
from dask_gpustreams.runtime import EventRegistry, StreamPool  # noqa: E402
from dask_gpustreams.runtime.policies import StreamPolicy, register_policy  # noqa: E402

from .kernels import spin_fill, spin_scale  # noqa: E402

N = 1 << 16


@register_policy
class ByKeyPrefix(StreamPolicy):
    """Test policy: the stream index is the number after the last '-' of the key."""

    name = "test-by-key"

    def select(self, task, pool):
        return pool.slots[int(str(task.key).rsplit("-", 1)[1]) % len(pool.slots)]


def runtime(streams=2, policy="test-by-key"):
    return get_runtime(StreamsConfig(backend="cupy", streams=streams, policy=policy))


def test_consumer_on_other_stream_waits_for_slow_producer():
    rt = runtime()
    reg = EventRegistry()
    for value in range(20):
        x = rt.run(f"x{value}-0", lambda _, v=value: spin_fill(N, float(v), 5), {}, reg)
        y = rt.run(f"y{value}-1", lambda inp, k=f"x{value}-0": inp[k] * 2, {f"x{value}-0": x}, reg)
        rt.synchronize([f"y{value}-1"], reg)
        assert cupy.asnumpy(y).tolist() == [2.0 * value] * N
    rt.collect()


def _freed_input_is_reused(rt):
    """Producer on stream 0, slow reader on stream 1, then the input is dropped and
    stream 0 allocates the same size and overwrites it with -1."""
    reg = EventRegistry()
    x = rt.run("x-0", lambda _: spin_fill(N, 3.0, 0), {}, reg)
    rt.synchronize(["x-0"], reg)
    inputs = {"x-0": x}
    y = rt.run("y-1", lambda inp: spin_scale(inp["x-0"], 2.0, 30), inputs, reg)
    del x, inputs
    rt.run("z-0", lambda _: cupy.full(N, -1.0), {}, reg)
    rt.synchronize(["y-1"], reg)
    result = cupy.asnumpy(y)
    rt.pool.synchronize()
    return result


def test_input_released_by_dask_is_held_until_consumer_finishes():
    rt = runtime()
    for _ in range(5):
        assert _freed_input_is_reused(rt).tolist() == [6.0] * N


def test_without_holding_inputs_the_reuse_race_is_real(monkeypatch):
    """The previous test is meaningful: dropping the hold lets stream 0 reuse the block."""
    rt = runtime()
    original = StreamPool.record
    monkeypatch.setattr(
        StreamPool, "record", lambda self, s, e, refs, *a: original(self, s, e, None, *a)
    )
    bad = [_freed_input_is_reused(rt) for _ in range(5)]
    assert any((b == -2.0).any() for b in bad)


RMM_REUSE = """
import cupy, rmm
from rmm.allocators.cupy import rmm_cupy_allocator

rmm.reinitialize(pool_allocator=True, initial_pool_size=1 << 30)
cupy.cuda.set_allocator(rmm_cupy_allocator)
from dask_gpustreams.runtime import StreamPool
from tests.gpu.test_runtime_gpu import N, _freed_input_is_reused, runtime

rt = runtime()
held = all(_freed_input_is_reused(rt).tolist() == [6.0] * N for _ in range(5))
original = StreamPool.record
StreamPool.record = lambda self, s, e, refs, *a: original(self, s, e, None, *a)
raced = any((_freed_input_is_reused(rt) == -2.0).any() for _ in range(5))
print(held, raced)
"""


def test_inputs_are_held_with_rmm_as_cupys_allocator(run_python):
    """RMM's pool also reuses a block on its stream at once: the same hold keeps it exact."""
    pytest.importorskip("rmm")
    assert run_python(RMM_REUSE).split()[-2:] == ["True", "True"]


@pytest.mark.parametrize("streams, bound", [(8, "fast"), (1, "slow")])
def test_independent_kernels_run_concurrently(streams, bound):
    ms = 20

    def make(i):
        return spin_fill(1024, float(i), ms)

    tasks = [dask.delayed(make)(i) for i in range(8)]
    cfg = {
        "gpustreams.enabled": True,
        "gpustreams.backend": "cupy",
        "gpustreams.streams": streams,
        "gpustreams.policy": "round-robin",
    }
    with dask.config.set(cfg):
        dask.compute(*tasks)  # warm-up: compile, create streams
        t0 = time.perf_counter()
        out = dask.compute(*tasks)
        wall = (time.perf_counter() - t0) * 1e3
    assert [float(o[0]) for o in out] == [float(i) for i in range(8)]
    if bound == "fast":
        assert wall < 3 * ms, wall
    else:
        assert wall > 0.8 * 8 * ms, wall


POLICIES = ["auto", "round-robin", "least-loaded", "affinity", "critical-path"]


@pytest.mark.parametrize("policy", POLICIES)
def test_dask_array_workload_equals_numpy(policy):
    da = pytest.importorskip("dask.array")
    rng = np.random.default_rng(42)
    a = rng.standard_normal((2048, 1024))
    b = rng.standard_normal((1024, 512))
    x = da.from_array(a, chunks=(256, 256)).map_blocks(cupy.asarray)
    y = da.from_array(b, chunks=(256, 256)).map_blocks(cupy.asarray)
    expr = ((da.exp(x / 10) * 2 + x) @ y).sum(axis=0) + (x**2).mean()
    expected = ((np.exp(a / 10) * 2 + a) @ b).sum(axis=0) + (a**2).mean()
    cfg = {"gpustreams.enabled": True, "gpustreams.backend": "cupy", "gpustreams.policy": policy}
    with dask.config.set(cfg):
        for _ in range(3):
            got = expr.compute()
            assert isinstance(got, cupy.ndarray)
            np.testing.assert_allclose(cupy.asnumpy(got), expected, rtol=1e-10)


RESERVE = """
import os, time, warnings
import cupy
{before}
from dask_gpustreams import StreamsConfig, get_runtime
from dask_gpustreams.runtime import EventRegistry
from tests.gpu.kernels import spin_fill
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    rt = get_runtime(StreamsConfig(backend="cupy", streams=16, policy="round-robin"))

def batch():  # 16 kernels of 10 ms, one per stream
    registry = EventRegistry()
    t0 = time.perf_counter()
    for i in range(16):
        rt.run(i, lambda inputs: spin_fill(256, 1.0, 10.0), {{}}, registry)
    rt.synchronize(range(16), registry)
    return (time.perf_counter() - t0) * 1e3

batch()
wall = min(batch() for _ in range(3))
print(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"), rt.pool.n_streams, len(caught), wall)
"""


@pytest.mark.parametrize(
    "before, expected, concurrent",
    [
        ("", "18 16 0", True),  # 16 compute + 2 copy streams get their hardware queues
        ("cupy.cuda.runtime.getDeviceCount()", "None 8 1", False),  # too late: capped, warned
    ],
)
def test_hardware_queues_reserved_before_cuda_starts(run_python, before, expected, concurrent):
    unset = "import os; os.environ.pop('CUDA_DEVICE_MAX_CONNECTIONS', None)\n"
    out = run_python(unset + RESERVE.format(before=before))
    *fields, wall = out.strip().splitlines()[-1].split()
    assert " ".join(fields) == expected
    # One round of 10 ms kernels on 16 queues; two rounds on 8 (streams capped, or sharing).
    assert (float(wall) < 15.0) if concurrent else (float(wall) > 18.0), wall


def _held_after_three_runtimes():
    """The CuPy pool's held bytes after each of three runtimes that allocate on 4 streams."""
    from dask_gpustreams.runtime.runtime import runtimes

    pool = cupy.get_default_memory_pool()
    config = StreamsConfig(backend="cupy", streams=4, policy="test-by-key")
    held = []
    for _ in range(3):
        rt = runtimes.create(config)
        reg = EventRegistry()
        outs = [rt.run(f"a{i}-{i % 4}", lambda _: cupy.ones(1 << 20), {}, reg) for i in range(8)]
        rt.synchronize(list(reg), reg)
        assert all(float(o.sum()) == 1 << 20 for o in outs)
        del outs
        rt.close()
        held.append(pool.total_bytes())
    return held


def test_a_closed_runtime_frees_the_blocks_cupy_cached_for_its_streams():
    """CuPy reuses a free block only on its own stream: a closed runtime's streams' blocks
    would stay held. Closing and making a runtime again must not grow the pool."""
    held = _held_after_three_runtimes()
    assert held[2] <= held[0], held


def test_without_the_release_closed_runtimes_grow_the_pool(monkeypatch):
    """The control: with ``destroy_stream`` freeing nothing, the closed runtimes' blocks stay
    held. Not all 64 MiB of each: a new stream may get a closed one's handle, and CuPy then
    reuses its arena (rapidsai/rmm#654's case). On the H200 at 0062085: +64 MiB, then +48."""
    from dask_gpustreams.backends.cupy import CupyBackend

    cupy.get_default_memory_pool().free_all_blocks()
    monkeypatch.setattr(CupyBackend, "destroy_stream", lambda self, stream, timeout=None: None)
    held = _held_after_three_runtimes()
    assert held[2] >= held[0] + (8 << 23), held  # at least one runtime's 64 MiB
