"""A dask.array computation on a distributed cluster, every task on the workers' streams.

Starts a ``LocalCluster``, registers :class:`dask_gpustreams.StreamsPlugin` on its
workers, computes an integer ``dask.array`` expression, checks it exactly against
NumPy and prints :func:`dask_gpustreams.status` for every worker. Chunks are
CuPy arrays where a GPU is visible, else arrays of the simulated device::

    python examples/distributed_cluster.py [--workers 2] [--streams 4] [--size 2048] [--chunk 512]

On a running cluster, replace the ``LocalCluster`` with ``Client("tcp://host:8786")``.
"""

from __future__ import annotations

import argparse

import dask.array as da
import numpy as np
from distributed import Client, LocalCluster

import dask_gpustreams
from dask_gpustreams.backends import gpu_visible


def expression(x):
    """Elementwise work, a transpose (chunks from other workers) and a reduction."""
    return ((x % 7) * (x.T % 5) + x).sum(axis=0)


def arange(size: int, chunk: int) -> da.Array:
    """The ``size`` x ``size`` matrix of ``i * size + j``, made chunk by chunk where it is
    computed: the graph carries no data (a NumPy array in it would be sent whole)."""
    return da.fromfunction(
        lambda i, j: i * size + j, shape=(size, size), dtype=np.int64, chunks=chunk
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--size", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=512)
    args = parser.parse_args()

    if gpu_visible()[0]:
        import cupy as xp
    else:
        from dask_gpustreams import sim as xp  # the simulated device: no GPU needed

    with (
        LocalCluster(n_workers=args.workers, threads_per_worker=2, dashboard_address=":0") as lc,
        Client(lc) as client,
    ):
        client.register_plugin(dask_gpustreams.StreamsPlugin(streams=args.streams))
        x = arange(args.size, args.chunk).map_blocks(xp.asarray)
        got = xp.asnumpy(expression(x).compute())
        want = expression(np.arange(args.size**2, dtype=np.int64).reshape(args.size, args.size))
        assert np.array_equal(got, want), "the cluster's result differs from NumPy's"
        print(f"sum {int(got.sum())}: equal to NumPy's, {len(got)} columns")
        print(dask_gpustreams.status(client))


if __name__ == "__main__":
    main()
