#!/usr/bin/env bash
# The H200 run behind the stream blocks default (issue 13): the cluster workloads that
# h200_verify.sh leaves out (matmul, qr, stencil, tiny-tasks) with fft and std, plugin off /
# on (task per key) / on (blocks); the wide shapes on distributed (8 ms kernels) with blocks
# auto and off; the runtime's cost per no-op task with more repeats. Usage on the device,
# with the dask-cuda wheels carried (../shared/tools/gpu-wheels.sh --dask-cuda):
# bash benchmarks/h200_blocks.sh COMMIT. Everything goes to $OUT/blocks.tar.gz.
set -u
source benchmarks/h200_setup.sh
R="/tmp/blocks-${1:-unknown}"
mkdir -p "$R"
echo "commit ${1:-unknown}" > "$R/commit.txt"
timeout 290 python3 -m benchmarks.bench_cluster --backend cupy \
    --workloads matmul,qr,stencil,tiny-tasks,fft,std \
    --modes off,on-noblocks,on --samples 2 --rounds 2 --warmup 1 --out "$R/cluster" \
    > "$R/cluster.log" 2>&1
echo "cluster rc $?" >> "$R/cluster.log"
timeout 140 python3 -m benchmarks.bench_shapes --backend cupy --schedulers distributed \
    --families wide --modes ptds-sync,gpustreams,ideal --dist-streams 8 --dist-blocks auto,off \
    --policies auto --warmup 1 --samples 3 --out "$R/shapes-8ms" > "$R/shapes-8ms.log" 2>&1
echo "shapes rc $?" >> "$R/shapes-8ms.log"
timeout 70 python3 -m benchmarks.bench_overhead --backend cupy --tasks 10000 --repeats 7 \
    --policies auto > "$R/overhead.txt" 2>&1
grep "^\[\|rc \|geometric" "$R/cluster.log"
grep -v "^\[" "$R/cluster.log" | tail -22
tail -30 "$R/shapes-8ms.log"
tail -12 "$R/overhead.txt"
tar -czf "$OUT/blocks.tar.gz" -C /tmp "blocks-${1:-unknown}"
