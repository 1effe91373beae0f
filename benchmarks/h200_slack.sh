#!/usr/bin/env bash
# The H200 run behind cutting by levels with a slack on the outputs held (issue 13): the
# wide shapes on distributed with blocks auto and off side by side at width 32 on 32
# streams (CUDA_DEVICE_MAX_CONNECTIONS=32 in the workers' environment), with blocks at
# width 8 on 8 streams (8 ms kernels), and qr on the cluster (the one suite workload whose
# blocks the change cuts otherwise), plugin off / on. The timeouts add up to 150 s. Usage
# on the device, with the dask-cuda wheels carried (../shared/tools/gpu-wheels.sh
# --dask-cuda): bash benchmarks/h200_slack.sh COMMIT. Everything goes to $OUT/slack.tar.gz.
set -u
source benchmarks/h200_setup.sh
results slack
modes=(--modes gpustreams,ideal --dist-kernel-ms 8)
CUDA_DEVICE_MAX_CONNECTIONS=32 shapes w32 70 "${modes[@]}" --dist-streams 32 --width 32 \
    --dist-blocks auto,off
shapes w8 40 "${modes[@]}" --dist-streams 8 --dist-blocks auto
timeout 40 python3 -m benchmarks.bench_cluster --backend cupy --workloads qr --modes off,on \
    --samples 2 --rounds 2 --warmup 1 --out "$R/cluster" > "$R/cluster.log" 2>&1
echo "cluster rc $?" >> "$R/cluster.log"
grep -A18 "^== distributed" "$R/shapes-w32.log"
grep -A18 "^-- distributed · wide: serial" "$R/shapes-w8.log"
grep -v "^\[" "$R/cluster.log" | tail -6
tar -czf "$OUT/slack.tar.gz" -C /tmp "slack-$COMMIT"
