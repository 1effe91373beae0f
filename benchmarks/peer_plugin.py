"""Pytest plugin for ``peer_suites.sh``: run a whole pytest session with dask_gpustreams loaded.

Load it with ``-p peer_plugin`` (``benchmarks/`` on ``PYTHONPATH``). ``PEER_GPUSTREAMS=on``
(the default) enables the plugin on the simulated device; ``off`` only imports it. The config
is set when pytest loads this module, before any conftest: distributed's ``utils_test``
snapshots ``dask.config.config`` at import and every ``gen_cluster`` test resets to that
snapshot, so the switch reaches in-process workers and the client preload that installs
``StreamsPlugin`` on them.
"""

import os

import dask

import dask_gpustreams  # noqa: F401  (registers the local callback and the client preload)

MODE = os.environ.get("PEER_GPUSTREAMS", "on")
if MODE not in ("on", "off"):
    raise ValueError(f"PEER_GPUSTREAMS={MODE!r} is invalid: allowed values are 'on' and 'off'")

dask.config.set({"gpustreams.enabled": MODE == "on", "gpustreams.backend": "sim"})
