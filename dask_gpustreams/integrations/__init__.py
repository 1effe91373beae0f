"""Thin integrations of the runtime with dask's schedulers."""
