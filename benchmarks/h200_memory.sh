#!/usr/bin/env bash
# The H200 runs of the launcher's retry of a task out of device memory, in two parts that
# each fit the device's 600 s a call:
#   local:   tests/gpu (with the GPU test of the retry); probes/probe_memory_pressure (plain
#            sync, plain threads and the launcher with the device filled to 1.1x what plain
#            sync needs), first with the library of BASE_DIR (a tree made by `git archive
#            BASE dask_gpustreams | tar -x -C BASE_DIR`) if given, then this tree's; the 12
#            workloads under plain threads, plain sync and the launcher
#   cluster: six workloads on LocalCUDACluster, plugin off and on (blocks, the default);
#            the plugin's hook cost on the worker's event loop
# Usage on the device: bash benchmarks/h200_memory.sh COMMIT local|cluster [BASE_DIR];
# everything goes to $OUT/memory-PART.tar.gz.
set -u
source benchmarks/h200_setup.sh
part memory "local cluster"
BASE="${3:-}"
pressure() {
    timeout 100 python3 -m benchmarks.probes.probe_memory_pressure \
        --workloads elementwise,matmul,qr,delayed,fft --headroom 1.10 --reps 2 > "$R/$1" 2>&1
    echo "pressure rc $?" >> "$R/$1"
}
if [ "$PART" = local ]; then
    gpu_tests 150
    if [ -n "$BASE" ]; then
        # PYTHONSAFEPATH: `python -m` would put this tree first on the path, before BASE.
        PYTHONSAFEPATH=1 PYTHONPATH="$PWD/$BASE:$PYTHONPATH" pressure "pressure-$(basename "$BASE").txt"
    fi
    pressure pressure.txt
    timeout 110 python3 -m benchmarks.bench_workloads --backend cupy \
        --modes threads,sync,launcher --samples 2 --rounds 2 --warmup 1 \
        --set rechunk.n=4096 --out "$R/workloads" > "$R/workloads.log" 2>&1
    echo "workloads rc $?" >> "$R/workloads.log"
    tail -14 "$R/gpu-tests.txt"
    for f in "$R"/pressure*.txt; do
        echo "== $f: $(grep -c "ran out of device memory" "$f") retries logged"
        grep -v "ran out of device memory\|^  \|^\[" "$f" | tail -40
    done
    grep -v "^\[" "$R/workloads.log" | tail -46
elif [ "$PART" = cluster ]; then
    cluster_part 200 elementwise,transpose,matmul,fft,qr,delayed
fi
tar -czf "$OUT/memory-$PART.tar.gz" -C /tmp "memory-$PART-$COMMIT"
