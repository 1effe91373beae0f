# One H200 call at COMMIT (b1f8487's library): all 12 workloads on LocalCUDACluster, plugin
# off against on (blocks auto), and the plugin's hook cost on the worker's event loop.
# Usage: bash call.sh COMMIT (carry .whl), from the repository root.
source benchmarks/h200_setup.sh "$1"
results cluster
cluster_part 330 elementwise,transpose,std,matmul,stencil,small-chunks,fft,rechunk,qr,tiny-tasks,pipeline,delayed --set rechunk.n=4096
tar -C /tmp -czf "$OUT/cluster-$1.tgz" "cluster-$1"
