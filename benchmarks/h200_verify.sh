#!/usr/bin/env bash
# One call that verifies a library change on the H200 and refreshes the headline numbers:
# tests/gpu (with dask-cuda), the ordinary workloads on the launcher against plain threads and
# sync, the runtime's cost per no-op task, the plugin's hook cost per task, and the cluster
# workloads plugin off / on (task per key) / on (blocks). The timeouts add up to 580 s, under
# the device's 600 s a call (at 37fb352 tests/gpu took 117 s and the workloads' former 130 s
# cut them after 10 of 13; they took 96-163 s since; at a33d571, on an H100, the cost per no-op
# task's former 40 s cut it before the chains). On a slow host (stop 63's H100: the cluster's
# 120 s cut it) run it as two calls instead, with longer timeouts: part a (tests/gpu, the
# hooks, the cluster workloads in 240 s; about 480 s) and part b (the launcher's workloads in
# 200 s and the cost per no-op task; about 260 s). Usage on the device, with the dask-cuda
# wheels carried (../shared/tools/gpu-wheels.sh --dask-cuda):
# bash benchmarks/h200_verify.sh COMMIT [a|b]
# Everything goes to $OUT/verify-COMMIT.tgz (verify-a-COMMIT.tgz, verify-b-COMMIT.tgz), packed
# again after each part, so a call cut by the device's limit still returns the parts that
# ended; the launcher's workloads come last (stops 51 and 52 changed the worker's per-task
# path more than the launcher's).
set -u
source benchmarks/h200_setup.sh
PART="${2:-}"
case "$PART" in
    "") results verify; cluster_seconds=120 ;;
    a) results verify-a; cluster_seconds=240 ;;
    b) results verify-b ;;
    *) echo "usage: bash $0 COMMIT [a|b]" >&2; exit 2 ;;
esac
if [ "$PART" != b ]; then
    gpu_tests 160
    tail -16 "$R/gpu-tests.txt"
    pack
    timeout 80 python3 -m benchmarks.probe_distributed --hook-times --reps 3 > "$R/hook-times.txt" 2>&1
    tail -40 "$R/hook-times.txt"
    pack
    timeout "$cluster_seconds" python3 -m benchmarks.bench_cluster --backend cupy \
        --workloads elementwise,transpose,std,small-chunks,fft,delayed,pipeline \
        --modes off,on-noblocks,on --samples 2 --rounds 2 --warmup 1 --out "$R/cluster" \
        > "$R/cluster.log" 2>&1
    echo "cluster rc $?" >> "$R/cluster.log"
    grep -v "^\[" "$R/cluster.log" | tail -26
    pack
fi
if [ "$PART" != a ]; then
    if [ "$PART" = b ]; then launcher_workloads 200 55; else launcher_workloads 165 55; fi
    grep -v "^\[" "$R/workloads.log" | tail -30
    tail -8 "$R/overhead.txt"
    pack
fi
