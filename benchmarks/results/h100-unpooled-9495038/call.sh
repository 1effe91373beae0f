#!/usr/bin/env bash
# Stop 63, from the repository root with `.whl` carried (the --dask-cuda wheels; asked for
# nvidia-h200, got an H100): the new GPU tests of results made before the plugin is
# registered (per-thread default stream, dask-cuda), with the spill tests beside them.
source benchmarks/h200_setup.sh "$1" >/dev/null; mkdir -p $OUT/t   # $1 = 9495038
timeout 240 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_dask_cuda_gpu.py \
    -k "registered or device_host_file" 2>&1 | tee $OUT/t/new-gpu-tests.txt | tail -15
