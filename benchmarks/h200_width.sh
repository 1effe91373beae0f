#!/usr/bin/env bash
# The H200 run behind the width-32 report (issue 13): the wide shapes on distributed with
# blocks auto and off side by side, at width 32 on 32 streams (CUDA_DEVICE_MAX_CONNECTIONS=32
# in the workers' environment) and at width 8 on 8 streams, 8 ms kernels. The timeouts add
# up to 160 s. Usage on the device, with the dask-cuda wheels carried
# (../shared/tools/gpu-wheels.sh --dask-cuda): bash benchmarks/h200_width.sh COMMIT.
# Everything goes to $OUT/width.tar.gz.
set -u
source benchmarks/h200_setup.sh
results width
shapes() {  # NAME, then bench_shapes arguments
    local name=$1
    shift
    timeout 95 python3 -m benchmarks.bench_shapes --backend cupy --schedulers distributed \
        --families wide --modes ptds-sync,gpustreams,ideal --dist-blocks auto,off \
        --policies auto --dist-kernel-ms 8 --warmup 1 --samples 3 --out "$R/shapes-$name" \
        "$@" > "$R/shapes-$name.log" 2>&1
    echo "shapes rc $?" >> "$R/shapes-$name.log"
}
CUDA_DEVICE_MAX_CONNECTIONS=32 shapes w32 --dist-streams 32 --width 32
timeout 65 python3 -m benchmarks.bench_shapes --backend cupy --schedulers distributed \
    --families wide --modes gpustreams,ideal --dist-blocks auto,off --policies auto \
    --dist-kernel-ms 8 --warmup 1 --samples 3 --dist-streams 8 --out "$R/shapes-w8" \
    > "$R/shapes-w8.log" 2>&1
echo "shapes rc $?" >> "$R/shapes-w8.log"
grep -A16 "^== distributed" "$R/shapes-w32.log"
grep -A18 "^-- distributed · wide: serial" "$R/shapes-w8.log"
tar -czf "$OUT/width.tar.gz" -C /tmp "width-$COMMIT"
