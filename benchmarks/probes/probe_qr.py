"""Answered: the launcher's QR mismatch (2e-7, float32) is cuBLAS picking other implementations
on several active streams, not a wrong value (H200 at 9d48fa7: one run of 12 differed, with plain
sync's residual and orthogonality; benchmarks/results/h200-misc/qr-reproducibility-9d48fa7.txt).

    python -m benchmarks.probes.probe_qr

Same tall-skinny QR (bench_workloads sizes) under: plain sync, plain threads, launcher with
1 and 8 streams, 3 runs each. For each run: bitwise equal to plain sync? max |diff|; and the
accuracy against float64 (||QR - A|| / ||A||, ||Q^T Q - I||). Then one block's cupy.linalg.qr
and a matmul on 8 streams at once from one thread against the same on the null stream.
"""

import cupy as cp
import dask
import dask.array as da
import numpy as np

import dask_gpustreams  # noqa: F401  (registers scheduler="gpustreams")


def acc(q, r, a64, cols):
    q64, r64 = cp.asnumpy(q).astype(np.float64), cp.asnumpy(r).astype(np.float64)
    res = np.linalg.norm(q64 @ r64 - a64) / np.linalg.norm(a64)
    orth = np.linalg.norm(q64.T @ q64 - np.eye(cols))
    return res, orth


def run(x, mode, streams):
    q, r = da.linalg.qr(x)
    if mode == "launcher":
        with dask.config.set({"gpustreams.streams": streams}):
            return dask.compute(q, r, scheduler="gpustreams")
    return dask.compute(q, r, scheduler=mode)


def main():
    rows, chunks, cols = 32768, 32, 256
    rs = cp.random.RandomState(10)
    A = rs.random_sample((rows * chunks, cols), dtype=np.float32)
    x = da.from_array(A, chunks=(rows, cols), asarray=False)
    A64 = cp.asnumpy(A).astype(np.float64)

    base = run(x, "sync", 0)
    cp.cuda.Device().synchronize()
    res, orth = acc(*base, A64, cols)
    print(f"plain sync accuracy: residual {res:.3e} orthogonality {orth:.3e}")
    for mode, streams in (("sync", 0), ("threads", 0), ("launcher", 1), ("launcher", 8)):
        for i in range(3):
            q, r = run(x, mode, streams)
            cp.cuda.Device().synchronize()
            dq = float(cp.abs(q - base[0]).max())
            dr = float(cp.abs(r - base[1]).max())
            same = bool(cp.array_equal(q, base[0]) and cp.array_equal(r, base[1]))
            res, orth = acc(q, r, A64, cols)
            print(
                f"{mode:<9} streams {streams} run {i}: bitwise {same}  "
                f"max|dq| {dq:.2e} max|dr| {dr:.2e}  "
                f"residual {res:.3e} orthogonality {orth:.3e}",
                flush=True,
            )

    # One thread, many streams: cuSOLVER QR and cuBLAS matmul of the same blocks.
    blocks = [A[i * rows : (i + 1) * rows] for i in range(8)]
    ref_q = [cp.linalg.qr(b)[0] for b in blocks]
    ref_m = [b.T @ b for b in blocks]
    cp.cuda.Device().synchronize()
    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(8)]
    for rnd in range(3):
        outs_q, outs_m = [], []
        for b, s in zip(blocks, streams, strict=True):
            with s:
                outs_q.append(cp.linalg.qr(b)[0])
                outs_m.append(b.T @ b)
        cp.cuda.Device().synchronize()
        eq_q = sum(bool(cp.array_equal(o, r)) for o, r in zip(outs_q, ref_q, strict=True))
        eq_m = sum(bool(cp.array_equal(o, r)) for o, r in zip(outs_m, ref_m, strict=True))
        dq = max(float(cp.abs(o - r).max()) for o, r in zip(outs_q, ref_q, strict=True))
        dm = max(float(cp.abs(o - r).max()) for o, r in zip(outs_m, ref_m, strict=True))
        print(
            f"8 streams one thread round {rnd}: qr bitwise {eq_q}/8 (max {dq:.2e}), "
            f"matmul bitwise {eq_m}/8 (max {dm:.2e})",
            flush=True,
        )


if __name__ == "__main__":
    main()
