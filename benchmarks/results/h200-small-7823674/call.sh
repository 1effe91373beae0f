# One H200 call: tests/gpu, where small results pin CuPy blocks (before/after small-blocks),
# a nearly full device, and the 12 workloads with small-blocks on (default) and off.
source benchmarks/h200_setup.sh "$1"
results small
gpu_tests 170
tail -3 "$R/gpu-tests.txt"
timeout 90 python3 -m benchmarks.probes.probe_split_blocks --backend cupy > "$R/split.txt" 2>&1
echo "split rc $?" >> "$R/split.txt"; cat "$R/split.txt"
timeout 110 python3 -m benchmarks.probes.probe_memory_pressure --workloads elementwise,matmul \
    --headroom 1.10 --reps 2 > "$R/pressure.txt" 2>&1
echo "pressure rc $?" >> "$R/pressure.txt"; cat "$R/pressure.txt"
timeout 150 python3 -m benchmarks.bench_workloads --backend cupy --modes threads,sync,launcher \
    --samples 4 --rounds 2 --warmup 1 --set rechunk.n=4096 --out "$R/workloads" > "$R/workloads.log" 2>&1
echo "workloads rc $?" >> "$R/workloads.log"; grep -v "^\[" "$R/workloads.log" | tail -30
DASK_GPUSTREAMS__SMALL_BLOCKS=0 timeout 110 python3 -m benchmarks.bench_workloads --backend cupy \
    --modes sync,launcher --samples 4 --rounds 2 --warmup 1 --set rechunk.n=4096 \
    --out "$R/workloads-off" > "$R/workloads-off.log" 2>&1
echo "workloads-off rc $?" >> "$R/workloads-off.log"; grep -v "^\[" "$R/workloads-off.log" | tail -22
tar -C /tmp -czf "$OUT/small-$1.tgz" "small-$1"
