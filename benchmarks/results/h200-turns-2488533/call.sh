# One H200 call: the no-op overhead and the threaded wide and Dagger shapes with the modes
# in turn (paired by round); the held memory of qr, delayed and pipeline under the launcher's
# memory knobs; the wide shapes on distributed (blocks auto) at 8 and 2 ms. No library change
# since 65508fe, so tests/gpu is not run here. Usage: bash call.sh COMMIT (carry .whl).
source benchmarks/h200_setup.sh "$1"
results turns
timeout 150 python3 -m benchmarks.bench_overhead --backend cupy --tasks 10000 --repeats 7 \
    --policies auto > "$R/overhead.txt" 2>&1
echo "overhead rc $?" >> "$R/overhead.txt"; tail -12 "$R/overhead.txt"
tar -C /tmp -czf "$OUT/turns-$1.tgz" "turns-$1"
for ms in 2 0.5; do
    fam=wide,dagger; [ "$ms" = 0.5 ] && fam=wide
    timeout 120 python3 -m benchmarks.bench_shapes --backend cupy --schedulers threaded \
        --families "$fam" --modes serial-sync,launcher,ideal --policies auto --streams 8 \
        --dagger-streams 8 --kernel-ms "$ms" --warmup 1 --samples 6 --rounds 3 --ideal layers \
        --out "$R/threaded-${ms}ms" > "$R/threaded-${ms}ms.log" 2>&1
    echo "shapes rc $?" >> "$R/threaded-${ms}ms.log"
    grep -A12 "paired by round" "$R/threaded-${ms}ms.log"; tail -2 "$R/threaded-${ms}ms.log"
done
tar -C /tmp -czf "$OUT/turns-$1.tgz" "turns-$1"
timeout 150 python3 -m benchmarks.bench_workloads --backend cupy --workloads qr,delayed,pipeline \
    --modes sync,launcher,launcher-1,launcher-2,launcher-nolarge,launcher-nosmall --samples 2 \
    --rounds 2 --warmup 1 --out "$R/memory" > "$R/memory.log" 2>&1
echo "memory rc $?" >> "$R/memory.log"; grep -v "^\[" "$R/memory.log" | tail -32
tar -C /tmp -czf "$OUT/turns-$1.tgz" "turns-$1"
for ms in 8 2; do
    shapes "${ms}ms" 60 --modes gpustreams,ideal --dist-kernel-ms "$ms" --dist-streams 8 \
        --dist-blocks auto
done
for f in "$R"/shapes-*.log; do echo "== $f"; grep -A10 "^-- distributed · wide: " "$f"; tail -1 "$f"; done
tar -C /tmp -czf "$OUT/turns-$1.tgz" "turns-$1"
