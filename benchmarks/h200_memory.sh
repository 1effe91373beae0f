#!/usr/bin/env bash
# The H200 run of the launcher's retry of a task out of device memory:
#   tests/gpu (with the GPU test of the retry);
#   probes/probe_memory_pressure (plain sync, plain threads and the launcher with the device
#   filled to 1.1x what plain sync needs), first with the library of BASE_DIR (a tree made
#   by `git archive BASE dask_gpustreams | tar -x -C BASE_DIR`) if given, then this tree's;
#   the 12 workloads under plain threads, plain sync, the launcher and the enabled route on
#   Dask's threads (2 rounds).
# Usage on the device: bash benchmarks/h200_memory.sh COMMIT [BASE_DIR]; everything goes to
# $OUT/memory.tar.gz.
set -u
source benchmarks/h200_setup.sh
results memory
BASE="${2:-}"
gpu_tests 150
pressure() {
    timeout 120 python3 -m benchmarks.probes.probe_memory_pressure \
        --workloads elementwise,matmul,qr,delayed,fft,stencil --headroom 1.10 --reps 2 \
        > "$R/$1" 2>&1
    echo "pressure rc $?" >> "$R/$1"
}
if [ -n "$BASE" ]; then
    PYTHONPATH="$PWD/$BASE:$PYTHONPATH" pressure "pressure-$(basename "$BASE").txt"
fi
pressure pressure.txt
timeout 140 python3 -m benchmarks.bench_workloads --backend cupy \
    --modes threads,sync,launcher,enabled-threads --samples 2 --rounds 2 --warmup 1 \
    --set rechunk.n=4096 --out "$R/workloads" > "$R/workloads.log" 2>&1
echo "workloads rc $?" >> "$R/workloads.log"
tail -14 "$R/gpu-tests.txt"
for f in "$R"/pressure*.txt; do
    echo "== $f: $(grep -c "ran out of device memory" "$f") retries logged"
    grep -v "ran out of device memory\|^  \|^\[" "$f" | tail -40
done
grep -v "^\[" "$R/workloads.log" | tail -60
tar -czf "$OUT/memory.tar.gz" -C /tmp "memory-$COMMIT"
