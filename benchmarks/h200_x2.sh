#!/usr/bin/env bash
# The two-GPU run of issue 16, in one call of the nvidia-h200-x2 machine: scaling from one H200 to
# two on dask-cuda (one worker per GPU), plugin off against on, every result checked exact.
# Usage on the device, with the wheels carried as .whl (see docs/scale-out.md for the line):
#   bash benchmarks/h200_x2.sh COMMIT [STEPS]
# STEPS (default all, in this order): shapes workloads gantt tests ucx gantt-noblocks
#   shapes     bench_shapes, wide shapes at width 16, 8 ms kernels, 16 streams and 16 threads a
#              worker, serial (plugin off) / gpustreams blocks auto,off / ideal, on LocalCUDACluster
#              of 1 worker then 2 (--dist-workers 1,2): the scaling table (target: plugin on two
#              GPUs >= 1.8x plugin on one)
#   workloads  bench_cluster --workers 1,2 --modes off,on: the ordinary workloads on one GPU then
#              two (target: on >= 0.97x off on each); matmul (x @ y of 2D chunks) and stencil
#              (map_overlap) read chunks of both workers; stencil at n=8192 (a quarter of the
#              one-GPU size) and rechunk, qr left out, to fit the call
#   gantt      gantt_cluster: one recorded run per wide shape on 2 workers, blocks auto; one
#              Gantt row per (GPU, stream); SERIALIZED / ONE-SIDED when a graph stays on one GPU
#   tests      pytest tests/gpu/test_dask_cuda_gpu.py (the two-GPU fetch tests run here)
#   ucx        only with distributed-ucxx importable: the fetch tests over protocol="ucx"
#              (GPUSTREAMS_TEST_PROTOCOL=ucx; the control test is expected to FAIL there, since
#              distributed-ucxx syncs the whole device before it sends), then the wide shapes on
#              2 workers over UCX (serial, gpustreams blocks auto,off)
#   gantt-noblocks  the Gantt again with --blocks off
# Time: each step runs under `timeout` and never past DEADLINE (560 s after the start), so the
# call ends within the device's 10 minutes; a step that would get under 20 s is skipped (logged).
# Estimate for the H200s, extrapolated from h200-cluster-52ce52f (one GPU) and from timing the
# same steps on the sim (2-core host; see docs/scale-out.md): setup 15 s, shapes 90 s (cap 140),
# workloads 170 s (cap 240), gantt 30 s (cap 60), tests 70 s (cap 100), ucx 60 s (cap 100),
# gantt-noblocks 30 s (cap 50): about 465 s, under the 560 s deadline.
# Logs and results go to $OUT/x2.tar.gz, the tails to $OUT/summary.txt.
# On a CPU (the same steps on the sim at small sizes, to check the script itself):
#   X2_SIM=1 OUT=/tmp/x2-sim bash benchmarks/h200_x2.sh test
set -u
START=$(date +%s)
DEADLINE=${DEADLINE:-560}
if [ "${X2_SIM:-0}" = 1 ]; then
    PY=${PYTHON:-.venv/bin/python} BACKEND=sim SMALL="--depth 4" QUICK="--quick" STENCIL="" CLUSTER=""
else
    source benchmarks/h200_setup.sh
    PY=python3 BACKEND=cupy SMALL="" QUICK="" STENCIL="--set stencil.n=8192"
    CLUSTER="--cluster cuda"  # fail rather than run two in-process workers on one GPU
fi
R="$OUT/x2"
mkdir -p "$R"
echo "commit ${1:-unknown}" > "$R/commit.txt"
STEPS=" ${2:-shapes workloads gantt tests ucx gantt-noblocks} "
{ nvidia-smi -L; nvidia-smi topo -m; } > "$R/gpus.txt" 2>&1
$PY -c "import cupy; print('visible GPUs:', cupy.cuda.runtime.getDeviceCount())" >> "$R/gpus.txt" 2>&1
UCX=$($PY -c "import distributed_ucxx, ucxx; print('distributed-ucxx', distributed_ucxx.__version__, 'ucxx', ucxx.__version__)" 2>&1 | tail -1)
echo "ucx: $UCX" >> "$R/gpus.txt"

# step NAME CAP_SECONDS CMD...: run CMD under timeout min(CAP, time left), output to $R/NAME.log.
step() {
    local name=$1 cap=$2
    shift 2
    case "$STEPS" in *" $name "*) ;; *) return 0 ;; esac
    local left=$((DEADLINE - ($(date +%s) - START)))
    [ "$cap" -gt "$left" ] && cap=$left
    if [ "$cap" -lt 20 ]; then
        echo "$name: skipped, ${left} s left before the deadline" | tee -a "$R/steps.txt"
        return 0
    fi
    local t0=$(date +%s)
    timeout "$cap" "$@" > "$R/$name.log" 2>&1
    echo "$name: rc $? in $(($(date +%s) - t0)) s (cap $cap s)" | tee -a "$R/steps.txt"
}

step shapes 140 $PY -m benchmarks.bench_shapes --backend $BACKEND --schedulers distributed \
    --families wide --width 16 --modes serial,gpustreams,ideal --dist-streams 16 --threads 16 \
    --policies auto --dist-blocks auto,off --dist-workers 1,2 --gantt-streams 16 --warmup 1 \
    --samples 3 $SMALL $CLUSTER --out "$R/shapes-w16"
step workloads 240 $PY -m benchmarks.bench_cluster --backend $BACKEND --workers 1,2 \
    --modes off,on --warmup 1 --samples 2 $STENCIL $QUICK \
    --workloads elementwise,transpose,std,matmul,stencil,small-chunks,fft,tiny-tasks,pipeline,delayed \
    --out "$R/workloads"
step gantt 60 $PY -m benchmarks.gantt_cluster --backend $BACKEND --workers 2 --streams 16 \
    --threads 16 --blocks auto $SMALL --out "$R/gantt"
step tests 100 $PY -m pytest -q -p no:cacheprovider -rs tests/gpu/test_dask_cuda_gpu.py
case "$UCX" in
distributed-ucxx*)
    GPUSTREAMS_TEST_PROTOCOL=ucx step ucx 50 $PY -m pytest -q -p no:cacheprovider -rs \
        tests/gpu/test_dask_cuda_gpu.py -k across_gpus
    [ -f "$R/ucx.log" ] && mv "$R/ucx.log" "$R/ucx-tests.log"
    step ucx 50 $PY -m benchmarks.bench_shapes --backend $BACKEND --schedulers distributed \
        --families wide --width 16 --modes serial,gpustreams --dist-streams 16 --threads 16 \
        --policies auto --dist-blocks auto,off --dist-workers 2 --protocol ucx --gantt-streams 16 \
        --warmup 1 --samples 2 $SMALL $CLUSTER --out "$R/shapes-w16-ucx"
    [ -f "$R/ucx.log" ] && mv "$R/ucx.log" "$R/ucx-shapes.log"
    ;;
*) echo "ucx: not run: $UCX" | tee -a "$R/steps.txt" ;;
esac
step gantt-noblocks 50 $PY -m benchmarks.gantt_cluster --backend $BACKEND --workers 2 \
    --streams 16 --threads 16 --blocks off $SMALL --out "$R/gantt-noblocks"

for f in "$R"/*.log; do [ -f "$f" ] || continue; echo "== $(basename "$f")"; tail -45 "$f"; done \
    > "$R/tails.txt"
{ cat "$R/commit.txt" "$R/gpus.txt"; cat "$R/steps.txt"; cat "$R/tails.txt"; } > "$OUT/summary.txt"
[ -f "$R/gantt/gantt.png" ] && cp "$R/gantt/gantt.png" "$OUT/gantt.png"
tar -czf "$OUT/x2.tar.gz" -C "$OUT" x2 && rm -rf "$R"
echo "done in $(($(date +%s) - START)) s"
