#!/usr/bin/env bash
# The H200 run behind the stream blocks default (issue 13), with tests/gpu and the hook cost:
# the cluster workloads that h200_verify.sh leaves out (matmul, qr, stencil, tiny-tasks with
# 1,024 leaves) with fft and std, plugin off / on (task per key) / on (blocks); the wide
# shapes on distributed (8 ms kernels) with blocks auto and off. The timeouts add up to
# 570 s, under the device's 600 s a call. Usage on the device, with the dask-cuda wheels
# carried (../shared/tools/gpu-wheels.sh --dask-cuda): bash benchmarks/h200_blocks.sh COMMIT.
# Everything goes to $OUT/blocks.tar.gz (written last: one file, under the return's limits).
set -u
source benchmarks/h200_setup.sh
results blocks
gpu_tests 150
timeout 80 python3 -m benchmarks.probe_distributed --hook-times --reps 3 > "$R/hook-times.txt" 2>&1
timeout 230 python3 -m benchmarks.bench_cluster --backend cupy \
    --workloads matmul,qr,stencil,tiny-tasks,fft,std --set tiny-tasks.leaves=1024 \
    --modes off,on-noblocks,on --samples 2 --rounds 2 --warmup 1 --out "$R/cluster" \
    > "$R/cluster.log" 2>&1
echo "cluster rc $?" >> "$R/cluster.log"
timeout 110 python3 -m benchmarks.bench_shapes --backend cupy --schedulers distributed \
    --families wide --modes ptds-sync,gpustreams,ideal --dist-streams 8 --dist-blocks auto,off \
    --policies auto --warmup 1 --samples 3 --out "$R/shapes-8ms" > "$R/shapes-8ms.log" 2>&1
echo "shapes rc $?" >> "$R/shapes-8ms.log"
tail -14 "$R/gpu-tests.txt"
grep "transition" "$R/hook-times.txt"
grep -v "^\[" "$R/cluster.log" | tail -22
tail -30 "$R/shapes-8ms.log"
tar -czf "$OUT/blocks.tar.gz" -C /tmp "blocks-$COMMIT"
