#!/usr/bin/env bash
# The H200 run behind the launcher's numbers (README, docs/measurements/launcher.md), in two parts that
# each fit the device's 600 s a call:
#   tests:  tests/gpu; the ordinary workloads (plain threads, plain sync, the launcher); the
#           runtime's cost per no-op task; cProfile of std under plain sync and the launcher
#   shapes: the wide and Dagger shapes at 2 ms and the wide at 0.5 ms (serial, serial-sync,
#           launcher, ideal); the cluster workloads with FFTs and learned host work (off/on)
#   allocator: the workloads under plain sync and the launcher, on CuPy's default pool and
#           on cudaMallocAsync (bench_workloads --allocator async), one after the other
# Usage on the device, with the dask-cuda wheels carried (../shared/tools/gpu-wheels.sh
# --dask-cuda): bash benchmarks/h200_launcher.sh COMMIT tests|shapes|allocator. Everything
# goes to $OUT/launcher-PART.tar.gz.
set -u
source benchmarks/h200_setup.sh
part launcher "tests shapes allocator"
if [ "$PART" = tests ]; then
    gpu_tests 140
    launcher_workloads 150 70
    timeout 60 python3 -m benchmarks.probes.probe_launcher_profile std > "$R/profile-std.txt" 2>&1
    tail -14 "$R/gpu-tests.txt"
    grep -v "^\[" "$R/workloads.log" | tail -24
    tail -12 "$R/overhead.txt"
elif [ "$PART" = shapes ]; then
    timeout 90 python3 -m benchmarks.bench_shapes --backend cupy --schedulers threaded \
        --families wide,dagger --modes serial,serial-sync,launcher,ideal --policies auto \
        --streams 8 --dagger-streams 8 --kernel-ms 2 --warmup 1 --out "$R/shapes-2ms" \
        > "$R/shapes-2ms.log" 2>&1
    echo "shapes rc $?" >> "$R/shapes-2ms.log"
    timeout 45 python3 -m benchmarks.bench_shapes --backend cupy --schedulers threaded \
        --families wide --modes serial,serial-sync,launcher,ideal --policies auto --streams 8 \
        --kernel-ms 0.5 --warmup 1 --out "$R/shapes-05ms" > "$R/shapes-05ms.log" 2>&1
    echo "shapes rc $?" >> "$R/shapes-05ms.log"
    timeout 150 python3 -m benchmarks.bench_cluster --backend cupy \
        --workloads fft,std,stencil,delayed --modes off,on --samples 2 --rounds 2 --warmup 1 \
        --out "$R/cluster" > "$R/cluster.log" 2>&1
    echo "cluster rc $?" >> "$R/cluster.log"
    grep -v "^\[" "$R/shapes-2ms.log" | grep -E "launcher|ideal:layers|serial-sync|rc " | head -40
    grep -v "^\[" "$R/shapes-05ms.log" | grep -E "launcher|ideal:layers|serial-sync|rc " | head -20
    grep "^\[\|rc \|geometric" "$R/cluster.log"
elif [ "$PART" = allocator ]; then
    for allocator in pool async; do
        timeout 100 python3 -m benchmarks.bench_workloads --backend cupy --modes sync,launcher \
            --samples 4 --rounds 2 --warmup 1 --set rechunk.n=4096 --allocator "$allocator" \
            --out "$R/$allocator" > "$R/$allocator.log" 2>&1
        echo "workloads rc $?" >> "$R/$allocator.log"
        grep -v "^\[" "$R/$allocator.log" | tail -34
    done
fi
tar -czf "$OUT/launcher-$PART.tar.gz" -C /tmp "launcher-$PART-$COMMIT"
