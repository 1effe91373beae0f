# One H200 call at COMMIT (b1f8487's library): 5 of the 12 workloads on LocalCUDACluster
# (the ones whose memory or blocks changed most; the device time left allowed no more),
# plugin off against on (blocks auto), and the plugin's hook cost on the worker's event loop.
# Usage: bash call.sh COMMIT (carry .whl), from the repository root.
source benchmarks/h200_setup.sh "$1"
results cluster
cluster_part 110 elementwise,matmul,qr,pipeline,delayed
tar -C /tmp -czf "$OUT/cluster-$1.tgz" "cluster-$1"
