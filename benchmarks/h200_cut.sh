#!/usr/bin/env bash
# The H200 run behind cutting a large part by levels where that keeps its critical path
# (issue 13): tests/gpu; the cluster workloads whose blocks are cut (matmul, qr, stencil, fft),
# plugin off / on (blocks), for time and memory; the wide shapes on distributed with blocks,
# 8 ms and 2 ms kernels. The timeouts add up to 560 s, under the device's 600 s a call.
# Usage on the device, with the dask-cuda wheels carried (../shared/tools/gpu-wheels.sh
# --dask-cuda): bash benchmarks/h200_cut.sh COMMIT. Everything goes to $OUT/cut.tar.gz.
set -u
source benchmarks/h200_setup.sh
results cut
gpu_tests 140
timeout 220 python3 -m benchmarks.bench_cluster --backend cupy \
    --workloads matmul,qr,stencil,fft --modes off,on --samples 2 --rounds 2 --warmup 1 \
    --out "$R/cluster" > "$R/cluster.log" 2>&1
echo "cluster rc $?" >> "$R/cluster.log"
for ms in 8 2; do
    timeout 95 python3 -m benchmarks.bench_shapes --backend cupy --schedulers distributed \
        --families wide --modes ptds-sync,gpustreams,ideal --dist-streams 8 --dist-blocks auto \
        --policies auto --dist-kernel-ms "$ms" --warmup 1 --samples 3 --out "$R/shapes-${ms}ms" \
        > "$R/shapes-${ms}ms.log" 2>&1
    echo "shapes rc $?" >> "$R/shapes-${ms}ms.log"
done
tail -14 "$R/gpu-tests.txt"
grep -v "^\[" "$R/cluster.log" | tail -14
tail -19 "$R/shapes-8ms.log" "$R/shapes-2ms.log"
tar -czf "$OUT/cut.tar.gz" -C /tmp "cut-$COMMIT"
