#!/usr/bin/env bash
# The H200 run behind blocks that read another block's tuple straight (issue 13): tests/gpu;
# the cluster workloads with blocks, plugin off / on, for time and memory; the wide shapes on
# distributed with blocks, 8 ms and 2 ms kernels, and width 32 on 32 streams with
# CUDA_DEVICE_MAX_CONNECTIONS=32 in the workers' environment; and distributed's own floor
# (plain, no plugin: a graph of 8 and of 128 no-op tasks); the exit time after a compute
# (benchmarks/probes/probe_exit.py). The timeouts add up to 590 s,
# under the device's 600 s a call. Usage on the device, with the dask-cuda wheels carried
# (../shared/tools/gpu-wheels.sh --dask-cuda): bash benchmarks/h200_reads.sh COMMIT.
# Everything goes to $OUT/reads.tar.gz.
set -u
source benchmarks/h200_setup.sh
results reads
gpu_tests 140
timeout 220 python3 -m benchmarks.bench_cluster --backend cupy \
    --workloads matmul,qr,stencil,fft,std,delayed --modes off,on --samples 2 --rounds 2 \
    --warmup 1 --out "$R/cluster" > "$R/cluster.log" 2>&1
echo "cluster rc $?" >> "$R/cluster.log"
modes=(--modes ptds-sync,gpustreams,ideal --dist-blocks auto)
shapes 8ms 55 "${modes[@]}" --dist-streams 8 --dist-kernel-ms 8
shapes 2ms 55 "${modes[@]}" --dist-streams 8 --dist-kernel-ms 2
CUDA_DEVICE_MAX_CONNECTIONS=32 shapes w32-8ms 55 "${modes[@]}" --dist-streams 32 --width 32 \
    --dist-kernel-ms 8
timeout 15 python3 - > "$R/floor.txt" 2>&1 <<'PY'
import statistics, time
import distributed
cluster = distributed.LocalCluster(n_workers=1, threads_per_worker=8, processes=False, dashboard_address=None)
client = distributed.Client(cluster)
for n in (8, 128):
    walls = []
    for token in range(15):
        dsk = {("noop", i, token): (int, i) for i in range(n)}
        t = time.perf_counter()
        client.get(dsk, list(dsk))
        walls.append((time.perf_counter() - t) * 1e3)
    print(f"plain distributed, {n} no-op tasks: median {statistics.median(walls[3:]):.1f} ms, min {min(walls):.1f} ms")
client.close()
cluster.close()
PY
timeout 50 python3 -m benchmarks.probes.probe_exit --backend cupy --workloads fft,elementwise --timeout 20 > "$R/exit.txt" 2>&1
tail -14 "$R/gpu-tests.txt"
grep -v "^\[" "$R/cluster.log" | tail -16
tail -19 "$R/shapes-8ms.log" "$R/shapes-2ms.log"
grep -A6 "^== distributed" "$R/shapes-w32-8ms.log"
cat "$R/floor.txt" "$R/exit.txt"
tar -czf "$OUT/reads.tar.gz" -C /tmp "reads-$COMMIT"
