#!/usr/bin/env bash
# The H200 run behind the cluster numbers (issue 13) and the GPU checks of the library safety
# work (issue 12): all GPU tests with dask-cuda, the plugin's hook cost per task, the workload
# suite on LocalCUDACluster (plugin off / on), the wide shapes on distributed (8 ms kernels;
# width 32 on 32 streams) and the fuzzer on the distributed route. Usage on the device, with the dask-cuda wheels carried
# (../shared/tools/gpu-wheels.sh --dask-cuda): bash benchmarks/h200_cluster.sh COMMIT
# Logs and results go to $OUT/cluster.tar.gz, the tails to $OUT/summary.txt.
set -u
source benchmarks/h200_setup.sh
R="$OUT/cluster"
mkdir -p "$R"
echo "commit $COMMIT" > "$R/commit.txt"
gpu_tests 150
timeout 50 python3 -m benchmarks.probe_distributed --hook-times --reps 3 > "$R/hook-times.txt" 2>&1
timeout 190 python3 -m benchmarks.bench_cluster --backend cupy --samples 3 --out "$R/workloads" \
    > "$R/workloads.log" 2>&1
timeout 70 python3 -m benchmarks.bench_shapes --backend cupy --schedulers distributed \
    --families wide --modes serial,ptds-sync,gpustreams,ideal --dist-streams 8 \
    --policies auto --warmup 1 --samples 3 --out "$R/shapes-8ms" > "$R/shapes-8ms.log" 2>&1
CUDA_DEVICE_MAX_CONNECTIONS=32 timeout 60 python3 -m benchmarks.bench_shapes --backend cupy \
    --schedulers distributed --families wide --width 32 --modes gpustreams,ideal \
    --dist-streams 32 --policies auto --warmup 1 --samples 2 --out "$R/shapes-w32" \
    > "$R/shapes-w32.log" 2>&1
timeout 45 python3 -m benchmarks.fuzz --backend cupy --routes distributed --seed 2 \
    --seconds 30 > "$R/fuzz.txt" 2>&1
{ cat "$R/commit.txt"; tail -30 "$R/gpu-tests.txt"; cat "$R/hook-times.txt"
  tail -30 "$R/workloads.log"; tail -30 "$R/shapes-8ms.log"
  tail -14 "$R/shapes-w32.log"; tail -8 "$R/fuzz.txt"; } \
    > "$OUT/summary.txt"
tar -czf "$OUT/cluster.tar.gz" -C "$OUT" cluster && rm -rf "$R"
