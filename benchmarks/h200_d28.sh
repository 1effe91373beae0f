#!/usr/bin/env bash
# tests/gpu under dask and distributed 2026.8.0, what a fresh `pip install` gets where dask-cuda
# is not installed (dask-cuda 26.10 pins 2026.7.1, which the other scripts carry). Usage on the
# device, with `../shared/tools/gpu-wheels.sh --dask-cuda` run and the 2026.8.0 wheels put in
# .whl/d28 (`pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl/d28
# dask==2026.8.0 distributed==2026.8.0`), carrying .whl: bash benchmarks/h200_d28.sh COMMIT.
# They shadow the 2026.7.1 ones; dask-cuda stays installed, so its tests run against 2026.8.0
# too. Everything goes to $OUT/d28-COMMIT.tgz.
set -u
source benchmarks/h200_setup.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site28 \
    .whl/d28/*.whl || exit 1
export PYTHONPATH="$PWD:$PWD/.site28:$PWD/.site"
results d28
python3 -c "import dask, distributed; print('dask', dask.__version__, 'distributed', distributed.__version__)" \
    | tee "$R/versions.txt"
gpu_tests 160
tail -4 "$R/gpu-tests.txt"
pack
