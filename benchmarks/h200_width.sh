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
CUDA_DEVICE_MAX_CONNECTIONS=32 shapes w32 95 --modes ptds-sync,gpustreams,ideal \
    --dist-blocks auto,off --dist-kernel-ms 8 --dist-streams 32 --width 32
shapes w8 65 --modes gpustreams,ideal --dist-blocks auto,off --dist-kernel-ms 8 --dist-streams 8
grep -A16 "^== distributed" "$R/shapes-w32.log"
grep -A18 "^-- distributed · wide: serial" "$R/shapes-w8.log"
tar -czf "$OUT/width.tar.gz" -C /tmp "width-$COMMIT"
