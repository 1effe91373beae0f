#!/usr/bin/env bash
# The H200 check of a change of defaults (stream blocks on, 57470ab): tests/gpu with dask-cuda,
# then the cluster workloads that the last runs cut (std) or ran closest to plugin-off
# (small-chunks), plugin off / on (task per key) / on (blocks). Usage on the device, with the
# dask-cuda wheels carried (../shared/tools/gpu-wheels.sh --dask-cuda):
# bash benchmarks/h200_default.sh COMMIT. Everything goes to $OUT/default.tar.gz.
set -u
source benchmarks/h200_setup.sh
results default
gpu_tests 140
timeout 100 python3 -m benchmarks.bench_cluster --backend cupy --workloads std,small-chunks \
    --modes off,on-noblocks,on --samples 2 --rounds 2 --warmup 1 --out "$R/cluster" \
    > "$R/cluster.log" 2>&1
echo "cluster rc $?" >> "$R/cluster.log"
tail -14 "$R/gpu-tests.txt"
grep -v "^\[" "$R/cluster.log" | tail -10
tar -czf "$OUT/default.tar.gz" -C /tmp "default-$COMMIT"
