"""Benchmarks of dask_gpustreams; run them as ``python -m benchmarks.<name>`` from the repo root."""
