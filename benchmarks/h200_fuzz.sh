#!/usr/bin/env bash
# The random-DAG fuzzer (benchmarks/fuzz.py) on the GPU, every result checked exactly: the
# launcher, Dask's threads with the plugin, an in-process cluster and dask-cuda's
# LocalCUDACluster, first with CuPy's legacy default stream, then with a per-thread default
# stream (CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1, which only the plugin's waits order), SECONDS
# each (default 100). Usage on the device, with the dask-cuda wheels carried
# (../shared/tools/gpu-wheels.sh --dask-cuda): bash benchmarks/h200_fuzz.sh COMMIT [SECONDS].
# Everything goes to $OUT/fuzz-COMMIT.tgz, packed again after each part.
set -u
source benchmarks/h200_setup.sh
results fuzz
SECONDS_EACH="${2:-100}"
for ptds in 0 1; do
    CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=$ptds timeout $((SECONDS_EACH + 60)) python3 -m \
        benchmarks.fuzz --backend cupy --routes launcher,threaded,distributed,dask-cuda \
        --seed $((6300 + ptds)) --seconds "$SECONDS_EACH" > "$R/fuzz-ptds$ptds.txt" 2>&1
    echo "fuzz rc $?" >> "$R/fuzz-ptds$ptds.txt"
    tail -8 "$R/fuzz-ptds$ptds.txt"
    pack
done
