# One H200 call at COMMIT (packing limited to parts of PACK_DEPTH levels or more), against
# BASE (12492fd's tree, made by `git archive 12492fd dask_gpustreams benchmarks | tar -x -C
# .h200diag/base12492fd`, carried): tests/gpu; bench_cluster (LocalCUDACluster, dask-cuda's
# defaults) over the 13 workloads, plugin off and on, the three whose blocks changed first;
# the base's plugin off and on over those three; the distributed wide shape linear on a
# worker of one thread at 8 ms (blocks auto and off, ideal). Packed every 30 s and as each
# step ends. Usage: bash call.sh COMMIT (carry .whl and .h200diag/base12492fd), from the
# repository root.
source benchmarks/h200_setup.sh "$1"
BASE="$PWD/.h200diag/base12492fd"
SITE="$PWD/.site"
results final
pack() { tar -C /tmp -czf "$OUT/final-$COMMIT.tgz" "final-$COMMIT"; }
(while sleep 30; do pack; done) &
gpu_tests 140
tail -1 "$R/gpu-tests.txt"; grep -E "passed|failed" "$R/gpu-tests.txt" | tail -1
pack
cluster() {  # cluster NAME DIR SECONDS WORKLOADS
    (cd "$2" && PYTHONPATH="$PWD:$SITE" timeout "$3" python3 -m benchmarks.bench_cluster \
        --backend cupy --workloads "$4" --modes off,on --samples 2 --rounds 1 --warmup 1 \
        --set rechunk.n=4096 --out "$R/$1" > "$R/$1.log" 2>&1; echo "cluster rc $?" >> "$R/$1.log")
    grep -v "^\[" "$R/$1.log" | tail -20
}
CHANGED=elementwise,transpose,matmul
cluster cluster "$PWD" 300 "$CHANGED,std,range,stencil,small-chunks,fft,rechunk,qr,tiny-tasks,pipeline,delayed"
pack
cluster cluster-base "$BASE" 60 "$CHANGED"
pack
shapes t1-linear 40 --shapes linear --threads 1 --modes gpustreams,ideal --dist-kernel-ms 8 \
    --dist-streams 8 --dist-blocks auto,off
grep -A8 "^-- distributed · wide: " "$R/shapes-t1-linear.log"; tail -1 "$R/shapes-t1-linear.log"
kill %1
pack
