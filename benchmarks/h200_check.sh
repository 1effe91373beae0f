#!/usr/bin/env bash
# A library change's short check on the device, for a session with little device time left
# (about 250 s): tests/gpu, the runtime's cost per no-op task on the launcher and Dask's
# threads against plain Dask, and the plugin's hook cost on the worker's event loop.
# Usage on the device, with the dask-cuda wheels carried (../shared/tools/gpu-wheels.sh
# --dask-cuda): bash benchmarks/h200_check.sh COMMIT. Everything goes to
# $OUT/check-COMMIT.tgz, packed again after each part.
set -u
source benchmarks/h200_setup.sh
results check
gpu_tests 160
tail -4 "$R/gpu-tests.txt"
pack
timeout 50 python3 -m benchmarks.bench_overhead --backend cupy --tasks 10000 --repeats 3 \
    --policies auto > "$R/overhead.txt" 2>&1
echo "overhead rc $?" >> "$R/overhead.txt"
tail -16 "$R/overhead.txt"
pack
timeout 60 python3 -m benchmarks.probe_distributed --hook-times --reps 3 > "$R/hook-times.txt" 2>&1
echo "hooks rc $?" >> "$R/hook-times.txt"
tail -6 "$R/hook-times.txt"
pack
