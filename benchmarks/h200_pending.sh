#!/usr/bin/env bash
# What stops 51 to 53 left for the H200, in calls of under 600 s each (first
# benchmarks/h200_verify.sh, which verifies the library, then parts ahead and b; a and c
# together cover what h200_verify.sh does, with more). Usage on the device, with the dask-cuda wheels carried
# (../shared/tools/gpu-wheels.sh --dask-cuda): bash benchmarks/h200_pending.sh COMMIT a|ahead|b|c|d
#
# a: tests/gpu (no run since 67a7dc3, 7997f25, d86d073, 0dce10e, nor on stop 52's library:
#    038c6ea's host wait for host_task, with tests/gpu/test_host_tasks_gpu.py, the preload,
#    config and timeline fixes); probe_task_cost with its
#    runtime-gil mode (is task per key's loss beside the event loop its GIL hand-offs?); the
#    hook cost; the cluster workloads whose blocks held more than task per key, plugin off
#    against blocks at launch-ahead 192 (the default), 64 and 16 MiB and task per key, in one
#    run (on the sim, matmul's blocks held 32 MiB at the default and 23 at 1 MiB, task per
#    key 24-27: bench_cluster --backend sim --workloads matmul).
# ahead: part a without tests/gpu and the hook cost (after h200_verify.sh, which runs them).
# c: the local workloads, plain threads and sync against the launcher, and the runtime's cost
#    per no-op task (no H200 comparison since a5b178d, before stop 51's and 52's per-task
#    changes).
# b: the cluster workloads no call finished since stop 50 (qr, rechunk, tiny-tasks at 1,024
#    leaves), off / per key / blocks; the wide shapes on distributed at 8 ms against
#    ptds-sync and ideal, at 2 ms, and at width 32 on 32 streams; the CuPy fuzz with blocks.
# d: the launcher's targets not rerun since stops 47 and 48: the threaded wide shapes at 2 and
#    0.5 ms against plain sync and the ideal, each in two processes (the host's speed differs
#    from process to process), then Dagger's tiles twice (24 samples in 12 rounds), as
#    benchmarks/results/h200-threaded-80d227e/call.sh ran them.
# Each part packs $R into $OUT as it ends, so a call cut by the limit keeps what ended.
set -u
source benchmarks/h200_setup.sh
part pending "a ahead b c d"
if [ "$PART" = a ] || [ "$PART" = ahead ]; then
    if [ "$PART" = a ]; then
        gpu_tests 150
        tail -14 "$R/gpu-tests.txt"
        pack
        timeout 70 python3 -m benchmarks.probe_distributed --hook-times --reps 3 \
            > "$R/hook-times.txt" 2>&1
        echo "hooks rc $?" >> "$R/hook-times.txt"
        grep "StreamsPlugin.transition  \|EmptyHook\|rc " "$R/hook-times.txt"
        pack
    fi
    timeout 70 python3 -m benchmarks.probes.probe_task_cost --backend cupy --rounds 3 \
        > "$R/task-cost.txt" 2>&1
    echo "task-cost rc $?" >> "$R/task-cost.txt"
    cat "$R/task-cost.txt"
    pack
    timeout 230 python3 -m benchmarks.bench_cluster --backend cupy \
        --workloads elementwise,matmul,transpose,pipeline --samples 2 --rounds 2 --warmup 1 \
        --modes off,on,on:launch-ahead=64MiB,on:launch-ahead=16MiB,on-noblocks \
        --out "$R/cluster-ahead" > "$R/cluster-ahead.log" 2>&1
    echo "cluster rc $?" >> "$R/cluster-ahead.log"
    grep -v "^\[" "$R/cluster-ahead.log" | tail -24
    pack
elif [ "$PART" = d ]; then
    for run in 1 2; do
        for kernel_ms in 2 0.5; do
            name="wide$kernel_ms-$run"
            timeout 60 python3 -m benchmarks.bench_shapes --backend cupy --schedulers threaded \
                --families wide --modes serial-sync,launcher,ideal --policies auto --streams 8 \
                --kernel-ms $kernel_ms --warmup 1 --samples 4 --rounds 2 --ideal layers \
                --out "$R/$name" > "$R/$name.log" 2>&1
            echo "shapes rc $?" >> "$R/$name.log"
            echo "== $name"; grep -A10 "paired by round" "$R/$name.log" | grep -E "launcher|ideal"
        done
        pack
    done
    for i in 1 2; do
        # 110 s: at stop 63's host (a loop iteration 190-204 ns) 75 s ended both before tangled.
        timeout 110 python3 -m benchmarks.bench_shapes --backend cupy --schedulers threaded \
            --families dagger --modes serial-sync,launcher,ideal --policies auto --streams 8 \
            --dagger-streams 8 --warmup 1 --samples 24 --rounds 12 --ideal layers \
            --out "$R/dagger-$i" > "$R/dagger-$i.log" 2>&1
        echo "shapes rc $?" >> "$R/dagger-$i.log"
        echo "== dagger $i"; grep -A10 "paired by round" "$R/dagger-$i.log" | grep -E "launcher|ideal"
        pack
    done
elif [ "$PART" = c ]; then
    launcher_workloads 200 50
    grep -v "^\[" "$R/workloads.log" | tail -48
    tail -8 "$R/overhead.txt"
    pack
else
    timeout 200 python3 -m benchmarks.bench_cluster --backend cupy --workloads qr,rechunk,tiny-tasks \
        --modes off,on-noblocks,on --samples 2 --rounds 2 --warmup 1 --set rechunk.n=4096 \
        --set tiny-tasks.leaves=1024 --out "$R/cluster" > "$R/cluster.log" 2>&1
    echo "cluster rc $?" >> "$R/cluster.log"
    grep -v "^\[" "$R/cluster.log" | tail -14
    pack
    shapes 8ms 110 --modes ptds-sync,gpustreams,ideal --dist-kernel-ms 8 --dist-streams 8 \
        --dist-blocks auto
    pack
    shapes 2ms 80 --modes gpustreams,ideal --dist-kernel-ms 2 --dist-streams 8 --dist-blocks auto
    pack
    CUDA_DEVICE_MAX_CONNECTIONS=32 shapes w32 70 --width 32 --modes gpustreams,ideal \
        --dist-kernel-ms 8 --dist-streams 32 --dist-blocks auto
    for f in "$R"/shapes-*.log; do echo "== $f"; grep -A14 "^-- distributed · wide: " "$f"; tail -1 "$f"; done
    pack
    timeout 45 python3 -m benchmarks.fuzz --backend cupy --routes distributed,distributed-loss \
        --seed 5201 --seconds 30 > "$R/fuzz.txt" 2>&1
    echo "fuzz rc $?" >> "$R/fuzz.txt"
    tail -4 "$R/fuzz.txt"
    pack
fi
