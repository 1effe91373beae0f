#!/usr/bin/env bash
# The H200 run behind the launcher's numbers (README, benchmarks/results/h200-launcher-*):
# the ordinary workloads and the wide/Dagger shapes, every mode side by side in one call; the
# runtime's cost per task; QR under CUBLAS_WORKSPACE_CONFIG; the GPU fuzzer (local routes).
# Usage on the device: bash benchmarks/h200_launcher.sh COMMIT (with .whl carried; logs and
# results go to $OUT/launcher.tar.gz and $OUT/summary.txt). The GPU tests: h200_cluster.sh.
set -u
source benchmarks/h200_setup.sh
R="$OUT/launcher"
mkdir -p "$R"
echo "commit ${1:-unknown}" > "$R/commit.txt"
timeout 250 python3 -m benchmarks.bench_workloads --backend cupy --out "$R/workloads" \
    > "$R/workloads.log" 2>&1
timeout 110 python3 -m benchmarks.bench_shapes --backend cupy --schedulers threaded \
    --families wide,dagger --modes serial,serial-sync,gpustreams,launcher,ideal \
    --policies auto,round-robin --streams 8 --dagger-streams 8 --kernel-ms 2 --warmup 1 \
    --gantt-policies auto --out "$R/shapes-2ms" > "$R/shapes-2ms.log" 2>&1
timeout 30 python3 -m benchmarks.bench_shapes --backend cupy --schedulers threaded \
    --families wide --modes serial,serial-sync,gpustreams,launcher,ideal --policies auto \
    --streams 8 --kernel-ms 0.5 --warmup 1 --gantt-policies auto --out "$R/shapes-05ms" \
    > "$R/shapes-05ms.log" 2>&1
timeout 40 python3 -m benchmarks.bench_overhead --backend cupy --tasks 10000 --repeats 3 \
    --policies auto,round-robin > "$R/overhead.txt" 2>&1
# QR alone with cuBLAS's deterministic workspace (is its multi-stream mismatch cuBLAS's?).
CUBLAS_WORKSPACE_CONFIG=:4096:8 timeout 40 python3 -m benchmarks.bench_workloads --backend cupy \
    --workloads qr --out "$R/workloads-qr-cublas" > "$R/workloads-qr-cublas.log" 2>&1
timeout 75 python3 -m benchmarks.fuzz --backend cupy --routes threaded,launcher --seed 3 \
    --seconds 60 > "$R/fuzz.txt" 2>&1
{ tail -25 "$R/workloads.log"; tail -40 "$R/shapes-2ms.log"; tail -20 "$R/shapes-05ms.log"
  cat "$R/overhead.txt"; tail -12 "$R/workloads-qr-cublas.log"; tail -6 "$R/fuzz.txt"
} > "$OUT/summary.txt"
tar -czf "$OUT/launcher.tar.gz" -C "$OUT" launcher && rm -rf "$R"
