#!/usr/bin/env bash
# The H200 runs of lean fused tasks (integrations/subgraphs.py), in two parts that each fit
# the device's 600 s a call:
#   local:   tests/gpu; the 12 workloads under plain threads, plain sync, the launcher and
#            the enabled route on Dask's threads (3 rounds); probes/probe_task_gaps on
#            rechunk, std and elementwise
#   cluster: the 12 workloads on LocalCUDACluster, plugin off and on (blocks, the default);
#            the plugin's hook cost on the worker's event loop
# Usage on the device, with the dask-cuda wheels carried (../shared/tools/gpu-wheels.sh
# --dask-cuda): bash benchmarks/h200_lean.sh COMMIT local|cluster. Everything goes to
# $OUT/lean-PART.tar.gz.
set -u
source benchmarks/h200_setup.sh
part lean "local cluster"
if [ "$PART" = local ]; then
    gpu_tests 150
    timeout 250 python3 -m benchmarks.bench_workloads --backend cupy \
        --modes threads,sync,launcher,enabled-threads --samples 3 --rounds 3 --warmup 1 \
        --set rechunk.n=4096 --out "$R/workloads" > "$R/workloads.log" 2>&1
    echo "workloads rc $?" >> "$R/workloads.log"
    timeout 90 python3 -m benchmarks.probes.probe_task_gaps --backend cupy \
        --workloads rechunk,std,elementwise --reps 3 > "$R/gaps.txt" 2>&1
    echo "gaps rc $?" >> "$R/gaps.txt"
    tail -14 "$R/gpu-tests.txt"
    grep -v "^\[" "$R/workloads.log" | tail -60
    tail -40 "$R/gaps.txt"
elif [ "$PART" = cluster ]; then
    cluster_part 380 \
        elementwise,transpose,std,matmul,fft,delayed,pipeline,small-chunks,qr,rechunk,tiny-tasks,stencil \
        --set rechunk.n=4096
fi
tar -czf "$OUT/lean-$PART.tar.gz" -C /tmp "lean-$PART-$COMMIT"
