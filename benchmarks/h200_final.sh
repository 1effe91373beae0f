#!/usr/bin/env bash
# The closing H200 call of the fused-task round (one call, timeouts adding up to 540 s):
# tests/gpu at COMMIT; the plugin's hook cost per task on the worker's event loop, A/B
# against the tree in BASE_DIR (alternating, two runs each); the workloads under plain sync
# and the launcher; the wide shapes on distributed (blocks auto, width 8 on 8 streams) at
# 8 and 2 ms kernels with gpustreams.block-size 64 (the default) and 128.
# Usage on the device, with the dask-cuda wheels carried (../shared/tools/gpu-wheels.sh
# --dask-cuda) and a base tree made by `git archive BASE dask_gpustreams benchmarks | tar
# -x -C BASE_DIR` (carried too): bash benchmarks/h200_final.sh COMMIT BASE_DIR.
# Everything goes to $OUT/final.tar.gz.
set -u
source benchmarks/h200_setup.sh
BASE_DIR="${2:?a base tree for the hook A/B}"
results final
gpu_tests 150
SITE="$PWD/.site"
hooks() {  # hooks NAME DIR
    (cd "$2" && PYTHONPATH="$PWD:$SITE" timeout 45 python3 -m benchmarks.probe_distributed \
        --hook-times --reps 2 > "$R/hooks-$1.txt" 2>&1; echo "rc $?" >> "$R/hooks-$1.txt")
}
hooks base1 "$BASE_DIR"
hooks new1 .
hooks base2 "$BASE_DIR"
hooks new2 .
timeout 90 python3 -m benchmarks.bench_workloads --backend cupy --modes sync,launcher \
    --samples 3 --rounds 2 --warmup 1 --set rechunk.n=4096 --out "$R/workloads" \
    > "$R/workloads.log" 2>&1
echo "workloads rc $?" >> "$R/workloads.log"
for ms in 8 2; do
    for size in 64 128; do
        DASK_GPUSTREAMS__BLOCK_SIZE=$size shapes "${ms}ms-b$size" 40 --modes gpustreams,ideal \
            --dist-kernel-ms "$ms" --dist-streams 8 --dist-blocks auto
    done
done
tail -14 "$R/gpu-tests.txt"
for n in base1 new1 base2 new2; do
    echo "== $n"; grep -E "StreamsPlugin.transition  |->executing|^rc" "$R/hooks-$n.txt"
done
grep -v "^\[" "$R/workloads.log" | tail -34
for f in "$R"/shapes-*.log; do echo "== $f"; grep -A14 "^-- distributed · wide: " "$f"; tail -1 "$f"; done
tar -czf "$OUT/final.tar.gz" -C /tmp "final-$COMMIT"
