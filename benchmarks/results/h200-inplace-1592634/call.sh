# One H200 call at COMMIT: tests/gpu; where the launcher loses on Dagger's gemm tiles with
# and without the in-place fix (probe_dagger_host with this library, then with 9bfbaa8's from
# old-9bfbaa8/, made by `git archive 9bfbaa8 dask_gpustreams | tar -x -C old-9bfbaa8`, not
# committed); the threaded wide and Dagger shapes at 2 ms and the wide at 0.5 ms, modes in
# turn. Usage: bash call.sh COMMIT (carry .whl), from the repository root.
source benchmarks/h200_setup.sh "$1"
results inplace
HERE=$(dirname "$0")
gpu_tests 170
tail -3 "$R/gpu-tests.txt"
tar -C /tmp -czf "$OUT/inplace-$1.tgz" "inplace-$1"
timeout 100 python3 -m benchmarks.probes.probe_dagger_host --backend cupy --rounds 5 \
    > "$R/dagger-host.txt" 2>&1
echo "dagger rc $?" >> "$R/dagger-host.txt"; grep -v "^ \|^$" "$R/dagger-host.txt" | head -32
PYTHONPATH="$PWD/$HERE/old-9bfbaa8:$PYTHONPATH" timeout 100 python3 -m \
    benchmarks.probes.probe_dagger_host --backend cupy --rounds 5 > "$R/dagger-host-old.txt" 2>&1
echo "dagger old rc $?" >> "$R/dagger-host-old.txt"; grep -v "^ \|^$" "$R/dagger-host-old.txt" | head -28
tar -C /tmp -czf "$OUT/inplace-$1.tgz" "inplace-$1"
for ms in 2 0.5; do
    fam=wide,dagger; [ "$ms" = 0.5 ] && fam=wide
    timeout 100 python3 -m benchmarks.bench_shapes --backend cupy --schedulers threaded \
        --families "$fam" --modes serial-sync,launcher,ideal --policies auto --streams 8 \
        --dagger-streams 8 --kernel-ms "$ms" --warmup 1 --samples 6 --rounds 3 --ideal layers \
        --out "$R/threaded-${ms}ms" > "$R/threaded-${ms}ms.log" 2>&1
    echo "shapes rc $?" >> "$R/threaded-${ms}ms.log"
    grep -A18 "paired by round" "$R/threaded-${ms}ms.log"; tail -2 "$R/threaded-${ms}ms.log"
done
tar -C /tmp -czf "$OUT/inplace-$1.tgz" "inplace-$1"
