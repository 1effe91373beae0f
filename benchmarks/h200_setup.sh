# Sourced at the start of a command on the H200 machine: installs the carried wheels
# (dask, distributed, dask-cuda; see ../shared/tools/gpu-wheels.sh) and uses the tree.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl || exit 1
export PYTHONPATH="$PWD:$PWD/.site" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import cupy, dask, distributed, numpy; print('cupy', cupy.__version__, 'dask', dask.__version__, 'distributed', distributed.__version__, 'numpy', numpy.__version__)"
