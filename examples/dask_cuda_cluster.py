"""dask-cuda's LocalCUDACluster with the plugin preloaded: one worker per GPU, each on streams.

Sets ``gpustreams.*`` in Dask's config (the workers get the creating process's
config), starts the cluster with ``preload=["dask_gpustreams"]``, uploads chunks
to the workers' GPUs, runs an integer matrix product, checks it exactly against
NumPy and prints :func:`dask_gpustreams.status` for every worker::

    pip install "dask-gpustreams[dask-cuda,cuda12]"
    python examples/dask_cuda_cluster.py [--backend auto|cupy|sim] [--streams 8] [--size 1024]
                                         [--chunk 256]

``--backend auto`` (the default) uses ``LocalCUDACluster`` where CuPy sees a GPU.
Where it sees none, it says so and runs the same code on a ``LocalCluster`` of
two workers on the simulated device, as ``--backend sim`` does. ``--backend
cupy`` without a GPU, or without dask-cuda installed, stops with the reason.
"""

from __future__ import annotations

import argparse
import sys

import dask
import dask.array as da
import numpy as np
from distributed import Client, LocalCluster

import dask_gpustreams
from dask_gpustreams.backends import gpu_visible


def start_cluster(backend: str):
    """A LocalCUDACluster for ``cupy``, a LocalCluster for ``sim``, both with the plugin."""
    if backend == "sim":
        return LocalCluster(n_workers=2, preload=["dask_gpustreams"], dashboard_address=":0")
    try:
        from dask_cuda import LocalCUDACluster
    except ImportError as e:
        sys.exit(f"dask-cuda is not installed ({e}): pip install 'dask-gpustreams[dask-cuda]'")
    return LocalCUDACluster(preload=["dask_gpustreams"], dashboard_address=":0")


def digits(size: int, chunk: int) -> da.Array:
    """The ``size`` x ``size`` matrix of ``i * size + j`` mod 10, made chunk by chunk where
    it is computed: the graph carries no data (a NumPy array in it would be sent whole)."""
    return da.fromfunction(
        lambda i, j: (i * size + j) % 10, shape=(size, size), dtype=np.int64, chunks=chunk
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("auto", "cupy", "sim"), default="auto")
    parser.add_argument("--streams", type=int, default=8)
    # 4 x 4 chunks, 64 block products. On a CPU (the sim's) integer matrix products get no
    # BLAS: at 2048 x 2048 they take 8 times as long, some 10 s more.
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=256)
    args = parser.parse_args()

    backend = args.backend
    visible, reason = gpu_visible()
    if backend == "cupy" and not visible:
        sys.exit(f"--backend cupy needs a GPU: {reason}")
    if backend == "auto":
        backend = "cupy" if visible else "sim"
        if not visible:
            print(f"LocalCUDACluster needs a GPU and none is visible: {reason}.")
            print("Running the same code on a LocalCluster of 2 workers on the simulated device.")
    if backend == "cupy":
        import cupy as xp
    else:
        from dask_gpustreams import sim as xp

    config = {"gpustreams.backend": backend, "gpustreams.streams": args.streams}
    with dask.config.set(config), start_cluster(backend) as cluster, Client(cluster) as client:
        x = digits(args.size, args.chunk).map_blocks(xp.asarray)
        got = xp.asnumpy((x @ x.T).sum(axis=1).compute())
        host = np.arange(args.size**2, dtype=np.int64).reshape(args.size, args.size) % 10
        # The row sums of host @ host.T are host times its column sums: NumPy's integer
        # matrix product, with no BLAS, would take seconds at 2048 x 2048.
        assert np.array_equal(got, host @ host.sum(axis=0)), "result differs from NumPy's"
        print(f"{type(cluster).__name__}: sum {int(got.sum())}, equal to NumPy's")
        print(dask_gpustreams.status(client))


if __name__ == "__main__":
    main()
